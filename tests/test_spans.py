"""The striped receive's plan (zmqtransport/fetch/spans.py), driven directly: fake streams, explicit time."""

from __future__ import annotations

import math
import random

import pytest

from zmqtransport.fetch.spans import FASTER_BY, QUIET_FIRST, QUIET_MIN, SOURCE, SpanBook


def book(messages: int = 20, streams: int = 2, span: int = 4, depth: int = 2) -> SpanBook:
    b = SpanBook(messages, streams, span, depth)
    for stream in range(streams):
        b.connected(stream, True)
    return b


def deliver(b: SpanBook, xfer: int, now: float, count: int | None = None) -> list[bool | None]:
    span = b.spans[xfer]
    stop = span.stop if count is None else min(span.stop, span.next + count)
    return [b.on_data(xfer, seq, now) for seq in range(span.next, stop)]


def test_spans_cover_every_message_once_and_streams_take_turns() -> None:
    b = book(messages=10, streams=2, span=4, depth=1)
    first = b.assign(0, 1, 0.0)
    second = b.assign(1, 2, 0.0)
    assert first is not None and second is not None
    assert (first.first, first.stop, second.first, second.stop) == (0, 4, 4, 8)
    assert b.assign(0, 3, 0.0) is None  # depth 1: stream 0 is full
    assert deliver(b, 1, 0.1) == [True] * 4
    assert b.on_end(1) == []
    third = b.assign(0, 3, 0.1)
    assert third is not None and (third.first, third.stop) == (8, 10)  # the last span is short
    deliver(b, 2, 0.2)
    deliver(b, 3, 0.2)
    b.on_end(2)
    b.on_end(3)
    assert b.complete and b.prefix() == 10 and b.spans == {}


def test_a_faster_stream_carries_more() -> None:
    b = book(messages=40, streams=2, span=2, depth=1)
    carried = [0, 0]
    xfer = 0
    for tick in range(100):
        for stream in (0, 1):
            xfer += 1
            b.assign(stream, xfer, tick)
        for span in list(b.spans.values()):
            # stream 0 delivers a whole span per tick, stream 1 one message every other tick
            if span.stream == 0 or tick % 2 == 0:
                count = 2 if span.stream == 0 else 1
                carried[span.stream] += sum(1 for new in deliver(b, span.xfer, tick, count) if new)
            if span.finished:
                b.on_end(span.xfer)
        if b.complete:
            break
    assert b.complete
    assert carried[0] > 2 * carried[1]


def test_nothing_is_handed_to_a_stream_that_is_not_connected() -> None:
    b = SpanBook(8, 2, 4)
    b.connected(0, True)
    assert b.assign(1, 1, 0.0) is None
    assert b.assign(0, 2, 0.0) is not None
    b.connected(1, True)
    assert b.assign(1, 3, 0.0) is not None


def test_lost_stream_gives_back_its_unfinished_spans_in_front() -> None:
    b = book(messages=16, streams=2, span=4, depth=2)
    a1, a2 = b.assign(0, 1, 0.0), b.assign(0, 2, 0.0)
    assert a1 is not None and a2 is not None
    deliver(b, 1, 0.1, count=3)  # 0, 1, 2 landed; 3 missing
    gone = b.lost(0)
    assert {s.xfer for s in gone} == {1, 2}
    assert b.assign(0, 9, 0.2) is None  # a lost stream gets nothing
    taken = [b.assign(1, 10, 0.2), b.assign(1, 11, 0.2)]
    # Its unfinished messages come first again: the lowest free messages are asked for first.
    assert [(s.first, s.stop) for s in taken if s] == [(3, 7), (7, 11)]
    assert b.on_data(1, 3, 0.3) is None  # the lost stream's late message: no such span


