"""Zero-copy frames libzmq still references, and the disallows waiting for them to go.

Pure bookkeeping (no zmq import): a tracker is anything with a ``done``
attribute, such as pyzmq's ``MessageTracker``; the caller passes the time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class Tracker(Protocol):
    @property
    def done(self) -> bool: ...


T = TypeVar("T", bound=Tracker)


@dataclass
class _Waiting:
    deadline: float  # past it, the socket is closed to free the frames
    done: threading.Event
    forced: bool = False


class HeldFrames(Generic[T]):
    """Frames handed to libzmq without a copy, until libzmq lets go of them."""

    def __init__(self) -> None:
        self.trackers: list[T] = []
        self._waiting: list[_Waiting] = []

    def track(self, tracker: T) -> None:
        self.trackers.append(tracker)

    def wait(self, done: threading.Event, deadline: float) -> None:
        """Set ``done`` once no frame is held; :meth:`poll` asks for a forced release after ``deadline``."""
        self._waiting.append(_Waiting(deadline, done))

    @property
    def waiting(self) -> bool:
        """Whether a disallow waits for the frames to be released."""
        return bool(self._waiting)

    def poll(self, now: float) -> bool:
        """Forget released frames and wake waiters; True when the socket must be closed to free the rest."""
        if self.trackers:
            self.trackers = [t for t in self.trackers if not t.done]
        if not self._waiting:
            return False
        if not self.trackers:
            self.release_waiters()
            return False
        if any(w.deadline <= now and not w.forced for w in self._waiting):
            for waiting in self._waiting:
                waiting.forced = True
            return True
        return False

    def release_waiters(self) -> None:
        for waiting in self._waiting:
            waiting.done.set()
        self._waiting.clear()
