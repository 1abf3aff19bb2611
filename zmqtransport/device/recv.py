"""The receive unstager: data messages land in pinned bounce buffers, then go to device memory."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Protocol

import torch

from .. import wire
from .engines import CopyEngine, CopyEvent
from .ring import PinnedRing, Slot, one_event
from .staging import DeviceStaging, RecvKit


class UnstageTarget(Protocol):
    """What the unstager needs of a receive destination (``fetch.landed.Destination``)."""

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

    def __init__(self, staging: DeviceStaging, kit: RecvKit, targets: Sequence[UnstageTarget]) -> None:
        self._staging = staging
        self._kit = kit
        self._targets = targets
        self._staged = [target.device_bytes is not None for target in targets]
        self._current: Slot | None = None
        self._inflight: deque[Slot] = deque()  # released slots, oldest copy first
        self._closed = False

    @classmethod
    def borrow(cls, staging: DeviceStaging, targets: Sequence[UnstageTarget]) -> RecvUnstager | None:
        """An unstager for a receive into ``targets``, or None when none is device memory."""
        if not any(target.device_bytes is not None for target in targets):
            return None
        unstager = cls(staging, staging.borrow(), targets)
        try:
            # In-place targets may still be written by kernels the caller queued:
            # the side streams wait for them before overwriting.
            for device in {lb.device for lb in (t.device_bytes for t in targets) if lb is not None}:
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

    def buffer(self, nbytes: int, reserve: int = 0) -> memoryview:
        """A bounce buffer of ``nbytes`` to receive the next message into.

        ``reserve``: the receive's largest bounced message, the size a new
        buffer gets (see :meth:`PinnedRing.acquire`).
        """
        assert self._current is None, "deliver() the previous message first"
        ring = self._kit.ring
        slot = ring.acquire(self, nbytes, reserve)
        while slot is None:
            # Back-pressure: every buffer feeds a copy still running. Wait for
            # the oldest; later frames wait in the socket meanwhile (bounded by credit).
            if not self._inflight:
                raise RuntimeError("no bounce buffer is free and none is in flight")
            oldest = self._inflight.popleft()
            if oldest.event is not None:
                oldest.event.synchronize()
            slot = ring.acquire(self, nbytes, reserve)
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
            destination = self._targets[piece.storage]
            target = destination.device_bytes
            if target is None:
                # A host storage packed with staged ones: copy it now.
                destination.view[piece.start : piece.start + piece.length] = slot.view(end)[at:end]
            else:
                pair = (target[piece.start : piece.start + piece.length], slot.buffer[at:end])
                pairs.setdefault(target.device, []).append(pair)
            at = end
        events: list[CopyEvent] = []
        for device, device_pairs in pairs.items():
            engine = self._engine(device)
            engine.copy(device_pairs)
            events.append(engine.record())
        self._kit.ring.release(slot, event=one_event(events))
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