def test_quiet_stream_is_taken_over_only_when_nothing_is_queued_and_after_its_pace() -> None:
    b = book(messages=8, streams=2, span=4, depth=1)
    slow, fast = b.assign(0, 1, 0.0), b.assign(1, 2, 0.0)
    assert slow is not None and fast is not None
    for i in range(2):  # stream 0 delivers two messages 10 ms apart, then goes silent
        assert b.on_data(1, i, 0.01 * (i + 1)) is True
    deliver(b, 2, 0.02)
    b.on_end(2)
    quiet = b.quiet_after(0)
    assert quiet == pytest.approx(max(QUIET_MIN, 4 * 0.01))
    assert b.assign(1, 3, 0.02 + quiet / 2) is None  # not quiet long enough
    assert b.next_takeover_at(0.02 + quiet / 2) == pytest.approx(0.02 + quiet)
    rest = b.assign(1, 3, 0.02 + quiet + 0.001)
    assert rest is not None and (rest.first, rest.stop) == (2, 4)
    assert b.assign(1, 4, 10.0) is None  # taken over once only (and depth 1)
    # The quiet stream wakes up: its copies are duplicates once the takeover landed them.
    deliver(b, 3, 0.1)
    assert b.on_end(3) == [b_span for b_span in [slow]]  # the original is pointless now: cancel it
    assert b.complete and 1 not in b.spans


def test_a_quiet_span_nobody_can_take_over_is_not_due_again_and_again() -> None:
    # The receiving loop waits until next_takeover_at: a span already quiet that no stream can take
    # over yet (every other stream busy) must not count, or the loop passes again without waiting.
    b = book(messages=16, streams=2, span=4, depth=1)
    quiet_one, busy = b.assign(0, 1, 0.0), b.assign(1, 2, 0.0)
    assert quiet_one is not None and busy is not None
    assert b.next_takeover_at(0.0) == pytest.approx(QUIET_FIRST)  # neither has delivered yet
    assert b.on_data(2, busy.first, 0.1) is True  # stream 1 delivers, stream 0 stays silent
    later = QUIET_FIRST + 0.05
    assert b.assign(1, 3, later) is None  # stream 1 has no room (depth 1): nothing is taken over
    assert b.next_takeover_at(later) > later  # stream 1's own span: quiet only later; stream 0's: not counted
    assert b.next_takeover_at(later) == pytest.approx(0.1 + QUIET_FIRST)
    b.lost(1)
    assert b.next_takeover_at(later) == math.inf


def test_duplicates_are_dropped_and_a_taken_over_span_that_finishes_first_cancels_the_copy() -> None:
    b = book(messages=4, streams=2, span=4, depth=1)
    original = b.assign(0, 1, 0.0)
    assert original is not None
    copy = b.assign(1, 2, QUIET_FIRST + 0.01)  # stream 0 never delivered: quiet after QUIET_FIRST
    assert copy is not None and (copy.first, copy.stop) == (0, 4)
    assert deliver(b, 2, 0.6, count=2) == [True, True]
    assert deliver(b, 1, 0.6) == [False, False, True, True]  # the original overtakes
    assert b.on_end(1) == [copy]  # the copy's remaining messages all landed: cancel it
    assert b.complete


def test_out_of_order_message_or_early_end_is_a_protocol_error() -> None:
    b = book(messages=8, streams=1, span=4)
    assert b.assign(0, 1, 0.0) is not None
    with pytest.raises(ValueError, match="where 0 was due"):
        b.on_data(1, 2, 0.1)
    with pytest.raises(ValueError, match="before message 0"):
        b.on_end(1)


@pytest.mark.parametrize("seed", range(20))
def test_random_schedules_land_every_message_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    streams = rng.randint(1, 4)
    b = book(messages=rng.randint(0, 60), streams=streams, span=rng.randint(1, 7), depth=rng.randint(1, 3))
    landed: list[int] = []
    dead = {s for s in range(1, streams) if rng.random() < 0.3}  # never stream 0: someone must live
    now, xfer = 0.0, 0
    for _ in range(10_000):
        if b.complete:
            break
        now += 0.01
        for stream in b.live():
            xfer += 1
            b.assign(stream, xfer, now)
        for span in list(b.spans.values()):
            if span.xfer not in b.spans or span.stream in dead:
                continue
            for seq in range(span.next, min(span.stop, span.next + rng.randint(0, 3))):
                if b.on_data(span.xfer, seq, now):
                    landed.append(seq)
            if span.finished and span.xfer in b.spans:
                b.on_end(span.xfer)
        if dead and rng.random() < 0.05:
            b.lost(dead.pop())
    assert b.complete
    assert sorted(landed) == list(range(len(b.landed)))


