"""A striped receive's decisions, without sockets: the receiving side's planner.

The header has arrived (over the first connection, from a sender that serves
span fetches: docs/protocol.md, "Spans") and the landing plan is carried out
over several connections at once (*streams*): to the source over each of its
paths and, in a swarm (docs/protocol.md, "Swarm"), to each peer it knows.
Every decision of that data phase is made here, in one place:

* which span to ask which stream for (:class:`~.spans.SpanBook`: rarest
  first, takeovers of quiet or much slower streams), what to ask the peers
  and the source about the swarm, claims, signs of life, and the digests of
  what peers send (:class:`Outgoing`);
* what each reply means: a data message to land, held until its digest
  matches, a duplicate to drop, an answer, a refusal;
* which stream or peer to drop (lost, never connected, stalled, silent while
  owing what it holds, lying, malformed, refusing) and when the receive
  fails: no connection to the source left, the deadline, or a protocol or
  integrity error of the source. A peer is a helper the receive does without
  at the first sign of trouble; only the source's own refusals fail it.

:class:`ReceivePlanner` is pure, like the sending side's scheduler
(:mod:`zmqtransport.serve.scheduler`): no zmq, no threads, no clock of its
own. The socket owner (:mod:`.owner`) feeds it events with an explicit
``now`` (a stream added, a connection up or down, a reply, time passing) and
carries out the actions it returns (:data:`Action`): send a request on a
stream, cancel one, close a stream, connect to a new peer, receive a data
message into its destination, count one as landed, fail the receive. What
was asked of whom lives in one :class:`~.registry.Registry`, shared by the
span book, the digest book and the swarm's peers.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import wire
from ..errors import ProtocolError
from .backoff import Backoff
from .liveness import CONNECT_BOUND, RECONNECT_GRACE, SETTLE_AFTER_LOSS, Wait, failure
from .peers import QUESTION_PIPELINE, NewPeer, Peers
from .registry import CANCELLED, FORGOTTEN, KEEPALIVE, Question, Registry
from .replies import refusal
from .requests import SpanTerms, digest_request, span_request
from .spans import DEPTH, QUIET_FIRST, SOURCE, SPAN_BYTES, Span, SpanBook
from .verify import DigestBook, DigestRequest, Verdict

logger = logging.getLogger("zmqtransport.fetch")

# How long the owner waits before the planner is asked again (connections
# coming up, takeovers due), when nothing else wakes it sooner.
CHECK_EVERY = 0.1
# Seconds a second connection to the source, over a path where another one connected, gets to
# handshake (CONNECT_BOUND: one over a path where none did). 40 receivers on two cores: a
# member's questions-only connection came up after CONNECT_BOUND.
LATE_CONNECT_BOUND = 5.0
# Spans one stream should get over a receive at the least: with fewer, one
# slow stream's outstanding spans are a large part of the whole.
MIN_SPANS_PER_STREAM = 4
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
# A receive takes on no new peer once at most 1/LATE_PEERS of its messages are missing: such a peer
# has little left to serve, and no pace yet to judge its silence by, so one that lies (claims all,
# serves nothing) held what it was asked for through a quiet bound of seconds. In the model, 64
# members with two liars: the slowest 1.52-1.61x the ideal with 1/16, 1.41-1.46x with 1/4; equal links
# and 256 members within 1% (docs/sim.md, "New peers late in a receive").
LATE_PEERS = 4
# Read-ahead: once a receive has peers, it asks the source for the digests of
# messages no span has reached yet, in plan order, so that what peers send is
# checked on arrival rather than held until its digest comes back. A digest
# reply queues behind the data the source is sending on the same connection
# (50-180 ms measured in the lab at 400 Mbit/s), and a member forwards only
# what it has verified: without read-ahead that wait is paid at every hop.
# The source hashes each message once per staging whatever asks for it.
# Few long runs, not many short ones: every digest request is a control message
# the source's serving thread handles, and at a job start of 256 members those
# made the source the bound in the model (4 runs of 8 out: 2.31x the ideal, the
# source's thread busy 11.9 s of a 12.4 s receive; 2 runs of 32: 1.76x, 6.9 s;
# docs/sim.md, "The model recalibrated"). A run of 32 is 1 KiB of digests, and
# the source hashes it over several rounds (serve/digests.py bounds a round).
# The first run is short: its answer releases what peers sent first, and the
# source answers a run only once all of it is hashed (32 MiB in 1 MiB frames
# took 150-200 ms on a busy source, 8 MiB a quarter of that).
AHEAD_REQUESTS = 2  # read-ahead requests out at once (the source allows 16 digest requests per peer)
AHEAD_RUN = 32  # messages per read-ahead request
AHEAD_FIRST_RUN = 8  # ... the one from the plan's first message (again if that one was refused or not sent)
# A read-ahead unanswered this long is cancelled and reading ahead stops: a
# source staging device memory hashes a message only as it sends it to a
# peer, so it answers a run only once it has sent all of it (its messages'
# digests are then asked for as spans reach them, as without read-ahead).
# Not where the source's header says it hashes ahead (every source of this
# release, device memory through its pinned ring): there a late answer means
# a busy source, and stopping made it busier. At 23 members
# sharing two cores every member's read-ahead went late, each then asked for
# the digests of every one-message span on its own (3257 requests where 357
# served 15 members), and the receive took 7.7-8.9 s instead of 4.2 s
# (docs/fast-links.md, "Read-ahead under load").
AHEAD_PATIENCE = 0.3


def claim_size(spread: float) -> int:
    """Messages to claim at once, with ``spread`` times :data:`~.peers.HAVE_PEERS` peers.

    :data:`CLAIM_MESSAGES` up to 16 peers. Past that, one: with 64 members
    claiming 4 each (and asking for them 2 ahead) the source had reserved
    every message within 0.3 s, so each member, its reservations fetched,
    asked the source for what it thought rare, and those second copies took
    two fifths of the source's uplink from its first copies, which then came
    at 1.7x the ideal instead of 1.0x (docs/sim.md, "The source's first
    copies").
    """
    return CLAIM_MESSAGES if spread <= 1.0 else 1


def source_depth(spread: float) -> int:
    """Spans a stream to the source keeps outstanding, with ``spread`` times :data:`~.peers.HAVE_PEERS` peers.

    :data:`~.spans.DEPTH` up to 16 peers. Past that, one: the source serves
    each open transfer one message a round, and with every member two ahead it
    had twice the transfers its ``Limits`` allow (64), refused the rest
    ``busy``, and each waiting transfer's turn came later. In the model at 64
    receivers: 1.68x the ideal and 1.50 states uploaded with two, 1.47x and
    1.24 with one, and no refusal (docs/sim.md, "One span ahead at the source").
    """
    return DEPTH if spread <= 1.0 else 1


def span_messages(chunk_bytes: int, messages: int = 0, streams: int = 1) -> int:
    """Data messages per span: about :data:`SPAN_BYTES`, within the credit one request may carry,
    and small enough that each of ``streams`` streams gets several spans of ``messages``."""
    size = max(1, min(wire.MAX_CREDIT, math.ceil(SPAN_BYTES / chunk_bytes)))
    if messages:
        size = min(size, max(1, messages // (MIN_SPANS_PER_STREAM * max(1, streams))))
    return size


# ----------------------------------------------------------------------------- actions

# Actions are slotted, not frozen, dataclasses: a striped receive makes two per
# data message (Receive, Land), and a frozen dataclass is built at twice the
# cost (2.7 us against 1.2 us on a loaded host). Nothing changes one once made.


@dataclass(slots=True)
class Send:
    """Send ``request`` (transfer id ``xfer``) on stream ``stream``; if it takes no more, tell
    :meth:`ReceivePlanner.undelivered`."""

    stream: int
    xfer: int
    request: bytes


@dataclass(slots=True)
class Cancel:
    """Tell the sender on ``stream`` to forget ``xfer`` (best effort: nothing is reported back)."""

    stream: int
    xfer: int


@dataclass(slots=True)
class Close:
    """Stream ``stream`` is dropped: stop reading it and close it."""

    stream: int


@dataclass(slots=True)
class Connect:
    """Open the connections to a swarm member, and :meth:`ReceivePlanner.add_stream` each."""

    peer: NewPeer


@dataclass(slots=True)
class Discard:
    """Drop the rest of the message just read from ``stream``."""

    stream: int


@dataclass(slots=True)
class Receive:
    """Receive the payload of data message ``reply`` from ``stream`` into its destination (hashing it when
    ``relayed``), then report :meth:`ReceivePlanner.received` (or :meth:`ReceivePlanner.unreceived`)."""

    stream: int
    reply: wire.Reply
    relayed: bool


@dataclass(slots=True)
class Land:
    """Data message ``seq`` has landed, checked where it had to be: count it (``crc``: the source's checksum)."""

    seq: int
    crc: int | None


@dataclass(slots=True)
class Fetching:
    """What this receive is fetching now (a bit set), for the others of the swarm (its relay duty)."""

    asked: int


@dataclass(slots=True)
class Wake:
    """Pass again (:meth:`ReceivePlanner.tick`) no later than ``at``: what came asks nothing of this
    receive before then (a peer's answer that changes nothing it knows: only its next question is due)."""

    at: float


@dataclass(slots=True)
class Fail:
    """The receive fails with ``error``."""

    error: Exception


Action = Send | Cancel | Close | Connect | Discard | Receive | Land | Fetching | Wake | Fail


@dataclass(frozen=True)
class Swarm:
    """This receive is a swarm member: its ``token`` (None: it shows none) and the members it knows of."""

    token: bytes | None
    known: Sequence[wire.Peer] = ()


@dataclass(eq=False)
class Lane:
    """One stream of the receive as the planner sees it: whose it is, its connection, its fate."""

    peer: int  # SOURCE, or a swarm member
    token: bytes | None  # shown in every span fetch to a peer; None for the source
    questions: bool  # it carries questions only, never a span fetch
    endpoint: str
    added: float  # when it joined the receive (a peer learned of later, later)
    established: bool = False  # its connection came up at least once
    lost_at: float | None = None  # when its connection went down (None: it is up, or never was)
    interrupted: bool = False  # its connection dropped; given RECONNECT_GRACE to come back
    gone: str = ""  # why it was dropped ("" while in use)
    bytes: int = 0  # landed from it
    messages: int = 0


def describe(lane: Lane, source: str) -> str:
    """How errors name the sender on ``lane`` (``source``: the source's name, its rank where known)."""
    return f"the peer at {lane.endpoint}" if lane.token is not None else f"{source} at {lane.endpoint}"


def log_drop(lane: Lane, step: int, why: str, level: int | None) -> None:
    """A stream no longer used: a peer at WARNING by default (it failed this receive), the source at INFO."""
    if lane.token is not None:
        message = "dropping the peer at %s for this receive of step %d: %s; its spans go to the others"
        logger.log(logging.WARNING if level is None else level, message, lane.endpoint, step, why)
    else:
        message = "striped receive of step %d: dropping %s (%s)"
        logger.log(logging.INFO if level is None else level, message, step, lane.endpoint, why)


def bounds(lanes: Sequence[Lane], terms: SpanTerms, missing: int, messages: int, now: float) -> list[Action]:
    """Fail when no connection to the source is left (peers serve only what they have, and nothing
    they send can be checked without the source), or at the deadline (``missing`` of ``messages`` not landed)."""
    if not any(not lane.gone for lane in lanes if lane.peer == SOURCE and not lane.questions):
        tried = ", ".join(f"{lane.endpoint} ({lane.gone or 'a peer'})" for lane in lanes)
        stalled = all("stall" in lane.gone for lane in lanes if lane.peer == SOURCE)
        message = f"every connection to the source failed mid-transfer: {tried}"
        return [Fail(failure(Wait.STALLED if stalled else Wait.LOST, message))]
    if now >= terms.deadline:
        waiting = ", ".join(lane.endpoint for lane in lanes if not lane.gone)
        message = (
            f"recv_checkpoint timed out waiting for {missing} of {messages} data messages "
            f"(step {terms.step}) over {waiting}"
        )
        return [Fail(failure(Wait.DEADLINE, message))]
    return []


# ----------------------------------------------------------------------------- what goes out


class Outgoing:
    """What a receive asks, and when: span fetches as the book hands them out, questions to the swarm,
    claims, signs of life, and the digests of what peers are asked for. It reads the planner's lanes
    and books; it writes only its own timing and the requests it registers."""

    def __init__(self, plan: ReceivePlanner, xfers: Callable[[], int]) -> None:
        self.plan = plan
        self.new_xfer = xfers
        self.reads_ahead = True  # until the source refuses a read-ahead request (e.g. device memory)
        self._ahead_from = 0  # messages before this one were read ahead, known or asked
        self._questions = 0  # questions asked so far (which connection to the source asks next)
        self._to_source = -math.inf  # when a request last went to the source
        self.backoff = Backoff()  # when the source may be asked again what it refused ``busy``

    def due(self, now: float) -> list[Action]:
        """Every request due now (each one registered as it is made)."""
        plan = self.plan
        self._claims_late(now)
        actions = self._questions_due(now) + self._spans(now)
        if plan.digests is not None:
            actions += self._digests(now, ahead=plan.peers is not None and bool(plan.peers.tokens))
        actions += self._keepalive(now)
        return actions

    def _keepalive(self, now: float) -> list[Action]:
        peers = self.plan.peers
        if (peers is not None and peers.own_token is not None) or now - self._to_source < KEEPALIVE_EVERY:
            return []
        for index, lane in enumerate(self.plan.lanes):
            if lane.token is None and not lane.gone and not lane.interrupted:
                xfer = self.new_xfer()
                self.plan.registry.settle(xfer, KEEPALIVE)  # its answer means nothing
                self._to_source = now
                return [Send(index, xfer, wire.have_request(xfer, self.plan.terms.stage, None))]
        return []

    def _spans(self, now: float) -> list[Action]:
        plan, actions = self.plan, list[Action]()
        book, terms = plan.book, plan.terms
        if plan.peers is not None:
            book.depth = source_depth(plan.peers.spread())
        takeovers = book.takeovers(now)
        for index, lane in enumerate(plan.lanes):
            if lane.gone:
                continue
            # A transfer id is drawn only for a stream with room (most of a swarm's streams have none).
            while book.has_room(index) and (span := book.assign(index, self.new_xfer(), now, takeovers)) is not None:
                logger.debug("asking %s for messages %d..%d", lane.endpoint, span.first, span.stop)
                request = span_request(span.xfer, span.first, span.stop, terms, lane.token, now)
                actions.append(Send(index, span.xfer, request))
                if lane.token is None:
                    self._to_source = now
        if plan.relays:
            actions.append(Fetching(book.asked()))  # the others ask the source for something else
        return actions

    def _questions_due(self, now: float) -> list[Action]:
        """Ask the peers whose turn it is what they hold, and the source who the peers are."""
        plan = self.plan
        peers = plan.peers
        if peers is None:
            return []
        actions: list[Action] = []
        claim = plan.book.wants_claim()
        for peer in peers.due(now, self.reachable(), self.busy(), claim, self._paced()):
            live = [index for index, lane in enumerate(plan.lanes) if lane.peer == peer and not lane.gone]
            # Its questions-only connections where it has them: answers there queue behind no data.
            live = [index for index in live if plan.lanes[index].questions] or live
            # The source is asked over each of its connections in turn: each comes from one of this
            # receiver's addresses, and the source believes this receiver's paths on those it sees.
            index = live[self._questions % len(live)] if peer == SOURCE else live[0]
            self._questions += 1
            xfer = self.new_xfer()
            count = claim_size(peers.spread()) if claim and peer == SOURCE else 0
            peers.asking(peer, xfer, now, claim=bool(count))
            names = peers.names() if peer == SOURCE else wire.NAMES_PLAIN
            request = wire.have_request(xfer, plan.terms.stage, peers.token_of(peer), count, names)
            actions.append(Send(index, xfer, request))
        return actions

    def _claims_late(self, now: float) -> None:
        plan = self.plan
        late = [q for q in plan.registry.of(Question) if q.peer == SOURCE and now - q.sent > SOURCE_PATIENCE]
        for question in late:
            plan.registry.settle(question.xfer, FORGOTTEN)  # the next question goes out on another connection
            if question.claim and plan.book.reserved.open:
                logger.info("the source did not answer a claim within %.2g s: asking it without claims",
                            SOURCE_PATIENCE)
            self.source_answered(question, None)

    def next_question_at(self) -> float:
        """When :meth:`_questions_due` next has a question to send (inf: none can). It asks
        :meth:`Peers.next_due` what it asks :meth:`Peers.due`: a turn counted here that the other would
        not take makes the owner's loop pass again without waiting."""
        plan = self.plan
        if plan.peers is None:
            return math.inf
        return plan.peers.next_due(self.reachable(), self.busy(), plan.book.wants_claim(), self._paced())

    def _paced(self) -> bool:
        """Whether this receive has work in hand (:data:`.peers.QUESTION_PIPELINE` messages asked and not
        landed), so its questions to peers are paced by its progress; the budget learns what has landed."""
        plan = self.plan
        assert plan.peers is not None
        plan.peers.budget.landed(sum(lane.bytes for lane in plan.lanes))
        return plan.book.asked().bit_count() >= QUESTION_PIPELINE

    def reachable(self) -> set[int]:
        """The peers (the source included) with a connection in use that is not down."""
        return {lane.peer for lane in self.plan.lanes if not lane.gone and not lane.interrupted}

    def busy(self) -> set[int]:
        """The peers this receive still has work for (asked about less often)."""
        plan = self.plan
        assert plan.peers is not None
        return {peer for peer in plan.peers.tokens if plan.book.has_work_for(peer)}

    def on_have(self, lane: Lane, reply: wire.Reply, who: str, now: float) -> list[Action]:
        """An answer to a question, on ``lane``: what a peer holds, or the swarm's members and a claim
        (``ProtocolError``: it answers no question, or a peer's does not fit the plan)."""
        plan, peers = self.plan, self.plan.peers
        if lane.token is None and plan.registry.settled_as(reply.xfer) in (KEEPALIVE, FORGOTTEN):
            return [Wake(now)]  # the answer to a sign of life, or a late one to a question given up on
        question = peers.question(reply.xfer) if peers is not None else None
        peer = peers.answered(reply.xfer) if peers is not None else None
        if peer is None or peers is None or question is None or peer != lane.peer:
            raise ProtocolError(f"{who}: a have reply to no question")
        if peer == SOURCE:
            self.source_answered(question, reply.claimed)
            return [*source_named(plan, reply), Wake(now)]
        elif not peers.dropped(peer):
            if reply.peers or reply.claimed is not None or reply.alone:
                raise ProtocolError(f"{who}: a have reply that speaks for the source")
            if not self._holds(peer, reply, who, now):
                # Most answers in a swarm of dozens: a pass now would find nothing due that the last
                # one's wake time does not already name, but for this peer's next question.
                return [Wake(max(now, peers.turn_of(peer, plan.book.has_work_for(peer))))]
        return [Wake(now)]

    def heard(self, lane: Lane, reply: wire.Reply, who: str, now: float) -> None:
        """A reply came on ``lane``: the source's is a sign of life; a peer's span end may say what it holds
        and is fetching (``ProtocolError``: that does not fit the plan), taken as the answer to a question,
        so its next question comes an interval from now."""
        plan, peers = self.plan, self.plan.peers
        if lane.token is None:
            plan.source_heard = now
        elif reply.op == wire.OP_END and reply.have is not None and peers is not None and not peers.dropped(lane.peer):
            self._holds(lane.peer, reply, who, now)
            peers.heard(lane.peer, now)

    def _holds(self, peer: int, reply: wire.Reply, who: str, now: float) -> bool:
        """``peer`` said, in ``reply``, what it holds and is fetching: into the book (whether that changed
        what it is believed to hold or fetch)."""
        plan = self.plan
        have = reply.have or 0  # a peer that says "everything" (no bits) is believed to hold nothing
        if (have | reply.coming) >> plan.messages:
            raise ProtocolError(f"{who}: a {reply.op} reply whose holdings do not fit the plan")
        return plan.book.holds(peer, have, reply.coming, now)

    def source_answered(self, question: Question, claimed: tuple[int, ...] | None) -> None:
        """The source answered ``question`` (or it was given up on); if it claimed, with what the source
        reserved (``claimed``: the run; empty or None: none are left, or a source that reserves none)."""
        if not question.claim:
            return
        if claimed:
            self.plan.book.reserved.add(*claimed[:2])
        else:
            self.plan.book.reserved.close()

    def digests_answered(self, reply: wire.Reply, now: float) -> list[Verdict]:
        """A ``digests`` reply from the source: verdicts on the messages that waited for it (``ValueError``:
        it does not cover what was asked, or none was)."""
        book = self.plan.digests
        assert reply.xfer is not None and reply.dg is not None  # wire.decode_reply
        if self.plan.registry.settled_as(reply.xfer) is not None:
            return []  # asked for before the receive gave up on peers: nothing waits for them
        if book is None:
            raise ValueError("digests this receive did not ask for")
        request = self.plan.registry.get(reply.xfer, DigestRequest)
        verdicts = book.on_digests(reply.xfer, reply.seq, reply.dg) or []
        if request is not None and logger.isEnabledFor(logging.DEBUG):
            # How long held messages wait for their digests: the answer queues behind the data.
            logger.debug("digests of messages %d..%d after %.0f ms; %d held messages released",
                         request.first, request.stop, (now - request.opened) * 1000, len(verdicts))
        return verdicts

    def _digests(self, now: float, ahead: bool) -> list[Action]:
        """Ask the source for the digests of the spans relays are asked for, and of held messages whose
        request was lost; with ``ahead`` (the receive has peers), for those of messages further on too."""
        plan, book = self.plan, self.plan.digests
        assert book is not None
        index = self._digest_stream()
        if index is None or self.backoff.holds("digests", now):
            return []  # none is connected yet (or left: the receive then drops its relays), or the source is busy
        relayed = [span for span in plan.registry.of(Span) if plan.lanes[span.stream].token is not None]
        runs = [run for span in relayed for run in book.wanted(span.first, span.stop)]
        runs += book.unverified_wanted()
        actions: list[Action] = [self._digest_request(index, first, stop, now, False) for first, stop in runs]
        late = [] if plan.terms.digests_ahead else [
            r for r in plan.registry.of(DigestRequest) if r.ahead and now - r.opened > AHEAD_PATIENCE
        ]
        for request in late:
            self.reads_ahead = False
            actions.append(Cancel(request.stream, request.xfer))
            book.withdraw(request.xfer)
            # The answer may still come (it races the cancel): dropped, also once the receive has given up on
            # peers and holds no digest book (seen in the lab: 11 receivers, one killed, unshaped).
            plan.registry.settle(request.xfer, CANCELLED)
        out = sum(1 for request in plan.registry.of(DigestRequest) if request.ahead)
        while ahead and self.reads_ahead and out < AHEAD_REQUESTS:
            run = book.ahead(self._ahead_from, AHEAD_RUN if self._ahead_from else AHEAD_FIRST_RUN)
            if run is None:
                break
            actions.append(self._digest_request(index, *run, now, True))
            self._ahead_from, out = run[1], out + 1
        return actions

    def _digest_request(self, index: int, first: int, stop: int, now: float, ahead: bool) -> Send:
        plan, terms = self.plan, self.plan.terms
        assert plan.digests is not None and terms.algorithm is not None
        xfer = self.new_xfer()
        request = digest_request(xfer, terms.step, terms.stage, terms.algorithm, first, stop, terms.deadline, now)
        plan.digests.asking(xfer, index, first, stop, now, ahead)
        return Send(index, xfer, request)

    def _digest_stream(self) -> int | None:
        """The connection to the source to ask for digests on (never a relay's): one for questions only
        while there is one (its answers queue behind no data; a request sent before it is up waits in it),
        else one that is up."""
        found = None
        for index, lane in enumerate(self.plan.lanes):
            if lane.token is not None or lane.gone:
                continue
            if lane.questions:
                return index
            if found is None and lane.established and lane.lost_at is None:
                found = index
        return found

    def digests_refused(self, xfer: int | None) -> bool | None:
        """The source refused request ``xfer``: None if it is no digest request of this receive, else
        whether what peers send can no longer be checked. False for a read-ahead: reading ahead stops
        (the source may hash device memory only as it sends it) and its messages' digests are asked
        for as spans reach them."""
        book = self.plan.digests
        if book is None or self.plan.registry.get(xfer, DigestRequest) is None:
            return None
        assert xfer is not None
        request = book.withdraw(xfer)
        if request is not None and request.ahead:
            self.reads_ahead = False
            return False
        return True

    def source_busy(self, stream: int, xfer: int | None, now: float) -> list[Span]:
        """The source refused request ``xfer`` on ``stream`` as ``busy`` (at its limits for now): it is asked
        again after a backoff (:mod:`.backoff`), and meanwhile peers serve what they hold. Returns the spans
        to cancel: a refused span fetch gives the source a rest from this receive's spans (those of ``stream``
        go to the others at once, and no stream to the source is given a span until the backoff ends)."""
        plan = self.plan
        if plan.registry.get(xfer, Span) is not None:
            self.backoff.refused("spans", xfer, now)
            return plan.book.interrupted(stream)
        request = plan.registry.get(xfer, DigestRequest)
        if request is not None and plan.digests is not None:
            self.backoff.refused("digests", xfer, now)
            plan.digests.withdraw(request.xfer)  # asked again once the backoff ends
            if request.ahead:
                self._ahead_from = min(self._ahead_from, request.first)
        question = plan.peers.question(xfer) if plan.peers is not None else None
        if question is not None and plan.peers is not None:
            plan.registry.pop(question.xfer)  # no answer comes: asked again (a claim too) once the backoff ends
            plan.peers.source_from = self.backoff.refused("questions", xfer, now)
        return []

    def resting(self, lane: Lane, now: float) -> bool:
        """Whether ``lane`` is a stream to the source given no span now: the source said ``busy``."""
        return lane.token is None and self.backoff.holds("spans", now)

    def resume_at(self, now: float) -> float:
        """When the streams to the source get spans again after a ``busy`` (inf: they are not resting)."""
        until = self.backoff.until("spans")
        return until if until > now else math.inf

    def undelivered(self, send: Send) -> bool:
        """``send`` did not go out (its stream takes no more now): its request is forgotten. Returns
        whether the stream is to be dropped (a span fetch or a question it could not take)."""
        plan, xfer = self.plan, send.xfer
        if plan.registry.get(xfer, Span) is not None:
            return True  # dropped, its span goes to the others
        if plan.registry.get(xfer, Question) is not None:
            assert plan.peers is not None
            plan.peers.unasked(xfer)
            return True
        request = plan.registry.get(xfer, DigestRequest)
        if request is not None:
            assert plan.digests is not None
            plan.digests.withdraw(xfer)  # asked again on the next pass
            if request.ahead:
                self._ahead_from = min(self._ahead_from, request.first)
        elif plan.registry.settled.pop(xfer, None) == KEEPALIVE:
            self._to_source = -math.inf  # a sign of life is still due
        return False


# ----------------------------------------------------------------------------- when to ask the planner


def source_named(plan: ReceivePlanner, reply: wire.Reply) -> list[Action]:
    """The source answered this receive's question about the swarm: connect to the members it named that
    this receive takes on, retire those out of its view; or, told ``alone``, step aside."""
    peers = plan.peers
    if plan.digests is None or peers is None:  # peers only while their bytes can be checked
        return []
    if reply.alone:
        return step_aside(plan)
    take_on = plan.book.missing * LATE_PEERS > plan.messages
    actions: list[Action] = [Connect(new) for new in peers.learn(reply.peers, take_on)]
    return actions + retire(plan, peers.surplus()) if take_on else actions


def retire(plan: ReceivePlanner, surplus: list[int]) -> list[Action]:
    """Stop using the peers of ``surplus`` (out of the view, :meth:`.Peers.surplus`) that have no span
    outstanding here, so nothing asked is lost; the others at a later answer."""
    owing = {plan.book.peer_of(span.stream) for span in plan.registry.of(Span)}
    actions: list[Action] = []
    for peer in (peer for peer in surplus if peer not in owing):
        actions += plan.drop_peer(peer, "more members were heard of; it left this receive's view", logging.DEBUG)
    return actions


def step_aside(plan: ReceivePlanner) -> list[Action]:
    """The source answered ``alone``: its uplink feeds every receiver faster than the swarm would
    (docs/protocol.md, "Swarm", "Stepping aside"). Every peer is dropped (what one sent that waits for
    its digest is fetched again), what the source reserved binds no more, and the source is asked for
    spans of full size: the rest comes from it alone, without verifying or serving onward what peers send.
    """
    logger.info("step %d: the source's uplink outpaces the swarm: fetching the rest from it alone", plan.terms.step)
    plan.book.reserved.close()
    plan.book.source_span = plan.book.span
    return plan.give_up_on_peers("the source feeds this receive faster alone", logging.DEBUG)


def connect_overdue(lane: Lane, lanes: Sequence[Lane], now: float) -> bool:
    """Whether ``lane``, a connection to the source that has not come up, is given up on.

    A path of the source that does not connect within :data:`CONNECT_BOUND` may never (see racing); a
    peer's is simply given no work until it does. A second connection over a path of the source where
    another one came up gets :data:`LATE_CONNECT_BOUND` (the path is there; a source serving dozens
    handshakes late), but not for ever: questions would wait on it (a source at its cap refuses it)."""
    if lane.established or lane.peer != SOURCE:
        return False
    # Another connection over its path came up (``lane`` itself is not up: it counts for nothing here).
    path_up = any(o.endpoint == lane.endpoint and o.established for o in lanes if o.peer == SOURCE)
    return now - lane.added >= (LATE_CONNECT_BOUND if path_up else CONNECT_BOUND)


def silent_for(book: SpanBook, index: int, lane: Lane, source_heard: float | None, now: float) -> float:
    """How long stream ``index`` (``lane``) has sent nothing of what it owes (0: it owes nothing).

    A swarm member's connections to the source (``source_heard``: when the source last sent the receive
    anything, on any connection) share its uplink with every other member's: each flow gets a share, and
    a span's data may take longer than the stall bound while the source answers this receive's questions
    on its other connection. Stalled is a source that sends the receive nothing at all; a slow path's
    spans go to others (takeovers)."""
    since = book.owed_since(index)
    if since is None:
        return 0.0  # it owes nothing (most streams of a swarm, on most passes)
    silent = now - since
    if lane.token is None and source_heard is not None:
        silent = min(silent, now - source_heard)
    return silent


class Ticks:
    """When the socket owner asks the planner again (:meth:`ReceivePlanner.tick`): at the time the last
    tick named (:meth:`ReceivePlanner.wake_at`), or at once after anything but a data message that landed.

    A data message that lands asks nothing new of anyone: a stream gets room for its next span only
    with its span's ``end``, a peer new holdings only with a ``have`` answer, a check with a
    ``digests`` answer; what time makes due (a question, a takeover, a drop, the deadline) is in the
    last tick's wake time, which a message's arrival only postpones. A swarm member of three at
    400 Mbit/s passed its loop about 1.6 times per data message and ticked at each pass, the biggest
    part of its receiving thread's CPU (docs/fast-links.md, "Relaying CPU").
    """

    def __init__(self) -> None:
        self.at = -math.inf  # when the next tick is due (-inf: at once)

    def due(self, now: float) -> bool:
        return now >= self.at

    def ticked(self, wake_at: float) -> None:
        """A tick ran; the next is due at ``wake_at`` unless something comes first."""
        self.at = wake_at

    def changed(self) -> None:
        """Something the planner must look at came: a connection's state, a malformed message."""
        self.at = -math.inf

    def replied(self, reply: wire.Reply) -> None:
        """A reply came: a ``have`` answer says by its :class:`Wake` when it calls for a pass."""
        if reply.op not in (wire.OP_DATA, wire.OP_HAVE):
            self.changed()

    def carried(self, action: Action) -> None:
        """The owner carried out ``action``: one that changes the receive's streams or fails it calls
        for a tick (a data message's own actions do not, unless it dropped its peer)."""
        if isinstance(action, Wake):
            self.at = min(self.at, action.at)
        elif not isinstance(action, (Receive, Land, Discard, Fetching, Send)):
            self.changed()


# ----------------------------------------------------------------------------- the planner


class ReceivePlanner:
    """The decisions of one striped receive of ``offsets`` (where each data message starts in the stream,
    and the end) under ``terms``, in spans of ``span`` messages; ``who`` names the source in errors.

    In a swarm (``swarm``), ``offset`` is where this receive starts its walk;
    ``relays``: this receive serves what it lands to others (:class:`Fetching`
    tells them what it fetches). ``xfers`` makes transfer ids (random by default).
    """

    def __init__(
        self,
        offsets: Sequence[int],
        terms: SpanTerms,
        span: int,
        who: str,
        swarm: Swarm | None = None,
        offset: int = 0,
        relays: bool = False,
        xfers: Callable[[], int] | None = None,
    ) -> None:
        self.offsets = offsets
        self.messages = len(offsets) - 1
        self.terms = terms
        self.who = who
        self.relays = relays
        self.registry = Registry()
        self.book = SpanBook(self.messages, 0, span, offset=offset, registry=self.registry)
        self.lanes: list[Lane] = []  # a stream's index is its place here (and in the span book)
        self.duplicates = 0  # messages that landed twice (the second copy dropped)
        self.source_heard = -math.inf  # when the source last sent this receive anything, on any connection
        self.peers: Peers | None = None
        # How peers' messages are checked (None: no peers, or nothing they send can be checked any more).
        self.digests: DigestBook | None = None
        if swarm is not None:
            assert terms.algorithm is not None  # a receive uses peers only when the source publishes digests
            self.peers = Peers(swarm.token, swarm.known, self.registry)
            self.digests = DigestBook(self.messages, terms.algorithm.size, self.registry)
            self.book.reserved.open = swarm.token is not None
        self.out = Outgoing(self, xfers if xfers is not None else lambda: random.getrandbits(63))

    # ------------------------------------------------------------------ events

    @property
    def complete(self) -> bool:
        return self.book.complete

    def start(self) -> list[Action]:
        """The streams given at the start are added: connect to the members the relay order named."""
        return [Connect(new) for new in self.peers.learn()] if self.peers is not None else []

    def add_stream(self, peer: int, token: bytes | None, questions: bool, endpoint: str, now: float) -> int:
        """A new stream (not yet connected) to ``peer``; returns its index."""
        self.lanes.append(Lane(peer, token, questions, endpoint, now))
        return self.book.add_stream(peer, data=not questions)

    def connection(self, stream: int, established: bool, lost_at: float | None) -> None:
        """Stream ``stream``'s connection came up (``established``) or went down (since ``lost_at``)."""
        lane = self.lanes[stream]
        lane.established, lane.lost_at = established, lost_at

    def settling(self, now: float) -> list[int]:
        """Streams whose connection went down a while ago: read what arrived before it did, then :meth:`tick`."""
        return [
            index
            for index, lane in enumerate(self.lanes)
            if not lane.gone and lane.lost_at is not None and now - lane.lost_at >= SETTLE_AFTER_LOSS
        ]

    def tick(self, now: float) -> list[Action]:
        """Time passed: streams dropped or given work again, every request due, the receive's bounds."""
        actions = self._follow(now) + self.out.due(now)
        return actions + bounds(self.lanes, self.terms, self.book.missing, self.messages, now)

    def wake_at(self, now: float) -> float:
        """When :meth:`tick` is next due, if no reply comes sooner."""
        takeover, question = self.book.next_takeover_at(now), self.out.next_question_at()
        return min(self.terms.deadline, now + CHECK_EVERY, takeover, question, self.out.resume_at(now))

    def undelivered(self, send: Send) -> list[Action]:
        """``send`` did not go out: its stream takes no more requests now."""
        if self.out.undelivered(send) and not self.lanes[send.stream].gone:
            return self._drop(send.stream, "its connection takes no requests")
        return []

    def close(self) -> list[Action]:
        """The receive is over: cancel every span and digest request still out."""
        actions = self._cancel(list(self.registry.of(Span)))
        for request in list(self.registry.of(DigestRequest)):
            self.registry.pop(request.xfer)
            if not self.lanes[request.stream].gone:
                actions.append(Cancel(request.stream, request.xfer))
        return actions

    def describe(self, stream: int) -> str:
        return describe(self.lanes[stream], self.who)

    # ------------------------------------------------------------------ connections and time

    def _follow(self, now: float) -> list[Action]:
        actions: list[Action] = []
        # A peer serves every member that asks it, one message each in turn: in a swarm of more than
        # HAVE_PEERS its turns come that much further apart (its quiet spans are still taken over at once).
        quiet_first = QUIET_FIRST * (self.peers.spread() if self.peers is not None else 1.0)
        for index, lane in enumerate(self.lanes):
            if lane.gone:
                continue
            lost_for = None if lane.lost_at is None else now - lane.lost_at
            if lost_for is not None and lost_for >= SETTLE_AFTER_LOSS:
                if lost_for >= RECONNECT_GRACE:
                    actions += self._drop(index, "connection lost")
                elif not lane.interrupted:
                    # The DEALER reconnects by itself (a source that rebuilt its
                    # ROUTER answers again within milliseconds): its spans go to
                    # the others now, and it gets work again once it is back.
                    lane.interrupted = True
                    actions += self._cancel(self.book.interrupted(index))
                continue
            lane.interrupted = False
            if connect_overdue(lane, self.lanes, now):
                actions += self._drop(index, "did not connect")
                continue
            self.book.connected(index, lane.established and lane.lost_at is None and not self.out.resting(lane, now))
            silent = silent_for(self.book, index, lane, self.source_heard if self.peers is not None else None, now)
            if (stall := self.terms.stall_timeout) is not None and silent >= stall:
                actions += self._drop(index, f"sent nothing for {stall:.3g} s (stall_timeout)")
            elif lane.token is not None and silent >= quiet_first and silent >= self.book.silent_peer_bound(index):
                # A peer is asked only for what it says it holds: silence is not waiting, it is failure.
                actions += self.drop_peer(lane.peer, f"sent nothing for {silent:.2g} s of what it holds")
        for peer in self.book.unbacked(now):  # claims are hints with deadlines (fetch/claims.py)
            actions += self.drop_peer(peer, "it claims to be fetching what this receive wants, and for its "
                                       "claim bound neither came to hold more nor sent anything")
        return actions

    # ------------------------------------------------------------------ replies

    def on_reply(self, stream: int, reply: wire.Reply, who: str, now: float) -> list[Action]:
        """A reply's envelope arrived on ``stream`` (``who``: :meth:`describe`); its frames follow.

        Whatever a peer sends that this receive cannot use drops that peer (:meth:`malformed`)."""
        try:
            return self._on_reply(stream, reply, who, now)
        except ProtocolError as exc:
            return [Discard(stream), *self.malformed(stream, exc)]

    def _on_reply(self, stream: int, reply: wire.Reply, who: str, now: float) -> list[Action]:
        op = reply.op
        self.out.heard(self.lanes[stream], reply, who, now)
        if op == wire.OP_DATA and reply.more:
            return self._on_data(stream, reply, who, now)
        if op == wire.OP_END and not reply.more:
            if self.registry.settled_as(reply.xfer) == CANCELLED:
                return []
            assert reply.xfer is not None  # wire.decode_reply: only an error may lack an id
            try:
                done = self.book.on_end(reply.xfer)
            except ValueError as exc:
                raise ProtocolError(f"{who}: {exc}") from None
            return self._idle_peers(done, now) + self._cancel(done)
        if op == wire.OP_HAVE and not reply.more:
            return self.out.on_have(self.lanes[stream], reply, who, now)
        if op == wire.OP_ERROR:
            return [Discard(stream), *self._on_error(stream, reply, who, now)]
        if op == wire.OP_DIGESTS and not reply.more and self.lanes[stream].token is None:
            try:  # the source's digests: verdicts on the relayed messages that waited for them
                return self._judge(self.out.digests_answered(reply, now))
            except ValueError as exc:
                raise ProtocolError(f"{who}: {exc}") from None
        raise ProtocolError(f"unexpected {op!r} message from {who} in a striped receive")

    def malformed(self, stream: int, error: ProtocolError) -> list[Action]:
        """What came on ``stream`` broke the protocol: the source's fails the receive; a peer is dropped."""
        lane = self.lanes[stream]
        if lane.token is None:
            return [Fail(error)]
        return self.drop_peer(lane.peer, f"malformed message: {error}", believed=False)

    def received(self, stream: int, seq: int, crc: int | None, digest: bytes | None) -> list[Action]:
        """Data message ``seq`` from ``stream`` is in its destination (``digest``: computed, from a peer)."""
        if self.lanes[stream].token is None:
            return self._count(seq, crc, stream)
        assert self.digests is not None and digest is not None
        verdict = self.digests.check(seq, digest, stream)
        return [] if verdict is None else self._judge([Verdict(seq, stream, verdict)])

    def unreceived(self, seq: int) -> None:
        """Data message ``seq`` failed to land: whatever landed of it is overwritten by a good copy."""
        self.book.rejected([seq])

    def _on_data(self, stream: int, reply: wire.Reply, who: str, now: float) -> list[Action]:
        seq = reply.seq
        if seq >= self.messages:
            raise ProtocolError(f"data message number {seq} out of range from {who}")
        assert reply.xfer is not None  # wire.decode_reply: only an error may lack an id
        relayed = self.lanes[stream].token is not None
        if relayed and self.digests is None:
            return [Discard(stream)]  # a peer's message that can no longer be checked never counts
        try:
            fresh = self.book.on_data(reply.xfer, seq, now, held=relayed)
        except ValueError as exc:
            raise ProtocolError(f"{who}: {exc}") from None
        if not fresh:
            # A duplicate (the rest of a span taken over) or a cancelled span's: dropped.
            self.duplicates += fresh is False
            return [Discard(stream)]
        return [Receive(stream, reply, relayed)]

    def _on_error(self, stream: int, reply: wire.Reply, who: str, now: float) -> list[Action]:
        xfer, lane = reply.xfer, self.lanes[stream]
        if self.registry.settled_as(xfer) is not None:
            return []  # a sign of life the source does not answer (an earlier release), or a request given up on
        if lane.token is not None:
            # A peer is a helper: whatever it refuses, the source or another peer serves.
            stopped = reply.code == wire.ERR_NOT_RELAYING  # it stopped serving: routine at the end of its tail
            why = f"error reply [{reply.code}] {reply.text}"
            return self.drop_peer(lane.peer, why, logging.INFO if stopped else None, believed=stopped)
        if reply.code == wire.ERR_BUSY:  # at its limits for now: asked again later (fetch/backoff.py)
            return self._cancel(self.out.source_busy(stream, xfer, now))
        refused = self.out.digests_refused(xfer)
        if refused is not None:  # nothing peers send can be checked, or only reading ahead stops
            why = f"the source refused the digests: [{reply.code}] {reply.text}"
            return self.give_up_on_peers(why) if refused else []
        question = self.peers.question(xfer) if self.peers is not None else None
        if question is not None:
            # A question about the swarm the source does not answer: no more members to learn of, no claims.
            self.registry.pop(question.xfer)
            self.out.source_answered(question, ())
            return []
        return [Fail(refusal(reply, who, self.terms.step))]

    # ------------------------------------------------------------------ verdicts

    def _judge(self, verdicts: list[Verdict]) -> list[Action]:
        """Relayed messages checked against the source's digests: counted, or their peer dropped."""
        actions: list[Action] = []
        for verdict in verdicts:
            if verdict.ok:
                actions += self._count(verdict.seq, None, verdict.stream)
                continue
            self.book.rejected([verdict.seq])
            lane = self.lanes[verdict.stream]
            if not lane.gone:
                algorithm = self.terms.algorithm.name if self.terms.algorithm is not None else "digest"
                why = f"data message {verdict.seq} does not match the source's {algorithm} digest"
                actions += self.drop_peer(lane.peer, why, believed=False)
        return actions

    def _count(self, seq: int, crc: int | None, stream: int) -> list[Action]:
        """Message ``seq`` from ``stream`` has landed (checked where it had to be)."""
        self.book.verified(seq)
        lane = self.lanes[stream]
        lane.bytes += self.offsets[seq + 1] - self.offsets[seq]
        lane.messages += 1
        return [Land(seq, crc)]

    def _idle_peers(self, done: list[Span], now: float) -> list[Action]:
        """Spans whose rest landed from others: a peer that sent nothing for them is dropped.

        It held them through a quiet bound, or while another stream served
        them: dropped now, it is not given new spans to hold, so a peer that
        serves nothing costs this receive one quiet bound, not one per span.
        """
        actions: list[Action] = []
        for span in done:
            lane = self.lanes[span.stream]
            if lane.token is not None and not lane.gone and self.book.did_nothing(span, now):
                why = "sent nothing for a quiet bound, nor while others served its spans"
                actions += self.drop_peer(lane.peer, why)
        return actions

    def _cancel(self, spans: list[Span]) -> list[Action]:
        """Tell the senders to stop sending spans this receive no longer needs; what still comes is dropped."""
        actions: list[Action] = []
        for span in spans:
            self.registry.settle(span.xfer, CANCELLED)
            if not self.lanes[span.stream].gone:
                actions.append(Cancel(span.stream, span.xfer))
        return actions

    # ------------------------------------------------------------------ drops

    def _drop(self, stream: int, why: str, level: int | None = None, believed: bool = True) -> list[Action]:
        """Stop using ``stream``; logged at ``level`` (default: WARNING for a peer, INFO for the source).

        ``believed``: a dropped peer's messages still waiting for their digest
        are checked when it comes (it failed, it did not lie); otherwise they
        are fetched again.
        """
        lane = self.lanes[stream]
        log_drop(lane, self.terms.step, why, level)
        lane.gone = why
        self.book.lost(stream)
        if self.digests is not None:
            if lane.token is None:
                self.digests.lost(stream)  # what it was asked is asked again on another
            elif not believed:
                self.book.rejected(self.digests.forget(stream))
        return [Close(stream)]

    def drop_peer(self, peer: int, why: str, level: int | None = None, believed: bool = True) -> list[Action]:
        """Fetch nothing more from ``peer`` in this receive: its spans go to the source and the others."""
        assert self.peers is not None and peer != SOURCE
        self.peers.drop(peer)
        self.book.forget_peer(peer)
        actions: list[Action] = []
        for index, lane in enumerate(self.lanes):
            if lane.peer == peer and not lane.gone:
                actions += self._drop(index, why, level, believed)
                level = logging.DEBUG  # named once
        return actions

    def give_up_on_peers(self, why: str, level: int | None = None) -> list[Action]:
        """Nothing peers send can be checked (the source refused the digests), or the source feeds this
        receive faster alone (:func:`step_aside`): fetch it all from the source."""
        assert self.digests is not None and self.peers is not None
        waiting = list(self.digests.pending)  # held, and now never to be checked
        actions: list[Action] = []
        for peer in list(self.peers.tokens):
            if not self.peers.dropped(peer):
                actions += self.drop_peer(peer, why, level, believed=False)
        self.book.rejected(waiting)
        for request in list(self.registry.of(DigestRequest)):
            self.registry.settle(request.xfer, FORGOTTEN)  # their answers, when they come, are dropped
        self.digests = None  # and no new peer is connected
        return actions
