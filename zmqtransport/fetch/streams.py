"""The stream seam: what a receive does with one connection, and its ZeroMQ DEALER implementation.

A receive talks to each of its connections through :class:`Stream`: send a
request without blocking, read the next reply's envelope, receive the frame
after it exactly into its destination, drop or end a message, wait for the
next one within the receive's bounds, close. :class:`DealerStream` is the one
production implementation (a DEALER and the socket monitor that follows its
connection, :class:`SourceWatch`); :class:`MemoryStream` is an in-memory one
for tests. A second data path (shared memory, RDMA) is one more
implementation here; the planner (:mod:`.planner`) never sees a socket.

Threading: a stream belongs to the thread that receives on it.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from .. import wire
from ..errors import ProtocolError
from .liveness import (
    CONNECT_RETRIED,
    DISCONNECTED,
    HANDSHAKE_SUCCEEDED,
    HEARTBEAT_IVL,
    HEARTBEAT_MARGIN,
    RECONNECT_GRACE,
    SETTLE_AFTER_LOSS,
    ConnectionState,
    Wait,
)

# A ZeroMQ context, as the receive's DEALERs are made in one (the caller's).
Context = zmq.Context[Any]
# Applies options (a CurveZMQ key, say) to a new socket.
Configure = Callable[[zmq.Socket[Any]], None]


class Stream(Protocol):
    """One connection of a receive, as the receive uses it."""

    @property
    def endpoint(self) -> str: ...

    def send(self, request: bytes) -> bool:
        """Queue ``request`` without blocking; False when the stream takes no more now."""
        ...

    def send_by(self, request: bytes, deadline: float) -> bool:
        """Queue ``request``, waiting until ``deadline`` (``time.monotonic``) at most; False: it could not."""
        ...

    def cancel(self, request: bytes) -> None:
        """Queue ``request`` if the stream takes it now, else forget it (best effort: the peer may be gone)."""
        ...

    def reply(self, who: str) -> wire.Reply | None:
        """The next reply's envelope (None: none is waiting); the frames after it stay to be read."""
        ...

    def receive(self, into: memoryview | None, what: str, expected: int) -> memoryview:
        """The current message's next frame, into ``into`` (None: as it comes); it must hold ``expected`` bytes."""
        ...

    def frame(self) -> bytes:
        """The current message's next frame, whole."""
        ...

    def discard(self) -> None:
        """Drop the remaining frames of the current message."""
        ...

    def ended(self, what: str) -> None:
        """The current message must have ended; else its extra frames are dropped and ``ProtocolError`` raised."""
        ...

    def wait(self, deadline: float, in_transfer: bool) -> Wait:
        """Block until a reply is waiting, or until one of the bounds says why not (see :class:`SourceWatch`)."""
        ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- the DEALER

_EVENTS = HANDSHAKE_SUCCEEDED | DISCONNECTED
# A failed connection attempt (another is scheduled): watched only when choosing
# among several paths (.racing); ConnectionState ignores it.
REFUSAL_EVENTS = CONNECT_RETRIED
# As plain ints: pyzmq's enums cost a few microseconds per operation, on every pass of a receive's loop.
_READY, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
# Monitor endpoints are named by a counter, not by the socket's descriptor
# (pyzmq's default): a descriptor is reused as soon as a socket is gone, while
# libzmq may not have released the old inproc name yet.
_monitor_ids = itertools.count()


class SourceWatch:
    """Waits for messages on one DEALER while a socket monitor follows its connection (:mod:`.liveness`).

    Used by the thread that owns the DEALER; :meth:`close` before the DEALER
    is closed. Created before the DEALER connects, so it sees the handshake.
    """

    def __init__(self, socket: zmq.Socket[Any], stall_timeout: float | None, extra_events: int = 0) -> None:
        self._socket = socket
        self.stall_timeout = stall_timeout
        address = f"inproc://zmqtransport-monitor-{next(_monitor_ids)}"
        self._monitor: zmq.Socket[Any] = socket.get_monitor_socket(_EVENTS | extra_events, address)
        self.state = ConnectionState()
        self._poller = zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)

    def wait(self, deadline: float, in_transfer: bool) -> Wait:
        """Block until a message is ready on the DEALER, or until one of the bounds says why not.

        ``in_transfer``: the header has arrived, so the source should be
        sending (stall bound) and a lost connection cannot come back.
        """
        started = time.monotonic()
        stall_at = started + self.stall_timeout if in_transfer and self.stall_timeout is not None else math.inf
        grace = SETTLE_AFTER_LOSS if in_transfer else RECONNECT_GRACE
        while True:
            now = time.monotonic()
            self.read_events(now)
            lost_at = self.state.lost_at
            lost_deadline = math.inf if lost_at is None else lost_at + grace
            if now >= lost_deadline:
                return Wait.LOST
            if now >= deadline:
                return Wait.DEADLINE
            if now >= stall_at:
                return Wait.STALLED
            wake = min(deadline, stall_at, lost_deadline)
            ready = dict(self._poller.poll(max(0, math.ceil((wake - now) * 1000))))
            if self._socket in ready:
                return Wait.READY

    @property
    def monitor(self) -> zmq.Socket[Any]:
        """The monitor socket, for a poller that waits on several DEALERs at once."""
        return self._monitor

    def read_events(self, now: float) -> list[int]:
        """Apply every event the monitor has queued; return them."""
        events: list[int] = []
        # Asked first: a receive reads every connection's monitor on each pass of its loop, and
        # an empty read raises (measured: a sixth of a swarm member's CPU, seven receivers).
        while int(self._monitor.getsockopt(_READY)) & _POLLIN:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return events
            event = int(parse_monitor_message(frames)["event"])
            self.state.on_event(event, now)
            events.append(event)
        return events

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self._monitor.close(linger=0)