def test_interrupted_stream_hands_its_spans_on_and_works_again_once_back() -> None:
    b = book(messages=12, streams=2, span=4, depth=1)
    first = b.assign(0, 1, 0.0)
    assert first is not None
    b.on_data(1, 0, 0.1)
    assert [s.xfer for s in b.interrupted(0)] == [1]
    assert b.assign(0, 3, 0.2) is None  # not connected now
    taken = b.assign(1, 4, 0.2)
    assert taken is not None and (taken.first, taken.stop) == (1, 5)
    b.connected(0, True)  # back
    again = b.assign(0, 5, 0.3)
    assert again is not None and (again.first, again.stop) == (5, 9)
    assert b.live() == [0, 1]


def swarm(messages: int, span: int = 4, depth: int = 2, offset: int = 0) -> tuple[SpanBook, int, int]:
    """A book with one stream to the source (0) and one to a peer (1), both connected; every stream asks
    for ``span`` messages at a time with ``depth`` spans outstanding (the defaults differ: see below)."""
    b = SpanBook(messages, 1, span, depth, offset=offset, source_span=span, peer_depth=depth)
    peer_stream = b.add_stream(7)
    b.connected(0, True)
    b.connected(peer_stream, True)
    return b, 0, peer_stream


def bits(*seqs: int) -> int:
    return sum(1 << seq for seq in set(seqs))


def test_a_peer_is_asked_only_for_what_it_holds() -> None:
    b, _, peer = swarm(12)
    assert b.assign(peer, 1, 0.0) is None  # a new peer holds nothing
    b.holds(7, bits(4, 5, 6, 9))
    span = b.assign(peer, 2, 0.0)
    assert span is not None and (span.first, span.stop) == (4, 7)  # a run of held messages
    span = b.assign(peer, 3, 0.0)
    assert span is not None and (span.first, span.stop) == (9, 10)
    assert b.assign(peer, 4, 0.0) is None  # depth 2


def test_the_source_goes_first_to_what_no_peer_holds() -> None:
    b, source, peer = swarm(12, span=2, depth=3)
    b.holds(7, bits(0, 1, 2, 3))
    asked = [b.assign(source, xfer, 0.0) for xfer in (1, 2, 3)]
    assert [(s.first, s.stop) for s in asked if s] == [(4, 6), (6, 8), (8, 10)]
    span = b.assign(peer, 4, 0.0)
    assert span is not None and (span.first, span.stop) == (0, 2)


def test_receivers_with_other_offsets_start_at_other_messages() -> None:
    first, *_ = swarm(16, offset=0)
    second, *_ = swarm(16, offset=8)
    a, b = first.assign(0, 1, 0.0), second.assign(0, 1, 0.0)
    assert a is not None and b is not None and (a.first, b.first) == (0, 8)
    # Past the end of the plan the walk wraps around to what is still free.
    for xfer in range(2, 6):
        span = second.assign(0, xfer, 0.0)
        if span is not None:
            for seq in range(span.first, span.stop):
                second.on_data(xfer, seq, 0.1)
            second.on_end(xfer)
    assert second.prefix() >= 4


def test_a_slow_stream_is_overtaken_by_a_faster_one_with_nothing_to_do() -> None:
    b, source, peer = swarm(8, span=4, depth=1)
    b.holds(7, bits(*range(4)))
    slow = b.assign(peer, 1, 0.0)
    fast = b.assign(source, 2, 0.0)
    assert slow is not None and fast is not None and (slow.first, fast.first) == (0, 4)
    # The peer delivers a message every 0.4 s, the source one every 0.02 s.
    b.on_data(1, 0, 0.4)
    b.on_data(1, 1, 0.8)
    for seq, now in zip(range(4, 8), (0.02, 0.04, 0.06, 0.08), strict=True):
        b.on_data(2, seq, now)
    b.on_end(2)
    # Not quiet (it delivered 0.0 s ago), but FASTER_BY times slower: the source takes the rest.
    assert b.quiet_after(peer) > 0.0
    rest = b.assign(source, 3, 0.8)
    assert rest is not None and (rest.first, rest.stop) == (2, 4) and slow.taken_over
    assert FASTER_BY > 1


