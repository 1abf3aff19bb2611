"""A striped receive's data phase: the spans of one step over several connections at once.

The header has arrived (over the first connection, from a sender that serves
span fetches: docs/protocol.md, "Spans") and the landing plan is carried out.
Here one thread, the receiving one, owns every DEALER: it asks each connected
stream for spans as :class:`~.spans.SpanBook` hands them out,
lands each data message as it comes (on whichever stream), and notices
streams that are lost (their connection closed) or stalled (silent for the
stall bound while they owe data), whose work goes to the others. It fails only
when no stream is left, at the transfer deadline, or on a protocol or
integrity error of the source.

A relay (a stream with a token: docs/protocol.md, "Relays") is a helper the
receive does without at the first sign of trouble: every message it sends is
checked against the source's digest before it counts (:mod:`.checking`), and a
mismatch, any error reply, anything malformed, or silence while the source
stands by drops it for this receive, with a WARNING naming it; its spans go to
the source. Only the source's own refusals fail the receive.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from .. import wire
from ..digests import Algorithm
from ..errors import ConnectionLostError, ProtocolError, StalledError
from . import liveness, racing
from .checking import DigestTerms, RelayCheck
from .connection import Connection
from .inbox import Inbox
from .replies import discard_rest, next_reply, refusal
from .spans import SPAN_BYTES, Span, SpanBook
from .verify import Verdict

logger = logging.getLogger("zmqtransport.fetch")

# How long one wait may last before streams are checked again (connections
# coming up, takeovers due), when nothing else wakes the loop sooner.
CHECK_EVERY = 0.1
# Messages taken from one stream before the others get a turn.
DRAIN_BATCH = 32


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


def span_messages(chunk_bytes: int) -> int:
    """Data messages per span: about :data:`SPAN_BYTES`, within the credit one request may carry."""
    return max(1, min(wire.MAX_CREDIT, math.ceil(SPAN_BYTES / chunk_bytes)))


def span_request(span: Span, terms: SpanTerms, token: bytes | None, now: float) -> bytes:
    """The span fetch for ``span``: to a relay with its ``token``; to the source, with digests if verify="all"."""
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


def log_drop(stream: Connection, step: int, why: str, level: int | None) -> None:
    """A stream no longer used: a relay at WARNING by default (it failed its downstream), the source at INFO."""
    if stream.token is not None:
        message = "dropping the relay at %s for this receive of step %d: %s; its spans go to the source"
        logger.log(logging.WARNING if level is None else level, message, stream.endpoint, step, why)
    else:
        message = "striped receive of step %d: dropping %s (%s)"
        logger.log(logging.INFO if level is None else level, message, step, stream.endpoint, why)


class StripedReceive:
    """Receives every data message of ``inbox``'s plan over ``streams``; the calling thread owns them all.

    ``who`` names the source in errors (its rank, where the caller gave one).
    """

    def __init__(self, streams: Sequence[Connection], inbox: Inbox, terms: SpanTerms, span: int, who: str) -> None:
        self.streams = list(streams)
        self.inbox = inbox
        self.terms = terms
        self.who = who
        self.messages = len(inbox.plan)
        standby = frozenset(i for i, stream in enumerate(self.streams) if stream.standby)
        self.book = SpanBook(self.messages, len(self.streams), span, standby=standby)
        self.check: RelayCheck | None = None
        if any(stream.token is not None for stream in self.streams):
            assert terms.algorithm is not None  # a receive uses relays only when the source publishes digests
            digest_terms = DigestTerms(terms.step, terms.stage, terms.algorithm, terms.deadline)
            self.check = RelayCheck(self.streams, self.messages, digest_terms)
        self.started = time.monotonic()
        self.duplicates = 0  # messages that landed twice (the second copy dropped)
        self.cancelled: set[int] = set()
        self.poller = zmq.Poller()
        for stream in self.streams:
            self.poller.register(stream.socket, zmq.POLLIN)
            self.poller.register(stream.watch.monitor, zmq.POLLIN)

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Until every message has landed."""
        try:
            while not self.book.complete:
                now = time.monotonic()
                self._follow_connections(now)
                self._ask(now)
                if self.check is not None:
                    self.check.ask(self._relayed_spans(), now)
                self._check_bounds(now)
                ready = dict(self.poller.poll(self._wait_ms(now)))
                for index, stream in enumerate(self.streams):
                    if not stream.gone and stream.socket in ready:
                        self._drain(index, stream)
        finally:
            self._cancel(list(self.book.spans.values()))
            if self.check is not None:
                self.check.cancel_all()

    def _relayed_spans(self) -> list[Span]:
        return [span for span in self.book.spans.values() if self.streams[span.stream].token is not None]

    def _wait_ms(self, now: float) -> int:
        wake = min(self.terms.deadline, now + CHECK_EVERY, self.book.next_takeover_at())
        return max(0, math.ceil((wake - now) * 1000))

    # ------------------------------------------------------------------ streams

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
                elif not stream.interrupted:
                    # The DEALER reconnects by itself (a source that rebuilt its
                    # ROUTER answers again within milliseconds): its spans go to
                    # the others now, and it gets work again once it is back.
                    stream.interrupted = True
                    self._cancel(self.book.interrupted(index))
                continue
            stream.interrupted = False
            if not state.established and now - self.started >= racing.CONNECT_BOUND:
                self._drop(index, stream, "did not connect")
                continue
            self.book.connected(index, state.established and state.lost_at is None)
            owed = [span for span in self.book.outstanding(index) if not span.finished]
            stall = self.terms.stall_timeout
            if owed and stall is not None and now - min(self.book.silent_since(s) for s in owed) >= stall:
                self._drop(index, stream, f"sent nothing for {stall:.3g} s (stall_timeout)")

    def _drop(
        self, index: int, stream: Connection, why: str, level: int | None = None, believed: bool = True
    ) -> None:
        """Stop using a stream; logged at ``level`` (default: WARNING for a relay, INFO for the source).

        ``believed``: a dropped relay's messages still waiting for their
        digest are checked when it comes (it failed, it did not lie);
        otherwise they are fetched again.
        """
        log_drop(stream, self.terms.step, why, level)
        stream.gone = why
        self.book.lost(index)
        if self.check is not None:
            if stream.token is None:
                self.check.source_lost(index)
            elif not believed:
                self.book.rejected(self.check.relay_dropped(index))
        with contextlib.suppress(KeyError):
            self.poller.unregister(stream.socket)
            self.poller.unregister(stream.watch.monitor)
        stream.close()

    def _ask(self, now: float) -> None:
        for index, stream in enumerate(self.streams):
            if stream.gone:
                continue
            while (span := self.book.assign(index, random.getrandbits(63), now)) is not None:
                try:
                    stream.socket.send(span_request(span, self.terms, stream.token, now), zmq.NOBLOCK)
                except zmq.Again:
                    self._drop(index, stream, "its connection takes no requests")
                    break

    def _idle_relays(self, done: list[Span]) -> None:
        """Spans whose rest landed from others: a relay that sent nothing since they were taken over is dropped.

        It held them through a quiet bound (:data:`~.spans.STANDBY_QUIET`, or
        :data:`~.spans.QUIET_FIRST` before its first message) and
        then while another stream served them: dropped now, it is not given
        new spans to hold, so a relay that serves nothing costs its downstream
        one quiet bound, not one per span. One that was only waiting for its
        own upstream has sent something by then (its upstream's pace is the
        downstream's), and is kept.
        """
        for span in done:
            stream = self.streams[span.stream]
            if stream.token is not None and not stream.gone and self.book.idle_since_taken_over(span):
                why = "sent nothing for a quiet bound, nor while the source served its spans"
                self._drop(span.stream, stream, why)

    def _check_bounds(self, now: float) -> None:
        if self.check is not None and all(s.gone for s in self.streams if s.token is None):
            # Nothing a relay sends can be checked any more.
            for index, stream in enumerate(self.streams):
                if not stream.gone:
                    why = "no connection to the source is left to check its messages against"
                    self._drop(index, stream, why, believed=False)
        if all(stream.gone for stream in self.streams):
            tried = ", ".join(f"{s.endpoint} ({s.gone})" for s in self.streams)
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
            except ProtocolError as exc:
                if stream.token is None:
                    raise  # the source's own: the receive fails
                self._drop(index, stream, f"malformed message: {exc}", believed=False)
            if self.book.complete or stream.gone:
                return

    def _describe(self, stream: Connection) -> str:
        return f"the relay at {stream.endpoint}" if stream.token is not None else f"{self.who} at {stream.endpoint}"

    def _handle(self, index: int, stream: Connection, reply: wire.Reply, who: str) -> None:
        xfer = reply.xfer
        if reply.op == wire.OP_DATA and reply.more:
            self._on_data(index, stream, reply, who)
        elif reply.op == wire.OP_END and not reply.more:
            if xfer in self.cancelled:
                return
            assert xfer is not None  # wire.decode_reply: only an error may lack an id
            try:
                done = self.book.on_end(xfer)
            except ValueError as exc:
                raise ProtocolError(f"{who}: {exc}") from None
            self._idle_relays(done)
            self._cancel(done)
        elif reply.op == wire.OP_ERROR:
            discard_rest(stream.socket)
            if xfer in self.cancelled:
                return
            if stream.token is not None:
                # A relay is a helper: whatever it refuses, the source or another relay serves.
                stopped = reply.code == wire.ERR_NOT_RELAYING  # it stopped relaying: routine
                why = f"error reply [{reply.code}] {reply.text}"
                self._drop(index, stream, why, logging.INFO if stopped else None, believed=stopped)
                return
            if self.check is not None and self.check.asked(xfer):
                assert xfer is not None
                self._no_digests(xfer, f"[{reply.code}] {reply.text}")
                return
            raise refusal(reply, who, self.terms.step)
        elif reply.op == wire.OP_DIGESTS and not reply.more and stream.token is None and self.check is not None:
            self._judge(self.check.answered(reply, who) or [])
        else:
            discard_rest(stream.socket)
            raise ProtocolError(f"unexpected {reply.op!r} message from {who} in a striped receive")

    def _on_data(self, index: int, stream: Connection, reply: wire.Reply, who: str) -> None:
        seq = reply.seq
        if seq >= self.messages:
            discard_rest(stream.socket)
            raise ProtocolError(f"data message number {seq} out of range from {who}")
        assert reply.xfer is not None  # wire.decode_reply: only an error may lack an id
        relayed = self.check is not None and stream.token is not None
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
            self.book.rejected([seq])
            raise
        if not relayed:
            self._count(seq, reply.crc, index)
            return
        assert self.check is not None and digest is not None
        verdict = self.check.arrived(seq, digest, index)
        if verdict is not None:
            self._judge([Verdict(seq, index, verdict)])

    def _judge(self, verdicts: list[Verdict]) -> None:
        """Relayed messages checked against the source's digests: counted, or their relay dropped."""
        for verdict in verdicts:
            stream = self.streams[verdict.stream]
            if verdict.ok:
                self._count(verdict.seq, None, verdict.stream)
                continue
            self.book.rejected([verdict.seq])
            if not stream.gone:
                algorithm = self.terms.algorithm.name if self.terms.algorithm is not None else "digest"
                why = f"data message {verdict.seq} does not match the source's {algorithm} digest"
                self._drop(verdict.stream, stream, why, believed=False)

    def _count(self, seq: int, crc: int | None, index: int) -> None:
        """Message ``seq`` from stream ``index`` has landed (checked where it had to be)."""
        self.book.verified(seq)
        self.inbox.count(seq, crc)
        stream = self.streams[index]
        stream.bytes += self.inbox.offsets[seq + 1] - self.inbox.offsets[seq]
        stream.messages += 1

    def _no_digests(self, xfer: int, why: str) -> None:
        """The source refused a digest request: nothing relays send can be checked; fetch it all from the source."""
        assert self.check is not None
        self.check.withdraw(xfer)
        for index, stream in enumerate(self.streams):
            if stream.token is not None and not stream.gone:
                self._drop(index, stream, f"the source refused the digests to check it against: {why}", believed=False)

    def _cancel(self, spans: list[Span]) -> None:
        """Tell the source to stop sending spans this receive no longer needs (best effort)."""
        for span in spans:
            self.cancelled.add(span.xfer)
            stream = self.streams[span.stream]
            if not stream.gone:
                with contextlib.suppress(zmq.ZMQError):
                    stream.socket.send(wire.cancel_request(span.xfer), zmq.NOBLOCK)
