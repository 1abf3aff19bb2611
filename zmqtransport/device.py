"""Device (CUDA) staging: reusable pinned host buffers between GPU memory and ZeroMQ frames.

ZeroMQ moves host memory only. A CUDA storage therefore travels through a
small ring of page-locked ("pinned") host buffers, one data message at a time:

* **send** (:class:`SendStager`): the serving thread issues device-to-host
  copies of the next few data messages on a side stream, each into a free
  buffer of its ring, and sends a message as soon as its copy has completed;
  copies of later messages run while earlier ones are on the wire. Nothing is
  copied in ``send_checkpoint``, which only records where the caller's stream
  stands (:func:`prepare_send`).
* **receive** (:class:`RecvUnstager`): each data message for device memory is
  received into a free pinned bounce buffer, checked, and copied to the device
  on a side stream while the next messages arrive; the receive waits for every
  copy before it returns or raises.

A buffer is reused only when nothing can still touch it: no stager holds it,
its last copy has completed, and libzmq has released the last frame sent from
it (pyzmq ``MessageTracker``). The rings are allocated on first use and kept
for the transport's lifetime, so a step allocates no pinned memory.

Threading (who owns what):

* a :class:`SendStager` belongs to one ``sender.Server`` and is used only by
  its serving thread, which thus owns the send ring and the side stream of each
  of the stager's copy engines. The only cross-thread input is the *producer
  marker* that ``send_checkpoint`` records on the calling thread's current
  stream, which the side stream waits for before its first copy of that step;
* a :class:`RecvUnstager` is borrowed from its :class:`DeviceStaging` by one
  receiving thread for one ``recv_checkpoint`` and given back when that call
  ends; while borrowed, that thread alone uses its ring and side streams;
* a :class:`DeviceStaging` (configuration plus the pool of idle receive kits)
  may be shared by threads; its pool is guarded by a lock.

Copy engines hide CUDA streams and events behind :class:`CopyEngine`, so the
decisions made here (chunk order, look-ahead, back-pressure, buffer reuse) run
unchanged on CPU with :class:`HostCopyEngine`, a deferred fake that the tests
and ``scripts/device_check.sh --cpu`` use. On a CPU-only torch no CUDA API is
called: nothing reaches :class:`CudaCopyEngine` without a CUDA tensor, and
``device="cuda"`` is refused at construction.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import zmq

from . import buffers, wire
from .tree import EncodedTree, StorageRef

CPU = torch.device("cpu")

# How long the serving thread sleeps between polls of a pending copy event:
# short, because a chunk's copy takes microseconds to a millisecond; nonzero,
# so the GIL goes to the trainer's threads meanwhile.
_SPIN_SECONDS = 50e-6


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


class Tracker(Protocol):
    """What the ring needs of a pyzmq ``MessageTracker``."""

    @property
    def done(self) -> bool: ...


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


# ----------------------------------------------------------------------------- CPU fake


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


# ----------------------------------------------------------------------------- configuration


@dataclass
class _RecvKit:
    """What one receive borrows: a ring of bounce buffers and its engines, by device."""

    ring: PinnedRing
    engines: dict[torch.device, CopyEngine] = field(default_factory=dict)


@dataclass
class DeviceStaging:
    """How device memory is staged; one per transport, shared by its serving and receiving threads.

    Args:
        slots: pinned buffers in a ring (each as large as the largest data
            message it has carried). The serving thread has one ring; each
            concurrent receive borrows one. Pinned memory per ring is at most
            ``slots x chunk_bytes`` (on receive: the sender's ``chunk_bytes``).
        depth: device-to-host copies one transfer may have ahead of the
            network (never more than the receiver's credit allows, and fewer
            when several transfers share the ring).
        make_engine: the copy engine for a device; CUDA streams by default.
        host_buffer: allocates one ring buffer; pinned memory by default.
        stage_host: route host memory through the rings too. Slower; it exists
            so the tests exercise the staging pipeline on machines without GPUs.
    """

    slots: int = 8
    depth: int = 4
    make_engine: Callable[[torch.device], CopyEngine] = cuda_engine
    host_buffer: Callable[[int], torch.Tensor] = pinned_buffer
    stage_host: bool = False
    _idle: list[_RecvKit] = field(default_factory=list, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if not 1 <= self.depth <= self.slots:
            raise ValueError("depth must be in [1, slots]")

    def stages(self, device: torch.device) -> bool:
        """Whether memory on ``device`` travels through the rings."""
        return device.type == "cuda" or (self.stage_host and device.type == "cpu")

    def borrow(self) -> _RecvKit:
        """A receive kit for the calling thread; give it back with :meth:`give_back`."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return _RecvKit(PinnedRing(self.slots, self.host_buffer))

    def give_back(self, kit: _RecvKit) -> None:
        """Return a kit whose copies have all completed (the caller synchronised its engines)."""
        with self._lock:
            self._idle.append(kit)


def fresh_device(value: str | torch.device) -> torch.device:
    """Validate the ``device=`` option: where freshly allocated received tensors go."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {value!r}") from None
    if device.type == "cpu":
        return CPU
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={value!r}, but this torch build or machine has no CUDA")
        return device
    raise ValueError(f"device must be 'cpu' or a CUDA device, got {value!r}")


def can_fill(device: torch.device) -> bool:
    """Whether an in-place receive can write into a tensor on ``device``."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def storage_bytes(owner: Any) -> torch.Tensor:
    """The whole storage of ``owner`` (a tensor or an UntypedStorage) as flat uint8, no copy."""
    storage = owner if isinstance(owner, torch.UntypedStorage) else owner.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as flat uint8 on its device, no copy.

    Through ``set_`` rather than ``view(torch.uint8)``, which refuses some
    dtypes and 0-dim tensors.
    """
    itemsize = tensor.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    start = tensor.storage_offset() * itemsize
    return flat.set_(tensor.untyped_storage(), start, (tensor.numel() * itemsize,), (1,))


def landing_bytes(tensor: torch.Tensor, staging: DeviceStaging) -> torch.Tensor | None:
    """The flat bytes of a receive destination whose data goes through bounce buffers, else None."""
    return tensor_bytes(tensor) if staging.stages(tensor.device) else None


def fresh_storage(nbytes: int, device: torch.device) -> torch.Tensor:
    """Fresh uint8 memory for one received storage on a staged device."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


# ----------------------------------------------------------------------------- the ring


@dataclass(eq=False)
class Slot:
    """One reusable host buffer of a :class:`PinnedRing`.

    Reusable once nobody holds it, its last copy has completed and libzmq has
    let go of the last frame sent from it; :meth:`idle` checks all three.
    """

    index: int
    buffer: torch.Tensor
    holder: object | None = None
    event: CopyEvent | None = None
    tracker: Tracker | None = None
    uses: int = 0

    def idle(self) -> bool:
        if self.holder is not None:
            return False
        if self.event is not None:
            if not self.event.query():
                return False
            self.event = None
        if self.tracker is not None:
            if not self.tracker.done:
                return False
            self.tracker = None
        return True

    def view(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` of the buffer, writable, no copy (valid while the slot lives)."""
        return buffers.raw_view(self.buffer.data_ptr(), nbytes)


class PinnedRing:
    """A fixed number of reusable host staging buffers, allocated on first need and then kept.

    Used by one thread at a time (its stager's or unstager's owner); not thread-safe.
    """

    def __init__(self, slots: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self._allocate = allocate
        self._slots: list[Slot] = []
        self._capacity = slots
        self._next = 0
        self.allocations = 0  # buffers ever allocated (growths included)

    @property
    def slots(self) -> list[Slot]:
        return list(self._slots)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return self._allocate(nbytes)

    def acquire(self, holder: object, nbytes: int) -> Slot | None:
        """A free buffer of at least ``nbytes`` for ``holder``, or None when all are in flight."""
        count = len(self._slots)
        chosen: Slot | None = None
        # Round robin from the slot after the last one handed out: the least
        # recently used one is the likeliest to have finished its copy and frame.
        for i in range(count):
            slot = self._slots[(self._next + i) % count]
            if slot.idle():
                chosen = slot
                break
        if chosen is None:
            if count >= self._capacity:
                return None  # back-pressure: every buffer is held or in flight
            chosen = Slot(count, self._buffer(nbytes))
            self._slots.append(chosen)
        elif chosen.buffer.numel() < nbytes:
            # Larger messages than this buffer has carried: grow it once, keep it.
            chosen.buffer = self._buffer(nbytes)
        chosen.holder = holder
        chosen.uses += 1
        self._next = (chosen.index + 1) % self._capacity
        return chosen

    def release(self, slot: Slot, event: CopyEvent | None = None, tracker: Tracker | None = None) -> None:
        """Let go of ``slot``; it becomes reusable once ``event`` and ``tracker`` are done."""
        slot.holder = None
        if event is not None:
            slot.event = event
        if tracker is not None:
            slot.tracker = tracker

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a released buffer to become reusable."""
        deadline = time.monotonic() + timeout
        released = [s for s in self._slots if s.holder is None]
        if not released or any(s.idle() for s in released):
            return
        events = [s.event for s in released if s.event is not None]
        if events:
            _spin(events, deadline)
            return
        for slot in released:
            wait = getattr(slot.tracker, "wait", None)
            if wait is not None:
                with contextlib.suppress(zmq.NotDone):
                    wait(max(0.0, deadline - time.monotonic()))  # blocks without the GIL
                return

    def drop(self) -> None:
        """Forget every buffer (after the owner synchronised its engines)."""
        self._slots.clear()
        self._next = 0


def _spin(events: Sequence[CopyEvent], deadline: float) -> bool:
    """Poll ``events`` until one completes or ``deadline``; a CUDA event has no timed wait."""
    while True:
        if any(event.query() for event in events):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_SPIN_SECONDS)


class _EventGroup:
    """Several engines' events as one (a message whose pieces live on several devices)."""

    def __init__(self, events: list[CopyEvent]) -> None:
        self._events = events

    def query(self) -> bool:
        return all(event.query() for event in self._events)

    def synchronize(self) -> None:
        for event in self._events:
            event.synchronize()


def _one_event(events: list[CopyEvent]) -> CopyEvent | None:
    if not events:
        return None
    return events[0] if len(events) == 1 else _EventGroup(events)


# ----------------------------------------------------------------------------- sending


@dataclass
class SendPlan:
    """Which data messages of a staged step go through the stager.

    Built by :func:`prepare_send` in the thread calling ``send_checkpoint`` and
    read-only afterwards, except the cache of source views, which only the
    serving thread fills.
    """

    storages: list[StorageRef]
    pieces: list[list[wire.Piece]]
    staged: list[bool]  # per storage: copied by an engine (else read from host memory)
    chunks: list[bool]  # per data message: built in a staging buffer
    markers: dict[torch.device, object]  # where each device's producer stream stood
    _sources: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def device_of(self, storage: int) -> torch.device:
        return self.storages[storage].device or CPU

    def source(self, storage: int) -> torch.Tensor:
        """The storage's bytes as flat uint8 on its device (serving thread only)."""
        flat = self._sources.get(storage)
        if flat is None:
            flat = self._sources[storage] = storage_bytes(self.storages[storage].owner)
        return flat


def prepare_send(tree: EncodedTree, plan: list[list[wire.Piece]], staging: DeviceStaging) -> SendPlan | None:
    """The staging plan of one ``send_checkpoint``, or None when it has no device memory.

    Copies nothing: it records a marker on the caller's current stream of each
    device, so the serving thread's copies see the finished state.
    """
    staged = [staging.stages(ref.device or CPU) for ref in tree.storages]
    if not any(staged):
        return None
    chunks = [any(staged[piece.storage] for piece in pieces) for pieces in plan]
    devices = {ref.device for ref, s in zip(tree.storages, staged, strict=True) if s and ref.device}
    markers: dict[torch.device, object] = {}
    for device in devices:
        marker = capture_marker(device)
        if marker is not None:
            markers[device] = marker
    return SendPlan(list(tree.storages), plan, staged, chunks, markers)


@dataclass
class _Lane:
    """One transfer's staged messages: copies issued, in message order, not yet sent."""

    plan: SendPlan
    next_issue: int = 0
    queued: deque[tuple[int, Slot]] = field(default_factory=deque)
    waited: set[torch.device] = field(default_factory=set)


class SendStager:
    """Stages device memory for the serving thread, which alone calls it (see the module docstring).

    Per transfer (a *lane*, keyed by the server's transfer key) it keeps up to
    ``depth`` messages copied or being copied ahead of the one to send next,
    never beyond the receiver's credit, and fewer when transfers share the
    ring. The server asks :meth:`ready` before sending a message, takes its
    bytes with :meth:`take`, and reports the frame's tracker with :meth:`sent`.
    """

    def __init__(self, staging: DeviceStaging) -> None:
        self._staging = staging
        self._ring = PinnedRing(staging.slots, staging.host_buffer)
        self._engines: dict[torch.device, CopyEngine] = {}
        self._lanes: dict[Hashable, _Lane] = {}

    @property
    def ring(self) -> PinnedRing:
        return self._ring

    @property
    def engines(self) -> dict[torch.device, CopyEngine]:
        return dict(self._engines)

    def _engine(self, device: torch.device) -> CopyEngine:
        engine = self._engines.get(device)
        if engine is None:
            engine = self._engines[device] = self._staging.make_engine(device)
        return engine

    def ready(self, key: Hashable, plan: SendPlan, seq: int, credit: int) -> bool:
        """Whether message ``seq`` can be sent now; first issues copies ahead of it."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = self._lanes[key] = _Lane(plan, next_issue=seq)
        self._issue(key, lane, seq, credit)
        if not plan.chunks[seq]:
            return True  # host memory only: the server frames it directly
        if not lane.queued or lane.queued[0][0] != seq:
            return False  # not issued yet: no free buffer
        event = lane.queued[0][1].event
        return event is None or event.query()

    def _issue(self, key: Hashable, lane: _Lane, seq: int, credit: int) -> None:
        lane.next_issue = max(lane.next_issue, seq)
        # Never further ahead than the receiver lets us send: a buffer filled for
        # a message that cannot go out only keeps another transfer waiting.
        limit = min(seq + max(credit, 1), len(lane.plan.chunks))
        share = self._staging.slots // max(1, len(self._lanes))
        cap = max(1, min(self._staging.depth, share))
        chunks = lane.plan.chunks
        while len(lane.queued) < cap and lane.next_issue < limit:
            at = lane.next_issue
            if chunks[at]:
                slot = self._ring.acquire(key, wire.chunk_length(lane.plan.pieces[at]))
                if slot is None:
                    return  # back-pressure: every buffer is held or in flight
                self._fill(lane, at, slot)
                lane.queued.append((at, slot))
            lane.next_issue += 1

    def _fill(self, lane: _Lane, seq: int, slot: Slot) -> None:
        plan = lane.plan
        pieces = plan.pieces[seq]
        host_view = slot.view(wire.chunk_length(pieces))
        pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        at = 0
        for piece in pieces:
            end = at + piece.length
            if plan.staged[piece.storage]:
                source = plan.source(piece.storage)[piece.start : piece.start + piece.length]
                device = plan.device_of(piece.storage)
                pairs.setdefault(device, []).append((slot.buffer[at:end], source))
            else:
                # A small host storage packed with device ones: its bytes are
                # copied now (packed storages are small by construction).
                ref = plan.storages[piece.storage]
                host_view[at:end] = ref.view(piece.start, piece.start + piece.length)
            at = end
        events: list[CopyEvent] = []
        for device, device_pairs in pairs.items():
            engine = self._engine(device)
            if device not in lane.waited:
                marker = plan.markers.get(device)
                if marker is not None:
                    engine.wait_marker(marker)
                lane.waited.add(device)
            engine.copy(device_pairs)
            events.append(engine.record())
        slot.event = _one_event(events)

    def take(self, key: Hashable, seq: int) -> memoryview | None:
        """The staged bytes of message ``seq``, once :meth:`ready` said so; None if not staged."""
        lane = self._lanes.get(key)
        if lane is None or not lane.queued or lane.queued[0][0] != seq:
            return None
        slot = lane.queued[0][1]
        if slot.event is not None:
            if not slot.event.query():
                return None
            slot.event = None
        return slot.view(wire.chunk_length(lane.plan.pieces[seq]))

    def sent(self, key: Hashable, seq: int, tracker: Tracker | None) -> None:
        """Message ``seq`` was handed to libzmq; its buffer is free once ``tracker`` is done."""
        lane = self._lanes[key]
        at, slot = lane.queued.popleft()
        assert at == seq, (at, seq)
        self._ring.release(slot, tracker=tracker)

    def retain(self, keys: Collection[Hashable]) -> None:
        """Forget the lanes of transfers not in ``keys`` (finished, aborted, cancelled)."""
        for key in [k for k in self._lanes if k not in keys]:
            lane = self._lanes.pop(key)
            for _, slot in lane.queued:
                # An aborted transfer's copies may still be reading its device
                # memory; the lane's reference may be the last one keeping that
                # memory from the caching allocator. Wait for them (a few chunks).
                if slot.event is not None:
                    slot.event.synchronize()
                    slot.event = None
                self._ring.release(slot)

    def pending(self) -> bool:
        """Whether any lane holds staged messages."""
        return any(lane.queued for lane in self._lanes.values())

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a lane's next copy, or for a buffer to come free."""
        heads = [lane.queued[0][1].event for lane in self._lanes.values() if lane.queued]
        events = [event for event in heads if event is not None]
        if events:
            _spin(events, time.monotonic() + timeout)
        else:
            self._ring.wait(timeout)

    def synchronize(self) -> None:
        """Block until every issued copy has completed: device memory is no longer read."""
        for engine in self._engines.values():
            engine.synchronize()

    def close(self) -> None:
        """Synchronise, then drop lanes, engines and buffers (the server is shutting down)."""
        self.synchronize()
        self._lanes.clear()
        self._engines.clear()
        self._ring.drop()


# ----------------------------------------------------------------------------- receiving


class Landing(Protocol):
    """What the unstager needs of a receive destination (``receiver._Destination``)."""

    view: memoryview  # host destination: written directly
    device_bytes: torch.Tensor | None  # staged destination: flat uint8 on its device


class RecvUnstager:
    """Lands received data messages in device memory through pinned bounce buffers.

    Borrowed by one receiving thread for one receive (:meth:`borrow`); that
    thread alone calls it, and :meth:`close` gives its kit back. Per message:
    :meth:`buffer` hands out a free bounce buffer to receive into (blocking on
    the oldest copy when all are in flight), :meth:`deliver` queues its copies
    to the destinations, and the next message is received while they run.
    """

    def __init__(self, staging: DeviceStaging, kit: _RecvKit, landings: Sequence[Landing]) -> None:
        self._staging = staging
        self._kit = kit
        self._landings = landings
        self._staged = [landing.device_bytes is not None for landing in landings]
        self._current: Slot | None = None
        self._inflight: deque[Slot] = deque()  # released slots, oldest copy first
        self._closed = False

    @classmethod
    def borrow(cls, staging: DeviceStaging, landings: Sequence[Landing]) -> RecvUnstager | None:
        """An unstager for a receive into ``landings``, or None when none is device memory."""
        if not any(landing.device_bytes is not None for landing in landings):
            return None
        unstager = cls(staging, staging.borrow(), landings)
        try:
            # In-place targets may still be written by kernels the caller queued:
            # the side streams wait for them before overwriting.
            for device in {lb.device for lb in (d.device_bytes for d in landings) if lb is not None}:
                unstager._engine(device).after_current()
        except BaseException:
            unstager.close()  # the caller never sees it: give the kit back here
            raise
        return unstager

    @property
    def ring(self) -> PinnedRing:
        return self._kit.ring

    def _engine(self, device: torch.device) -> CopyEngine:
        engine = self._kit.engines.get(device)
        if engine is None:
            engine = self._kit.engines[device] = self._staging.make_engine(device)
        return engine

    def wants(self, pieces: list[wire.Piece]) -> bool:
        """Whether a data message carries bytes for a staged destination."""
        return any(self._staged[piece.storage] for piece in pieces)

    def buffer(self, nbytes: int) -> memoryview:
        """A bounce buffer of ``nbytes`` to receive the next message into."""
        assert self._current is None, "deliver() the previous message first"
        ring = self._kit.ring
        slot = ring.acquire(self, nbytes)
        while slot is None:
            # Back-pressure: every buffer feeds a copy still running. Wait for
            # the oldest; later frames wait in the socket meanwhile (bounded by credit).
            if not self._inflight:
                raise RuntimeError("no bounce buffer is free and none is in flight")
            oldest = self._inflight.popleft()
            if oldest.event is not None:
                oldest.event.synchronize()
            slot = ring.acquire(self, nbytes)
        if slot in self._inflight:
            self._inflight.remove(slot)
        self._current = slot
        return slot.view(nbytes)

    def deliver(self, pieces: list[wire.Piece]) -> None:
        """Queue the copies of the message just received into :meth:`buffer` to its destinations."""
        slot = self._current
        assert slot is not None, "buffer() first"
        self._current = None
        at = 0
        pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for piece in pieces:
            end = at + piece.length
            landing = self._landings[piece.storage]
            target = landing.device_bytes
            if target is None:
                # A host storage packed with staged ones: copy it now.
                landing.view[piece.start : piece.start + piece.length] = slot.view(end)[at:end]
            else:
                pair = (target[piece.start : piece.start + piece.length], slot.buffer[at:end])
                pairs.setdefault(target.device, []).append(pair)
            at = end
        events: list[CopyEvent] = []
        for device, device_pairs in pairs.items():
            engine = self._engine(device)
            engine.copy(device_pairs)
            events.append(engine.record())
        self._kit.ring.release(slot, event=_one_event(events))
        self._inflight.append(slot)

    def close(self) -> None:
        """Wait for every queued copy, then give the kit back; on success and on error alike.

        After it returns nothing writes into the destinations any more and the
        buffers can serve another receive. If synchronising fails (a CUDA
        error), the kit is dropped rather than reused.
        """
        if self._closed:
            return
        self._closed = True
        for engine in self._kit.engines.values():
            engine.synchronize()
        if self._current is not None:
            self._kit.ring.release(self._current)
            self._current = None
        self._inflight.clear()
        self._staging.give_back(self._kit)


__all__ = [
    "CopyEngine",
    "CopyEvent",
    "CudaCopyEngine",
    "DeviceStaging",
    "FakeDevice",
    "HostCopyEngine",
    "PinnedRing",
    "RecvUnstager",
    "SendPlan",
    "SendStager",
    "Slot",
    "can_fill",
    "capture_marker",
    "fresh_device",
    "fresh_storage",
    "landing_bytes",
    "prepare_send",
    "storage_bytes",
    "tensor_bytes",
]
