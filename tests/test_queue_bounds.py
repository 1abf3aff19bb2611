"""What one connection, and all of them together, may have queued, whatever credit a peer grants (serve/frames.py),
and what a misbehaving peer costs the log (serve/notices.py).

The rules are pure (fake trackers, an explicit time); the cut of one ROUTER
connection is checked on real sockets: libzmq frees what it queued for that
peer, and another peer's connection is untouched.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import zmq

from zmqtransport import ZMQTransport
from zmqtransport.serve.frames import HeldFrames
from zmqtransport.serve.notices import SUMMARY_EVERY, Notices
from zmqtransport.serve.router import Router

from .floods import unread_dealer

LOOPBACK = "127.0.0.1"

MiB = 1 << 20
STALL = 2.0


@dataclass
class FakeTracker:
    done: bool = False


def held(per_connection: int = 4 * MiB, copies: int = 6 * MiB) -> HeldFrames[FakeTracker]:
    return HeldFrames(STALL, per_connection=per_connection, copies=copies)


def test_one_connection_holds_at_most_its_bound_however_much_credit_its_peer_grants() -> None:
    frames = held()
    trackers = []
    for _ in range(4):
        assert frames.may_queue((b"a", 1), MiB)
        trackers.append(FakeTracker())
        frames.track((b"a", 1), trackers[-1], pinned=False, now=0.0, nbytes=MiB, copied=True)
    assert not frames.may_queue((b"a", 1), MiB)  # 4 MiB held: a fifth would exceed the bound
    assert not frames.may_queue((b"a", 2), MiB)  # per connection, not per transfer
    assert frames.may_queue((b"b", 1), MiB)  # another connection is not held back
    assert frames.wakeup_in(0.0) is not None  # a paused connection is looked at again soon
    trackers[0].done = True
    assert frames.poll(0.1) == {(b"a", 1)}
    assert frames.may_queue((b"a", 1), MiB)


def test_a_frame_larger_than_the_bound_may_go_when_nothing_is_queued() -> None:
    frames = held(per_connection=MiB)
    assert frames.may_queue((b"a", 1), 8 * MiB)
    frames.track((b"a", 1), FakeTracker(), pinned=True, now=0.0, nbytes=8 * MiB)
    assert not frames.may_queue((b"a", 1), 8 * MiB)


def test_copies_of_all_connections_together_stay_within_their_bound() -> None:
    frames = held(per_connection=64 * MiB, copies=3 * MiB)
    trackers = {peer: FakeTracker() for peer in (b"a", b"b", b"c")}
    for peer, tracker in trackers.items():
        assert frames.may_copy(MiB)
        frames.track((peer, 1), tracker, pinned=False, now=0.0, nbytes=MiB, copied=True)
    assert frames.copied == 3 * MiB
    assert not frames.may_copy(MiB)
    # Zero-copy frames of the caller's tensors are no copies: they do not count.
    frames.track((b"d", 1), FakeTracker(), pinned=True, now=0.0, nbytes=8 * MiB)
    assert frames.copied == 3 * MiB
    assert not frames.resumed()
    trackers[b"b"].done = True
    frames.poll(0.1)
    assert frames.resumed()  # a copy was released: sends held back may try again
    assert not frames.resumed()  # said once
    assert frames.may_copy(MiB)


def test_a_connection_that_takes_nothing_for_the_stall_bound_is_reported_once() -> None:
    frames = held()
    slow, stuck = FakeTracker(), FakeTracker()
    frames.track((b"slow", 1), slow, pinned=False, now=0.0, nbytes=MiB, copied=True)
    frames.track((b"slow", 1), FakeTracker(), pinned=False, now=0.0, nbytes=MiB, copied=True)
    frames.track((b"stuck", 1), stuck, pinned=False, now=0.0, nbytes=MiB, copied=True)
    slow.done = True
    frames.poll(1.5)  # the slow one takes data, however slowly
    assert frames.stuck(1.0) == []
    assert frames.stuck(STALL + 0.1) == [b"stuck"]
    assert frames.stuck(STALL + 0.2) == []  # reported once
    assert frames.stuck(1.5 + STALL + 0.1) == [b"slow"]


def test_a_cut_connections_pinned_frames_ask_for_no_socket_wide_close() -> None:
    frames = held()
    frames.track((b"stuck", 1), FakeTracker(), pinned=True, now=0.0, nbytes=MiB)
    assert frames.must_close(STALL + 1.0, transfers_running=False)
    assert frames.stuck(STALL + 1.0) == [b"stuck"]
    frames.cutting(b"stuck")
    assert not frames.must_close(STALL + 1.0, transfers_running=False)


def test_cutting_one_connection_frees_what_libzmq_queued_for_it_and_nothing_else() -> None:
    context = zmq.Context()
    router = Router(context, ["127.0.0.1"], 0, None)
    try:
        stuck, reader = unread_dealer(context, LOOPBACK, router.port), unread_dealer(context, LOOPBACK, router.port)
        stuck.send(b"stuck")
        reader.send(b"reader")
        peers: dict[bytes, bytes] = {}  # which hello came on which connection: they may arrive in any order
        deadline = time.monotonic() + 10
        while len(peers) < 2 and time.monotonic() < deadline:
            router.socket.poll(100)
            peers.update({frames[0].bytes: peer for peer, _, frames in router.read()})
        assert len(peers) == 2
        stuck_id, reader_id = peers[b"stuck"], peers[b"reader"]
        payload = bytearray(MiB)
        trackers = [router.send_data(stuck_id, b"env", memoryview(payload), track=True) for _ in range(32)]
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            router.socket.poll(10)
        assert not all(t is not None and t.done for t in trackers), "the stuck peer took everything"

        assert router.cut(stuck_id)
        deadline = time.monotonic() + 10
        while not all(t is not None and t.done for t in trackers) and time.monotonic() < deadline:
            router.socket.poll(10)  # libzmq acts on the closed connection while the socket is used
        assert all(t is not None and t.done for t in trackers), "frames queued for the cut peer were not freed"

        # The other connection still works both ways.
        assert router.send(reader_id, [b"still here"])
        assert reader.poll(5000)
        assert reader.recv() == b"still here"
        reader.send(b"again")
        assert router.socket.poll(5000)
        assert [peer for peer, _, _ in router.read()] == [reader_id]
        assert not router.cut(b"no such peer")
    finally:
        router.close()
        context.destroy(linger=0)


def test_a_peer_that_repeats_itself_gets_one_warning_and_a_count() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("test.notices")
    log.addHandler(Keep())
    log.setLevel(logging.DEBUG)
    log.propagate = False
    notices = Notices(log)
    for n in range(100):
        notices.warn("10.0.0.9", "bad request", float(n), "bad request %d from %s", n, "10.0.0.9")
    notices.warn("10.0.0.8", "bad request", 0.0, "bad request from %s", "10.0.0.8")
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert warnings == ["bad request 0 from 10.0.0.9", "bad request from 10.0.0.8"]
    assert not notices.due(50.0) and notices.due(1.0 + SUMMARY_EVERY)
    notices.flush()
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and "bad request 100 times in all" in warnings[-1]
    notices.flush()  # nothing new: nothing more
    assert len([r for r in records if r.levelno == logging.WARNING]) == 3
    notices.warn("10.0.0.9", "bad request", 200.0, "bad request again from %s", "10.0.0.9")
    assert [r.getMessage() for r in records if r.levelno == logging.WARNING][-1] == "bad request again from 10.0.0.9"


def test_a_flood_of_bad_requests_logs_one_warning_and_its_count(caplog: pytest.LogCaptureFixture) -> None:
    source: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=10), bind_host="127.0.0.1")
    context = zmq.Context()
    try:
        dealer = unread_dealer(context, LOOPBACK, source.address.port)
        with caplog.at_level(logging.WARNING, logger="zmqtransport"):
            for _ in range(200):
                dealer.send(b"not msgpack at all")
            for _ in range(200):
                assert dealer.poll(5000), "an error reply for every bad request"
                dealer.recv()
            bad = [r for r in caplog.records if "bad request" in r.getMessage()]
            assert len(bad) == 1, [r.getMessage() for r in bad]
            source.shutdown()
        assert any("bad request 200 times in all" in r.getMessage() for r in caplog.records)
    finally:
        source.shutdown()
        context.destroy(linger=0)


def test_a_connection_paused_on_a_slow_link_is_looked_at_near_its_frames_release_not_every_few_ms() -> None:
    """The serving thread looks at a paused connection's frames when the oldest should be released at the rate
    its frames last drained (EARLY_LOOK of the way, then every LATE_LOOKS of that time), not every PAUSED_POLL
    (which woke it about twenty times a 1 MiB frame at 400 Mbit/s)."""
    from zmqtransport.serve.frames import EARLY_LOOK, LATE_LOOKS, PAUSED_POLL, RELEASE_POLL

    frames = held(per_connection=64 * MiB)
    key = (b"a", 1)
    first = FakeTracker()
    frames.track(key, first, pinned=True, now=0.0, nbytes=MiB)
    assert not frames.may_send(key, MiB)  # queued, its drain rate not known yet: paused
    assert frames.wakeup_in(0.0) == PAUSED_POLL  # nothing to predict from: looked at often
    first.done = True
    assert frames.poll(0.064) == {key}  # 1 MiB in 64 ms: about 16 MB/s (a third of a 400 Mbit/s link)
    drain = 0.064
    frames.track(key, FakeTracker(), pinned=True, now=0.064, nbytes=MiB)
    assert not frames.may_send(key, MiB)  # 2 MiB would take 128 ms to drain, over PINNED_DRAIN
    assert frames.wakeup_in(0.064) == pytest.approx(EARLY_LOOK * drain)
    assert PAUSED_POLL < EARLY_LOOK * drain < RELEASE_POLL
    late = 0.064 + EARLY_LOOK * drain + 0.001  # the early look saw nothing: then a tenth of the drain apart
    assert frames.wakeup_in(late) == pytest.approx(LATE_LOOKS * drain)
    frames.track((b"b", 1), FakeTracker(), pinned=True, now=0.07, nbytes=MiB)
    assert not frames.may_send((b"b", 1), MiB)  # another connection, rate unknown: it sets the pace
    assert frames.wakeup_in(0.07) == PAUSED_POLL


def test_a_paused_connection_on_a_fast_link_is_still_looked_at_every_paused_poll() -> None:
    from zmqtransport.serve.frames import PAUSED_POLL

    frames = held(per_connection=256 * MiB)
    key = (b"a", 1)
    first = FakeTracker()
    frames.track(key, first, pinned=True, now=0.0, nbytes=MiB)
    first.done = True
    frames.poll(0.0005)  # 1 MiB in half a millisecond: 2 GB/s
    frames.track(key, FakeTracker(), pinned=True, now=0.001, nbytes=MiB)
    assert not frames.may_send(key, 64 * MiB)  # 65 MiB would take 33 ms: over PINNED_DRAIN
    assert frames.wakeup_in(0.001) == PAUSED_POLL  # its frame drains within half a millisecond
