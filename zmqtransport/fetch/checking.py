"""A striped receive's relayed messages checked against the source's digests, on its sockets.

:class:`RelayCheck` carries out a :class:`~.verify.DigestBook` for
:mod:`.striped`: it asks the source, on a connection to the source (never a
relay's), for the digests of every span a relay is asked for (a span fetch with
``digests_only``: docs/protocol.md, "Digests"), asks again when that
connection is lost, reads the answers, and gives verdicts on the relayed
messages. The receiving thread alone uses it.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zmq

from .. import wire
from ..digests import Algorithm
from ..errors import ProtocolError
from .connection import Connection
from .spans import Span
from .verify import DigestBook, Verdict


@dataclass(frozen=True)
class DigestTerms:
    """What every digest request of one receive shares."""

    step: int
    stage: int
    algorithm: Algorithm
    deadline: float


class RelayCheck:
    """Digest requests to the source and verdicts on relayed messages, for one striped receive."""

    def __init__(self, streams: Sequence[Connection], messages: int, terms: DigestTerms) -> None:
        self.streams = streams
        self.terms = terms
        self.book = DigestBook(messages, terms.algorithm.size)

    def ask(self, relayed: Iterable[Span], now: float) -> None:
        """Ask the source for the digests of these relayed spans, and of held messages whose request was lost."""
        stream = self._source_stream()
        if stream is None:
            return  # none is connected yet (or left: the receive then drops its relays)
        index, connection = stream
        runs = [run for span in relayed for run in self.book.wanted(span.first, span.stop)]
        runs += self.book.unverified_wanted()
        for first, stop in runs:
            xfer = random.getrandbits(63)
            terms = self.terms
            wait_ms = max(0, int((terms.deadline - now) * 1000))
            request = wire.fetch_request(
                xfer,
                terms.step,
                wait_ms,
                1,
                False,
                span=(first, stop),
                stage=terms.stage,
                verify=[terms.algorithm.name],
                digests_only=True,
            )
            try:
                connection.socket.send(request, zmq.NOBLOCK)
            except zmq.Again:
                return  # its queue is full: asked again on the next pass
            self.book.asking(xfer, index, first, stop, now)

    def _source_stream(self) -> tuple[int, Connection] | None:
        for index, connection in enumerate(self.streams):
            state = connection.watch.state
            if connection.token is None and not connection.gone and state.established and state.lost_at is None:
                return index, connection
        return None

    def arrived(self, seq: int, digest: bytes, stream: int) -> bool | None:
        """Relayed message ``seq`` landed with this digest: True/False once the source's is known, else None."""
        return self.book.check(seq, digest, stream)

    def answered(self, reply: wire.Reply, who: str) -> list[Verdict] | None:
        """A ``digests`` reply from the source; verdicts on the messages that waited (None: not a request of ours)."""
        assert reply.xfer is not None and reply.dg is not None  # wire.decode_reply
        try:
            return self.book.on_digests(reply.xfer, reply.seq, reply.dg)
        except ValueError as exc:
            raise ProtocolError(f"{who}: {exc}") from None

    def asked(self, xfer: int | None) -> bool:
        """Whether ``xfer`` is a digest request still out (an error reply for it is about digests)."""
        return xfer is not None and xfer in self.book.requests

    def withdraw(self, xfer: int) -> None:
        self.book.withdraw(xfer)

    def source_lost(self, stream: int) -> None:
        """A connection to the source is gone: what it was asked is asked again on another."""
        self.book.lost(stream)

    def relay_dropped(self, stream: int) -> list[int]:
        """A relay was dropped: its messages still waiting for a digest are not believed. Returns them."""
        return self.book.forget(stream)

    def cancel_all(self) -> None:
        """Tell the source to forget every digest request still out (best effort)."""
        for request in list(self.book.requests.values()):
            connection = self.streams[request.stream]
            if not connection.gone:
                with contextlib.suppress(zmq.ZMQError):
                    connection.socket.send(wire.cancel_request(request.xfer), zmq.NOBLOCK)
        self.book.requests.clear()
