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
work goes to the others. A peer that answers with an error or anything
malformed is dropped for this receive and its work goes elsewhere: only the
source's refusals fail a receive. It fails only then, when no stream is left,
at the transfer deadline, or on a protocol or integrity error from the source.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from .. import wire
from ..errors import ConnectionLostError, IntegrityError, ProtocolError, StalledError
from . import liveness, racing
from .connection import Connection
from .inbox import Inbox
from .peers import NewPeer, Peers
from .replies import discard_rest, next_reply, refusal
from .spans import SOURCE, SPAN_BYTES, Span, SpanBook

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


@dataclass(frozen=True)
class SpanTerms:
    """What every span fetch of one receive shares."""

    step: int
    stage: int
    accept_pickle: bool
    deadline: float
    stall_timeout: float | None


def span_messages(chunk_bytes: int, messages: int = 0, streams: int = 1) -> int:
    """Data messages per span: about :data:`SPAN_BYTES`, within the credit one request may carry,
    and small enough that each of ``streams`` streams gets several spans of ``messages``."""
    size = max(1, min(wire.MAX_CREDIT, math.ceil(SPAN_BYTES / chunk_bytes)))
    if messages:
        size = min(size, max(1, messages // (MIN_SPANS_PER_STREAM * max(1, streams))))
    return size


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
        self.streams: list[Connection] = []
        self.inbox = inbox
        self.terms = terms
        self.who = who
        self.peers = peers
        self.open_peer = open_peer
        self.messages = len(inbox.plan)
        self.book = SpanBook(self.messages, 0, span, offset=offset)
        self.added: list[float] = []  # when each stream joined this receive (a peer learned of later, later)
        self.duplicates = 0  # messages that landed twice (the second copy dropped)
        self.cancelled: set[int] = set()
        self.poller = zmq.Poller()
        for stream in streams:
            self._add(stream)
        if peers is not None:
            self._connect(peers.learn())

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Until every message has landed."""
        try:
            while not self.book.complete:
                now = time.monotonic()
                self._follow_connections(now)
                self._ask_peers(now)
                self._ask(now)
                self._check_bounds(now)
                ready = dict(self.poller.poll(self._wait_ms(now)))
                for index, stream in enumerate(self.streams):
                    if not stream.gone and stream.socket in ready:
                        self._drain(index, stream)
        finally:
            self._cancel(list(self.book.spans.values()))

    def _wait_ms(self, now: float) -> int:
        wake = min(self.terms.deadline, now + CHECK_EVERY, self.book.next_takeover_at())
        if self.peers is not None:
            wake = min(wake, self.peers.next_due(self._busy()))
        return max(0, math.ceil((max(wake, now) - now) * 1000))

    # ------------------------------------------------------------------ streams

    def _add(self, stream: Connection) -> None:
        self.streams.append(stream)
        self.added.append(time.monotonic())
        self.book.add_stream(stream.peer)
        self.poller.register(stream.socket, zmq.POLLIN)
        self.poller.register(stream.watch.monitor, zmq.POLLIN)

    def _connect(self, fresh: list[NewPeer]) -> None:
        for new in fresh:
            assert self.open_peer is not None  # a receive with peers can open them
            try:
                connections = self.open_peer(new.at, new.token, new.peer)
            except ProtocolError as exc:
                logger.warning("striped receive of step %d: cannot fetch from a peer: %s", self.terms.step, exc)
                continue
            for connection in connections:
                self._add(connection)

    def _follow_connections(self, now: float) -> None:
        for index, stream in enumerate(self.streams):
            if stream.gone:
                continue
            stream.watch.read_events(now)
            state = stream.watch.state
            lost_for = state.lost_for(now)
            if lost_for is not None and lost_for >= liveness.SETTLE_AFTER_LOSS:
                self._drain(index, stream)  # what arrived before the connection closed still counts
                if lost_for >= liveness.RECONNECT_GRACE:
                    self._drop(index, stream, "connection lost")
                elif not stream.interrupted and not stream.gone:
                    # The DEALER reconnects by itself (a source that rebuilt its
                    # ROUTER answers again within milliseconds): its spans go to
                    # the others now, and it gets work again once it is back.
                    stream.interrupted = True
                    self._cancel(self.book.interrupted(index))
                continue
            stream.interrupted = False
            # A path of the source that does not connect is given up on (it may
            # never: see racing); a peer's is simply given no work until it does.
            late = now - self.added[index] >= racing.CONNECT_BOUND
            if not state.established and late and stream.peer == SOURCE:
                self._drop(index, stream, "did not connect")
                continue
            self.book.connected(index, state.established and state.lost_at is None)
            owed = [span for span in self.book.outstanding(index) if not span.finished]
            stall = self.terms.stall_timeout
            if owed and stall is not None and now - min(self.book.silent_since(s) for s in owed) >= stall:
                self._drop(index, stream, f"sent nothing for {stall:.3g} s (stall_timeout)")

    def _drop(self, index: int, stream: Connection, why: str, level: int = logging.INFO) -> None:
        logger.log(level, "striped receive of step %d: dropping %s (%s)", self.terms.step, stream.endpoint, why)
        stream.gone = why
        self.book.lost(index)
        with contextlib.suppress(KeyError):
            self.poller.unregister(stream.socket)
            self.poller.unregister(stream.watch.monitor)
        stream.close()

    def _drop_peer(self, peer: int, why: str, level: int = logging.WARNING) -> None:
        """Fetch nothing more from ``peer`` in this receive: its spans go to the source and the others."""
        assert self.peers is not None and peer != SOURCE
        self.peers.drop(peer)
        self.book.forget_peer(peer)
        for index, stream in enumerate(self.streams):
            if stream.peer == peer and not stream.gone:
                self._drop(index, stream, f"peer: {why}", level)
                level = logging.DEBUG  # named once

    def _ask(self, now: float) -> None:
        terms = self.terms
        for index, stream in enumerate(self.streams):
            if stream.gone:
                continue
            while (span := self.book.assign(index, random.getrandbits(63), now)) is not None:
                wait_ms = max(0, int((terms.deadline - now) * 1000))
                fetch = wire.fetch_request(
                    span.xfer,
                    terms.step,
                    wait_ms,
                    span.stop - span.first,
                    terms.accept_pickle,
                    span=(span.first, span.stop),
                    stage=terms.stage,
                    token=stream.token,
                )
                if not self._send(index, stream, fetch):
                    break
        if self.inbox.duty is not None:
            self.inbox.duty.fetching(self.book.asked())

    def _ask_peers(self, now: float) -> None:
        """Ask the peers whose turn it is what they hold, and the source who the peers are."""
        peers = self.peers
        if peers is None:
            return
        reachable = {stream.peer for stream in self.streams if not stream.gone and not stream.interrupted}
        for peer in peers.due(now, reachable, self._busy()):
            index, stream = next((i, s) for i, s in enumerate(self.streams) if s.peer == peer and not s.gone)
            xfer = random.getrandbits(63)
            if self._send(index, stream, wire.have_request(xfer, self.terms.stage, peers.token_of(peer))):
                peers.asking(peer, xfer, now)

    def _busy(self) -> set[int]:
        """The peers this receive still has work for (asked about less often)."""
        assert self.peers is not None
        return {peer for peer in self.peers.tokens if self.book.has_work_for(peer)}

    def _send(self, index: int, stream: Connection, request: bytes) -> bool:
        try:
            stream.socket.send(request, zmq.NOBLOCK)
        except zmq.Again:
            self._drop(index, stream, "its connection takes no requests")
            return False
        return True

    def _check_bounds(self, now: float) -> None:
        if all(stream.gone for stream in self.streams if stream.peer == SOURCE):
            # Peers serve only what they have: with the source gone, nothing guarantees the rest.
            tried = ", ".join(f"{s.endpoint} ({s.gone or 'a peer'})" for s in self.streams)
            stalled = all("stall" in s.gone for s in self.streams)
            message = f"every connection to the source failed mid-transfer: {tried}"
            raise StalledError(message) if stalled else ConnectionLostError(message)
        if now >= self.terms.deadline:
            waiting = ", ".join(s.endpoint for s in self.streams if not s.gone)
            raise TimeoutError(
                f"recv_checkpoint timed out waiting for {self.book.missing} of {self.messages} data messages "
                f"(step {self.terms.step}) over {waiting}"
            )

    # ------------------------------------------------------------------ messages

    def _drain(self, index: int, stream: Connection) -> None:
        who = self._describe(stream)
        for _ in range(DRAIN_BATCH):
            try:
                reply = next_reply(stream.socket, who)
                if reply is None:
                    return
                self._handle(index, stream, reply, who)
            except (ProtocolError, IntegrityError) as exc:
                if stream.peer == SOURCE:
                    raise
                # A peer that sends anything malformed or corrupt is dropped; the source still serves.
                self._drop_peer(stream.peer, str(exc))
            if self.book.complete or stream.gone:
                return

    def _describe(self, stream: Connection) -> str:
        return f"the peer at {stream.endpoint}" if stream.peer != SOURCE else f"{self.who} at {stream.endpoint}"

    def _handle(self, index: int, stream: Connection, reply: wire.Reply, who: str) -> None:
        xfer = reply.xfer
        if reply.op == wire.OP_DATA and reply.more:
            self._on_data(stream, reply, who)
        elif reply.op == wire.OP_END and not reply.more:
            if xfer in self.cancelled:
                return
            assert xfer is not None  # wire.decode_reply: only an error may lack an id
            try:
                self._cancel(self.book.on_end(xfer))
            except ValueError as exc:
                raise ProtocolError(f"{who}: {exc}") from None
        elif reply.op == wire.OP_HAVE and not reply.more:
            self._on_have(stream, reply, who)
        elif reply.op == wire.OP_ERROR:
            discard_rest(stream.socket)
            if xfer in self.cancelled:
                return
            if stream.peer == SOURCE:
                raise refusal(reply, who, self.terms.step)
            # A peer that cannot (or no longer) serve: routine at the end of its tail.
            level = logging.INFO if reply.code == wire.ERR_NOT_RELAYING else logging.WARNING
            self._drop_peer(stream.peer, f"[{reply.code}] {reply.text}", level)
        else:
            discard_rest(stream.socket)
            raise ProtocolError(f"unexpected {reply.op!r} message from {who} in a striped receive")

    def _on_have(self, stream: Connection, reply: wire.Reply, who: str) -> None:
        peer = self.peers.answered(reply.xfer) if self.peers is not None else None
        if peer is None or self.peers is None or peer != stream.peer:
            raise ProtocolError(f"{who}: a have reply to no question")
        if peer == SOURCE:
            self._connect(self.peers.learn(reply.peers))
        elif not self.peers.dropped(peer):
            self.book.holds(peer, reply.have or 0, reply.coming)

    def _on_data(self, stream: Connection, reply: wire.Reply, who: str) -> None:
        seq = reply.seq
        if seq >= self.messages:
            discard_rest(stream.socket)
            raise ProtocolError(f"data message number {seq} out of range from {who}")
        assert reply.xfer is not None  # wire.decode_reply: only an error may lack an id
        try:
            fresh = self.book.on_data(reply.xfer, seq, time.monotonic())
        except ValueError as exc:
            discard_rest(stream.socket)
            raise ProtocolError(f"{who}: {exc}") from None
        if not fresh:
            # A duplicate (the rest of a span taken over) or a cancelled span's: dropped.
            discard_rest(stream.socket)
            self.duplicates += fresh is False
            return
        try:
            stream.bytes += self.inbox.land(stream.socket, reply, who)
        except (ProtocolError, IntegrityError):
            self.book.rejected([seq])  # whatever landed of it is overwritten by a good copy
            raise
        stream.messages += 1

    def _cancel(self, spans: list[Span]) -> None:
        """Tell the senders to stop sending spans this receive no longer needs (best effort)."""
        for span in spans:
            self.cancelled.add(span.xfer)
            stream = self.streams[span.stream]
            if not stream.gone:
                with contextlib.suppress(zmq.ZMQError):
                    stream.socket.send(wire.cancel_request(span.xfer), zmq.NOBLOCK)