def test_a_pass_weighs_for_a_takeover_a_span_opened_earlier_in_it() -> None:
    # A pass gathers what might be taken over only once a stream in it asks (most passes hand every stream
    # a span of its own, or none has room): the spans opened before that in the pass are weighed as well.
    b, source, peer = swarm(8, span=2, depth=1)
    b.holds(7, bits(0, 1))
    first_pass = b.takeovers(0.0)
    slow, fast = b.assign(peer, 1, 0.0, first_pass), b.assign(source, 2, 0.0, first_pass)
    assert slow is not None and fast is not None and (slow.first, fast.first) == (0, 2)
    # The source delivers a message every 0.02 s, the peer one every 0.4 s.
    for xfer, seq, now in ((2, 2, 0.02), (2, 3, 0.04)):
        b.on_data(xfer, seq, now)
    b.on_end(2)
    assert b.assign(source, 3, 0.04) is not None
    for xfer, seq, now in ((3, 4, 0.06), (3, 5, 0.08), (1, 0, 0.4), (1, 1, 0.8)):
        b.on_data(xfer, seq, now)
    b.on_end(3)
    b.on_end(1)
    b.holds(7, bits(0, 1, 6, 7))  # the peer now holds the last two
    in_pass = b.takeovers(0.8)
    opened = b.assign(peer, 4, 0.8, in_pass)
    assert opened is not None and (opened.first, opened.stop) == (6, 8)
    # The source, FASTER_BY faster, has nothing free: it takes over the span just opened.
    taken = b.assign(source, 5, 0.8, in_pass)
    assert taken is not None and (taken.first, taken.stop) == (6, 8) and opened.taken_over


def test_a_stream_of_equal_pace_is_not_overtaken() -> None:
    b, source, peer = swarm(8, span=4, depth=1)
    b.holds(7, bits(*range(4)))
    one, two = b.assign(peer, 1, 0.0), b.assign(source, 2, 0.0)
    assert one is not None and two is not None
    for seq, now in zip(range(0, 2), (0.01, 0.02), strict=True):
        b.on_data(1, seq, now)
    for seq, now in zip(range(4, 8), (0.01, 0.02, 0.03, 0.04), strict=True):
        b.on_data(2, seq, now)
    b.on_end(2)
    assert b.assign(source, 3, 0.03) is None


def test_a_rejected_message_is_asked_for_again_and_a_forgotten_peer_gets_nothing() -> None:
    b, source, peer = swarm(4, span=4, depth=1)
    b.holds(7, bits(0, 1, 2, 3))
    from_peer = b.assign(peer, 1, 0.0)
    assert from_peer is not None
    for seq in range(4):
        assert b.on_data(1, seq, 0.1) is True
    b.on_end(1)
    assert b.complete
    # Message 2's bytes did not match the source's digest: the peer is dropped, 2 is fetched again.
    b.rejected([2])
    assert not b.complete and b.prefix() == 2
    assert b.forget_peer(7) == [peer]
    assert b.assign(peer, 2, 0.2) is None
    again = b.assign(source, 3, 0.2)
    assert again is not None and (again.first, again.stop) == (2, 3)
    assert b.on_data(3, 2, 0.3) is True and b.complete


