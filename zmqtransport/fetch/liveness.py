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

This module is pure (no zmq, no clock of its own): the bounds, the
:class:`ConnectionState` a monitor's events drive, how a wait ended
(:class:`Wait`) and the one mapping of an ended wait to the exception the
caller sees (:func:`failure`). :class:`~.streams.SourceWatch` feeds it from
the DEALER's socket monitor and waits on the DEALER with every bound.
"""

from __future__ import annotations

import enum

from ..errors import ConnectionLostError, StalledError

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
# Seconds a more preferred path that answers nothing holds up a less preferred
# one that has connected (.racing), and a striped receive waits for a path of
# the source to connect before giving up on it. A reachable path on a LAN
# connects in well under a millisecond, so 1 s is a wide margin; an
# unreachable one costs at most this.
CONNECT_BOUND = 1.0

# The socket monitor's events this module reads, as libzmq numbers them (zmq.h:
# ZMQ_EVENT_*; tests/test_liveness_receiver.py holds them against pyzmq's).
HANDSHAKE_SUCCEEDED = 0x1000
DISCONNECTED = 0x0200
CONNECT_RETRIED = 0x0004


class ConnectionState:
    """Whether an established connection to the source has been lost, and since when."""

    def __init__(self) -> None:
        self.established = False  # a handshake with the source succeeded at least once
        self.lost_at: float | None = None  # when the current loss began; None while connected

    def on_event(self, event: int, now: float) -> None:
        if event == HANDSHAKE_SUCCEEDED:
            self.established = True
            self.lost_at = None
        elif event == DISCONNECTED and self.established and self.lost_at is None:
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


def failure(outcome: Wait, message: str) -> Exception:
    """The exception a receive raises when a wait ended without a message (the one mapping of the
    receiving side): a lost connection, a stall, the transfer's deadline."""
    if outcome is Wait.LOST:
        return ConnectionLostError(message)
    if outcome is Wait.STALLED:
        return StalledError(message)
    assert outcome is Wait.DEADLINE, outcome
    return TimeoutError(message)


def silence(outcome: Wait, who: str, waiting_for: str, stall_timeout: float | None, timed_out: str) -> Exception:
    """:func:`failure` for a wait on ``who`` for ``waiting_for`` (``timed_out``: the deadline's message)."""
    if outcome is Wait.LOST:
        return failure(outcome, f"connection lost to {who} while waiting for {waiting_for}")
    if outcome is Wait.STALLED:
        assert stall_timeout is not None  # only a wait with a stall bound stalls
        return failure(
            outcome,
            f"recv_checkpoint stalled: nothing from {who} for {stall_timeout:.3g} s (stall_timeout) "
            f"while waiting for {waiting_for}",
        )
    return failure(outcome, timed_out)
