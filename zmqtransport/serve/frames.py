"""Data frames libzmq still holds, per transfer: progress, stuck receivers, and when a disallow may return.

Pure bookkeeping (no zmq import): a tracker is anything with a ``done``
attribute, such as pyzmq's ``MessageTracker``; the caller passes the time.

libzmq lets go of a frame once its bytes are in the kernel: for a receiver
that reads, frames are released continuously (the transfer makes progress);
for one that stopped reading (frozen, host gone, stuck), they stay queued.
Frames that reference the caller's tensors (``pinned``) must all be released
before ``disallow_checkpoint`` returns, so few may be queued at any moment: a
pinned frame goes out only while what libzmq holds for its connection, and the
frame, drain within :data:`PINNED_DRAIN` at the rate that connection last
drained (:meth:`HeldFrames.may_send`); otherwise its transfer pauses until
frames of that connection are released. On a fast link that never binds (the
receiver's credit does); on a slow one the kernel's socket buffer keeps the
link busy while libzmq holds a few frames, and a disallow waits for little.
Closing the socket frees every frame at once, at the price of every other
connection: it is done when no receiver that is making progress would lose
data, or when a disallow waits only for frames of receivers that are stuck
(docs/protocol.md, "Releasing staged memory").

What libzmq holds is also this side's memory, and a peer decides how much of
it there is: credit is something a peer *says*, so one that grants credit and
never reads would have every message queued (copies of packed or relayed
frames cost their bytes each). So what is queued is bounded whatever a peer
grants (docs/security.md, "Memory a peer can make this side hold"): per
connection by :attr:`HeldFrames.per_connection` bytes, and the copies of all
connections together by :attr:`HeldFrames.copies`; a connection that has
released nothing for the stall bound is reported by :meth:`HeldFrames.stuck`,
and the socket owner cuts that one connection, which frees what was queued
for it without touching anyone else's.
"""

from __future__ import annotations

import threading
from collections.abc import Container
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
# Seconds: the most the pinned frames queued for one connection may be
# expected to take to drain, at the rate its frames last drained: what a
# disallow waits for such frames of a receiver that keeps reading.
PINNED_DRAIN = 0.03
# Seconds between looks at held frames while a transfer waits for its
# connection to drain (it sends again as soon as a look sees a release).
PAUSED_POLL = 0.002
# A paused connection whose drain rate is known is first looked at this share
# of the way to when its oldest frame should be released at that rate, then
# every LATE_LOOKS of that frame's drain time (never more often than
# PAUSED_POLL). Looking every PAUSED_POLL from the start woke the serving
# thread about twenty times per 1 MiB frame on a 400 Mbit/s link shared by
# three receivers (a pinned frame may be queued only while it drains within
# PINNED_DRAIN, so such a source is paused most of the time: 8,246 polls in
# 4 s). Early, then often: a release is dated to the look that sees it, so
# one seen late reads as a slower rate; looks a tenth of the drain apart keep
# that error under a tenth, and the kernel's socket buffer, full behind the
# released frame, keeps the link busy meanwhile.
EARLY_LOOK = 0.75
LATE_LOOKS = 0.1
# Bytes libzmq may hold for one connection (every frame it has not handed to
# the kernel yet, zero-copy or copied). An honest receiver's credit keeps it
# far below: a direct receive grants 16 messages, a span fetch about 4 MiB, and
# a receiver that reads takes frames as fast as the kernel sends them. At least
# one frame is always allowed, whatever its size.
QUEUED_PER_CONNECTION = 32 << 20
# Bytes of copies (packed small tensors, relayed and snapshot messages) libzmq
# may hold for all connections together: ZMQTransport(send_queue_bytes=...).
QUEUED_COPIES = 256 << 20


@dataclass
class _Waiting:
    deadline: float  # the transfer timeout: past it, the socket is closed whatever the progress
    done: threading.Event
    forced: bool = False


@dataclass
class _Frame(Generic[T]):
    tracker: T
    nbytes: int
    sent_at: float
    ahead: int  # bytes libzmq still held for the same connection when this one was queued
    pinned: bool  # references the caller's tensors (else a buffer of this side's: it only tells progress)
    copied: bool = False  # a copy made for this send: its bytes are this side's memory until released


@dataclass
class _Frames(Generic[T]):
    """The frames of one transfer that libzmq has not released yet."""

    last_release: float  # when one of them was last released (or the first was queued)
    held: list[_Frame[T]] = field(default_factory=list)
    closing: bool = False  # queued on a socket that has since been closed: libzmq is freeing them

    @property
    def pinned(self) -> list[T]:
        return [frame.tracker for frame in self.held if frame.pinned]


