"""Test doubles for the device (CUDA) staging; not used in production.

:class:`HostCopyEngine` is a CPU stand-in for a CUDA stream whose copies run
only when an event is queried or waited for, so a caller that reads a buffer
too early reads stale bytes, as it would on a GPU; :class:`FakeDevice` builds a
:class:`~zmqtransport.device.DeviceStaging` around it whose host buffers start
filled with ``0xA5``. The tests (tests/test_device.py), ``scripts/device_bench.py``
and ``scripts/device_check.sh --cpu`` use them to run the staging pipeline on
machines without GPUs. Nothing in the package imports this module.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

import torch

from .device.engines import CPU, CopyEngine, CopyEvent
from .device.staging import DeviceStaging


class HostEvent:
    """A :class:`CopyEvent` of a :class:`HostCopyEngine`."""

    def __init__(self, engine: HostCopyEngine) -> None:
        self._engine = engine
        self.done = False

    def query(self) -> bool:
        if not self.done:
            self._engine.advance(self._engine.ops_per_query)
        return self.done

    def synchronize(self) -> None:
        while not self.done:
            if not self._engine.advance(1):
                raise RuntimeError("HostEvent was never queued on its engine")


class HostCopyEngine:
    """A CPU stand-in for a CUDA stream: copies are queued and performed later, in order.

    Queued work runs only when an event is queried (``ops_per_query``
    operations per query), waited for, or the engine is synchronised. A caller
    that read a buffer before its event completed would read stale bytes, as it
    would with a real asynchronous copy, so the tests see that bug as wrong data.
    Like a stream it is used by the one thread that owns it. The counters are
    for tests.
    """

    def __init__(self, device: torch.device = CPU, ops_per_query: int = 1) -> None:
        self._device = device
        self.ops_per_query = ops_per_query
        self._queue: deque[tuple[torch.Tensor, torch.Tensor] | HostEvent] = deque()
        self.copies = 0  # copies performed
        self.copied_bytes = 0
        self.max_queued = 0  # most copies queued at once
        self.markers: list[object] = []
        self.after_current_calls = 0
        self.order: list[int] = []  # data_ptr of each performed copy's source, in order

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pending(self) -> int:
        """Copies queued and not yet performed."""
        return sum(1 for op in self._queue if not isinstance(op, HostEvent))

    def wait_marker(self, marker: object) -> None:
        self.markers.append(marker)

    def after_current(self) -> None:
        self.after_current_calls += 1

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in pairs:
            if dst.numel() != src.numel():
                raise ValueError(f"copy of {src.numel()} bytes into {dst.numel()}")
            self._queue.append((dst, src))
        self.max_queued = max(self.max_queued, self.pending)

    def record(self) -> CopyEvent:
        event = HostEvent(self)
        self._queue.append(event)
        return event

    def advance(self, count: int) -> bool:
        """Run up to ``count`` queued operations; False when the queue was empty."""
        if not self._queue:
            return False
        for _ in range(count):
            if not self._queue:
                break
            op = self._queue.popleft()
            if isinstance(op, HostEvent):
                op.done = True
                continue
            dst, src = op
            dst.copy_(src)
            self.copies += 1
            self.copied_bytes += dst.numel()
            self.order.append(src.data_ptr())
        return True

    def synchronize(self) -> None:
        while self.advance(len(self._queue)):
            pass


class FakeDevice:
    """Builds a :class:`DeviceStaging` that stages host memory through :class:`HostCopyEngine`.

    Its host buffers are ordinary memory filled with ``0xA5``, so bytes that
    were never copied in show up as wrong data. ``engines`` lists every engine
    made (by any thread; the list is guarded), ``buffers`` every buffer.
    """

    FILL = 0xA5

    def __init__(self, ops_per_query: int = 1) -> None:
        self.ops_per_query = ops_per_query
        self.engines: list[HostCopyEngine] = []
        self.buffers: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def engine(self, device: torch.device) -> CopyEngine:
        engine = HostCopyEngine(device, self.ops_per_query)
        with self._lock:
            self.engines.append(engine)
        return engine

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = torch.full((nbytes,), self.FILL, dtype=torch.uint8)
        with self._lock:
            self.buffers.append(buffer)
        return buffer

    def staging(self, slots: int = 4, depth: int = 2) -> DeviceStaging:
        return DeviceStaging(
            slots=slots,
            depth=depth,
            make_engine=self.engine,
            host_buffer=self.host_buffer,
            stage_host=True,
        )

__all__ = ["FakeDevice", "HostCopyEngine", "HostEvent"]
