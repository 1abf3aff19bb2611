"""Reading a sender's replies off a DEALER: envelopes, the frames after them, and refusals.

One place for what both the single-connection and the striped receive do
with a reply: decode its envelope (:func:`zmqtransport.wire.decode_reply`),
receive its payload frame exactly into place (:func:`recv_exact`), drop the
frames of a message that is not wanted (:func:`discard_rest`), insist that a
message has ended (:func:`expect_no_more`), and turn an error reply into the
exception the caller sees (:func:`refusal`). The socket is the caller's; these
only read from it.
"""

from __future__ import annotations

from typing import Any

import zmq

from .. import wire
from ..errors import ProtocolError, RemoteError


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


def refusal(reply: wire.Reply, who: str, step: int) -> Exception:
    """The exception for an error reply of ``who`` (the source) about ``step``.

    ``not_staged`` means the peer gave up waiting for the step on the
    receiver's behalf: the same outcome as the receiver's own deadline
    passing, so the same type (``TimeoutError``). Every other code is a
    :class:`~zmqtransport.errors.RemoteError` carrying it.
    """
    if reply.code == wire.ERR_NOT_STAGED:
        return TimeoutError(f"recv_checkpoint timed out: {who} staged nothing for step {step} in time ({reply.text})")
    return RemoteError(reply.code, f"{who}: {reply.text}")


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