class HeldFrames(Generic[T]):
    """Frames handed to libzmq, per transfer, until libzmq lets go of them; drain rates per connection."""

    def __init__(
        self, stall: float, per_connection: int = QUEUED_PER_CONNECTION, copies: int = QUEUED_COPIES
    ) -> None:
        self.stall = stall  # frames not released for this long belong to a stuck receiver
        self.per_connection = per_connection
        self.copies = copies
        self._frames: dict[Key, _Frames[T]] = {}
        self._waiting: list[_Waiting] = []
        # Per connection (routing id): bytes held, and the rate they last drained at (bytes per second).
        self._queued: dict[bytes, int] = {}
        self._rates: dict[bytes, float] = {}
        self._paused: set[bytes] = set()  # connections a transfer waits on (may_send or may_queue said no)
        self._copied = 0  # bytes of copies held, all connections together
        self._starved = False  # a send waits for copies to be released (may_copy said no)
        self._resumed = False  # copies were released since: sends held back may try again
        self._cut: set[bytes] = set()  # connections reported stuck: their frames are being freed

    def track(self, key: Key, tracker: T, pinned: bool, now: float, nbytes: int = 0, copied: bool = False) -> None:
        frames = self._frames.get(key)
        if frames is None:
            frames = self._frames[key] = _Frames(now)
        queued = self._queued.get(key[0], 0)
        frames.held.append(_Frame(tracker, nbytes, now, queued, pinned, copied))
        self._queued[key[0]] = queued + nbytes
        if copied:
            self._copied += nbytes

    @property
    def copied(self) -> int:
        """Bytes of copies libzmq holds now, all connections together."""
        return self._copied

    def queued(self, peer: bytes) -> int:
        """Bytes libzmq holds now for the connection ``peer``."""
        return self._queued.get(peer, 0)

    def may_queue(self, key: Key, nbytes: int) -> bool:
        """Whether a frame of ``nbytes`` may be queued for this transfer's connection now.

        No while what libzmq holds for that connection and the frame would
        exceed :attr:`per_connection` (one frame is always allowed): the
        connection's credit is what its peer says, this is what it reads.
        After a no, :meth:`poll` reports the connection as soon as one of its
        frames is released.
        """
        peer = key[0]
        queued = self._queued.get(peer, 0)
        if queued == 0 or queued + nbytes <= self.per_connection:
            return True
        self._paused.add(peer)
        return False

    def may_copy(self, nbytes: int) -> bool:
        """Whether a copy of ``nbytes`` may be queued now (all connections' copies within :attr:`copies`).

        One copy is always allowed when none is held. After a no, the first
        :meth:`poll` that sees a copy released makes :meth:`resumed` true.
        """
        if self._copied == 0 or self._copied + nbytes <= self.copies:
            return True
        self._starved = True
        return False

    def resumed(self) -> bool:
        """Whether sends held back by :meth:`may_copy` may try again now (asked once: it resets)."""
        resumed, self._resumed = self._resumed, False
        return resumed

    def may_send(self, key: Key, nbytes: int) -> bool:
        """Whether a pinned frame of ``nbytes`` may be queued for this transfer now.

        Yes when nothing is queued for its connection, or when what is and the
        frame drain within :data:`PINNED_DRAIN` at the rate the connection
        last drained; no while that rate is unknown and frames are queued.
        After a no, :meth:`poll` reports the transfer's connection as soon as
        one of its frames is released, and :meth:`wakeup_in` looks often.
        """
        peer = key[0]
        queued = self._queued.get(peer, 0)
        rate = self._rates.get(peer)
        if queued == 0 or (rate is not None and (queued + nbytes) / rate <= PINNED_DRAIN):
            return True
        self._paused.add(peer)
        return False

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
        return [frame.tracker for frames in self._frames.values() for frame in frames.held]

    def poll(self, now: float) -> set[Key]:
        """Forget released frames and wake waiters; returns the transfers that made progress."""
        progressed: set[Key] = set()
        for key, frames in list(self._frames.items()):
            held = [frame for frame in frames.held if not frame.tracker.done]
            if len(held) == len(frames.held):
                continue
            progressed.add(key)
            frames.last_release = now
            released = [f for f in frames.held if f.tracker.done]
            peer = key[0]
            self._queued[peer] = max(0, self._queued.get(peer, 0) - sum(f.nbytes for f in released))
            freed = sum(f.nbytes for f in released if f.copied)
            if freed:
                self._copied = max(0, self._copied - freed)
                self._resumed, self._starved = self._resumed or self._starved, False
            latest = max(released, key=lambda f: f.sent_at)
            # What was ahead of it and itself drained in the time it was held.
            self._rates[peer] = (latest.ahead + latest.nbytes) / max(now - latest.sent_at, 1e-6)
            self._paused.discard(peer)
            if held:
                frames.held = held
            else:
                del self._frames[key]
        if self._waiting and not any(frames.pinned for frames in self._frames.values()):
            self.release_waiters()
        return progressed

    def retain(self, peers: Container[bytes]) -> None:
        """Forget the drain rates of connections not in ``peers`` (no transfer of theirs runs)."""
        for peer in [p for p in self._rates if p not in peers]:
            del self._rates[peer]
        for peer in [p for p, queued in self._queued.items() if not queued and p not in peers]:
            del self._queued[peer]
        self._paused = {peer for peer in self._paused if peer in peers}
        held = {peer for peer, _ in self._frames}
        self._cut = {peer for peer in self._cut if peer in held}  # freed: a new connection may reuse the id

    def stuck(self, now: float) -> list[bytes]:
        """Connections that hold frames and released none for the stall bound, each reported once.

        Its peer granted credit (or asked) and does not read: the socket owner
        cuts that connection, which frees what libzmq queued for it. A receiver
        that takes data, however slowly, releases frames and is never reported.
        """
        latest: dict[bytes, float] = {}
        for (peer, _), frames in self._frames.items():
            if frames.held and not frames.closing:
                latest[peer] = max(latest.get(peer, float("-inf")), frames.last_release)
        stuck = [peer for peer, last in latest.items() if now - last > self.stall and peer not in self._cut]
        self._cut.update(stuck)
        return stuck

    def cutting(self, peer: bytes) -> None:
        """The connection ``peer`` is being closed: libzmq frees its frames, no socket-wide close is needed for them."""
        for (holder, _), frames in self._frames.items():
            if holder == peer:
                frames.closing = True

    def wakeup_in(self, now: float) -> float | None:
        """Seconds until :meth:`poll` should look again (None: nothing held that matters)."""
        if self._starved:
            return PAUSED_POLL
        oldest: dict[bytes, _Frame[T]] = {}  # per paused connection, its frame queued first
        held = []
        for (peer, _), frames in self._frames.items():
            if not frames.held or frames.closing:
                continue
            held.append(frames.last_release)
            first = frames.held[0]  # held in the order they were queued
            if peer in self._paused and (peer not in oldest or first.sent_at < oldest[peer].sent_at):
                oldest[peer] = first
        looks = [self._release_due(peer, oldest.get(peer), now) for peer in self._paused]
        if held:
            looks.append(max(0.0, min(RELEASE_POLL, min(held) + self.stall - now)))
        return min(looks) if looks else None

    def _release_due(self, peer: bytes, oldest: _Frame[T] | None, now: float) -> float:
        """Seconds until paused connection ``peer``, ``oldest`` its frame queued first, is looked at again
        (:data:`EARLY_LOOK`, :data:`LATE_LOOKS`): within [:data:`PAUSED_POLL`, :data:`RELEASE_POLL`],
        :data:`PAUSED_POLL` while its drain rate is unknown."""
        rate = self._rates.get(peer)
        if not rate or oldest is None:  # no drain measured (data frames are never empty: a rate is above 0)
            return PAUSED_POLL
        drain = (oldest.ahead + oldest.nbytes) / rate  # from its queueing to its release, at that rate
        due = oldest.sent_at + EARLY_LOOK * drain - now
        if due <= 0:
            due = LATE_LOOKS * drain
        return min(RELEASE_POLL, max(PAUSED_POLL, due))

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
        if transfers_running and not self._waiting:
            return False
        # A disallow waits for these frames alone: receivers that took nothing
        # for the stall bound never hold it longer, whatever else runs.
        return all(now - frames.last_release > self.stall for frames in held)

    def socket_closed(self) -> None:
        """Every queued frame is being freed by libzmq: none of them may ask for another close."""
        for frames in self._frames.values():
            frames.closing = True

    def release_waiters(self) -> None:
        for waiting in self._waiting:
            waiting.done.set()
        self._waiting.clear()
