"""Which data messages a striped receive asks of which connection: the receiving side's plan, without sockets.

A striped receive (docs/protocol.md, "Spans") fetches one step over several
connections (*streams*): to the source over one or more paths, and, in a
fan-out, to other receivers of the same step (*peers*, docs/protocol.md,
"Swarm") that serve what they have landed. The data messages of the chunk
plan are asked for in *spans* of consecutive messages; an idle stream asks for
its next span (a span fetch carries its own credit), keeping at most
``depth`` spans outstanding, so a faster stream asks more often and carries
more. Messages of one span arrive in order; spans on one stream interleave.

What a stream may be asked for is what its peer holds: the source holds
everything; another receiver holds what it reported (:meth:`SpanBook.holds`).
Among what it may ask for, a stream prefers what is rare: the source's
uplink goes first to messages no peer holds yet, a peer's to messages no
other peer holds; a receive starts its walk through the plan at its own
``offset``, so receivers that join together ask the source for different
messages and then exchange them.

Two kinds of takeover keep a slow or dead stream from holding the receive
back. When a stream has nothing left to ask for, it takes over the rest of a
span of another stream

* that has gone quiet for longer than its own pace explains
  (:meth:`SpanBook.quiet_after`): a dead or stalled path's work is asked for
  again on a live one;
* or that, at its measured pace, would finish well after this stream could
  (:data:`FASTER_BY`): a slow peer is never the only path for spans a faster
  one could deliver.

Whichever copy of a message lands first counts; the other copy is dropped
(both come from the same staging). A stream declared lost gives its
unfinished spans back.

A message from a stream that is not trusted (a peer) is *held* when it
arrives: asked for by nobody else, but not landed until the receive has
checked it against the source's digest (:mod:`.verify`); then it is
:meth:`SpanBook.verified`, or :meth:`SpanBook.rejected` and asked for again.

:class:`SpanBook` is pure (explicit ``now``, no zmq); the receive's planner
(:mod:`.planner`) consults it, and its outstanding spans live in the
receive's one :class:`~.registry.Registry` of requests. Sets of messages are Python integers used
as bit sets (bit ``seq``): a receive of 4 GiB in 1 MiB messages makes each
set operation a few microseconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..bitsets import lowest, lowest_from, run, run_length
from .claims import CLAIM_FLOOR, Holdings, claim_bound
from .registry import Registry

# Bytes per span: small enough that a lost path's outstanding work is a few
# megabytes and that streams of unequal speed end close together, large
# enough that requests (one round trip each, pipelined) cost nothing.
SPAN_BYTES = 4 << 20
# Spans one stream has outstanding: the next is already asked for while one
# arrives, so a stream never idles for a round trip.
DEPTH = 2
# ... to a peer, one: a peer serves several receivers over its uplink, and spans
# asked of it ahead wait there in line (measured in the two-NIC fan-out: a
# message took 95 ms from the span fetch to its arrival with two, 66 ms with
# one), while its holdings change under them.
PEER_DEPTH = 1
# A stream silent for this many of its usual gaps between messages is quiet:
# its spans may be taken over (within the bounds below).
QUIET_GAPS = 4.0
QUIET_MIN = 0.05  # seconds: never sooner (scheduling noise on a busy host)
# A stream that has delivered nothing yet (or one message: no gap to measure)
# is quiet after QUIET_FIRST seconds, or after QUIET_GAPS times the time a
# message takes from the source here when that is longer (the source's measured
# pace, or before that the wait for its first message). A peer's first message
# comes no sooner than the source's: on slow links shared by many members
# (seven at 100 Mbit/s in the lab), a peer serving six others takes 0.5 s for
# each copy, and a fixed bound dropped every peer in turn and left the source
# to send the state two to four times.
QUIET_FIRST = 0.5
# A peer that has sent nothing yet is judged by the other peers' message time once this many have sent
# some (SpanBook.silent_peer_bound); before that, by the source's.
PEERS_TO_JUDGE = 3
# An idle stream takes over the rest of a busy stream's span when, at the two
# streams' measured paces, it would deliver that rest this many times sooner.
FASTER_BY = 2.0
# Messages per span asked of the source by a swarm member: what it asks the
# source for is what nobody else has yet, and the others wait for it; spans of
# one message keep little outstanding at the source (one span per stream per
# member), so each such message comes soon and the others learn it early.
SOURCE_SPAN = 1
# The peer every book starts with: the source, which holds every message.
SOURCE = 0

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
    peer: int  # whose messages it carries (SOURCE, or another receiver)
    data: bool = True  # False: it carries questions only and is never asked for a span
    up: bool = False  # connected (work is only handed to streams that are)
    interrupted: bool = False  # was connected, connection dropped, may come back
    lost: bool = False
    last_data: float | None = None
    gaps: float = 0.0  # sum of the gaps between its messages, while it owed data
    messages: int = 0
    first_wait: float | None = None  # seconds from the request to its first message
    spans: list[Span] = field(default_factory=list)  # outstanding

    def delivered(self, now: float, span: Span) -> None:
        """A message of ``span`` arrived. The gap is counted from when it was asked for if that is later:
        a stream idle for want of work (a peer holding nothing this receive needs yet) is not slow."""
        if self.last_data is not None:
            self.gaps += now - self.silent_since(span)
            self.messages += 1
        else:
            self.first_wait = now - span.opened
        self.last_data = now

    def pace(self) -> float | None:
        """Seconds per message on average (None: not measured yet)."""
        return self.gaps / self.messages if self.messages else None

    def message_time(self) -> float:
        """Seconds a message takes on it: its pace, or the wait for its first message (0: not known)."""
        return self.pace() or self.first_wait or 0.0

    def quiet_after(self, source_time: float) -> float:
        """Seconds of silence after which its spans may be taken over (``source_time``: see QUIET_FIRST)."""
        if not self.messages:
            return max(QUIET_FIRST, QUIET_GAPS * source_time)
        return max(QUIET_MIN, QUIET_GAPS * self.gaps / self.messages)

    def silent_since(self, span: Span) -> float:
        """Since when it has delivered nothing for ``span`` (counted from when the span was asked for)."""
        return span.opened if self.last_data is None else max(self.last_data, span.opened)

    def owed_since(self) -> float | None:
        """Since when it has delivered nothing of the spans it still owes (None: it owes none)."""
        since = None
        for span in self.spans:
            if not span.finished:
                at = self.silent_since(span)
                since = at if since is None or at < since else since
        return since

    def quiet(self, now: float, source_time: float) -> bool:
        """Whether it owes data and has sent nothing for longer than its pace explains."""
        since = self.owed_since()
        return since is not None and now - since >= self.quiet_after(source_time)



class Reservations:
    """What the source reserved for this receive and it has not asked for yet (docs/protocol.md, "Swarm":
    claims): a swarm member asks the source only for these while :attr:`open`, that is until the source
    has reserved every message once, reserves none, or does not answer in time (:meth:`close`), and
    for these first after that."""

    def __init__(self, everything: int) -> None:
        self.everything = everything
        self.open = False
        self.bits = 0

    def add(self, first: int, stop: int) -> None:
        """The source reserved messages [first, stop) (clipped to the plan)."""
        self.bits |= run(first, stop) & self.everything

    def close(self) -> None:
        self.open = False

    def exhausted(self, free: int) -> bool:
        """Whether more should be claimed: reservations are open and none of ``free`` is reserved."""
        return self.open and not self.bits & free


class _Streams(list[_Stream]):
    """A receive's streams by index, and by peer: a pass of the planner asks about each peer's streams
    (their pace, the source's paths), and with 64 peers a receive has over a hundred streams."""

    def __init__(self) -> None:
        super().__init__()
        self._by_peer: dict[int, list[_Stream]] = {}

    def append(self, state: _Stream) -> None:
        super().append(state)
        self._by_peer.setdefault(state.peer, []).append(state)

    def of(self, peer: int) -> list[_Stream]:
        return self._by_peer.get(peer, [])


def peers_message_time(streams: list[_Stream]) -> float | None:
    """What a message takes from the peers here (the median of :data:`PEERS_TO_JUDGE` or more that have sent
    some; None: fewer have): how a peer that has sent this receive nothing yet is judged for silence.

    Not by the source's time: a member's one-message spans at the source wait their turn among every
    member's, so at 64 members four source messages outlast the stall bound, and a peer that claims what
    it never sends (a liar) held each receive that asked it that long (docs/sim.md, "Serving after the
    receive returns"). The other peers serve as many askers in turn as it does.
    """
    times = sorted(s.message_time() for s in streams if s.peer != SOURCE and s.data and s.first_wait is not None)
    return times[len(times) // 2] if len(times) >= PEERS_TO_JUDGE else None


def _peer_pace(streams: list[_Stream], peer: int, now: float, source_time: float) -> float | None:
    """The best measured pace of ``peer``'s live ``streams`` (None: none measured yet; inf: none serving);
    ``source_time`` as for :meth:`_Stream.quiet_after`.

    A stream whose connection dropped serves nobody while it is down: a
    peer SIGKILLed mid-receive must not keep the source off what only it
    held for the reconnect grace (measured: 3.0 s against 1.6 s).
    """
    mine = [state for state in streams if state.peer == peer and state.data and not state.lost]
    serving = [state for state in mine if state.up and not state.quiet(now, source_time)]
    if not serving:
        return math.inf
    measured = [pace for pace in (state.pace() for state in serving) if pace]
    return min(measured) if measured else None


Paces = dict[int, "float | None"]  # a pass's reckoned paces of the peers, by peer (:attr:`Takeovers.paces`)


class Takeovers:
    """The spans another stream might take over (see the module docstring), gathered once for a pass over
    every stream at one ``now`` (:meth:`SpanBook.takeovers`): with 64 peers a receive has a hundred spans
    out and a hundred streams, and each idle stream looked at every span. Within a pass nothing arrives,
    so what makes a span worth taking over holds; spans opened in the pass join (:meth:`add`), and one
    taken over is skipped from then on."""

    def __init__(
        self,
        streams: list[_Stream],
        landed: bytearray,
        spans: Callable[[], Iterable[Span]],
        now: float,
        source_time: Callable[[], float],
    ) -> None:
        self.streams, self.landed, self.now = streams, landed, now
        self._spans, self._source_time = spans, source_time
        self.source_time = 0.0
        # Each candidate: the span, its first missing message, its silence if it is quiet (else 0), its pace.
        self.entries: list[tuple[Span, int, float, float | None]] = []
        self.quiet = False  # some span is quiet: worth taking over whatever the taker's pace
        self.slowest = 0.0  # the slowest measured pace among the candidates' streams
        # Gathered when a stream first asks (:meth:`victim`): a pass that hands every stream with room a
        # span of its own needs none, and gathering weighs every span out (in the simulator at 11
        # receivers, a tenth of a pass; a third of it skipped this way). The spans gathered are the
        # ones out then, those opened earlier in the pass included.
        self._gathered = False
        # Each other peer's pace (:func:`_peer_pace`), reckoned once for the pass: every stream with room
        # weighs every other peer (SpanBook._others), so a pass reckoned them streams x peers times (at
        # eleven receivers, 9% of a member's receiving thread). Nothing a pass does changes a pace: it only
        # opens spans at ``now``, and a span opened now makes no stream quiet.
        self.paces: Paces = {}

    def _gather(self) -> None:
        self._gathered = True
        self.source_time = self._source_time()
        for span in self._spans():
            self.add(span)

    def add(self, span: Span) -> None:
        if not self._gathered or span.taken_over or span.finished:
            return  # not gathered yet: the span is among those gathered
        first = _first_missing(self.landed, span.next, span.stop)
        if first >= span.stop:
            return
        state = self.streams[span.stream]
        silence = self.now - state.silent_since(span)
        quiet = silence if silence >= state.quiet_after(self.source_time) else 0.0
        pace = state.pace()
        self.entries.append((span, first, quiet, pace))
        self.quiet = self.quiet or quiet > 0
        self.slowest = max(self.slowest, pace or 0.0)

    def victim(self, stream: int, held: int) -> Span | None:
        """The span ``stream`` (whose peer holds ``held``) should take over, if any: the one whose rest is
        worth most, its silence when it is quiet, else the time its rest would still take when its stream
        is :data:`FASTER_BY` slower than this one (a pace of 0, messages drained at once, measures nothing)."""
        if not self._gathered:
            self._gather()
        mine = self.streams[stream].pace()
        if not self.quiet and not (mine and self.slowest > FASTER_BY * mine):
            return None  # no candidate is worth anything to this stream
        best: Span | None = None
        best_score = 0.0
        for span, first, quiet, theirs in self.entries:
            if span.stream == stream or span.taken_at is not None or not held >> first & 1:
                continue
            slower = bool(mine) and theirs is not None and theirs > FASTER_BY * (mine or 0.0)
            score = quiet or ((span.stop - first) * (theirs or 0.0) if slower else 0.0)
            if score > best_score:
                best, best_score = span, score
        return best


def _bit(seq: int) -> int:
    return 1 << seq


def _first_missing(landed: bytearray, first: int, stop: int) -> int:
    """The first message of [first, stop) not arrived (``stop``: none)."""
    while first < stop and landed[first] != MISSING:
        first += 1
    return first


class SpanBook:
    """The spans of one striped receive: who may be asked for what, what is outstanding, what has landed.

    ``streams`` streams to the source to begin with; :meth:`add_stream` adds
    one to a peer. ``offset`` is where this receive starts its walk through
    the plan (spread over receivers that fetch at once). ``span`` and
    ``depth`` are what a stream asks for at once; in a swarm, a stream to the
    source asks for ``source_span`` messages at a time and one to a peer has
    ``peer_depth`` spans outstanding. Its spans are kept in ``registry`` (the
    receive's, shared with its other books; a fresh one by default).
    """

    def __init__(
        self,
        messages: int,
        streams: int,
        span: int,
        depth: int = DEPTH,
        offset: int = 0,
        source_span: int = SOURCE_SPAN,
        peer_depth: int = PEER_DEPTH,
        registry: Registry | None = None,
    ) -> None:
        if messages < 0 or streams < 0 or min(span, depth, source_span, peer_depth) < 1:
            raise ValueError("a span book needs messages >= 0, streams >= 0, and spans and depths >= 1")
        self.messages = messages
        self.span = span
        self.depth = depth
        self.source_span = source_span
        self.peer_depth = peer_depth
        self.offset = offset % messages if messages else 0
        # Per message: MISSING, HELD (arrived, waiting to be checked) or LANDED.
        self.landed = bytearray(messages)
        self.missing = messages  # messages not LANDED
        self.registry = registry if registry is not None else Registry()
        self._streams = _Streams()
        self._all = (1 << messages) - 1
        self._holds = Holdings(self._all, SOURCE)
        self._wanted = self._all  # not landed
        self._free = self._all  # not landed and not asked for on any stream
        self._prefix = 0
        self.reserved = Reservations(self._all)
        for _ in range(streams):
            self.add_stream(SOURCE)

    # ------------------------------------------------------------------ state

    @property
    def spans(self) -> dict[int, Span]:
        """The outstanding spans, by transfer id (a copy)."""
        return {span.xfer: span for span in self.registry.of(Span)}

    @property
    def complete(self) -> bool:
        return self.missing == 0

    def prefix(self) -> int:
        """How many messages from the first on have all landed."""
        while self._prefix < self.messages and self.landed[self._prefix] == LANDED:
            self._prefix += 1
        return self._prefix

    def owed_since(self, stream: int) -> float | None:
        """Since when ``stream`` has delivered nothing of the spans it still owes (None: it owes none)."""
        return self._streams[stream].owed_since()

    def live(self) -> list[int]:
        return [index for index, stream in enumerate(self._streams) if not stream.lost]

    def peer_of(self, stream: int) -> int:
        return self._streams[stream].peer

    # ------------------------------------------------------------------ events

    def add_stream(self, peer: int, data: bool = True) -> int:
        """A new stream to ``peer`` (not yet connected); returns its index. A new peer holds nothing yet.

        ``data``: it may be asked for spans (False: its connection carries questions only)."""
        self._holds.held.setdefault(peer, 0)
        self._streams.append(_Stream(peer, data))
        return len(self._streams) - 1

    def holds(self, peer: int, have: int, coming: int = 0, now: float = 0.0) -> bool:
        """``peer`` reported holding the messages set in ``have`` and fetching those in ``coming``
        (bit sets; out-of-plan bits are ignored), at ``now``; whether that is news (:meth:`.Holdings.report`)."""
        return self._holds.report(peer, have, coming, now)

    def unbacked(self, now: float) -> list[int]:
        """Peers whose claims to be fetching what this receive wants have gone unbacked past their
        :func:`~.claims.claim_bound` (:mod:`.claims`): drop them."""
        source_time, holds = self._source_time(), self._holds
        for state in self._streams:
            if state.last_data is not None:
                holds.delivered(state.peer, state.last_data)
        # A bound is at least CLAIM_FLOOR: a peer backed more recently is not judged (its pace is not needed).
        judged = [p for p in holds.coming if now - holds.backed.get(p, now) >= CLAIM_FLOOR]
        paces = {p: _peer_pace(self._streams.of(p), p, now, source_time) for p in judged}
        return [p for p, pace in paces.items() if holds.unbacked(p, self._wanted, now, claim_bound(source_time, pace))]

    def wants_claim(self) -> bool:
        """Whether this receive should ask the source to reserve it more messages."""
        return self.reserved.exhausted(self._free)

    def has_work_for(self, peer: int) -> bool:
        """Whether ``peer`` holds messages this receive still wants and has asked nobody for."""
        return bool(self._free & self._holds.of(peer))

    def asked(self) -> int:
        """The messages this receive is fetching now: wanted, and asked of some stream or reserved for it
        by the source (it asks the source for them next) (a bit set)."""
        return self._wanted & (~self._free | self.reserved.bits)

    def connected(self, stream: int, up: bool) -> None:
        state = self._streams[stream]
        state.up = up
        if up:
            state.interrupted = False

    def takeovers(self, now: float) -> Takeovers:
        """What :meth:`assign` weighs for a takeover, gathered once for a pass over every stream at ``now``."""
        return Takeovers(self._streams, self.landed, lambda: self.registry.of(Span), now, self._source_time)

    def has_room(self, stream: int) -> bool:
        """Whether ``stream`` may be asked for a span now: it is up, carries data and has room for one."""
        state = self._streams[stream]
        depth = self.depth if state.peer == SOURCE else self.peer_depth
        return not state.lost and state.up and state.data and len(state.spans) < depth

    def assign(self, stream: int, xfer: int, now: float, takeovers: Takeovers | None = None) -> Span | None:
        """The next span for ``stream`` to ask for under ``xfer``, or None (it is full, down, or nothing is due);
        ``takeovers``: :meth:`takeovers` at ``now``, for a pass that asks every stream in turn."""
        if not self.has_room(stream):
            return None
        state = self._streams[stream]
        held = self._holds.of(state.peer)
        choice = self._choose(stream, self._free & held, now, takeovers.paces if takeovers is not None else {})
        if choice is not None:
            first, stop = choice
            return self._open(xfer, stream, first, stop, now, takeovers)
        victim = (takeovers or self.takeovers(now)).victim(stream, held)
        if victim is None:
            return None
        victim.taken_at = now
        first = _first_missing(self.landed, victim.next, victim.stop)
        stop = first + run_length(self._wanted & held, first, victim.stop - first)
        return self._open(xfer, stream, first, stop, now, takeovers)

    def on_data(self, xfer: int, seq: int, now: float, held: bool = False) -> bool | None:
        """A data message arrived. True: land it; False: a duplicate, drop it; None: no such span (cancelled).

        ``held``: it comes from a stream that is not trusted, and counts only
        once :meth:`verified` (nobody else is asked for it meanwhile). Raises
        ``ValueError`` for a message out of its span's order.
        """
        span = self.registry.get(xfer, Span)
        if span is None:
            return None
        if seq != span.next:
            raise ValueError(f"data message {seq} on span {span.first}..{span.stop} where {span.next} was due")
        span.next += 1
        self._streams[span.stream].delivered(now, span)
        if self.landed[seq] != MISSING:
            return False
        self._wanted &= ~_bit(seq)
        self._free &= ~_bit(seq)
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

    def on_end(self, xfer: int) -> list[Span]:
        """A span's ``end`` arrived. Returns the spans now pointless (their messages all landed): cancel them."""
        span = self.registry.get(xfer, Span)
        if span is not None:
            if not span.finished:
                raise ValueError(f"end of span {span.first}..{span.stop} before message {span.next}")
            self._close(span)
        return self.redundant()

    def redundant(self) -> list[Span]:
        """Outstanding spans whose remaining messages all landed by other streams; forgotten here."""
        landed = self.landed
        done = [s for s in self.registry.of(Span) if _first_missing(landed, s.next, s.stop) >= s.stop > s.next]
        for span in done:
            self._close(span)
        return done

    def rejected(self, seqs: list[int]) -> None:
        """Messages not believed (a mismatch with the source's digest, or their stream was dropped while
        they were held, or their bytes failed to land): wanted again, from another stream."""
        for seq in seqs:
            if self.landed[seq] == MISSING:
                continue
            self.missing += self.landed[seq] == LANDED
            self.landed[seq] = MISSING
            self._prefix = min(self._prefix, seq)
            self._wanted |= _bit(seq)
            self._free |= _bit(seq)

    def lost(self, stream: int) -> list[Span]:
        """``stream`` is gone: its unfinished spans are free again. Returns them (forgotten here)."""
        self._streams[stream].lost = True
        return self.interrupted(stream)

    def forget_peer(self, peer: int) -> list[int]:
        """Nothing more is asked of ``peer`` (it lied, failed, or left): its streams are lost. Returns them."""
        streams = [index for index, state in enumerate(self._streams) if state.peer == peer and not state.lost]
        for index in streams:
            self.lost(index)
        self._holds.forget(peer)
        return streams

    def interrupted(self, stream: int) -> list[Span]:
        """``stream``'s connection dropped and may come back: its spans are free again (returned, forgotten).

        Until it is :meth:`connected` again it gets no work.
        """
        state = self._streams[stream]
        state.up = False
        state.interrupted = True
        gone = list(state.spans)
        for span in gone:
            self._close(span)
        return gone

    # ------------------------------------------------------------------ timing

    def quiet_after(self, stream: int) -> float:
        """Seconds of silence after which ``stream``'s spans may be taken over."""
        return self._streams[stream].quiet_after(self._source_time())

    def silent_peer_bound(self, stream: int) -> float:
        """Seconds of silence after which a peer's ``stream`` is dropped (:func:`peers_message_time`)."""
        state = self._streams[stream]
        typical = None if state.first_wait is not None or state.peer == SOURCE else peers_message_time(self._streams)
        return self.quiet_after(stream) if typical is None else max(QUIET_FIRST, QUIET_GAPS * typical)

    def _source_time(self) -> float:
        """Seconds a message takes from the source here: the slowest of its live paths (0: none known)."""
        times = [s.message_time() for s in self._streams.of(SOURCE) if s.data and not s.lost]
        return max(times, default=0.0)

    def pace(self, stream: int) -> float | None:
        """Seconds per message ``stream`` has taken on average (None: not measured yet)."""
        return self._streams[stream].pace()

    def idle_since_taken_over(self, span: Span) -> bool:
        """Whether ``span`` was taken over and its stream has delivered nothing since: it did none of its work."""
        last = self._streams[span.stream].last_data
        return span.taken_at is not None and (last is None or last < span.taken_at)

    def did_nothing(self, span: Span, now: float) -> bool:
        """Whether ``span``'s stream delivered nothing since it was asked for ``span``, for at least its
        quiet bound (and others have since served the span, or took it over)."""
        last = self._streams[span.stream].last_data
        idle = last is None or last < span.opened
        return self.idle_since_taken_over(span) or (idle and now - span.opened >= self.quiet_after(span.stream))

    def silent_since(self, span: Span) -> float:
        """Since when ``span``'s stream has delivered nothing (counted from when the span was asked for)."""
        return self._streams[span.stream].silent_since(span)

    def next_takeover_at(self, now: float) -> float:
        """When, after ``now``, an unfinished span not yet taken over becomes quiet enough to take over
        (inf: none will).

        One already quiet is not counted: it is taken over as soon as a
        stream that can serve it has room, and what gives a stream room (a
        span ended, an answer about holdings, a connection up) arrives on a
        socket and wakes the caller anyway. Counted, it made the receiving
        loop spin without waiting for as long as the quiet span lasted (seen
        in the seven-receiver fan-out: 300 passes of the loop in a row).
        """
        due, source_time = math.inf, self._source_time()
        for span in self.registry.of(Span):
            if not span.taken_over and not span.finished:
                stream = self._streams[span.stream]
                quiet_at = stream.silent_since(span) + stream.quiet_after(source_time)
                if quiet_at > now:
                    due = min(due, quiet_at)
        return due

    # ------------------------------------------------------------------ internals

    def _others(self, stream: int, now: float, paces: Paces) -> tuple[int, int]:
        """What the live peers other than ``stream``'s hold or are fetching: all of them, and those not
        much slower than ``stream`` (bit sets). ``paces``: the peers' paces at ``now`` reckoned so far
        (filled in here)."""
        peer, mine, source_time = self._streams[stream].peer, self.pace(stream), self._source_time()
        everyone = not_slow = 0
        for other, held in self._holds.held.items():
            if other == peer or held is None:
                continue
            if other not in paces:
                paces[other] = _peer_pace(self._streams.of(other), other, now, source_time)
            pace = paces[other]
            if pace is math.inf:
                continue  # no stream left to it, or every one gone quiet: it serves nobody now
            theirs = held | self._holds.coming.get(other, 0)
            everyone |= theirs
            if not (mine and pace is not None and pace > FASTER_BY * mine):
                not_slow |= theirs
        return everyone, not_slow

    def _choose(self, stream: int, candidates: int, now: float, paces: Paces) -> tuple[int, int] | None:
        """The span to ask ``stream`` for among ``candidates``: the rarest first, from this receive's offset on.

        Rarest: what no other peer holds or is fetching; then what only peers
        much slower than this stream hold or fetch. A stream to a peer then
        takes anything its peer holds; one to the source does not: the
        source's uplink is spent on nothing another peer is about to serve
        as fast.
        """
        if not candidates:
            return None
        state = self._streams[stream]
        size = self.source_span if state.peer == SOURCE and len(self._holds.held) > 1 else self.span
        if state.peer == SOURCE and (self.reserved.open or candidates & self.reserved.bits):
            # What the source reserved for this receive comes first, also once it has none left to reserve.
            pool = candidates & self.reserved.bits
            if not pool:
                return None
            start = lowest(pool)
            return start, start + run_length(pool, start, min(size, self.messages - start))
        everyone, not_slow = self._others(stream, now, paces)
        pool = (candidates & ~everyone) or (candidates & ~not_slow)
        if not pool and state.peer != SOURCE:
            pool = candidates
        if not pool:
            return None
        start = lowest_from(pool, self.offset)
        return start, start + run_length(candidates, start, min(size, self.messages - start))

    def _open(self, xfer: int, stream: int, first: int, stop: int, now: float, takeovers: Takeovers | None) -> Span:
        span = Span(xfer, stream, first, stop, first, now)
        self.registry.add(span)
        if takeovers is not None:
            takeovers.add(span)
        self._streams[stream].spans.append(span)
        self._free &= ~run(first, stop)
        return span

    def _close(self, span: Span) -> None:
        """Forget an outstanding span; what it did not deliver is free again unless another span asks for it."""
        self.registry.pop(span.xfer)
        self._streams[span.stream].spans.remove(span)
        if span.finished:
            return
        rest = run(span.next, span.stop) & self._wanted
        for other in self.registry.of(Span):
            if other.next < span.stop and span.next < other.stop:
                rest &= ~run(other.next, other.stop)
        self._free |= rest