@pytest.mark.parametrize("seed", range(20))
def test_random_swarm_schedules_land_every_message_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    messages = rng.randint(0, 60)
    b = SpanBook(messages, 1, rng.randint(1, 5), rng.randint(1, 3), offset=rng.randint(0, 60))
    b.connected(0, True)
    peers = {b.add_stream(peer): peer for peer in (1, 2, 3)}
    for stream in peers:
        b.connected(stream, True)
    held = {peer: 0 for peer in peers.values()}
    dead = {stream for stream in peers if rng.random() < 0.3}
    landed: list[int] = []
    now, xfer = 0.0, 0
    for _ in range(10_000):
        if b.complete:
            break
        now += 0.01
        for peer, have in held.items():  # peers land messages on their own and report them
            held[peer] = have | 1 << rng.randrange(max(messages, 1))
            b.holds(peer, held[peer])
        for stream in b.live():
            xfer += 1
            b.assign(stream, xfer, now)
        for span in list(b.spans.values()):
            if span.xfer not in b.spans or span.stream in dead:
                continue
            for seq in range(span.next, min(span.stop, span.next + rng.randint(0, 3))):
                assert span.stream == SOURCE or held[b.peer_of(span.stream)] >> seq & 1
                if b.on_data(span.xfer, seq, now):
                    landed.append(seq)
            if span.finished and span.xfer in b.spans:
                b.on_end(span.xfer)
        if dead and rng.random() < 0.05:
            b.lost(dead.pop())
    assert b.complete
    assert sorted(landed) == list(range(messages))


def test_the_source_is_not_asked_for_what_a_peer_as_fast_holds_or_is_fetching() -> None:
    b, source, peer = swarm(8, span=2, depth=4)
    b.holds(7, bits(0, 1, 2, 3), coming=bits(4, 5))
    asked = [b.assign(source, xfer, 0.0) for xfer in (1, 2, 3)]
    assert [(s.first, s.stop) for s in asked if s] == [(6, 8)]  # only what nobody has or fetches
    assert [(s.first, s.stop) for s in [b.assign(peer, 4, 0.0), b.assign(peer, 5, 0.0)] if s] == [(0, 2), (2, 4)]


def test_a_peer_whose_connection_dropped_does_not_hold_the_source_off_what_it_holds() -> None:
    b, source, peer = swarm(8, span=2, depth=4)
    b.holds(7, bits(0, 1, 2, 3))
    assert [(s.first, s.stop) for s in [b.assign(source, x, 0.0) for x in (1, 2, 3)] if s] == [(4, 6), (6, 8)]
    b.interrupted(peer)  # killed: its connection is down, and may come back only after a grace
    asked = [b.assign(source, xfer, 0.01) for xfer in (4, 5)]
    assert [(s.first, s.stop) for s in asked if s] == [(0, 2), (2, 4)]


def test_the_source_is_asked_for_what_only_a_much_slower_peer_holds() -> None:
    b, source, peer = swarm(12, span=1, depth=1)
    b.holds(7, bits(*range(6)))

    def fetch(stream: int, xfer: int, asked: float, arrived: float) -> int:
        span = b.assign(stream, xfer, asked)
        assert span is not None
        b.on_data(xfer, span.first, arrived)
        b.on_end(xfer)
        return span.first

    # The peer delivers a message 100 ms after it is asked, the source 10 ms (what no peer holds).
    assert [fetch(peer, 1, 0.0, 0.1), fetch(peer, 2, 0.1, 0.2)] == [0, 1]
    assert [fetch(source, 10 + n, 0.01 * n, 0.01 * (n + 1)) for n in range(6)] == [6, 7, 8, 9, 10, 11]
    # Measured 10x slower than the source: what only it holds is fair game for the source now.
    assert fetch(source, 20, 0.25, 0.26) == 2


def test_a_held_message_is_asked_of_nobody_else_and_counts_once_verified() -> None:
    b, source, peer = swarm(4, span=4, depth=1)
    b.holds(7, bits(0, 1, 2, 3))
    span = b.assign(peer, 1, 0.0)
    assert span is not None
    for seq in range(4):
        assert b.on_data(1, seq, 0.1, held=True) is True
    b.on_end(1)
    assert not b.complete and b.prefix() == 0
    assert b.assign(source, 2, 0.1) is None  # held: asked of nobody else while it is checked
    b.verified(0)
    b.verified(1)
    b.rejected([2, 3])  # did not match: wanted again
    assert b.prefix() == 2 and b.missing == 2
    b.forget_peer(7)
    again = b.assign(source, 3, 0.2)
    assert again is not None and (again.first, again.stop) == (2, 4)