def configure_heartbeats(socket: zmq.Socket[Any], stall_timeout: float | None) -> None:
    """Ping the source so a connection to a vanished host ends (no stall bound: no heartbeats)."""
    if stall_timeout is None:
        return
    socket.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL * 1000))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int((stall_timeout + HEARTBEAT_MARGIN) * 1000))


class DealerStream:
    """A :class:`Stream` over a DEALER ``socket`` (to ``endpoint``) watched by ``watch``; closing it closes both."""

    def __init__(self, socket: zmq.Socket[Any], watch: SourceWatch, endpoint: str) -> None:
        self.socket = socket
        self.watch = watch
        self._endpoint = endpoint

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def send(self, request: bytes) -> bool:
        try:
            self.socket.send(request, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def send_by(self, request: bytes, deadline: float) -> bool:
        # A DEALER with no pipe to its peer (a connection refused by CurveZMQ,
        # torn down and not yet retried) blocks on send: never wait past the
        # deadline for one.
        while not self.send(request):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.socket.poll(max(1, min(100, math.ceil(left * 1000))), zmq.POLLOUT)
        return True

    def cancel(self, request: bytes) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.socket.send(request, zmq.NOBLOCK)

    def reply(self, who: str) -> wire.Reply | None:
        return next_reply(self.socket, who)

    def receive(self, into: memoryview | None, what: str, expected: int) -> memoryview:
        return recv_exact(self.socket, into, what, expected)

    def frame(self) -> bytes:
        return self.socket.recv()

    def discard(self) -> None:
        discard_rest(self.socket)

    def ended(self, what: str) -> None:
        expect_no_more(self.socket, what)

    def wait(self, deadline: float, in_transfer: bool) -> Wait:
        return self.watch.wait(deadline, in_transfer)

    def close(self) -> None:
        self.watch.close()
        self.socket.close(linger=0)


def next_reply(socket: zmq.Socket[Any], who: str) -> wire.Reply | None:
    """The next reply waiting on ``socket`` (None: nothing is ready); its further frames stay to be read."""
    try:
        frame = socket.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    more = bool(socket.getsockopt(zmq.RCVMORE))
    try:
        return wire.decode_reply(frame, more, who)
    except ProtocolError:
        if more:
            discard_rest(socket)  # the next read starts at a message boundary
        raise


def discard_rest(socket: zmq.Socket[Any]) -> None:
    """Receive and drop the remaining frames of the current message."""
    while socket.getsockopt(zmq.RCVMORE):
        socket.recv(copy=False)


def expect_no_more(socket: zmq.Socket[Any], what: str) -> None:
    """The current message must have ended; else drop its extra frames and raise ``ProtocolError``."""
    if socket.getsockopt(zmq.RCVMORE):
        discard_rest(socket)
        raise ProtocolError(f"{what} carries unexpected extra frames")


def recv_exact(socket: zmq.Socket[Any], into: memoryview | None, what: str, expected: int) -> memoryview:
    """Receive the next frame into ``into`` (None: as a zero-copy frame); it must hold ``expected`` bytes."""
    if into is None:
        payload = socket.recv(copy=False).buffer
        received = len(payload)
    else:
        payload = into
        received = socket.recv_into(into)
    if received != expected:
        raise ProtocolError(f"{what} has {received} bytes, expected {expected}")
    return payload


# ----------------------------------------------------------------------------- in memory, for tests


class MemoryStream:
    """A :class:`Stream` in memory: replies queued by a test (:meth:`put`), requests kept in :attr:`sent`.

    ``room``: how many requests it takes before :meth:`send` says it is full
    (None: no bound). :meth:`wait` never blocks: a reply is waiting, or the
    stream says the deadline passed.
    """

    def __init__(self, endpoint: str = "memory://0", room: int | None = None) -> None:
        self._endpoint = endpoint
        self.room = room
        self.sent: list[bytes] = []
        self.closed = False
        self._queue: deque[list[bytes]] = deque()
        self._current: deque[bytes] = deque()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def put(self, *frames: bytes) -> None:
        """A reply of these frames (its envelope first) arrives."""
        self._queue.append(list(frames))

    def send(self, request: bytes) -> bool:
        if self.closed or (self.room is not None and len(self.sent) >= self.room):
            return False
        self.sent.append(request)
        return True

    def send_by(self, request: bytes, deadline: float) -> bool:
        return self.send(request)

    def cancel(self, request: bytes) -> None:
        self.send(request)

    def reply(self, who: str) -> wire.Reply | None:
        if self._current:
            self.discard()  # a reply's frames not read by the caller: a real socket would deliver them first
        if not self._queue:
            return None
        self._current = deque(self._queue.popleft())
        frame = self._current.popleft()
        try:
            return wire.decode_reply(frame, bool(self._current), who)
        except ProtocolError:
            self.discard()
            raise

    def frame(self) -> bytes:
        return self._current.popleft()

    def receive(self, into: memoryview | None, what: str, expected: int) -> memoryview:
        data = self._current.popleft()
        if into is None:
            payload = memoryview(data)
        else:
            payload = into
            into[: min(len(into), len(data))] = data[: len(into)]
        if len(data) != expected:
            raise ProtocolError(f"{what} has {len(data)} bytes, expected {expected}")
        return payload

    def discard(self) -> None:
        self._current.clear()

    def ended(self, what: str) -> None:
        if self._current:
            self.discard()
            raise ProtocolError(f"{what} carries unexpected extra frames")

    def wait(self, deadline: float, in_transfer: bool) -> Wait:
        return Wait.READY if self._queue else Wait.DEADLINE

    def close(self) -> None:
        self.closed = True
