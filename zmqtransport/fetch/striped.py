"""A striped receive's data phase: the spans of one step over several connections at once.

The header has arrived (over the first connection, from a sender that serves
span fetches: docs/protocol.md, "Spans") and the landing plan is carried out.
Here one thread, the receiving one, owns every DEALER: it asks each connected
stream for spans as :class:`~.spans.SpanBook` hands them out,
lands each data message as it comes (on whichever stream), and notices
streams that are lost (their connection closed) or stalled (silent for the
stall bound while they owe data), whose work goes to the others. It fails only
when no stream is left, at the transfer deadline, or on a protocol or
integrity error.
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
from ..errors import ConnectionLostError, ProtocolError, StalledError
from . import liveness, racing
from .connection import Connection
from .inbox import Inbox
from .replies import discard_rest, next_reply, refusal
from .spans import SPAN_BYTES, Span, SpanBook

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


def span_messages(chunk_bytes: int) -> int:
    """Data messages per span: about :data:`SPAN_BYTES`, within the credit one request may carry."""
    return max(1, min(wire.MAX_CREDIT, math.ceil(SPAN_BYTES / chunk_bytes)))


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
                self._check_bounds(now)
                ready = dict(self.poller.poll(self._wait_ms(now)))
                for index, stream in enumerate(self.streams):
                    if not stream.gone and stream.socket in ready:
                        self._drain(index, stream)
        finally:
            self._cancel(list(self.book.spans.values()))

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

    def _drop(self, index: int, stream: Connection, why: str) -> None:
        logger.info("striped receive of step %d: dropping %s (%s)", self.terms.step, stream.endpoint, why)
        stream.gone = why
        self.book.lost(index)
        with contextlib.suppress(KeyError):
            self.poller.unregister(stream.socket)
            self.poller.unregister(stream.watch.monitor)
        stream.close()

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
                try:
                    stream.socket.send(fetch, zmq.NOBLOCK)
                except zmq.Again:
                    self._drop(index, stream, "its connection takes no requests")
                    break

    def _check_bounds(self, now: float) -> None:
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
            reply = next_reply(stream.socket, who)
            if reply is None:
                return
            self._handle(index, stream, reply, who)
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
                self._cancel(self.book.on_end(xfer))
            except ValueError as exc:
                raise ProtocolError(f"{who}: {exc}") from None
        elif reply.op == wire.OP_ERROR:
            discard_rest(stream.socket)
            if xfer in self.cancelled:
                return
            if reply.code == wire.ERR_NOT_RELAYING and stream.token is not None:
                # A relay that cannot (or no longer) serve: the source or another relay will.
                self._drop(index, stream, f"relay: {reply.text}")
                return
            raise refusal(reply, who, self.terms.step)
        else:
            discard_rest(stream.socket)
            raise ProtocolError(f"unexpected {reply.op!r} message from {who} in a striped receive")

    def _on_data(self, index: int, stream: Connection, reply: wire.Reply, who: str) -> None:
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
        stream.bytes += self.inbox.land(stream.socket, reply, who)
        stream.messages += 1

    def _cancel(self, spans: list[Span]) -> None:
        """Tell the source to stop sending spans this receive no longer needs (best effort)."""
        for span in spans:
            self.cancelled.add(span.xfer)
            stream = self.streams[span.stream]
            if not stream.gone:
                with contextlib.suppress(zmq.ZMQError):
                    stream.socket.send(wire.cancel_request(span.xfer), zmq.NOBLOCK)
