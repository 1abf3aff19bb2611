"""The send stager: the serving thread copies device memory into pinned buffers ahead of the network."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Hashable
from dataclasses import dataclass, field

import torch

from .. import wire
from ..codec.tensors import EncodedTree, StorageRef
from .engines import CPU, CopyEngine, CopyEvent, capture_marker
from .ring import PinnedRing, Slot, Tracker, one_event, spin
from .staging import DeviceStaging, storage_bytes


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
    largest: int = 0  # bytes of the transfer's largest staged message: every buffer's size
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
            largest = max((wire.chunk_length(p) for p, c in zip(plan.pieces, plan.chunks, strict=True) if c), default=0)
            lane = self._lanes[key] = _Lane(plan, next_issue=seq, largest=largest)
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
                slot = self._ring.acquire(key, wire.chunk_length(lane.plan.pieces[at]), lane.largest)
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
        slot.event = one_event(events)

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

    def forget(self, key: Hashable, seq: int) -> None:
        """Message ``seq``, issued for ``key``, will not be taken (it was hashed meanwhile, as the pump sent it):
        its buffer is reusable once its copy completes."""
        lane = self._lanes.get(key)
        if lane is not None and lane.queued and lane.queued[0][0] == seq:
            _, slot = lane.queued.popleft()
            event, slot.event = slot.event, None
            self._ring.release(slot, event=event)

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
            spin(events, time.monotonic() + timeout)
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