def test_a_member_asks_the_source_only_for_what_it_reserved_until_none_are_left() -> None:
    b = SpanBook(12, 2, span=4)  # two connections to the source, the defaults of a swarm
    for stream in (0, 1):
        b.connected(stream, True)
    b.add_stream(7)  # a peer is known (it holds nothing yet)
    b.reserved.open = True
    assert b.wants_claim() and b.assign(0, 1, 0.0) is None  # nothing reserved yet: nothing asked
    b.reserved.add(6, 9)
    assert b.asked() == bits(6, 7, 8)  # what it will ask the source for counts as coming, for the others
    spans = [b.assign(stream, xfer, 0.0) for stream, xfer in ((0, 2), (1, 3), (0, 4), (1, 5))]
    # One message per span (SOURCE_SPAN), at most DEPTH per connection, only what was reserved.
    assert [(s.first, s.stop) for s in spans if s] == [(6, 7), (7, 8), (8, 9)]
    assert b.wants_claim()
    b.reserved.close()  # every message is reserved by some member: the rules of a swarm without claims
    assert not b.wants_claim()
    span = b.assign(1, 6, 0.0)
    assert span is not None and (span.first, span.stop) == (0, 1)  # what nobody holds, one message at a time


def test_a_member_still_asks_for_what_it_reserved_once_the_source_has_none_left() -> None:
    # At 128 members of 256 messages each member's second claim was granted while its first
    # message was on the way, and the next claim's "none left" made it ask the source for what
    # nobody in its view held: reserved for others, sent twice (docs/sim.md, "Own reservations").
    b = SpanBook(12, 1, span=4)
    b.connected(0, True)
    b.add_stream(7)
    b.reserved.open = True
    b.reserved.add(6, 8)
    first = b.assign(0, 1, 0.0)
    assert first is not None and (first.first, first.stop) == (6, 7)
    b.reserved.close()  # the next claim: none left
    span = b.assign(0, 2, 0.0)
    assert span is not None and (span.first, span.stop) == (7, 8)  # its own, not message 0
    b.on_data(1, 6, 0.1)
    b.on_end(1)
    b.on_data(2, 7, 0.2)
    b.on_end(2)
    after = b.assign(0, 3, 0.2)
    assert after is not None and (after.first, after.stop) == (0, 1)  # then as a swarm without claims


def test_a_member_with_no_peer_yet_asks_for_whole_spans_of_what_it_reserved() -> None:
    b = SpanBook(12, 1, span=4)
    b.connected(0, True)
    b.reserved.open = True
    b.reserved.add(0, 4)
    span = b.assign(0, 1, 0.0)
    assert span is not None and (span.first, span.stop) == (0, 4)


def test_a_peer_has_one_span_outstanding_by_default() -> None:
    b = SpanBook(12, 1, span=2)
    peer = b.add_stream(7)
    b.connected(peer, True)
    b.holds(7, bits(*range(12)))
    assert b.assign(peer, 1, 0.0) is not None
    assert b.assign(peer, 2, 0.0) is None  # PEER_DEPTH: the next is asked for once this one is done


def test_a_peer_idle_for_want_of_work_is_not_measured_slow() -> None:
    b, _, peer = swarm(12, span=1, depth=1)
    b.holds(7, bits(0))
    first = b.assign(peer, 1, 0.0)
    assert first is not None
    b.on_data(1, 0, 0.01)
    b.on_end(1)
    # It holds nothing more for a second; then it does, and delivers 10 ms after being asked.
    b.holds(7, bits(0, 1))
    again = b.assign(peer, 2, 1.0)
    assert again is not None
    b.on_data(2, 1, 1.01)
    pace = b.pace(peer)
    assert pace is not None and pace < 0.02  # the second it had nothing to send is not its pace


