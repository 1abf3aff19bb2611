"""Noticing, while receiving, that the source is gone or has stopped sending.

ZeroMQ hides disconnects: a DEALER whose peer died simply waits (and
reconnects on its own), so without help a receive whose source was killed ends
only at the transfer timeout. Two signals are used instead:

* **Lost connection.** A socket monitor on the DEALER reports
  ``EVENT_HANDSHAKE_SUCCEEDED`` when a connection to the source is established
  and ``EVENT_DISCONNECTED`` when it ends: the kernel closed it (source process
  killed, connection reset; within milliseconds) or ZMTP heartbeats went
  unanswered (a host that vanished without FIN or RST: the DEALER pings every
  :data:`HEARTBEAT_IVL` and drops the connection after ``heartbeat_timeout``).
  Only a connection that was established counts: a receiver that starts before
  its source binds sees connection retries, never a handshake, and keeps
  waiting. Before the header a lost connection is given
  :data:`RECONNECT_GRACE` to come back (a source that rebuilds its ROUTER, see
  docs/protocol.md, still answers a parked request after the DEALER
  reconnects); once the transfer runs, the stream has a hole and the receive
  fails as soon as the messages that did arrive are consumed.
* **Stall.** Once the header has arrived, no message from the source for
  ``stall_timeout`` while the receive loop waits for one fails the receive,
  even when the transfer timeout is far off. Only time spent waiting counts:
  a receiver busy with its own page faults or copies is not stalled.

:class:`ConnectionState` is the pure event logic; :class:`SourceWatch`
feeds it from the monitor socket and waits on the DEALER with every bound.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import math
import time
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

# A lost connection gets this long to come back before the header has arrived
# (DEALERs reconnect every 100 ms; a source rebuilds its ROUTER in milliseconds).
RECONNECT_GRACE = 2.0
# Once the transfer runs: messages the I/O thread read before the connection
# ended may reach the socket just after the monitor reports it; wait this long
# for them before calling the connection lost.
SETTLE_AFTER_LOSS = 0.1
# ZMTP heartbeat interval of a receiving DEALER. Pings cost a few bytes and are
# answered by the source's libzmq I/O thread, whatever its Python threads do.
HEARTBEAT_IVL = 1.0
# Heartbeats give up this much later than the stall bound, so a source that
# freezes mid-transfer is reported as stalled (the more precise error).
HEARTBEAT_MARGIN = 1.0

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
# As plain ints: pyzmq's enums cost a few microseconds per operation, on every pass of a receive's loop.
_READY, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)
# A failed connection attempt (another is scheduled): watched only when choosing
# among several paths (.racing); ConnectionState ignores it.
REFUSAL_EVENTS = zmq.EVENT_CONNECT_RETRIED
# Monitor endpoints are named by a counter, not by the socket's descriptor
# (pyzmq's default): a descriptor is reused as soon as a socket is gone, while
# libzmq may not have released the old inproc name yet.
_monitor_ids = itertools.count()


class ConnectionState:
    """Whether an established connection to the source has been lost, and since when."""

    def __init__(self) -> None:
        self.established = False  # a handshake with the source succeeded at least once
        self.lost_at: float | None = None  # when the current loss began; None while connected

    def on_event(self, event: int, now: float) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.established = True
            self.lost_at = None
        elif event == zmq.EVENT_DISCONNECTED and self.established and self.lost_at is None:
            self.lost_at = now

    def lost_for(self, now: float) -> float | None:
        """Seconds since the connection was lost (and has not come back), or None."""
        return None if self.lost_at is None else now - self.lost_at


class Wait(enum.Enum):
    """How a wait for the source's next message ended."""

    READY = "a message is ready"
    DEADLINE = "the transfer timeout passed"
    STALLED = "the source sent nothing for stall_timeout"
    LOST = "the connection to the source was lost"


class SourceWatch:
    """Waits for messages on one DEALER while a socket monitor follows its connection.

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
