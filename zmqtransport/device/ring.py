"""The pinned ring: a fixed number of reusable host buffers between device memory and frames.

A buffer is reused only when nothing can still touch it: no stager holds it,
its last copy has completed, and libzmq has released the last frame sent from
it (pyzmq ``MessageTracker``). Used by one thread at a time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import zmq

from .. import buffers
from .engines import CopyEvent

# How long the serving thread sleeps between polls of a pending copy event:
# short, because a chunk's copy takes microseconds to a millisecond; nonzero,
# so the GIL goes to the trainer's threads meanwhile.
_SPIN_SECONDS = 50e-6


class Tracker(Protocol):
    """What the ring needs of a pyzmq ``MessageTracker``."""

    @property
    def done(self) -> bool: ...


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

    def acquire(self, holder: object, nbytes: int, reserve: int = 0) -> Slot | None:
        """A free buffer of at least ``nbytes`` for ``holder``, or None when all are in flight.

        A buffer allocated (or grown) here gets ``max(nbytes, reserve)`` bytes:
        an owner that knows the largest message of its transfer passes it as
        ``reserve``, so a buffer first used for a small message is not grown
        (a second pinned allocation) when a full-size one comes to it later.
        """
        size = max(nbytes, reserve)
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
            chosen = Slot(count, self._buffer(size))
            self._slots.append(chosen)
        elif chosen.buffer.numel() < nbytes:
            # Larger messages than this buffer has carried: grow it once, keep it.
            chosen.buffer = self._buffer(size)
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
            spin(events, deadline)
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


def spin(events: Sequence[CopyEvent], deadline: float) -> bool:
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


def one_event(events: list[CopyEvent]) -> CopyEvent | None:
    if not events:
        return None
    return events[0] if len(events) == 1 else _EventGroup(events)
