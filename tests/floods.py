"""A peer that asks and never reads, for the attacker tests of the serving side's memory bounds
(test_appetite, test_relay_appetite): its DEALERs, and its loop that keeps granting credit."""

from __future__ import annotations

import contextlib
import time

import zmq

from zmqtransport import wire


def unread_dealer(context: zmq.Context[zmq.Socket[bytes]], host: str, port: int) -> zmq.Socket[bytes]:
    """A DEALER that takes (almost) nothing off the wire: libzmq stops pulling from TCP almost at once."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(f"tcp://{host}:{port}")
    return dealer


def keep_granting(dealers: list[zmq.Socket[bytes]], xfers: range, seconds: float) -> None:
    """Grant all the credit the protocol allows on ``xfers`` of every dealer, every 50 ms, for ``seconds``
    (bounded: it stops by itself). A connection that was cut (or is being re-made) is asked again next round."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for dealer in dealers:
            for xfer in xfers:
                with contextlib.suppress(zmq.ZMQError):
                    dealer.send(wire.credit_request(xfer, wire.MAX_CREDIT), zmq.NOBLOCK)
        time.sleep(0.05)
