"""Copy engines: asynchronous host/device byte copies behind one small protocol.

:class:`CopyEngine` hides CUDA streams and events, so the staging decisions
(chunk order, look-ahead, back-pressure, buffer reuse) run unchanged on CPU
with the deferred fake in :mod:`zmqtransport.testing`. :class:`CudaCopyEngine`
is the production engine: copies on a side stream of one CUDA device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

CPU = torch.device("cpu")


class CopyEvent(Protocol):
    """Completion of the copies queued before it on one engine."""

    def query(self) -> bool:
        """True once those copies have completed; never blocks."""
        ...

    def synchronize(self) -> None:
        """Block until those copies have completed."""
        ...


class CopyEngine(Protocol):
    """Asynchronous byte copies between host and one device, run in issue order (a stream).

    An engine is used by one thread at a time: the thread owning the stager
    or unstager that created it.
    """

    @property
    def device(self) -> torch.device: ...

    def wait_marker(self, marker: object) -> None:
        """Order later copies after the producer work ``marker`` marks (:func:`capture_marker`)."""
        ...

    def after_current(self) -> None:
        """Order later copies after work already queued on the calling thread's current stream."""
        ...

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Queue ``dst.copy_(src)`` for each ``(dst, src)``: flat uint8 tensors of equal length."""
        ...

    def record(self) -> CopyEvent:
        """An event that completes once every copy queued so far has."""
        ...

    def synchronize(self) -> None:
        """Block until every queued copy has completed."""
        ...



# ----------------------------------------------------------------------------- CUDA


class CudaCopyEngine:
    """Copies on a dedicated CUDA stream of ``device`` (streams and events of ``torch.cuda``).

    A side stream, not the trainer's: the copies then overlap its kernels and
    only wait for them where correctness needs it (:meth:`wait_marker`,
    :meth:`after_current`).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]

    @property
    def device(self) -> torch.device:
        return self._device

    def wait_marker(self, marker: object) -> None:
        if isinstance(marker, torch.cuda.Event):
            self._stream.wait_event(marker)

    def after_current(self) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(self._device))

    def copy(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        # non_blocking with a pinned host side makes each copy a cudaMemcpyAsync
        # on the current stream, which the context manager makes our side stream.
        with torch.cuda.stream(self._stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def record(self) -> CopyEvent:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self._stream)
        return event

    def synchronize(self) -> None:
        self._stream.synchronize()


def cuda_engine(device: torch.device) -> CopyEngine:
    """The default engine factory: a :class:`CudaCopyEngine` for CUDA devices."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"no copy engine for device {device}")
    return CudaCopyEngine(device)


def pinned_buffer(nbytes: int) -> torch.Tensor:
    """A page-locked uint8 host buffer (ordinary memory when this torch has no CUDA).

    Page-locked, because only then is a copy truly asynchronous (DMA): from
    pageable memory, ``copy_(non_blocking=True)`` goes through a driver
    bounce buffer synchronously.
    """
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def capture_marker(device: torch.device) -> object | None:
    """Record, on the calling thread's current stream of ``device``, the point the data is ready.

    Called by ``send_checkpoint``: the kernels that produced the state were
    queued on the caller's stream, and the serving thread's copies must not
    start before them.
    """
    if device.type != "cuda":
        return None
    marker: object = torch.cuda.current_stream(device).record_event()
    return marker
