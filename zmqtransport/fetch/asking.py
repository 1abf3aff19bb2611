"""What a striped receive sends: span fetches as its book hands them out, questions to the swarm, cancels.

The outbound half of :mod:`.striped`, on the receiving thread's sockets: it
asks every connected stream for the spans :class:`~.spans.SpanBook` assigns
it, asks the peers whose turn it is what they hold and the source who the
peers are (:class:`~.peers.Peers`), asks the source for the digests of what
peers are asked for (:class:`~.checking.RelayCheck`), and tells senders to
forget spans no longer needed. Every send is non-blocking: a connection that
takes no more requests is reported to the caller, which drops it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from .. import wire
from ..digests import Algorithm
from .checking import RelayCheck
from .connection import Connection
from .peers import Peers
from .relaying import RelayDuty
from .spans import SOURCE, Span, SpanBook

logger = logging.getLogger("zmqtransport.fetch")

# Seconds: a receive that sent the source nothing for this long asks it a `have`
# question, as a sign of life. A withdrawn staging (disallow_checkpoint ran
# during the receive) lets its readers go after the source's stall bound of
# silence, and a reader landing what it already holds asks for nothing
# meanwhile: a slow one was cut off mid-receive. Swarm members ask the source
# every 50 ms anyway (peers.MEMBERS_EVERY).
KEEPALIVE_EVERY = 0.5
# Messages a swarm member asks the source to reserve for it at a time: about what
# its connections to the source have outstanding (spans of one message), so the
# next reservation is back before they run dry.
CLAIM_MESSAGES = 4
# Seconds a question to the source may go unanswered before it is forgotten (the
# next goes out on another of the source's connections) and, if it claimed, this
# receive stops claiming and asks the source as a swarm without claims does. The
# answer normally takes a round trip, but the connection it went out on may be
# dead without a sign yet (a link down: TCP says nothing until the heartbeats run
# out), and a member that asks the source only for what it reserved would wait.
SOURCE_PATIENCE = 0.5


@dataclass(frozen=True)
class SpanTerms:
    """What every span fetch of one receive shares."""

    step: int
    stage: int
    accept_pickle: bool
    deadline: float
    stall_timeout: float | None
    algorithm: Algorithm | None = None  # the source's digest algorithm (None: it publishes none)
    inline: bool = False  # verify="all": the source's spans carry a digest per message


def span_request(span: Span, terms: SpanTerms, token: bytes | None, now: float) -> bytes:
    """The span fetch for ``span``: to a peer with its ``token``; to the source, with digests if verify="all"."""
    inline = terms.inline and token is None and terms.algorithm is not None
    verify = [terms.algorithm.name] if inline and terms.algorithm is not None else []
    wait_ms = max(0, int((terms.deadline - now) * 1000))
    return wire.fetch_request(
        span.xfer,
        terms.step,
        wait_ms,
        span.stop - span.first,
        terms.accept_pickle,
        span=(span.first, span.stop),
        stage=terms.stage,
        token=token,
        verify=verify,
        inline=inline,
    )


class Asking:
    """The requests of one striped receive over ``streams`` (shared with its caller, which adds to it)."""

    def __init__(
        self,
        streams: Sequence[Connection],
        book: SpanBook,
        terms: SpanTerms,
        peers: Peers | None,
        check: RelayCheck | None,
        duty: RelayDuty | None,
    ) -> None:
        self.streams = streams
        self.book = book
        self.terms = terms
        self.peers = peers
        self.check = check
        self.duty = duty
        self.cancelled: set[int] = set()  # span fetches told to stop: what still arrives for them is dropped
        self.keepalives: set[int] = set()  # signs of life sent to the source: their answers are dropped
        self.claims: set[int] = set()  # questions to the source that carry a claim
        self._to_source_asked: dict[int, float] = {}  # questions to the source unanswered: when each was sent
        self.forgotten: set[int] = set()  # questions to the source given up on: a late answer is dropped
        self._questions = 0  # questions asked so far (which connection to the source asks next)
        self._to_source = -math.inf  # when a request last went to the source

    def send(self, now: float) -> list[int]:
        """Everything due now; returns the streams whose connection took no more requests."""
        self._claims_late(now)
        full = self._questions_due(now) + self._spans(now)
        if self.check is not None:
            self.check.ask(self._relayed_spans(), now, ahead=self.peers is not None and bool(self.peers.tokens))
        self._keepalive(now)
        return full

    def _keepalive(self, now: float) -> None:
        if (self.peers is not None and self.peers.own_token is not None) or now - self._to_source < KEEPALIVE_EVERY:
            return
        for stream in self.streams:
            if stream.token is None and not stream.gone and not stream.interrupted:
                xfer = random.getrandbits(63)
                if _send(stream, wire.have_request(xfer, self.terms.stage, None)):
                    self.keepalives.add(xfer)
                    self._to_source = now
                return

    def _spans(self, now: float) -> list[int]:
        full: list[int] = []
        for index, stream in enumerate(self.streams):
            if stream.gone:
                continue
            while (span := self.book.assign(index, random.getrandbits(63), now)) is not None:
                logger.debug("asking %s for messages %d..%d", stream.endpoint, span.first, span.stop)
                if not _send(stream, span_request(span, self.terms, stream.token, now)):
                    full.append(index)
                    break
                if stream.token is None:
                    self._to_source = now
        if self.duty is not None:
            self.duty.fetching(self.book.asked())  # the others ask the source for something else
        return full

    def _questions_due(self, now: float) -> list[int]:
        """Ask the peers whose turn it is what they hold, and the source who the peers are."""
        peers = self.peers
        if peers is None:
            return []
        full: list[int] = []
        claim = self.book.wants_claim()
        for peer in peers.due(now, self.reachable(), self.busy(), claim):
            live = [(i, s) for i, s in enumerate(self.streams) if s.peer == peer and not s.gone]
            # Its questions-only connections where it has them: answers there queue behind no data.
            live = [(i, s) for i, s in live if s.questions] or live
            # The source is asked over each of its connections in turn: each comes from one of this
            # receiver's addresses, and the source believes this receiver's paths on those it sees.
            index, stream = live[self._questions % len(live)] if peer == SOURCE else live[0]
            self._questions += 1
            xfer = random.getrandbits(63)
            count = CLAIM_MESSAGES if claim and peer == SOURCE else 0
            if _send(stream, wire.have_request(xfer, self.terms.stage, peers.token_of(peer), count)):
                peers.asking(peer, xfer, now)
                if peer == SOURCE:
                    self._to_source_asked[xfer] = now
                if count:
                    self.claims.add(xfer)
            else:
                full.append(index)
        return full

    def answered_by_source(self, xfer: int | None, claimed: tuple[int, ...] | None) -> None:
        """The source answered question ``xfer``; if it claimed, with what it reserved (``claimed``: the
        run; empty or None: none are left, or a source that reserves none, an earlier release)."""
        if xfer is None:
            return
        self._to_source_asked.pop(xfer, None)
        if xfer not in self.claims:
            return
        self.claims.discard(xfer)
        if claimed:
            self.book.reserved.add(*claimed[:2])
        else:
            self.book.reserved.close()

    def _claims_late(self, now: float) -> None:
        late = [xfer for xfer, sent in self._to_source_asked.items() if now - sent > SOURCE_PATIENCE]
        for xfer in late:
            assert self.peers is not None  # only a receive with peers asks the source questions
            self.peers.answered(xfer)  # forgotten: the next question goes out on another connection
            self.forgotten.add(xfer)
            if xfer in self.claims and self.book.reserved.open:
                logger.info("the source did not answer a claim within %.2g s: asking it without claims",
                            SOURCE_PATIENCE)
            self.answered_by_source(xfer, None)

    def next_question_at(self) -> float:
        """When :meth:`_questions_due` next has a question to send (inf: none can). It asks
        :meth:`Peers.next_due` what it asks :meth:`Peers.due`: a turn counted here that the other would
        not take makes the receiving loop pass again without waiting."""
        if self.peers is None:
            return math.inf
        return self.peers.next_due(self.reachable(), self.busy(), self.book.wants_claim())

    def reachable(self) -> set[int]:
        """The peers (the source included) with a connection in use that is not down."""
        return {stream.peer for stream in self.streams if not stream.gone and not stream.interrupted}

    def busy(self) -> set[int]:
        """The peers this receive still has work for (asked about less often)."""
        assert self.peers is not None
        return {peer for peer in self.peers.tokens if self.book.has_work_for(peer)}

    def _relayed_spans(self) -> list[Span]:
        return [span for span in self.book.spans.values() if self.streams[span.stream].token is not None]

    def cancel(self, spans: list[Span]) -> None:
        """Tell the senders to stop sending spans this receive no longer needs (best effort)."""
        for span in spans:
            self.cancelled.add(span.xfer)
            stream = self.streams[span.stream]
            if not stream.gone:
                with contextlib.suppress(zmq.ZMQError):
                    stream.socket.send(wire.cancel_request(span.xfer), zmq.NOBLOCK)

    def cancel_all(self) -> None:
        """The receive is over: every span and digest request still out."""
        self.cancel(list(self.book.spans.values()))
        if self.check is not None:
            self.check.cancel_all()


def _send(stream: Connection, request: bytes) -> bool:
    try:
        stream.socket.send(request, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
