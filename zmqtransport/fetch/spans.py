"""Which data messages a striped receive asks for on which connection: the receiving side's plan, without sockets.

A striped receive (docs/protocol.md, "Spans") fetches one step over several
connections (*streams*), possibly over several paths. The data messages of the
chunk plan are cut into *spans* of consecutive messages; an idle stream asks
for the next span (a span fetch carries its own credit), keeping at most
``depth`` spans outstanding, so a faster stream asks more often and carries
more. Messages of one span arrive in order; spans on one stream interleave.

When no span is left to hand out, a stream with room takes over the rest of a
span whose stream has gone quiet for longer than its own pace explains
(:meth:`SpanBook.quiet_after`): a dead or stalled path's work is asked for
again on a live one, and whichever copy of a message lands first counts
(duplicates are dropped, so nothing lands twice with different bytes:
both copies come from the same staging). A stream declared lost gives its
unfinished spans back to the queue.

A message from a stream that is not trusted (a relay) is *held* when it
arrives: asked for by nobody else, but not landed until the receive has
checked it against the source's digest (:mod:`.verify`); then it is
:meth:`SpanBook.verified`, or :meth:`SpanBook.rejected` and asked for again.

:class:`SpanBook` is pure (explicit ``now``, no zmq); :mod:`.striped`
carries its decisions out on the sockets.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# Bytes per span: small enough that a lost path's outstanding work is a few
# megabytes and that streams of unequal speed end close together, large
# enough that requests (one round trip each, pipelined) cost nothing.
SPAN_BYTES = 4 << 20
# Spans one stream has outstanding: the next is already asked for while one
# arrives, so a stream never idles for a round trip.
DEPTH = 2
# A stream silent for this many of its usual gaps between messages is quiet:
# its spans may be taken over (within the bounds below).
QUIET_GAPS = 4.0
QUIET_MIN = 0.05  # seconds: never sooner (scheduling noise on a busy host)
QUIET_FIRST = 0.5  # seconds: a stream that has delivered nothing yet
# A standby stream (the source, while relays serve this receive) takes over a
# primary's span only after this much silence: a relay waits for its own
# upstream at times, and every takeover is an upload the source was spared.
# A relay that has delivered nothing yet is waited for QUIET_FIRST only: its
# upstream's first message takes one message time on its link (21 ms for
# 1 MiB at 400 Mbit/s), and a relay that never sends costs its downstream
# this wait before the source steps in (docs/protocol.md, "Relays").
STANDBY_QUIET = 1.0

# A message's state in SpanBook.landed.
MISSING = 0
LANDED = 1
HELD = 2  # arrived from a stream that is not trusted; waits to be checked


@dataclass
class Span:
    """One span fetch: messages [first, stop) asked of ``stream`` under transfer id ``xfer``."""

    xfer: int
    stream: int
    first: int
    stop: int
    next: int  # the next message this span's stream will deliver
    opened: float  # when it was asked for
    taken_at: float | None = None  # when another stream was asked for its rest (None: never)

    @property
    def taken_over(self) -> bool:
        return self.taken_at is not None

    @property
    def finished(self) -> bool:
        return self.next >= self.stop


@dataclass
class _Stream:
    standby: bool = False  # only takes over, or works when no primary stream is left
    up: bool = False  # connected (work is only handed to streams that are)
    interrupted: bool = False  # was connected, connection dropped, may come back
    lost: bool = False
    last_data: float | None = None
    gaps: float = 0.0  # sum of the gaps between its messages
    messages: int = 0


class SpanBook:
    """The spans of one striped receive: queued, outstanding per stream, and which messages landed."""

    def __init__(
        self,
        messages: int,
        streams: int,
        span: int,
        depth: int = DEPTH,
        standby: frozenset[int] = frozenset(),
    ) -> None:
        if messages < 0 or streams < 1 or span < 1 or depth < 1:
            raise ValueError("a span book needs messages >= 0, streams >= 1, span >= 1, depth >= 1")
        self.depth = depth
        self.queue: deque[tuple[int, int]] = deque((at, min(at + span, messages)) for at in range(0, messages, span))
        # Per message: MISSING, HELD (arrived, waiting to be checked) or LANDED.
        self.landed = bytearray(messages)
        self.missing = messages  # messages not LANDED
        self.spans: dict[int, Span] = {}  # outstanding, by transfer id
        self._streams = [_Stream(standby=index in standby) for index in range(streams)]
        self._prefix = 0

    # ------------------------------------------------------------------ state

    @property
    def complete(self) -> bool:
        return self.missing == 0

    def prefix(self) -> int:
        """How many messages from the first on have all landed."""
        while self._prefix < len(self.landed) and self.landed[self._prefix] == LANDED:
            self._prefix += 1
        return self._prefix

    def outstanding(self, stream: int) -> list[Span]:
        return [span for span in self.spans.values() if span.stream == stream]

    def live(self) -> list[int]:
        return [index for index, stream in enumerate(self._streams) if not stream.lost]

    # ------------------------------------------------------------------ events

    def connected(self, stream: int, up: bool) -> None:
        state = self._streams[stream]
        state.up = up
        if up:
            state.interrupted = False

    def assign(self, stream: int, xfer: int, now: float) -> Span | None:
        """The next span for ``stream`` to ask for under ``xfer``, or None (it is full, down, or nothing is due)."""
        state = self._streams[stream]
        if state.lost or not state.up or len(self.outstanding(stream)) >= self.depth:
            return None
        standing_by = state.standby and any(
            not s.lost and not s.interrupted and not s.standby for s in self._streams
        )
        while self.queue and not standing_by:
            first, stop = self.queue.popleft()
            first = self._first_missing(first, stop)
            if first < stop:
                return self._open(xfer, stream, first, stop, now)
        victim = self._quiet_span(stream, now, STANDBY_QUIET if standing_by else 0.0)
        if victim is None:
            return None
        victim.taken_at = now
        return self._open(xfer, stream, self._first_missing(victim.next, victim.stop), victim.stop, now)

    def on_data(self, xfer: int, seq: int, now: float, held: bool = False) -> bool | None:
        """A data message arrived. True: land it; False: a duplicate, drop it; None: no such span (cancelled).

        ``held``: it comes from a stream that is not trusted, and counts only
        once :meth:`verified`. Raises ``ValueError`` for a message out of its span's order.
        """
        span = self.spans.get(xfer)
        if span is None:
            return None
        if seq != span.next:
            raise ValueError(f"data message {seq} on span {span.first}..{span.stop} where {span.next} was due")
        span.next += 1
        state = self._streams[span.stream]
        if state.last_data is not None:
            state.gaps += now - state.last_data
            state.messages += 1
        state.last_data = now
        if self.landed[seq] != MISSING:
            return False
        if held:
            self.landed[seq] = HELD
        else:
            self.landed[seq] = LANDED
            self.missing -= 1
        return True

    def verified(self, seq: int) -> None:
        """Held message ``seq`` matched the source's digest: it has landed."""
        if self.landed[seq] == HELD:
            self.landed[seq] = LANDED
            self.missing -= 1

    def rejected(self, seqs: list[int]) -> None:
        """Held messages not believed (a mismatch, or their stream was dropped): asked for again, first."""
        runs: list[tuple[int, int]] = []
        for seq in sorted(seqs):
            if self.landed[seq] != HELD:
                continue
            self.landed[seq] = MISSING
            if runs and runs[-1][1] == seq:
                runs[-1] = (runs[-1][0], seq + 1)
            else:
                runs.append((seq, seq + 1))
        self.queue.extendleft(reversed(runs))

    def on_end(self, xfer: int) -> list[Span]:
        """A span's ``end`` arrived. Returns the spans now pointless (their messages all landed): cancel them."""
        span = self.spans.pop(xfer, None)
        if span is not None and not span.finished:
            raise ValueError(f"end of span {span.first}..{span.stop} before message {span.next}")
        return self.redundant()

    def redundant(self) -> list[Span]:
        """Outstanding spans whose remaining messages all landed by other streams; forgotten here."""
        done = [s for s in self.spans.values() if not s.finished and self._first_missing(s.next, s.stop) >= s.stop]
        for span in done:
            del self.spans[span.xfer]
        return done

    def lost(self, stream: int) -> list[Span]:
        """``stream`` is gone: its unfinished spans go back to the queue. Returns them (forgotten here)."""
        self._streams[stream].lost = True
        return self.interrupted(stream)

    def interrupted(self, stream: int) -> list[Span]:
        """``stream``'s connection dropped and may come back: its spans go back to the queue (returned, forgotten).

        Until it is :meth:`connected` again it gets no work, and a standby
        stream no longer waits for it.
        """
        state = self._streams[stream]
        state.up = False
        state.interrupted = True
        gone = self.outstanding(stream)
        for span in gone:
            del self.spans[span.xfer]
            if not span.finished and not span.taken_over:  # a taken-over span's rest is asked elsewhere
                self.queue.appendleft((span.next, span.stop))
        return gone

    # ------------------------------------------------------------------ timing

    def quiet_after(self, stream: int) -> float:
        """Seconds of silence after which ``stream``'s spans may be taken over."""
        state = self._streams[stream]
        if state.messages == 0:
            return QUIET_FIRST
        return max(QUIET_MIN, QUIET_GAPS * state.gaps / state.messages)

    def idle_since_taken_over(self, span: Span) -> bool:
        """Whether ``span`` was taken over and its stream has delivered nothing since: it did none of its work."""
        last = self._streams[span.stream].last_data
        return span.taken_at is not None and (last is None or last < span.taken_at)

    def silent_since(self, span: Span) -> float:
        """Since when ``span``'s stream has delivered nothing (counted from when the span was asked for)."""
        last = self._streams[span.stream].last_data
        return span.opened if last is None else max(last, span.opened)

    def next_takeover_at(self) -> float:
        """When an unfinished span not yet taken over becomes quiet enough to take over (inf: none)."""
        due = math.inf
        for span in self.spans.values():
            if not span.taken_over and not span.finished:
                due = min(due, self.silent_since(span) + self.quiet_after(span.stream))
        return due

    # ------------------------------------------------------------------ internals

    def _open(self, xfer: int, stream: int, first: int, stop: int, now: float) -> Span:
        span = Span(xfer, stream, first, stop, first, now)
        self.spans[xfer] = span
        return span

    def _first_missing(self, first: int, stop: int) -> int:
        while first < stop and self.landed[first] != MISSING:
            first += 1
        return first

    def _takeover_bound(self, stream: int, at_least: float) -> float:
        """The silence after which ``stream``'s spans are taken over (``at_least``: a standby's bound)."""
        if self._streams[stream].last_data is None:
            at_least = min(at_least, QUIET_FIRST)
        return max(at_least, self.quiet_after(stream))

    def _quiet_span(self, stream: int, now: float, at_least: float) -> Span | None:
        """The unfinished span of another stream that has been quiet longest, if any is quiet enough."""
        best: Span | None = None
        best_silence = 0.0
        for span in self.spans.values():
            if span.stream == stream or span.taken_over or span.finished:
                continue
            if self._first_missing(span.next, span.stop) >= span.stop:
                continue
            silence = now - self.silent_since(span)
            if silence >= self._takeover_bound(span.stream, at_least) and silence > best_silence:
                best, best_silence = span, silence
        return best