def test_a_peers_first_message_may_take_as_long_as_the_sources_do_here() -> None:
    # Seven members on slow links: a message from the source took 0.6 s here, and a peer serving six
    # others takes as long for its first copy. A fixed bound (QUIET_FIRST) called such a peer quiet:
    # the source was asked for what it held, or it was dropped, and the source sent the state two to
    # four times over.
    b, source, peer = swarm(4, span=1, depth=1)
    assert b.quiet_after(peer) == QUIET_FIRST  # nothing known yet
    first = b.assign(source, 1, 0.0)
    assert first is not None and first.first == 0
    assert b.on_data(1, 0, 0.6) is True
    b.on_end(1)
    assert b.quiet_after(peer) == pytest.approx(4 * 0.6)  # QUIET_GAPS x the source's message here
    b.holds(7, bits(1, 2, 3))
    asked = b.assign(peer, 2, 0.7)
    assert asked is not None and (asked.first, asked.stop) == (1, 2)
    late = 0.7 + 1.0  # twice QUIET_FIRST without its first copy: a slow peer, not a dead one
    assert b.assign(source, 3, late) is None  # the source is not asked for what the peer holds
    assert b.next_takeover_at(late) == pytest.approx(0.7 + 4 * 0.6)
    assert b.assign(source, 4, 0.7 + 4 * 0.6 + 0.01) is not None  # silent that long, it is quiet


def test_a_peer_that_never_sent_anything_is_judged_by_the_other_peers_not_the_source() -> None:
    # A member's one-message spans at the source wait their turn among every member's: at 64 members a
    # source message took 1.3 s, and four of them (the quiet bound of a peer with no pace) passed the stall
    # bound, so a liar that claims all and sends nothing held each member that asked it late for 5 s.
    b = SpanBook(40, 1, span=1, depth=1, source_span=1, peer_depth=1)
    b.connected(0, True)
    xfer = 1
    for at in (0.0, 1.5, 3.0):  # the source: a message every 1.5 s
        span = b.assign(0, xfer, at)
        assert span is not None
        b.on_data(xfer, span.first, at + 1.5)
        b.on_end(xfer)
        xfer += 1
    honest = [b.add_stream(peer) for peer in (7, 8, 9)]
    liar = b.add_stream(10)
    for stream, peer in zip([*honest, liar], (7, 8, 9, 10), strict=True):
        b.connected(stream, True)
        b.holds(peer, bits(*range(40)))
    for stream in honest:  # each peer: two messages, 0.1 s apart
        for _ in range(2):
            span = b.assign(stream, xfer, 5.0)
            assert span is not None
            b.on_data(xfer, span.first, 5.1 if _ == 0 else 5.2)
            b.on_end(xfer)
            xfer += 1
    assert b.assign(liar, xfer, 5.2) is not None  # asked, never answers
    assert b.quiet_after(liar) >= 4 * 1.5  # judged by the source: past a 5 s stall bound
    assert b.silent_peer_bound(liar) == QUIET_FIRST  # by the peers: 4 x 0.1 s, at least QUIET_FIRST
    assert b.silent_peer_bound(honest[0]) == b.quiet_after(honest[0])  # one that has sent: its own pace


def test_a_pass_over_every_stream_reckons_each_peers_pace_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within one pass (one Takeovers), each other peer's pace is reckoned once, not once per stream that
    asks (streams x peers: 9% of a member's receiving thread at eleven receivers); the spans handed out
    are the ones a pass without the shared reckoning hands out."""
    from zmqtransport.fetch import spans as spans_module

    def build() -> tuple[SpanBook, list[int]]:
        b = SpanBook(48, 1, 2, 2, source_span=2, peer_depth=1)
        b.connected(0, True)
        streams = []
        for peer in range(1, 7):
            stream = b.add_stream(peer)
            b.connected(stream, True)
            b.holds(peer, bits(*range(peer * 6, peer * 6 + 6)), coming=bits(peer))
            streams.append(stream)
        return b, [0, *streams]

    calls = 0
    reckon = spans_module._peer_pace

    def counted(*args: object, **kwargs: object) -> float | None:
        nonlocal calls
        calls += 1
        return reckon(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(spans_module, "_peer_pace", counted)
    shared, streams = build()
    takeovers = shared.takeovers(1.0)
    handed = [shared.assign(stream, xfer, 1.0, takeovers) for xfer, stream in enumerate(streams, 1)]
    assert 0 < calls <= 6  # six peers
    calls = 0
    alone, _ = build()
    apart = [alone.assign(stream, xfer, 1.0) for xfer, stream in enumerate(streams, 1)]
    assert calls > 6  # without a pass, each stream reckons the others again
    assert [(s.first, s.stop) if s else None for s in handed] == [(s.first, s.stop) if s else None for s in apart]
