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
import logging
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import zmq

from .. import wire
from ..digests import Algorithm
from ..errors import ProtocolError
from .connection import Connection
from .spans import Span
from .verify import DigestBook, Verdict

logger = logging.getLogger("zmqtransport.fetch")

# Read-ahead: once a receive has peers, it asks the source for the digests of
# messages no span has reached yet, in plan order, so that what peers send is
# checked on arrival rather than held until its digest comes back. A digest
# reply queues behind the data the source is sending on the same connection
# (50-180 ms measured in the lab at 400 Mbit/s), and a member forwards only
# what it has verified: without read-ahead that wait is paid at every hop.
# The source hashes each message once per staging whatever asks for it.
AHEAD_REQUESTS = 4  # read-ahead requests out at once (the source allows 16 digest requests per peer)
AHEAD_RUN = 8  # messages per read-ahead request
# A read-ahead unanswered this long is cancelled and reading ahead stops: a
# source staging device memory hashes a message only as it sends it to a
# peer, so it answers a run only once it has sent all of it (its messages'
# digests are then asked for as spans reach them, as without read-ahead).
AHEAD_PATIENCE = 0.3


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
        self.reads_ahead = True  # until the source refuses a read-ahead request (e.g. device memory)
        self._ahead_from = 0  # messages before this one were read ahead, known or asked

    def ask(self, relayed: Iterable[Span], now: float, ahead: bool = False) -> None:
        """Ask the source for the digests of these relayed spans, and of held messages whose request was lost;
        with ``ahead`` (the receive has peers), for those of messages further on too (:data:`AHEAD_RUN`)."""
        stream = self._source_stream()
        if stream is None:
            return  # none is connected yet (or left: the receive then drops its relays)
        index, connection = stream
        runs = [run for span in relayed for run in self.book.wanted(span.first, span.stop)]
        runs += self.book.unverified_wanted()
        for first, stop in runs:
            if not self._request(connection, index, first, stop, now, ahead=False):
                return  # its queue is full: asked again on the next pass
        late = [r for r in self.book.requests.values() if r.ahead and now - r.opened > AHEAD_PATIENCE]
        for request in late:
            self.reads_ahead = False
            self._cancel(request.xfer, request.stream)
            self.book.withdraw(request.xfer)
        out = sum(1 for request in self.book.requests.values() if request.ahead)
        while ahead and self.reads_ahead and out < AHEAD_REQUESTS:
            run = self.book.ahead(self._ahead_from, AHEAD_RUN)
            if run is None or not self._request(connection, index, *run, now, ahead=True):
                return
            self._ahead_from, out = run[1], out + 1

    def _request(self, connection: Connection, index: int, first: int, stop: int, now: float, ahead: bool) -> bool:
        """Ask for the digests of messages [first, stop) over ``connection``; False when its queue is full."""
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
            return False
        self.book.asking(xfer, index, first, stop, now, ahead)
        return True

    def _source_stream(self) -> tuple[int, Connection] | None:
        """The connection to the source to ask on: one for questions only while there is one (its answers
        queue behind no data; a request sent before it is up waits in it), else one that is up."""
        found = None
        for index, connection in enumerate(self.streams):
            if connection.token is not None or connection.gone:
                continue
            if connection.questions:
                return index, connection
            state = connection.watch.state
            if found is None and state.established and state.lost_at is None:
                found = index, connection
        return found

    def arrived(self, seq: int, digest: bytes, stream: int) -> bool | None:
        """Relayed message ``seq`` landed with this digest: True/False once the source's is known, else None."""
        return self.book.check(seq, digest, stream)

    def answered(self, reply: wire.Reply, who: str) -> list[Verdict] | None:
        """A ``digests`` reply from the source; verdicts on the messages that waited (None: not a request of ours)."""
        assert reply.xfer is not None and reply.dg is not None  # wire.decode_reply
        request = self.book.requests.get(reply.xfer)
        try:
            verdicts = self.book.on_digests(reply.xfer, reply.seq, reply.dg)
        except ValueError as exc:
            raise ProtocolError(f"{who}: {exc}") from None
        if request is not None and logger.isEnabledFor(logging.DEBUG):
            # How long held messages wait for their digests: the answer queues behind the data.
            waited = time.monotonic() - request.opened
            logger.debug("digests of messages %d..%d after %.0f ms; %d held messages released",
                         request.first, request.stop, waited * 1000, len(verdicts or ()))
        return verdicts

    def refused(self, xfer: int | None) -> bool | None:
        """The source refused request ``xfer``: None if it is no digest request of this receive, else
        whether what peers send can no longer be checked. False for a read-ahead: reading ahead stops
        (the source may hash device memory only as it sends it) and its messages' digests are asked
        for as spans reach them."""
        if xfer is None or xfer not in self.book.requests:
            return None
        request = self.book.withdraw(xfer)
        if request is not None and request.ahead:
            self.reads_ahead = False
            return False
        return True

    def source_lost(self, stream: int) -> None:
        """A connection to the source is gone: what it was asked is asked again on another."""
        self.book.lost(stream)

    def relay_dropped(self, stream: int) -> list[int]:
        """A relay was dropped: its messages still waiting for a digest are not believed. Returns them."""
        return self.book.forget(stream)

    def cancel_all(self) -> None:
        """Tell the source to forget every digest request still out (best effort)."""
        for request in list(self.book.requests.values()):
            self._cancel(request.xfer, request.stream)
        self.book.requests.clear()

    def _cancel(self, xfer: int, stream: int) -> None:
        connection = self.streams[stream]
        if not connection.gone:
            with contextlib.suppress(zmq.ZMQError):
                connection.socket.send(wire.cancel_request(xfer), zmq.NOBLOCK)
