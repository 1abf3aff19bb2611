"""A striped receive's data phase: the spans of one step over several connections at once.

The header has arrived (over the first connection, from a sender that serves
span fetches: docs/protocol.md, "Spans") and the landing plan is carried out.
Here one thread, the receiving one, owns every DEALER: to the source, over
each of its paths, and, in a swarm (docs/protocol.md, "Swarm"), to each peer
it knows. It asks each connected stream for spans as :class:`~.spans.SpanBook`
hands them out, asks the peers what they hold and the source who the peers
are (:class:`~.peers.Peers`), lands each data message as it comes (on
whichever stream), and notices streams that are lost (their connection
closed) or stalled (silent for the stall bound while they owe data), whose
work goes to the others. It fails only when no connection to the source is
left, at the transfer deadline, or on a protocol or integrity error of the
source.

A peer (a stream with a token) is a helper the receive does without at the
first sign of trouble: every message it sends is checked against the source's
digest before it counts (:mod:`.checking`), and a mismatch, any error reply,
anything malformed, or silence while others serve its spans drops it for this
receive, with a WARNING naming it; its spans go to the source and the other
peers. Only the source's own refusals fail the receive.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from .. import wire
from ..errors import ConnectionLostError, ProtocolError, StalledError
from . import liveness, racing
from .asking import Asking, SpanTerms
from .checking import DigestTerms, RelayCheck
from .connection import Connection
from .inbox import Inbox
from .peers import NewPeer, Peers
from .replies import discard_rest, next_reply, refusal
from .spans import QUIET_FIRST, SOURCE, SPAN_BYTES, Span, SpanBook
from .verify import Verdict

logger = logging.getLogger("zmqtransport.fetch")

# How long one wait may last before streams are checked again (connections
# coming up, takeovers due), when nothing else wakes the loop sooner.
CHECK_EVERY = 0.1
# Messages taken from one stream before the others get a turn.
DRAIN_BATCH = 32
# Spans one stream should get over a receive at the least: with fewer, one
# slow stream's outstanding spans are a large part of the whole.
MIN_SPANS_PER_STREAM = 4

# Opens the connections to a new swarm peer (where it serves, its token, its id in the book).
OpenPeer = Callable[[str, bytes, int], list[Connection]]


def span_messages(chunk_bytes: int, messages: int = 0, streams: int = 1) -> int:
    """Data messages per span: about :data:`SPAN_BYTES`, within the credit one request may carry,
    and small enough that each of ``streams`` streams gets several spans of ``messages``."""
    size = max(1, min(wire.MAX_CREDIT, math.ceil(SPAN_BYTES / chunk_bytes)))
    if messages:
        size = min(size, max(1, messages // (MIN_SPANS_PER_STREAM * max(1, streams))))
    return size


def describe(stream: Connection, source: str) -> str:
    """How errors name the sender on ``stream`` (``source``: the source's name, its rank where known)."""
    return f"the peer at {stream.endpoint}" if stream.token is not None else f"{source} at {stream.endpoint}"


def log_drop(stream: Connection, step: int, why: str, level: int | None) -> None:
    """A stream no longer used: a peer at WARNING by default (it failed this receive), the source at INFO."""
    if stream.token is not None:
        message = "dropping the peer at %s for this receive of step %d: %s; its spans go to the others"
        logger.log(logging.WARNING if level is None else level, message, stream.endpoint, step, why)
    else:
        message = "striped receive of step %d: dropping %s (%s)"
        logger.log(logging.INFO if level is None else level, message, step, stream.endpoint, why)


class StripedReceive:
    """Receives every data message of ``inbox``'s plan over ``streams``; the calling thread owns them all.

    ``who`` names the source in errors (its rank, where the caller gave one).
    In a swarm, ``peers`` says who the other members are and ``open_peer``
    connects to one; ``offset`` is where this receive starts its walk.
    """

    def __init__(
        self,
        streams: Sequence[Connection],
        inbox: Inbox,
        terms: SpanTerms,
        span: int,
        who: str,
        peers: Peers | None = None,
        open_peer: OpenPeer | None = None,
        offset: int = 0,
    ) -> None:
        self.streams: list[Connection] = []  # a stream's index is its place here (and in the span book)
        self.inbox = inbox
        self.terms = terms
        self.who = who
        self.peers = peers
        self.open_peer = open_peer
        self.messages = len(inbox.plan)
        self.book = SpanBook(self.messages, 0, span, offset=offset)
        self.duplicates = 0  # messages that landed twice (the second copy dropped)
        check = None
        if peers is not None:
            assert terms.algorithm is not None  # a receive uses peers only when the source publishes digests
            digest_terms = DigestTerms(terms.step, terms.stage, terms.algorithm, terms.deadline)
            check = RelayCheck(self.streams, self.messages, digest_terms)
        self.asking = Asking(self.streams, self.book, terms, peers, check, inbox.duty)
        self.lanes = Lanes(self.streams, self.book, self.asking, terms.step)
        for stream in streams:
            self.lanes.add(stream)
        if peers is not None:
            self.book.reserved.open = peers.own_token is not None
            self._connect(peers.learn())

    # ------------------------------------------------------------------ the loop

    @property
    def check(self) -> RelayCheck | None:
        """How peers' messages are checked (None: no peers, or nothing they send can be checked any more)."""
        return self.asking.check

    def run(self) -> None:
        """Until every message has landed."""
        ready: dict[Any, int] | None = None  # None: read every connection's monitor (the first pass)
        try:
            while not self.book.complete:
                now = time.monotonic()
                self._follow_connections(now, ready)
                for index in self.asking.send(now):
                    self.lanes.drop(index, "its connection takes no requests")
                self._check_bounds(now)
                ready = dict(self.lanes.poller.poll(self._wait_ms(now)))
                for index, stream in enumerate(self.streams):
                    if not stream.gone and stream.socket in ready:
                        self._drain(index, stream)
        finally:
            self.asking.cancel_all()

    def _wait_ms(self, now: float) -> int:
        takeover, question = self.book.next_takeover_at(now), self.asking.next_question_at()
        wake = min(self.terms.deadline, now + CHECK_EVERY, takeover, question)
        return max(0, math.ceil((max(wake, now) - now) * 1000))

    # ------------------------------------------------------------------ streams

    def _connect(self, fresh: list[NewPeer]) -> None:
        for new in fresh:
            assert self.open_peer is not None  # a receive with peers can open them
            try:
                connections = self.open_peer(new.at, new.token, new.peer)
            except ProtocolError as exc:
                logger.warning("striped receive of step %d: cannot fetch from a peer: %s", self.terms.step, exc)
                continue
            for connection in connections:
                self.lanes.add(connection)

    def _follow_connections(self, now: float, ready: dict[Any, int] | None = None) -> None:
        """Each connection's state, from its monitor's events (only monitors the last poll found ready have
        any: a receive with peers has a dozen connections or more, and passes its loop hundreds of times)."""
        for index, stream in enumerate(self.streams):
            if stream.gone:
                continue
            if ready is None or stream.watch.monitor in ready:
                stream.watch.read_events(now)
            state = stream.watch.state
            lost_for = state.lost_for(now)
            if lost_for is not None and lost_for >= liveness.SETTLE_AFTER_LOSS:
                self._drain(index, stream)  # what arrived before the connection closed still counts
                if lost_for >= liveness.RECONNECT_GRACE:
                    self.lanes.drop(index, "connection lost")
                elif not stream.interrupted and not stream.gone:
                    # The DEALER reconnects by itself (a source that rebuilt its
                    # ROUTER answers again within milliseconds): its spans go to
                    # the others now, and it gets work again once it is back.
                    stream.interrupted = True
                    self.asking.cancel(self.book.interrupted(index))
                continue
            stream.interrupted = False
            # A path of the source that does not connect is given up on (it may
            # never: see racing); a peer's is simply given no work until it does.
            late = now - self.lanes.added[index] >= racing.CONNECT_BOUND
            if not state.established and late and stream.peer == SOURCE:
                self.lanes.drop(index, "did not connect")
                continue
            self.book.connected(index, state.established and state.lost_at is None)
            owed = [span for span in self.book.outstanding(index) if not span.finished]
            silent = now - min(self.book.silent_since(s) for s in owed) if owed else 0.0
            stall = self.terms.stall_timeout
            if stall is not None and silent >= stall:
                self.lanes.drop(index, f"sent nothing for {stall:.3g} s (stall_timeout)")
            elif stream.token is not None and silent >= max(QUIET_FIRST, self.book.quiet_after(index)):
                # A peer is asked only for what it says it holds: silence is not waiting, it is failure.
                self.lanes.drop_peer(stream.peer, f"sent nothing for {silent:.2g} s of what it holds")

    def _idle_peers(self, done: list[Span]) -> None:
        """Spans whose rest landed from others: a peer that sent nothing for them is dropped.

        It held them through a quiet bound, or while another stream served
        them: dropped now, it is not given new spans to hold, so a peer that
        serves nothing costs this receive one quiet bound, not one per span.
        """
        now = time.monotonic()
        for span in done:
            stream = self.streams[span.stream]
            if stream.token is not None and not stream.gone and self.book.did_nothing(span, now):
                self.lanes.drop_peer(stream.peer, "sent nothing for a quiet bound, nor while others served its spans")

    def _check_bounds(self, now: float) -> None:
        self.lanes.check_source()
        if now >= self.terms.deadline:
            waiting = ", ".join(s.endpoint for s in self.streams if not s.gone)
            raise TimeoutError(
                f"recv_checkpoint timed out waiting for {self.book.missing} of {self.messages} data messages "
                f"(step {self.terms.step}) over {waiting}"
            )

    # ------------------------------------------------------------------ messages

    def _drain(self, index: int, stream: Connection) -> None:
        who, until = describe(stream, self.who), time.monotonic() + CHECK_EVERY  # then the loop's turn
        for _ in range(DRAIN_BATCH):
            try:
                reply = next_reply(stream.socket, who)
                if reply is None:
                    return
                self._handle(index, stream, reply, who)
            except ProtocolError as exc:
                if stream.token is None:
                    raise  # the source's own: the receive fails
                self.lanes.drop_peer(stream.peer, f"malformed message: {exc}", believed=False)
            if self.book.complete or stream.gone or time.monotonic() >= until:
                return

    def _handle(self, index: int, stream: Connection, reply: wire.Reply, who: str) -> None:
        xfer = reply.xfer
        if reply.op == wire.OP_DATA and reply.more:
            self._on_data(index, stream, reply, who)
        elif reply.op == wire.OP_END and not reply.more:
            if xfer in self.asking.cancelled:
                return
            assert xfer is not None  # wire.decode_reply: only an error may lack an id
            try:
                done = self.book.on_end(xfer)
            except ValueError as exc:
                raise ProtocolError(f"{who}: {exc}") from None
            self._idle_peers(done)
            self.asking.cancel(done)
        elif reply.op == wire.OP_HAVE and not reply.more:
            self._on_have(stream, reply, who)
        elif reply.op == wire.OP_ERROR:
            discard_rest(stream.socket)
            self._on_error(stream, reply, who)
        elif reply.op == wire.OP_DIGESTS and not reply.more and stream.token is None and self.check is not None:
            self._judge(self.check.answered(reply, who) or [])
        else:
            discard_rest(stream.socket)
            raise ProtocolError(f"unexpected {reply.op!r} message from {who} in a striped receive")

    def _on_error(self, stream: Connection, reply: wire.Reply, who: str) -> None:
        xfer = reply.xfer
        if xfer in self.asking.cancelled or xfer in self.asking.keepalives or xfer in self.asking.forgotten:
            return  # a sign of life the source does not answer (an earlier release), or a question given up on
        if stream.token is not None:
            # A peer is a helper: whatever it refuses, the source or another peer serves.
            stopped = reply.code == wire.ERR_NOT_RELAYING  # it stopped serving: routine at the end of its tail
            why = f"error reply [{reply.code}] {reply.text}"
            self.lanes.drop_peer(stream.peer, why, logging.INFO if stopped else None, believed=stopped)
            return
        refused = self.check.refused(xfer) if self.check is not None else None
        if refused is not None:
            if refused:  # nothing peers send can be checked
                self.lanes.give_up_on_peers(f"the source refused the digests: [{reply.code}] {reply.text}")
            return
        if self.peers is not None and self.peers.answered(xfer) is not None:
            # A question about the swarm the source does not answer: no more members to learn of, no claims.
            self.asking.answered_by_source(xfer, ())
            return
        raise refusal(reply, who, self.terms.step)

    def _on_have(self, stream: Connection, reply: wire.Reply, who: str) -> None:
        if stream.token is None and (reply.xfer in self.asking.keepalives or reply.xfer in self.asking.forgotten):
            return  # the answer to a sign of life, or a late one to a question given up on
        peer = self.peers.answered(reply.xfer) if self.peers is not None else None
        if peer is None or self.peers is None or peer != stream.peer:
            raise ProtocolError(f"{who}: a have reply to no question")
        if peer == SOURCE:
            self.asking.answered_by_source(reply.xfer, reply.claimed)
            if self.check is not None:  # peers only while their bytes can be checked
                self._connect(self.peers.learn(reply.peers))
        elif not self.peers.dropped(peer):
            self.book.holds(peer, reply.have or 0, reply.coming)

    def _on_data(self, index: int, stream: Connection, reply: wire.Reply, who: str) -> None:
        seq = reply.seq
        if seq >= self.messages:
            discard_rest(stream.socket)
            raise ProtocolError(f"data message number {seq} out of range from {who}")
        assert reply.xfer is not None  # wire.decode_reply: only an error may lack an id
        relayed = stream.token is not None
        if relayed and self.check is None:
            discard_rest(stream.socket)  # a peer's message that can no longer be checked never counts
            return
        try:
            fresh = self.book.on_data(reply.xfer, seq, time.monotonic(), held=relayed)
        except ValueError as exc:
            discard_rest(stream.socket)
            raise ProtocolError(f"{who}: {exc}") from None
        if not fresh:
            # A duplicate (the rest of a span taken over) or a cancelled span's: dropped.
            discard_rest(stream.socket)
            self.duplicates += fresh is False
            return
        try:
            _, digest = self.inbox.receive(stream.socket, reply, who, relayed)
        except ProtocolError:
            self.book.rejected([seq])  # whatever landed of it is overwritten by a good copy
            raise
        if not relayed:
            self._count(seq, reply.crc, index)
            return
        assert self.check is not None and digest is not None
        verdict = self.check.arrived(seq, digest, index)
        if verdict is not None:
            self._judge([Verdict(seq, index, verdict)])

    def _judge(self, verdicts: list[Verdict]) -> None:
        """Relayed messages checked against the source's digests: counted, or their peer dropped."""
        for verdict in verdicts:
            stream = self.streams[verdict.stream]
            if verdict.ok:
                self._count(verdict.seq, None, verdict.stream)
                continue
            self.book.rejected([verdict.seq])
            if not stream.gone:
                algorithm = self.terms.algorithm.name if self.terms.algorithm is not None else "digest"
                why = f"data message {verdict.seq} does not match the source's {algorithm} digest"
                self.lanes.drop_peer(stream.peer, why, believed=False)

    def _count(self, seq: int, crc: int | None, index: int) -> None:
        """Message ``seq`` from stream ``index`` has landed (checked where it had to be)."""
        self.book.verified(seq)
        self.inbox.count(seq, crc)
        stream = self.streams[index]
        stream.bytes += self.inbox.offsets[seq + 1] - self.inbox.offsets[seq]
        stream.messages += 1


class Lanes:
    """The streams of one striped receive (``streams``, shared with it) and what becomes of each.

    It adds streams (to the span book and the poller) and drops them: a
    dropped stream's spans go to the others, and a peer dropped for a lie
    has its messages still waiting for their digest fetched again.
    """

    def __init__(self, streams: list[Connection], book: SpanBook, asking: Asking, step: int) -> None:
        self.streams = streams
        self.book = book
        self.asking = asking
        self.step = step
        self.added: list[float] = []  # when each stream joined the receive (a peer learned of later, later)
        self.poller = zmq.Poller()

    def add(self, stream: Connection) -> None:
        self.streams.append(stream)
        self.added.append(time.monotonic())
        self.book.add_stream(stream.peer, data=not stream.questions)
        self.poller.register(stream.socket, zmq.POLLIN)
        self.poller.register(stream.watch.monitor, zmq.POLLIN)

    def drop(self, index: int, why: str, level: int | None = None, believed: bool = True) -> None:
        """Stop using stream ``index``; logged at ``level`` (default: WARNING for a peer, INFO for the source).

        ``believed``: a dropped peer's messages still waiting for their digest
        are checked when it comes (it failed, it did not lie); otherwise they
        are fetched again.
        """
        stream = self.streams[index]
        log_drop(stream, self.step, why, level)
        stream.gone = why
        self.book.lost(index)
        check = self.asking.check
        if check is not None:
            if stream.token is None:
                check.source_lost(index)
            elif not believed:
                self.book.rejected(check.relay_dropped(index))
        with contextlib.suppress(KeyError):
            self.poller.unregister(stream.socket)
            self.poller.unregister(stream.watch.monitor)
        stream.close()

    def drop_peer(self, peer: int, why: str, level: int | None = None, believed: bool = True) -> None:
        """Fetch nothing more from ``peer`` in this receive: its spans go to the source and the others."""
        peers = self.asking.peers
        assert peers is not None and peer != SOURCE
        peers.drop(peer)
        self.book.forget_peer(peer)
        for index, stream in enumerate(self.streams):
            if stream.peer == peer and not stream.gone:
                self.drop(index, why, level, believed)
                level = logging.DEBUG  # named once

    def check_source(self) -> None:
        """Raise when no connection to the source is left: peers serve only what they have, and
        nothing they send can be checked without the source."""
        if any(not stream.gone for stream in self.streams if stream.peer == SOURCE and not stream.questions):
            return
        tried = ", ".join(f"{s.endpoint} ({s.gone or 'a peer'})" for s in self.streams)
        stalled = all("stall" in s.gone for s in self.streams if s.peer == SOURCE)
        message = f"every connection to the source failed mid-transfer: {tried}"
        raise StalledError(message) if stalled else ConnectionLostError(message)

    def give_up_on_peers(self, why: str) -> None:
        """Nothing peers send can be checked (the source refused the digests): fetch it all from the source."""
        check, peers = self.asking.check, self.asking.peers
        assert check is not None and peers is not None
        waiting = list(check.book.pending)  # held, and now never to be checked
        for peer in list(peers.tokens):
            if not peers.dropped(peer):
                self.drop_peer(peer, why, believed=False)
        self.book.rejected(waiting)
        self.asking.check = None  # and no new peer is connected
