"""A striped receive's data phase: the spans of one step over several connections at once.

The header has arrived (over the first connection, from a sender that serves
span fetches: docs/protocol.md, "Spans") and the landing plan is carried out.
Here one thread, the receiving one, owns every DEALER: it asks each connected
stream for spans as :class:`~zmqtransport.spans.SpanBook` hands them out,
lands each data message as it comes (on whichever stream), and notices
streams that are lost (their connection closed) or stalled (silent for the
stall bound while they owe data), whose work goes to the others. It fails only
when no stream is left, at the transfer deadline, or on a protocol or
integrity error.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from . import liveness, paths, wire
from .errors import ConnectionLostError, ProtocolError, RemoteError, StalledError
from .landed import discard_rest
from .net import Path
from .spans import SPAN_BYTES, Span, SpanBook

logger = logging.getLogger(__name__)

# How long one wait may last before streams are checked again (connections
# coming up, takeovers due), when nothing else wakes the loop sooner.
CHECK_EVERY = 0.1
# Messages taken from one stream before the others get a turn.
DRAIN_BATCH = 32

# Lands data message ``seq`` (its envelope already read) from ``socket``; returns its bytes.
LandFn = Callable[[zmq.Socket[Any], int, dict[str, Any]], memoryview]


@dataclass
class Stream:
    """One connection of a striped receive: a DEALER to one of the source's paths."""

    path: Path
    socket: zmq.Socket[Any]
    watch: liveness.SourceWatch
    token: bytes | None = None  # a relay's: shown in every span fetch (docs/protocol.md, "Relays")
    interrupted: bool = False  # its connection dropped; given RECONNECT_GRACE to come back
    standby: bool = False  # the source while a relay serves: used when the relay cannot be
    bytes: int = 0  # landed from this stream
    messages: int = 0
    gone: str = ""  # why it was dropped ("" while in use)

    def close(self) -> None:
        self.watch.close()
        self.socket.close(linger=0)


@dataclass
class Request:
    """What every span fetch of this receive shares."""

    step: int
    stage: int
    accept_pickle: bool
    deadline: float
    stall_timeout: float | None


def span_messages(chunk_bytes: int) -> int:
    """Data messages per span: about :data:`SPAN_BYTES`, within the credit one request may carry."""
    return max(1, min(wire.MAX_CREDIT, math.ceil(SPAN_BYTES / chunk_bytes)))


