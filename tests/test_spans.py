"""The striped receive's plan (zmqtransport/spans.py), driven directly: fake streams, explicit time."""

from __future__ import annotations

import random

import pytest

from zmqtransport.fetch.spans import QUIET_FIRST, QUIET_MIN, SpanBook


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
    assert list(b.queue)[:2] == [(4, 8), (3, 4)]
    assert b.assign(0, 9, 0.2) is None  # a lost stream gets nothing
    taken = [b.assign(1, 10, 0.2), b.assign(1, 11, 0.2)]
    assert [(s.first, s.stop) for s in taken if s] == [(4, 8), (3, 4)]
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
    assert b.next_takeover_at() == pytest.approx(0.02 + quiet)
    rest = b.assign(1, 3, 0.02 + quiet + 0.001)
    assert rest is not None and (rest.first, rest.stop) == (2, 4)
    assert b.assign(1, 4, 10.0) is None  # taken over once only (and depth 1)
    # The quiet stream wakes up: its copies are duplicates once the takeover landed them.
    deliver(b, 3, 0.1)
    assert b.on_end(3) == [b_span for b_span in [slow]]  # the original is pointless now: cancel it
    assert b.complete and 1 not in b.spans


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
    b = SpanBook(12, 2, 4, depth=1, standby=frozenset({1}))
    b.connected(0, True)
    b.connected(1, True)
    first = b.assign(0, 1, 0.0)
    assert first is not None and b.assign(1, 2, 0.0) is None  # the standby waits for the primary
    b.on_data(1, 0, 0.1)
    assert [s.xfer for s in b.interrupted(0)] == [1]
    assert b.assign(0, 3, 0.2) is None  # not connected now
    taken = b.assign(1, 4, 0.2)  # an interrupted primary no longer holds the standby back
    assert taken is not None and (taken.first, taken.stop) == (1, 4)
    b.connected(0, True)  # back
    again = b.assign(0, 5, 0.3)
    assert again is not None and (again.first, again.stop) == (4, 8)
    assert b.live() == [0, 1]
