"""Every digest a source publishes for a step (docs/protocol.md, "Digests"), without the data.

``zmqtransport inspect --digests`` uses it to name a step's bytes (one root
digest over the messages' digests, in plan order) and to check a checkpoint
on disk against the source (:mod:`zmqtransport.layout`). The source computes
what it has not yet (bounded work per serving round), so asking costs it one
pass over the state at most once per staging and algorithm.

Threading: runs in the calling thread, on DEALERs of its own, like a receive.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from .. import digests, wire
from ..errors import ProtocolError
from ..net import PeerAddress
from . import liveness
from .options import FetchOptions
from .receive import Receive
from .replies import refusal
from .requests import digest_request
from .streams import Configure, Context

# Messages per digest request: one reply of 256 digests is 8 KiB of envelope.
BATCH = wire.MAX_CREDIT
# Requests out at once: within the source's bound per peer (serve.admission.Limits.digests_per_peer).
OUTSTANDING = 8


@dataclass(frozen=True)
class Published:
    """A step's header and the digest of each of its data messages, in plan order."""

    header: wire.Header
    algorithm: digests.Algorithm
    digests: list[bytes]

    @property
    def root(self) -> bytes:
        return digests.root_of(self.algorithm, self.digests)


def fetch_digests(
    context: Context,
    address: PeerAddress,
    step: int,
    timeout: float,
    options: FetchOptions,
    peer_options: Configure | None = None,
) -> Published:
    """Ask the source at ``address`` for the header of ``step`` and the digest of every data message."""
    receive = Receive(context, address, None, step, timeout, options, peer_options)
    try:
        receive.request(header_only=True)
        parsed = receive.receive_header()
        receive.receive_end()
        if receive.algorithm is None or receive.stage is None:
            raise ProtocolError(f"{receive.describe()} publishes no digests (a release before digests)")
        header = parsed.header
        count = len(wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below))
        found = _ask_all(receive, receive.algorithm, receive.stage, count)
        return Published(header, receive.algorithm, found)
    finally:
        receive.close()


def _ask_all(receive: Receive, algorithm: digests.Algorithm, stage: int, count: int) -> list[bytes]:
    """The digests of messages [0, count), asked :data:`BATCH` at a time, :data:`OUTSTANDING` requests at once."""
    stream = receive.conns.first
    who = receive.describe()
    asked: dict[int, tuple[int, int]] = {}
    batches = [(first, min(first + BATCH, count)) for first in range(0, count, BATCH)]
    found: list[bytes] = [b""] * count
    while batches or asked:
        while batches and len(asked) < OUTSTANDING:
            first, stop = batches.pop(0)
            xfer = random.getrandbits(63)
            now = time.monotonic()
            request = digest_request(xfer, receive.step, stage, algorithm, first, stop, receive.deadline, now)
            if not stream.send_by(request, receive.deadline):
                raise TimeoutError(f"timed out sending a digest request to {who} (step {receive.step})")
            asked[xfer] = (first, stop)
        reply = stream.reply(who)
        if reply is None:
            _wait(receive, stream.wait(receive.deadline, in_transfer=True), stream.watch.stall_timeout)
            continue
        stream.discard()
        if reply.op == wire.OP_ERROR:
            raise refusal(reply, who, receive.step)
        span = asked.pop(reply.xfer, None) if reply.xfer is not None else None
        if span is None or reply.op != wire.OP_DIGESTS or reply.dg is None:
            raise ProtocolError(f"unexpected {reply.op!r} reply from {who} while waiting for digests")
        first, stop = span
        size = algorithm.size
        if reply.seq != first or len(reply.dg) != (stop - first) * size:
            raise ProtocolError(f"{who} sent digests that do not cover messages {first}..{stop}")
        for index in range(stop - first):
            found[first + index] = reply.dg[index * size : (index + 1) * size]
    return found


def _wait(receive: Receive, outcome: liveness.Wait, stall_timeout: float | None) -> None:
    if outcome is not liveness.Wait.READY:
        timed_out = f"timed out waiting for the digests of step {receive.step} from {receive.describe()}"
        raise liveness.silence(outcome, receive.describe(), "digests", stall_timeout, timed_out)