class StripedReceive:
    """Receives every data message of a plan over ``streams``; the calling thread owns them all."""

    def __init__(
        self,
        streams: Sequence[Stream],
        plan: list[list[wire.Piece]],
        request: Request,
        land: LandFn,
        span: int,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.streams = list(streams)
        self.plan = plan
        self.request = request
        self.land = land
        self.progress = progress
        self.offsets = list(itertools.accumulate((wire.chunk_length(p) for p in plan), initial=0))
        standby = frozenset(i for i, stream in enumerate(self.streams) if stream.standby)
        self.book = SpanBook(len(plan), len(self.streams), span, standby=standby)
        self.started = time.monotonic()
        self.landed_bytes = 0
        self.duplicates = 0  # messages that landed twice (the second copy dropped)
        self.cancelled: set[int] = set()
        self._on_landed: Callable[[int, int | None], None] | None = None
        self.poller = zmq.Poller()
        for stream in self.streams:
            self.poller.register(stream.socket, zmq.POLLIN)
            self.poller.register(stream.watch.monitor, zmq.POLLIN)

    # ------------------------------------------------------------------ the loop

    def run(self, on_landed: Callable[[int, int | None], None] | None = None) -> None:
        """Until every message has landed; ``on_landed(seq, crc)`` after each message lands."""
        self._on_landed = on_landed
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
            # The callback usually refers to its owner, which refers to this
            # run: dropping it spares a garbage collection of the whole header.
            self._on_landed = None

    def prefix_bytes(self) -> int:
        """Bytes of the plan, from the first, that have all landed."""
        return self.offsets[self.book.prefix()]

    def _wait_ms(self, now: float) -> int:
        wake = min(self.request.deadline, now + CHECK_EVERY, self.book.next_takeover_at())
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
            if not state.established and now - self.started >= paths.CONNECT_BOUND:
                self._drop(index, stream, "did not connect")
                continue
            self.book.connected(index, state.established and state.lost_at is None)
            owed = [span for span in self.book.outstanding(index) if not span.finished]
            stall = self.request.stall_timeout
            if owed and stall is not None and now - min(self.book.silent_since(s) for s in owed) >= stall:
                self._drop(index, stream, f"sent nothing for {stall:.3g} s (stall_timeout)")

    def _drop(self, index: int, stream: Stream, why: str) -> None:
        logger.info("striped receive of step %d: dropping %s (%s)", self.request.step, stream.path.endpoint, why)
        stream.gone = why
        self.book.lost(index)
        with contextlib.suppress(KeyError):
            self.poller.unregister(stream.socket)
            self.poller.unregister(stream.watch.monitor)
        stream.close()

    def _ask(self, now: float) -> None:
        for index, stream in enumerate(self.streams):
            if stream.gone:
                continue
            while (span := self.book.assign(index, random.getrandbits(63), now)) is not None:
                wait_ms = max(0, int((self.request.deadline - now) * 1000))
                fetch = wire.fetch_request(
                    span.xfer,
                    self.request.step,
                    wait_ms,
                    span.stop - span.first,
                    self.request.accept_pickle,
                    span=(span.first, span.stop),
                    stage=self.request.stage,
                    token=stream.token,
                )
                try:
                    stream.socket.send(fetch, zmq.NOBLOCK)
                except zmq.Again:
                    self._drop(index, stream, "its connection takes no requests")
                    break

    def _check_bounds(self, now: float) -> None:
        if all(stream.gone for stream in self.streams):
            tried = ", ".join(f"{s.path.endpoint} ({s.gone})" for s in self.streams)
            stalled = all("stall" in s.gone for s in self.streams)
            message = f"every connection to the source failed mid-transfer: {tried}"
            raise StalledError(message) if stalled else ConnectionLostError(message)
        if now >= self.request.deadline:
            waiting = ", ".join(s.path.endpoint for s in self.streams if not s.gone)
            raise TimeoutError(
                f"recv_checkpoint timed out waiting for {self.book.missing} of {len(self.plan)} data messages "
                f"(step {self.request.step}) over {waiting}"
            )

    # ------------------------------------------------------------------ messages

    def _drain(self, index: int, stream: Stream) -> None:
        for _ in range(DRAIN_BATCH):
            try:
                frame = stream.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(index, stream, frame)
            if self.book.complete or stream.gone:
                return

    def _handle(self, index: int, stream: Stream, frame: bytes) -> None:
        message = wire.unpack(frame, wire.MAX_REQUEST_BYTES)
        wire.check_version(message, f"the sender at {stream.path.endpoint}")
        op, xfer = message.get("op"), message.get("id")
        if type(xfer) is not int:
            discard_rest(stream.socket)
            raise ProtocolError(f"a reply without a transfer id from {stream.path.endpoint}")
        more = bool(stream.socket.getsockopt(zmq.RCVMORE))
        if op == wire.OP_DATA and more:
            self._on_data(index, stream, message, xfer)
        elif op == wire.OP_END and not more:
            if xfer in self.cancelled:
                return
            try:
                self._cancel(self.book.on_end(xfer))
            except ValueError as exc:
                raise ProtocolError(f"{stream.path.endpoint}: {exc}") from None
        elif op == wire.OP_ERROR:
            discard_rest(stream.socket)
            if xfer in self.cancelled:
                return
            code, text = str(message.get("code", "unknown")), str(message.get("msg", ""))
            if code == wire.ERR_NOT_RELAYING and stream.token is not None:
                # A relay that cannot (or no longer) serve: the source or another relay will.
                self._drop(index, stream, f"relay: {text}")
                return
            if code == wire.ERR_NOT_STAGED:
                raise TimeoutError(f"recv_checkpoint timed out: the source at {stream.path.endpoint} staged nothing")
            raise RemoteError(code, f"the peer at {stream.path.endpoint}: {text}")
        else:
            discard_rest(stream.socket)
            raise ProtocolError(f"unexpected {op!r} message from {stream.path.endpoint} in a striped receive")

    def _on_data(self, index: int, stream: Stream, message: dict[str, Any], xfer: int) -> None:
        seq = message.get("seq")
        if type(seq) is not int or not 0 <= seq < len(self.plan):
            discard_rest(stream.socket)
            raise ProtocolError(f"data message number {seq!r} out of range from {stream.path.endpoint}")
        try:
            fresh = self.book.on_data(xfer, seq, time.monotonic())
        except ValueError as exc:
            discard_rest(stream.socket)
            raise ProtocolError(f"{stream.path.endpoint}: {exc}") from None
        if not fresh:
            # A duplicate (the rest of a span taken over) or a cancelled span's: dropped.
            discard_rest(stream.socket)
            self.duplicates += fresh is False
            return
        payload = self.land(stream.socket, seq, message)
        stream.bytes += len(payload)
        stream.messages += 1
        self.landed_bytes += len(payload)
        if self._on_landed is not None:
            self._on_landed(seq, wire.data_crc(message))
        if self.progress is not None:
            self.progress(self.landed_bytes, self.offsets[-1])

    def _cancel(self, spans: list[Span]) -> None:
        """Tell the source to stop sending spans this receive no longer needs (best effort)."""
        for span in spans:
            self.cancelled.add(span.xfer)
            stream = self.streams[span.stream]
            if not stream.gone:
                with contextlib.suppress(zmq.ZMQError):
                    stream.socket.send(wire.cancel_request(span.xfer), zmq.NOBLOCK)
