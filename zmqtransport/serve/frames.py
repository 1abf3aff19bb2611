"""Data frames libzmq still holds, per transfer: progress, stuck receivers, and when a disallow may return.

Pure bookkeeping (no zmq import): a tracker is anything with a ``done``
attribute, such as pyzmq's ``MessageTracker``; the caller passes the time.

libzmq lets go of a frame once its bytes are in the kernel: for a receiver
that reads, frames are released continuously (the transfer makes progress);
for one that stopped reading (frozen, host gone, stuck), they stay queued.
Frames that reference staged memory (``pinned``) must all be released before
``disallow_checkpoint`` returns; closing the socket frees them at once, at the
price of every other connection, so that is done only when no receiver that
is making progress would lose data (docs/protocol.md, "Releasing staged memory").
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

Key = tuple[bytes, int]  # (routing id, transfer id), as in the scheduler


class Tracker(Protocol):
    @property
    def done(self) -> bool: ...


T = TypeVar("T", bound=Tracker)

# Seconds between looks at held frames: a release is dated to the look that
# sees it, so this is how late progress (and a stuck receiver) is noticed.
RELEASE_POLL = 0.05


@dataclass
class _Waiting:
    deadline: float  # the transfer timeout: past it, the socket is closed whatever the progress
    done: threading.Event
    forced: bool = False


@dataclass
class _Frames(Generic[T]):
    """The frames of one transfer that libzmq has not released yet."""

    last_release: float  # when one of them was last released (or the first was queued)
    pinned: list[T] = field(default_factory=list)  # reference staged memory
    copies: list[T] = field(default_factory=list)  # their own buffers: only tell progress
    closing: bool = False  # queued on a socket that has since been closed: libzmq is freeing them


class HeldFrames(Generic[T]):
    """Frames handed to libzmq, per transfer, until libzmq lets go of them."""

    def __init__(self, stall: float) -> None:
        self.stall = stall  # frames not released for this long belong to a stuck receiver
        self._frames: dict[Key, _Frames[T]] = {}
        self._waiting: list[_Waiting] = []

    def track(self, key: Key, tracker: T, pinned: bool, now: float) -> None:
        frames = self._frames.get(key)
        if frames is None:
            frames = self._frames[key] = _Frames(now)
        (frames.pinned if pinned else frames.copies).append(tracker)

    def wait(self, done: threading.Event, deadline: float) -> None:
        """Set ``done`` once no pinned frame is held; past ``deadline`` :meth:`must_close` says so."""
        self._waiting.append(_Waiting(deadline, done))

    @property
    def waiting(self) -> bool:
        """Whether a disallow waits for pinned frames to be released."""
        return bool(self._waiting)

    @property
    def pinned(self) -> int:
        return sum(len(frames.pinned) for frames in self._frames.values())

    def trackers(self) -> list[T]:
        return [t for frames in self._frames.values() for t in frames.pinned + frames.copies]

    def poll(self, now: float) -> set[Key]:
        """Forget released frames and wake waiters; returns the transfers that made progress."""
        progressed: set[Key] = set()
        for key, frames in list(self._frames.items()):
            pinned = [t for t in frames.pinned if not t.done]
            copies = [t for t in frames.copies if not t.done]
            if len(pinned) + len(copies) < len(frames.pinned) + len(frames.copies):
                progressed.add(key)
                frames.last_release = now
            frames.pinned, frames.copies = pinned, copies
            if not pinned and not copies:
                del self._frames[key]
        if self._waiting and not any(frames.pinned for frames in self._frames.values()):
            self.release_waiters()
        return progressed

    def wakeup_in(self, now: float) -> float | None:
        """Seconds until :meth:`poll` should look again (None: nothing held that matters)."""
        held = [frames.last_release for frames in self._frames.values() if frames.pinned and not frames.closing]
        if not held:
            return None
        return max(0.0, min(RELEASE_POLL, min(held) + self.stall - now))

    def must_close(self, now: float, transfers_running: bool) -> bool:
        """Whether to close the socket now to free pinned frames.

        Yes when every transfer still holding pinned frames is stuck (nothing
        released for the stall bound) and no running transfer would lose its
        queued data; or, once, when a disallow has waited for the transfer timeout.
        """
        held = [frames for frames in self._frames.values() if frames.pinned and not frames.closing]
        if not held:
            return False
        overdue = [w for w in self._waiting if w.deadline <= now and not w.forced]
        if overdue:
            for waiting in self._waiting:
                waiting.forced = True
            return True
        if transfers_running:
            return False
        return all(now - frames.last_release > self.stall for frames in held)

    def socket_closed(self) -> None:
        """Every queued frame is being freed by libzmq: none of them may ask for another close."""
        for frames in self._frames.values():
            frames.closing = True

    def release_waiters(self) -> None:
        for waiting in self._waiting:
            waiting.done.set()
        self._waiting.clear()
