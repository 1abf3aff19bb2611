"""What a sender's error reply means to the receive: the exception its caller sees.

Reading replies off a connection is the stream's job (:mod:`.streams`); a
wait that ended without one is mapped in :func:`.liveness.failure`. Here the
one other mapping at the boundary: an error reply of the source turned into
the exception the caller sees (:func:`refusal`). Pure: no sockets.
"""

from __future__ import annotations

from .. import wire
from ..errors import RemoteError


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
