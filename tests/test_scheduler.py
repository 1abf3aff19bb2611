"""The sending side's scheduler, driven directly: a fake clock, fake peers, no sockets.

``Net`` plays the socket owner (zmqtransport/serve/server.py): it carries out the
scheduler's actions, records what each peer would receive, and reports sends to
peers that are not connected, as a ROUTER with ROUTER_MANDATORY does.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from zmqtransport import wire
from zmqtransport.codec.tensors import EncodedTree
from zmqtransport.errors import ProtocolError, VersionMismatchError
from zmqtransport.serve.actions import Abort, Action, Finish, Have, Refuse, SendHeader
from zmqtransport.serve.admission import Limits
from zmqtransport.serve.frames import HeldFrames
from zmqtransport.serve.scheduler import IDLE_WAKEUP, RELAY_REGISTER_GRACE, Scheduler
from zmqtransport.serve.staged import Staged

TIMEOUT = 10.0
STEP = 7


def staged(step: int = STEP, messages: int = 8, has_pickle: bool = False) -> Staged:
    plan = [[wire.Piece(0, i, 1)] for i in range(messages)]
    return Staged(step, b"header-body", EncodedTree(skeleton=None, has_pickle=has_pickle), plan, None)


def fetch(xfer: int = 1, step: int = STEP, credit: int = 4, wait_ms: int = 60_000, **kwargs: Any) -> wire.Request:
    return wire.Request(wire.OP_FETCH, xfer, step=step, wait_ms=wait_ms, credit=credit, **kwargs)


def credit(xfer: int, n: int) -> wire.Request:
    return wire.Request(wire.OP_CREDIT, xfer, credit=n)


@dataclass
class Net:
    """Fake peers: what each would receive, as (op, xfer, detail) tuples."""

    scheduler: Scheduler
    now: float = 1000.0
    disconnected: set[bytes] = field(default_factory=set)
    inbox: dict[bytes, list[tuple[str, int, Any]]] = field(default_factory=dict)
    finished: list[tuple[bytes, int, float]] = field(default_factory=list)

    def deliver(self, peer: bytes, message: tuple[str, int, Any]) -> bool:
        if peer in self.disconnected:
            return False
        self.inbox.setdefault(peer, []).append(message)
        return True

    def execute(self, actions: list[Action]) -> None:
        """What the server's _execute does, without a socket."""
        undelivered = set()
        for action in actions:
            if isinstance(action, SendHeader):
                if not self.deliver(action.peer, ("header", action.xfer, None)):
                    undelivered.add(action.key)
                    self.scheduler.undelivered(action, self.now)
                elif action.header_only:
                    self.deliver(action.peer, ("end", action.xfer, None))
            elif isinstance(action, Refuse):
                if not self.deliver(action.peer, ("error", action.xfer, action.code)):
                    self.scheduler.undelivered(action, self.now)
            elif isinstance(action, Abort):
                self.deliver(action.transfer.peer, ("error", action.transfer.xfer, action.code))
            elif isinstance(action, Finish) and action.transfer.key not in undelivered:
                end = wire.decode_reply(action.envelope(), False, "the server")  # a relay's: what it holds
                self.deliver(action.transfer.peer, ("end", action.transfer.xfer, end.have))
                self.finished.append((action.transfer.peer, action.transfer.xfer, action.seconds))

    def request(self, peer: bytes, request: wire.Request) -> None:
        self.execute(self.scheduler.on_request(peer, request, f"addr-{peer.hex()}", self.now))

    def pump(self, rounds: int = 1000) -> None:
        """What DataPump.run does for host memory: one message per transfer per round."""
        for _ in range(rounds):
            ready = self.scheduler.next_round()
            if not ready:
                return
            for transfer in ready:
                self.deliver(transfer.peer, ("data", transfer.xfer, transfer.next_seq))
                self.execute(self.scheduler.sent(transfer, self.now))

    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.execute(self.scheduler.expire(self.now))

    def ops(self, peer: bytes) -> list[tuple[str, Any]]:
        return [(op, detail) for op, _, detail in self.inbox.get(peer, []) if op != "data"]

    def data(self, peer: bytes, xfer: int | None = None) -> list[int]:
        return [seq for op, x, seq in self.inbox.get(peer, []) if op == "data" and xfer in (None, x)]


@pytest.fixture
def net() -> Net:
    return Net(Scheduler(TIMEOUT))


# ----------------------------------------------------------------------------- parked requests


def test_request_before_staging_waits_and_starts_when_a_step_is_staged(net: Net) -> None:
    net.request(b"a", fetch())
    assert net.inbox == {} and len(net.scheduler.parked) == 1
    net.execute(net.scheduler.stage(staged(), net.now))
    net.pump()
    assert net.ops(b"a") == [("header", None)]
    assert net.data(b"a") == [0, 1, 2, 3]  # exactly the granted credit
    assert net.scheduler.parked == []


def test_parked_request_is_refused_not_staged_at_its_deadline_not_before(net: Net) -> None:
    net.request(b"a", fetch(wait_ms=2000))
    net.tick(1.999)
    assert net.inbox == {}
    net.tick(0.001)
    assert net.ops(b"a") == [("error", wire.ERR_NOT_STAGED)]
    assert net.scheduler.parked == []


def test_parked_requests_from_one_peer_respect_the_per_peer_limit(net: Net) -> None:
    for xfer in range(100):
        net.request(b"a", fetch(xfer=xfer, credit=1))
    net.request(b"b", fetch(xfer=0, credit=1))
    net.execute(net.scheduler.stage(staged(), net.now))
    ops = net.ops(b"a")
    assert ops.count(("header", None)) == 4
    assert ops.count(("error", wire.ERR_BUSY)) == 96
    assert net.ops(b"b") == [("header", None)]  # one peer did not take everyone's slots


def test_too_many_parked_requests_are_refused_busy(net: Net) -> None:
    limit = net.scheduler.limits.parked
    for xfer in range(limit):
        net.request(bytes([xfer % 200 + 1]), fetch(xfer=xfer))
    assert net.inbox == {}
    net.request(b"late", fetch(xfer=1))
    assert net.ops(b"late") == [("error", wire.ERR_BUSY)]


def test_cancel_forgets_a_parked_request_and_a_running_transfer(net: Net) -> None:
    net.request(b"a", fetch(xfer=1))
    net.request(b"a", wire.Request(wire.OP_CANCEL, 1))
    assert net.scheduler.parked == []
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"a", fetch(xfer=2, credit=1))
    net.request(b"a", wire.Request(wire.OP_CANCEL, 2))
    assert net.scheduler.transfers == {}
    net.request(b"a", credit(2, 5))
    net.pump()
    assert net.data(b"a") == []


# ----------------------------------------------------------------------------- limits and refusals


def test_at_most_max_transfers_run_at_once(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(), net.now))
    limit = net.scheduler.limits.transfers
    for number in range(limit):
        net.request(f"p{number}".encode(), fetch(credit=1))
    net.request(b"late", fetch(credit=1))
    assert len(net.scheduler.transfers) == limit
    assert net.ops(b"late") == [("error", wire.ERR_BUSY)]
    net.request(b"p0", wire.Request(wire.OP_CANCEL, 1))  # a slot frees up
    net.request(b"late", fetch(xfer=2, credit=1))
    assert net.ops(b"late")[-1] == ("header", None)


def test_per_peer_limit_for_requests_arriving_while_staged(net: Net) -> None:
    net.scheduler = Scheduler(TIMEOUT, limits=Limits(transfers_per_peer=2))
    net.execute(net.scheduler.stage(staged(), net.now))
    for xfer in range(3):
        net.request(b"a", fetch(xfer=xfer, credit=1))
    assert net.ops(b"a") == [("header", None), ("header", None), ("error", wire.ERR_BUSY)]


def test_wrong_step_pickle_and_duplicate_ids_are_refused(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(step=STEP), net.now))
    net.request(b"a", fetch(xfer=1, step=STEP + 1))
    assert net.ops(b"a") == [("error", wire.ERR_WRONG_STEP)]
    net.request(b"a", fetch(xfer=2))
    net.request(b"a", fetch(xfer=2))
    assert net.ops(b"a")[1:] == [("header", None), ("error", wire.ERR_BUSY)]
    net.execute(net.scheduler.stage(staged(has_pickle=True), net.now))
    net.request(b"b", fetch(xfer=1))
    net.request(b"c", fetch(xfer=1, accept_pickle=True))
    assert net.ops(b"b") == [("error", wire.ERR_PICKLE)]
    assert net.ops(b"c") == [("header", None)]


def test_parked_request_for_another_step_is_refused_wrong_step_when_staged(net: Net) -> None:
    net.request(b"a", fetch(step=STEP - 1))
    net.execute(net.scheduler.stage(staged(step=STEP), net.now))
    assert net.ops(b"a") == [("error", wire.ERR_WRONG_STEP)]


def test_header_only_sends_header_and_end_and_starts_no_transfer(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"a", fetch(header_only=True))
    assert net.ops(b"a") == [("header", None), ("end", None)]
    assert net.scheduler.transfers == {}


def test_empty_step_sends_header_then_end(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=0), net.now))
    net.request(b"a", fetch())
    assert net.ops(b"a") == [("header", None), ("end", None)]
    assert net.finished == [(b"a", 1, 0.0)] and net.scheduler.transfers == {}


def test_decoders_raise_errors_that_carry_the_reply_code() -> None:
    future = msgpack.packb({"v": wire.PROTOCOL_VERSION + 1, "op": "fetch", "id": 1})
    with pytest.raises(VersionMismatchError) as version:
        wire.decode_request(future)
    assert version.value.code == wire.ERR_VERSION == "version"
    with pytest.raises(ProtocolError) as bad:
        wire.decode_request(msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": "fly", "id": 1}))
    assert type(bad.value) is ProtocolError and bad.value.code == wire.ERR_BAD_REQUEST == "bad_request"
    with pytest.raises(ProtocolError) as garbage:
        wire.decode_request(b"\xc1")
    assert garbage.value.code == wire.ERR_BAD_REQUEST


# ----------------------------------------------------------------------------- credit and fairness


def test_credit_bounds_what_is_sent_and_is_capped(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=wire.MAX_CREDIT + 50), net.now))
    net.request(b"a", fetch(credit=2))
    net.pump()
    assert net.data(b"a") == [0, 1]
    net.pump()
    assert net.data(b"a") == [0, 1]  # no credit, nothing more
    for _ in range(3):
        net.request(b"a", credit(1, wire.MAX_CREDIT))
    assert net.scheduler.transfers[(b"a", 1)].credit == wire.MAX_CREDIT
    net.pump()
    assert net.data(b"a") == list(range(2 + wire.MAX_CREDIT))


def test_credit_for_an_unknown_transfer_is_ignored(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"a", credit(99, 3))
    assert net.inbox == {} and net.scheduler.transfers == {}


def test_transfer_finishes_after_its_last_message_with_its_duration(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=3), net.now))
    net.request(b"a", fetch(credit=2))
    net.pump()
    net.now += 2.5
    net.request(b"a", credit(1, 2))
    net.pump()
    assert net.data(b"a") == [0, 1, 2]
    assert net.ops(b"a") == [("header", None), ("end", None)]
    assert net.finished == [(b"a", 1, 2.5)]
    assert net.scheduler.transfers == {}


def test_round_robin_among_receivers(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=4), net.now))
    for peer in (b"a", b"b", b"c"):
        net.request(peer, fetch(credit=4))
    order: list[bytes] = []
    while ready := net.scheduler.next_round():
        for transfer in ready:
            order.append(transfer.peer)
            net.execute(net.scheduler.sent(transfer, net.now))
    assert order == [b"a", b"b", b"c"] * 4
    assert len(net.finished) == 3


def test_a_receiver_without_credit_does_not_hold_up_the_others(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=6), net.now))
    net.request(b"slow", fetch(credit=1))
    net.request(b"fast", fetch(credit=6))
    net.pump()
    assert net.data(b"slow") == [0]
    assert net.data(b"fast") == list(range(6))


def test_wakeup_in(net: Net) -> None:
    assert net.scheduler.wakeup_in(net.now) == IDLE_WAKEUP
    net.request(b"a", fetch(wait_ms=300))
    assert net.scheduler.wakeup_in(net.now) == pytest.approx(0.3)
    net.execute(net.scheduler.stage(staged(), net.now))
    assert net.scheduler.wakeup_in(net.now) == 0.0  # data to send
    net.pump()
    net.now += 4
    assert net.scheduler.wakeup_in(net.now) == IDLE_WAKEUP  # the stall deadline is 6 s away
    net.now += 5.5
    assert net.scheduler.wakeup_in(net.now) == pytest.approx(0.5)


# ----------------------------------------------------------------------------- stalls


def test_a_receiver_granting_no_credit_for_the_timeout_is_dropped_stalled(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(credit=2))
    net.pump()
    net.tick(TIMEOUT)
    assert (b"a", 1) in net.scheduler.transfers  # exactly the timeout: not yet
    net.tick(0.01)
    assert net.ops(b"a") == [("header", None), ("error", wire.ERR_STALLED)]
    assert net.scheduler.transfers == {}


def test_credit_restarts_the_stall_clock(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(credit=1))
    for _ in range(5):
        net.pump()
        net.tick(TIMEOUT * 0.9)
        net.request(b"a", credit(1, 1))
    net.pump()
    net.tick(TIMEOUT * 0.9)
    assert net.ops(b"a") == [("header", None)]  # slow, but never stalled
    assert net.data(b"a") == list(range(6))


def test_a_transfer_with_credit_left_is_not_stalled(net: Net) -> None:
    """Only a receiver that withholds credit is stalled; the pump owes this one data."""
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(credit=2))
    net.tick(TIMEOUT * 3)
    assert net.ops(b"a") == [("header", None)]


# ----------------------------------------------------------------------------- disallow


def test_disallow_serves_no_new_receive_and_parks_later_requests(net: Net) -> None:
    """Running transfers go on (tests/test_withdrawn.py); a new fetch waits for the next staging."""
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(credit=2))
    net.pump()
    assert net.scheduler.disallow(net.now, cap=1 << 30) == (1, 98)  # its 98 messages not sent, 1 byte each
    assert net.scheduler.staged is None and net.ops(b"a") == [("header", None)]
    net.request(b"c", fetch())
    assert net.inbox.get(b"c") is None and len(net.scheduler.parked) == 1
    net.execute(net.scheduler.stage(staged(step=STEP), net.now))
    assert net.ops(b"c") == [("header", None)]


def test_shutdown_ends_transfers_and_parked_requests(net: Net) -> None:
    net.request(b"p", fetch(step=STEP + 1))
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"a", fetch())
    net.scheduler.staged = None
    net.request(b"q", fetch())
    net.execute(net.scheduler.shutdown())
    assert net.ops(b"a") == [("header", None), ("error", wire.ERR_SHUTDOWN)]
    assert net.ops(b"q") == [("error", wire.ERR_SHUTDOWN)]
    assert net.scheduler.transfers == {} and net.scheduler.parked == []


# ----------------------------------------------------------------------------- unreachable peers


def test_data_send_failure_drops_the_transfer(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"a", fetch())
    (transfer,) = net.scheduler.next_round()
    net.scheduler.drop(transfer)
    assert net.scheduler.next_round() == [] and net.scheduler.transfers == {}


def test_request_parked_across_a_rebind_is_retried_until_its_peer_is_back(net: Net) -> None:
    net.request(b"a", fetch(xfer=1, wait_ms=60_000))
    for xfer in range(2, 8):  # more than the per-peer limit: none of them may be lost
        net.request(b"a", fetch(xfer=xfer, wait_ms=60_000))
    net.scheduler.rebound(net.now)
    net.disconnected.add(b"a")  # its DEALER has not reconnected yet
    net.execute(net.scheduler.stage(staged(), net.now))
    assert net.scheduler.transfers == {} and len(net.scheduler.parked) == 7
    net.tick(0.5)
    assert len(net.scheduler.parked) == 7
    net.disconnected.clear()
    net.tick(0.1)
    ops = net.ops(b"a")
    assert ops.count(("header", None)) == 4 and ops.count(("error", wire.ERR_BUSY)) == 3
    assert net.scheduler.parked == []


def test_undeliverable_header_outside_the_rebind_grace_is_dropped(net: Net) -> None:
    net.request(b"a", fetch())
    net.disconnected.add(b"a")
    net.execute(net.scheduler.stage(staged(), net.now))
    assert net.scheduler.transfers == {} and net.scheduler.parked == []
    assert net.finished == []


# ----------------------------------------------------------------------------- held frames


@dataclass
class FakeTracker:
    done: bool = False


A, B = (b"a", 1), (b"b", 1)
STALL = 2.0


def test_held_frames_release_waiters_when_pinned_frames_are_released() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    pinned = [FakeTracker() for _ in range(3)]
    for tracker in pinned:
        held.track(A, tracker, pinned=True, now=0.0)
    held.track(A, FakeTracker(), pinned=False, now=0.0)  # a copy: no reason to wait
    done = threading.Event()
    held.wait(done, deadline=10.0)
    assert held.poll(0.5) == set() and not done.is_set() and held.waiting
    pinned[0].done = True
    assert held.poll(0.6) == {A} and not done.is_set()
    for tracker in pinned:
        tracker.done = True
    held.poll(0.7)
    assert done.is_set() and not held.waiting and held.pinned == 0


def test_held_frames_report_progress_per_transfer() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    a, b = FakeTracker(), FakeTracker()
    held.track(A, a, pinned=False, now=0.0)
    held.track(B, b, pinned=True, now=0.0)
    b.done = True
    assert held.poll(1.0) == {B}
    a.done = True
    assert held.poll(1.1) == {A}
    assert held.poll(1.2) == set() and held.trackers() == []


def test_frames_of_a_stuck_receiver_are_freed_once_nothing_runs() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    held.track(A, FakeTracker(), pinned=True, now=0.0)
    assert not held.must_close(STALL, transfers_running=False)  # exactly the bound: not yet
    assert not held.must_close(STALL + 0.1, transfers_running=True)  # others would lose data
    assert held.must_close(STALL + 0.1, transfers_running=False)
    held.socket_closed()
    assert not held.must_close(STALL + 5, transfers_running=False)  # once: libzmq is freeing them


def test_a_progressing_receiver_is_waited_for_a_stuck_one_is_not() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    stuck = FakeTracker()
    held.track(A, stuck, pinned=True, now=0.0)
    reading = [FakeTracker() for _ in range(10)]
    for tracker in reading:
        held.track(B, tracker, pinned=True, now=0.0)
    done = threading.Event()
    held.wait(done, deadline=100.0)
    now = 0.0
    for tracker in reading[:-1]:  # B takes one frame every second: slow, never stuck
        now += 1.0
        tracker.done = True
        held.poll(now)
        assert not held.must_close(now, transfers_running=False), now
    reading[-1].done = True
    held.poll(now + 1.0)
    assert held.must_close(now + 1.0, transfers_running=False)  # only A is left, stuck for 10 s


def test_held_frames_ask_for_one_forced_release_at_the_deadline() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(stall=1000.0)
    stuck = FakeTracker()
    held.track(A, stuck, pinned=True, now=0.0)
    done = threading.Event()
    held.wait(done, deadline=10.0)
    assert not held.must_close(9.99, transfers_running=False)
    assert held.must_close(10.0, transfers_running=False)
    assert not held.must_close(10.5, transfers_running=False)
    stuck.done = True
    held.poll(10.6)
    assert done.is_set()


# ----------------------------------------------------------------------------- liveness


def test_released_frames_count_as_progress_against_the_stall_bound() -> None:
    net = Net(Scheduler(TIMEOUT, stall=STALL))
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(credit=2))
    net.pump()
    for _ in range(5):  # no credit, but libzmq keeps releasing its frames: slow, not stalled
        net.now += STALL * 0.9
        net.scheduler.progress({(b"a", 1)}, net.now)
        net.tick(0)
    assert net.ops(b"a") == [("header", None)]
    net.tick(STALL + 0.01)
    assert net.ops(b"a") == [("header", None), ("error", wire.ERR_STALLED)]


def test_a_transfer_behind_another_on_its_connection_is_not_stalled_while_that_one_drains() -> None:
    net = Net(Scheduler(TIMEOUT, stall=STALL))
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(1, credit=2))
    net.request(b"a", fetch(2, credit=0))  # its credit comes once the first one's data has gone
    net.pump()
    for _ in range(5):  # the connection drains the first transfer's frames, slowly
        net.now += STALL * 0.9
        net.scheduler.progress({(b"a", 1)}, net.now)
        net.tick(0)
    assert (b"a", 2) in net.scheduler.transfers and ("error", wire.ERR_STALLED) not in net.ops(b"a")


def test_stall_bound_is_separate_from_and_at_most_the_timeout() -> None:
    assert Scheduler(TIMEOUT, stall=STALL).stall == STALL
    assert Scheduler(TIMEOUT, stall=TIMEOUT * 2).stall == TIMEOUT
    assert Scheduler(TIMEOUT).stall == TIMEOUT
    net = Net(Scheduler(TIMEOUT, stall=STALL))
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(credit=1))
    net.pump()
    assert net.scheduler.wakeup_in(net.now + STALL - 0.5) == pytest.approx(0.5)  # the stall, not the timeout
    net.tick(STALL + 0.01)
    assert net.ops(b"a") == [("header", None), ("error", wire.ERR_STALLED)]


def test_a_closed_connection_drops_its_transfers_but_keeps_parked_requests(net: Net) -> None:
    net.request(b"a", fetch(xfer=1))  # parked: nothing staged yet
    assert net.scheduler.disconnected(b"a") == []
    assert [p.key for p in net.scheduler.parked] == [(b"a", 1)]  # its DEALER may reconnect
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"a", fetch(xfer=2))
    net.request(b"b", fetch(xfer=2))
    gone = net.scheduler.disconnected(b"a")
    assert sorted(t.xfer for t in gone) == [1, 2]
    assert set(net.scheduler.transfers) == {(b"b", 2)}
    net.pump()
    assert net.data(b"a") == [] and net.data(b"b") == [0, 1, 2, 3]


# ----------------------------------------------------------------------------- span fetches (striped receives)


def span(xfer: int, first: int, stop: int, stage: int, **kwargs: Any) -> wire.Request:
    return fetch(xfer=xfer, credit=stop - first, span=(first, stop), stage=stage, **kwargs)


def test_span_fetch_sends_only_its_messages_and_no_header(net: Net) -> None:
    step = staged(messages=10)
    net.execute(net.scheduler.stage(step, net.now))
    net.request(b"a", fetch(xfer=1, header_only=True))
    net.request(b"a", span(2, 3, 7, step.stage_id))
    net.request(b"b", span(3, 7, 10, step.stage_id))
    net.pump()
    assert net.ops(b"a") == [("header", None), ("end", None), ("end", None)]
    assert net.data(b"a", 2) == [3, 4, 5, 6]
    assert net.ops(b"b") == [("end", None)]
    assert net.data(b"b", 3) == [7, 8, 9]
    assert sorted(xfer for _, xfer, _ in net.finished) == [2, 3]


def test_span_fetch_of_an_earlier_staging_or_beyond_the_plan_is_refused(net: Net) -> None:
    first = staged(messages=10)
    net.execute(net.scheduler.stage(first, net.now))
    again = staged(messages=10)  # the same step staged again: maybe other bytes
    net.execute(net.scheduler.stage(again, net.now))
    net.request(b"a", span(1, 0, 4, first.stage_id))
    net.request(b"a", span(2, 8, 11, again.stage_id))
    net.request(b"a", span(3, 0, 4, again.stage_id, step=STEP + 1))
    assert net.ops(b"a") == [
        ("error", wire.ERR_WRONG_STEP),
        ("error", wire.ERR_BAD_REQUEST),
        ("error", wire.ERR_WRONG_STEP),
    ]
    assert net.scheduler.transfers == {}


def test_span_credit_bounds_what_is_sent_and_cancel_stops_it(net: Net) -> None:
    step = staged(messages=10)
    net.execute(net.scheduler.stage(step, net.now))
    net.request(b"a", fetch(xfer=9, credit=2, span=(2, 9), stage=step.stage_id))
    net.pump()
    assert net.data(b"a", 9) == [2, 3]
    net.request(b"a", credit(9, 1))
    net.pump()
    assert net.data(b"a", 9) == [2, 3, 4]
    net.request(b"a", wire.Request(wire.OP_CANCEL, 9))
    net.request(b"a", credit(9, 5))
    net.pump()
    assert net.data(b"a", 9) == [2, 3, 4] and net.finished == []


def test_header_announces_the_staging_id() -> None:
    scheduler = Scheduler(TIMEOUT)
    step = staged()
    scheduler.stage(step, 0.0)
    actions = scheduler.on_request(b"a", fetch(header_only=True), "addr", 0.0)
    assert isinstance(actions[0], SendHeader) and actions[0].stage_id == step.stage_id


@pytest.mark.parametrize(
    "fields",
    [
        {"span": [0, 4]},  # no stage
        {"stage": 5},  # no span
        {"span": [4, 4], "stage": 5},
        {"span": [-1, 4], "stage": 5},
        {"span": [0, 2**33], "stage": 5},
        {"span": [0, True], "stage": 5},
        {"span": [0, 4, 8], "stage": 5},
        {"span": [0, 4], "stage": -1},
        {"span": "0-4", "stage": 5},
    ],
)
def test_malformed_span_fields_are_refused(fields: dict[str, Any]) -> None:
    message = {"v": wire.PROTOCOL_VERSION, "op": wire.OP_FETCH, "id": 1, "step": 1, "wait_ms": 0, "credit": 1}
    with pytest.raises(ProtocolError):
        wire.decode_request(msgpack.packb({**message, **fields}))


def test_span_fields_round_trip_and_plain_fetch_is_unchanged() -> None:
    plain = wire.fetch_request(1, 2, 3, 4, False)
    assert b"span" not in plain and b"stage" not in plain
    request = wire.decode_request(wire.fetch_request(1, 2, 3, 4, False, span=(5, 9), stage=77))
    assert request.span == (5, 9) and request.stage == 77


# ----------------------------------------------------------------------------- relays


def relayed(messages: int = 6, token: bytes = b"T" * 16, stage: int = 99) -> Any:
    from zmqtransport.relayed import Relayed

    plan = [[wire.Piece(0, i, 1)] for i in range(messages)]
    return Relayed(STEP, stage, token, plan, views=[memoryview(bytearray(range(messages)))])


def test_swarm_names_every_member_so_far_to_each_newcomer(net: Net) -> None:
    tokens = iter(bytes([n]) * 16 for n in range(1, 10))
    net.scheduler = Scheduler(TIMEOUT, make_token=lambda: next(tokens))
    net.execute(net.scheduler.stage(staged(), net.now))
    orders = []
    # Each offers to relay at its own address, and verifies what peers send (it offers an algorithm).
    hosts = {b"a": "10.0.0.1", b"b": "10.0.0.2", b"c": "10.0.0.3", b"d": "10.0.0.4", b"e": "10.0.0.5"}

    def offer(peer: bytes, xfer: int = 1, verify: tuple[str, ...] = ("sha256",)) -> list[Action]:
        request = fetch(xfer=xfer, relay=f"tcp://{hosts[peer]}:1", verify=verify)
        return net.scheduler.on_request(peer, request, hosts[peer], net.now)

    for peer in (b"a", b"b", b"c"):
        header = offer(peer)[0]
        assert isinstance(header, SendHeader)
        orders.append(header.relay)
        # A member that verifies asks for everything and is sent the header alone:
        # it fetches spans from the source and the members (uplink.py: the source
        # decides whether it is a member or is sent the data at once).
        assert header.header_only
    a, b = ("tcp://10.0.0.1:1", orders[0].token), ("tcp://10.0.0.2:1", orders[1].token)
    assert [o.peers for o in orders] == [(), (a,), (a, b)]
    # The newest member also comes as `from`, for receivers that know only a chain.
    assert [o.upstream for o in orders] == [None, "tcp://10.0.0.1:1", "tcp://10.0.0.2:1"]
    assert orders[2].upstream_token == orders[1].token
    net.scheduler.disconnected(b"c")  # c's receive ended: it is no member any more
    assert [at for at, _ in offer(b"d", xfer=5)[0].relay.peers] == ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1"]
    # One that does not verify is a member others may fetch from, but is named none.
    assert offer(b"e", xfer=7, verify=())[0].relay.peers == ()
    net.execute(net.scheduler.stage(staged(), net.now))  # a new staging: a new swarm
    fresh = offer(b"e", xfer=6)[0].relay
    assert fresh.peers == () and fresh.upstream is None


def two_members(net: Net) -> Staged:
    """A staging with two members, a (10.0.0.1, token 1 x 16) and b (10.0.0.2, token 2 x 16): it is returned."""
    tokens = iter(bytes([n]) * 16 for n in range(1, 10))
    net.scheduler = Scheduler(TIMEOUT, make_token=lambda: next(tokens))
    the_staged = staged()
    net.execute(net.scheduler.stage(the_staged, net.now))
    for peer, host in ((b"a", "10.0.0.1"), (b"b", "10.0.0.2")):
        request = fetch(relay=f"tcp://{host}:1", header_only=True, verify=("sha256",))
        net.scheduler.on_request(peer, request, host, net.now)
    return the_staged


def test_with_members_the_source_sends_first_copies_before_second_copies(net: Net) -> None:
    the_staged = two_members(net)
    net.request(b"a", span(1, 0, 1, the_staged.stage_id))
    net.pump()
    assert net.data(b"a", 1) == [0]
    net.request(b"b", span(2, 0, 1, the_staged.stage_id))  # a second copy of message 0
    net.request(b"a", span(3, 1, 3, the_staged.stage_id))  # messages nobody has been sent
    assert [t.key for t in net.scheduler.next_round()] == [(b"a", 3)]
    net.pump(rounds=1)
    assert net.data(b"a", 3) == [1] and net.data(b"b", 2) == []  # the second copy waited
    net.pump()
    assert net.data(b"a", 3) == [1, 2] and net.data(b"b", 2) == [0]  # and went once none was ready


def test_without_members_every_transfer_has_its_turn(net: Net) -> None:
    step = staged(messages=4)
    net.execute(net.scheduler.stage(step, net.now))
    net.request(b"a", span(1, 0, 2, step.stage_id))
    net.pump()
    net.request(b"b", span(2, 0, 1, step.stage_id))
    net.request(b"a", span(3, 2, 4, step.stage_id))
    assert sorted(t.key for t in net.scheduler.next_round()) == [(b"a", 3), (b"b", 2)]


def test_a_member_asking_the_source_learns_the_others_and_a_peer_says_what_it_holds(net: Net) -> None:
    the_staged = two_members(net)
    a_token = bytes([1]) * 16
    ask = wire.Request(wire.OP_HAVE, 9, stage=the_staged.stage_id, token=a_token)
    (answer,) = net.scheduler.on_request(b"a2", ask, "10.0.0.1", net.now)
    assert isinstance(answer, Have) and answer.bits is None and answer.peers == (("tcp://10.0.0.2:1", bytes([2]) * 16),)
    # As a member itself (a step it relays), this side answers with what has landed and what is coming.
    relay = relayed()
    net.execute(net.scheduler.relay(relay, net.now))
    relay.landed_one(2, None)
    relay.coming = 0b1000
    ask = wire.Request(wire.OP_HAVE, 3, stage=relay.stage_id, token=relay.token)
    (answer,) = net.scheduler.on_request(b"x", ask, "addr", net.now)
    assert isinstance(answer, Have) and (answer.bits, answer.coming, answer.peers) == (0b100, 0b1000, ())
    # Anything else: it serves nothing of that staging.
    (answer,) = net.scheduler.on_request(b"x", wire.Request(wire.OP_HAVE, 4, stage=12345), "addr", net.now)
    assert isinstance(answer, Refuse) and answer.code == wire.ERR_NOT_RELAYING


def test_a_members_paths_on_every_address_it_asks_from_are_believed(net: Net) -> None:
    tokens = iter(bytes([n]) * 16 for n in range(1, 10))
    net.scheduler = Scheduler(TIMEOUT, make_token=lambda: next(tokens))
    the_staged = staged()
    net.execute(net.scheduler.stage(the_staged, net.now))
    # Two NICs: it offers both paths, but its header request comes over the first only.
    offer = "tcp://10.0.0.1:5?paths=10.0.1.1:5,10.9.9.9:5"
    request = fetch(relay=offer, header_only=True, verify=("sha256",))
    net.scheduler.on_request(b"a", request, "10.0.0.1", net.now)
    net.scheduler.on_request(b"b", fetch(relay="tcp://10.0.0.2:5", header_only=True, verify=("sha256",)),
                             "10.0.0.2", net.now)
    a_token, b_token = bytes([1]) * 16, bytes([2]) * 16

    def members_seen_by_b() -> tuple[wire.Peer, ...]:
        ask = wire.Request(wire.OP_HAVE, 9, stage=the_staged.stage_id, token=b_token)
        (answer,) = net.scheduler.on_request(b"b2", ask, "10.0.0.2", net.now)
        assert isinstance(answer, Have)
        return answer.peers

    assert members_seen_by_b() == (("tcp://10.0.0.1:5", a_token),)
    # a asks the source over its second NIC: its path there is believed; 10.9.9.9 (no connection) never is.
    net.scheduler.on_request(b"a2", wire.Request(wire.OP_HAVE, 3, stage=the_staged.stage_id, token=a_token),
                             "10.0.1.1", net.now)
    assert members_seen_by_b() == (("tcp://10.0.0.1:5?paths=10.0.1.1:5", a_token),)
    # Someone else showing a's token from its own address changes nothing a did not offer.
    net.scheduler.on_request(b"x", wire.Request(wire.OP_HAVE, 4, stage=the_staged.stage_id, token=a_token),
                             "10.6.6.6", net.now)
    assert members_seen_by_b() == (("tcp://10.0.0.1:5?paths=10.0.1.1:5", a_token),)


def test_receivers_on_the_sources_own_host_join_no_swarm(net: Net) -> None:
    net.scheduler = Scheduler(TIMEOUT, is_local=lambda address: address == "10.1.2.3")
    net.execute(net.scheduler.stage(staged(), net.now))
    request = fetch(relay="tcp://10.1.2.3:1", header_only=True, verify=("sha256",))
    (local,) = net.scheduler.on_request(b"a", request, "10.1.2.3", net.now)
    request = fetch(relay="tcp://10.9.9.9:1", header_only=True, verify=("sha256",))
    (remote,) = net.scheduler.on_request(b"b", request, "10.9.9.9", net.now)
    assert isinstance(local, SendHeader) and local.relay is None
    assert isinstance(remote, SendHeader) and remote.relay is not None
    assert [member.at for member in net.scheduler.swarm.members] == ["tcp://10.9.9.9:1"]


def test_receiver_without_relay_offer_is_served_by_the_source(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"a", fetch(relay="tcp://a:1"))
    net.request(b"b", fetch())
    net.pump()
    assert net.data(b"b") == [0, 1, 2, 3]


def test_relayed_messages_go_out_only_once_landed_and_stop_ends_them(net: Net) -> None:
    relay = relayed()
    net.execute(net.scheduler.relay(relay, net.now))
    request = fetch(xfer=3, credit=6, span=(0, 6), stage=relay.stage_id, token=relay.token)
    net.request(b"down", request)
    net.pump()
    assert net.data(b"down") == []  # nothing has landed yet
    relay.landed_one(0, None)
    relay.landed_one(1, 7)
    relay.landed_one(3, None)
    net.pump()
    assert net.data(b"down") == [0, 1]  # in order: 2 has not landed
    actions = net.scheduler.stop_relay(relay.token)
    assert [a.code for a in actions if isinstance(a, Abort)] == [wire.ERR_NOT_RELAYING]
    relay.landed_one(2, None)
    net.pump()
    assert net.data(b"down") == [0, 1]
    # A span fetch that comes after the stop is refused at once, not held for the registration grace.
    net.request(b"late", fetch(xfer=4, credit=2, span=(2, 4), stage=relay.stage_id, token=relay.token))
    assert net.ops(b"late") == [("error", wire.ERR_NOT_RELAYING)]
    assert net.scheduler.relaying.waiting == []


def test_a_relay_ends_each_span_with_what_it_holds_and_is_fetching(net: Net) -> None:
    # Its downstream, which will ask it for more, learns that without a have question (wire.end_reply).
    relay = relayed()
    net.execute(net.scheduler.relay(relay, net.now))
    relay.landed_one(0, None)
    relay.landed_one(1, None)
    relay.landed_one(4, None)
    relay.coming = 0b100000
    net.request(b"down", fetch(xfer=3, credit=2, span=(0, 2), stage=relay.stage_id, token=relay.token))
    net.pump()
    assert net.data(b"down") == [0, 1] and net.ops(b"down") == [("end", 0b10011)]
    [(_, xfer, _)] = [m for m in net.inbox[b"down"] if m[0] == "end"]
    end = wire.decode_reply(wire.end_reply(xfer, (relay.have, relay.coming, relay.messages)), False, "a relay")
    assert (end.have, end.coming) == (0b10011, 0b100000)
    assert wire.decode_reply(wire.end_reply(xfer), False, "the source").have is None  # the source's says nothing


def test_span_fetch_to_a_relay_needs_its_token_stage_and_step(net: Net) -> None:
    relay = relayed()
    net.execute(net.scheduler.relay(relay, net.now))
    cases = [
        (relay.token, relay.stage_id + 1, STEP, wire.ERR_WRONG_STEP),
        (relay.token, relay.stage_id, STEP + 1, wire.ERR_WRONG_STEP),
    ]
    for xfer, (token, stage, step, code) in enumerate(cases):
        net.request(b"x", fetch(xfer=xfer, step=step, credit=2, span=(0, 2), stage=stage, token=token))
        assert net.ops(b"x")[-1] == ("error", code)
    # A token this side never registers: refused once the registration grace has passed.
    net.request(b"x", fetch(xfer=5, credit=2, span=(0, 2), stage=relay.stage_id, token=b"W" * 16))
    assert len(net.ops(b"x")) == 2
    net.tick(RELAY_REGISTER_GRACE)
    assert net.ops(b"x")[-1] == ("error", wire.ERR_NOT_RELAYING)
    net.request(b"x", fetch(xfer=9, credit=2, span=(4, 7), stage=relay.stage_id, token=relay.token))
    assert net.ops(b"x")[-1] == ("error", wire.ERR_BAD_REQUEST)
    assert net.scheduler.transfers == {}


def test_disallow_of_the_staged_step_leaves_relayed_transfers_alone(net: Net) -> None:
    relay = relayed()
    net.execute(net.scheduler.relay(relay, net.now))
    net.execute(net.scheduler.stage(staged(), net.now))
    net.request(b"down", fetch(xfer=1, credit=6, span=(0, 6), stage=relay.stage_id, token=relay.token))
    net.request(b"other", fetch(xfer=2))
    assert net.scheduler.disallow(net.now, cap=0) == (1, 8)  # "other": the relayed transfer is not the step's
    net.tick(TIMEOUT)  # the withdrawn step's transfer ends at the timeout; the relayed one is untouched
    assert net.ops(b"other")[-1] == ("error", wire.ERR_DISALLOWED)
    assert list(net.scheduler.transfers) == [(b"down", 1)]


def test_span_fetch_while_nothing_is_staged_is_refused_disallowed_at_once(net: Net) -> None:
    net.request(b"a", fetch(xfer=1, credit=2, span=(0, 2), stage=5))
    assert net.ops(b"a") == [("error", wire.ERR_DISALLOWED)]
    assert net.scheduler.parked == []


def test_relayed_payload_is_a_copy_and_none_after_stop() -> None:
    from zmqtransport.relayed import RelayStopped

    relay = relayed(messages=3)
    relay.landed_one(0, None)
    data, references = relay.payload(0)
    assert isinstance(data, bytes) and not references
    relay.stop()
    assert not relay.available(1)
    with pytest.raises(RelayStopped):
        relay.payload(0)


@pytest.mark.parametrize(
    "fields",
    [
        {"relay": ""},
        {"relay": 5},
        {"relay": "x" * 5000},
        {"token": b"t" * 16},  # a token only on a span fetch
        {"span": [0, 2], "stage": 1, "token": b"short"},
        {"span": [0, 2], "stage": 1, "token": "t" * 16},
    ],
)
def test_malformed_relay_fields_are_refused(fields: dict[str, Any]) -> None:
    message = {"v": wire.PROTOCOL_VERSION, "op": wire.OP_FETCH, "id": 1, "step": 1, "wait_ms": 0, "credit": 1}
    with pytest.raises(ProtocolError):
        wire.decode_request(msgpack.packb({**message, **fields}))


@pytest.mark.parametrize(
    "order",
    [
        [1, 2],
        {"token": b"x"},
        {"token": b"t" * 16, "from": "tcp://a:1"},  # no from_token
        {"token": b"t" * 16, "from": 7, "from_token": b"u" * 16},
        {"token": b"t" * 16, "from": "tcp://a:1", "from_token": b"u"},
    ],
)
def test_malformed_relay_orders_are_refused(order: Any) -> None:
    with pytest.raises(ProtocolError):
        wire.decode_relay_order(order)


def test_relay_order_round_trips() -> None:
    order = wire.RelayOrder(b"t" * 16, "tcp://a:1", b"u" * 16, (("tcp://a:1", b"u" * 16), ("tcp://b:2", b"v" * 16)))
    envelope = msgpack.unpackb(wire.header_envelope(3, 4, order))
    assert wire.decode_relay_order(envelope["relay"]) == order
    assert "relay" not in msgpack.unpackb(wire.header_envelope(3, 4))


def test_have_questions_and_answers_round_trip() -> None:
    request = wire.decode_request(wire.have_request(7, 99, b"t" * 16))
    assert (request.op, request.xfer, request.stage, request.token) == (wire.OP_HAVE, 7, 99, b"t" * 16)
    peers = (("tcp://a:1", b"u" * 16),)
    reply = wire.decode_reply(wire.have_reply(7, 0b1011, 12, peers, coming=0b100), False, "x")
    assert (reply.op, reply.have, reply.coming, reply.peers) == (wire.OP_HAVE, 0b1011, 0b100, peers)
    everything = wire.decode_reply(wire.have_reply(7, None, 12), False, "x")
    assert everything.have is None and everything.peers == () and everything.coming == 0


@pytest.mark.parametrize(
    "fields",
    [{"bits": "1"}, {"coming": 3}, {"peers": "x"}, {"peers": [["tcp://a:1"]]}, {"peers": [["tcp://a:1", b"x"]]},
     {"peers": [[7, b"t" * 16]]}, {"peers": [["tcp://a:1", b"t" * 16]] * (wire.MAX_PEERS + 1)}],
)
def test_malformed_have_replies_are_refused(fields: dict[str, Any]) -> None:
    message = {"v": wire.PROTOCOL_VERSION, "op": wire.OP_HAVE, "id": 1, **fields}
    with pytest.raises(ProtocolError):
        wire.decode_reply(msgpack.packb(message), False, "the peer")


def test_relayed_downstream_peers_are_tracked_until_their_connection_closes(net: Net) -> None:
    relay = relayed()
    net.execute(net.scheduler.relay(relay, net.now))
    assert not relay.served and not relay.peers
    net.request(b"down", fetch(xfer=1, credit=6, span=(0, 6), stage=relay.stage_id, token=relay.token))
    assert relay.served and relay.peers == {b"down"}
    net.scheduler.disconnected(b"down")  # its receive ended: the relay's tail may end
    assert relay.peers == set()


def test_a_relay_publishes_which_landings_its_transfers_wait_for(net: Net) -> None:
    # The receiving thread wakes the serving thread only for the messages published here
    # (RelayDuty.landed): a transfer with credit whose next message has not landed.
    relay = relayed()
    net.execute(net.scheduler.relay(relay, net.now))
    relay.landed_one(0, None)
    relay.landed_one(1, None)
    net.request(b"down", fetch(xfer=1, credit=6, span=(0, 6), stage=relay.stage_id, token=relay.token))
    net.request(b"other", fetch(xfer=2, credit=6, span=(4, 6), stage=relay.stage_id, token=relay.token))
    relaying = net.scheduler.relaying
    relaying.mark_awaited(net.scheduler.transfers.values())
    assert relay.awaited == 0b10000  # b"down" can send what has landed: only b"other" waits (for 4)
    net.pump()
    assert net.data(b"down", 1) == [0, 1]
    relaying.mark_awaited(net.scheduler.transfers.values())
    assert relay.awaited == 0b10100  # now both wait: for 2 and for 4
    relay.landed_one(2, None)
    net.pump()
    relaying.mark_awaited(net.scheduler.transfers.values())
    assert relay.awaited == 0b11000 and net.data(b"down", 1) == [0, 1, 2]
    # A transfer held back for its connection, or out of credit, waits for no landing.
    net.scheduler.transfers[(b"other", 2)].paused = True
    net.scheduler.transfers[(b"down", 1)].credit = 0
    relaying.mark_awaited(net.scheduler.transfers.values())
    assert relay.awaited == 0


def test_a_relaying_receive_wakes_the_serving_thread_only_for_an_awaited_landing() -> None:
    from zmqtransport.fetch.relaying import RelayDuty

    class Host:
        def __init__(self) -> None:
            self.pokes = 0

        def relay(self, relayed: Any) -> None:
            pass

        def poke(self) -> None:
            self.pokes += 1

        def stop_relay(self, token: bytes, timeout: float) -> bool:
            return True

    host = Host()
    relay = relayed()
    duty = RelayDuty(host, relay)
    relay.served = True  # a downstream has asked
    duty.landed(0, None)
    assert host.pokes == 0 and relay.available(0)  # nobody waits for 0: a downstream asks for it later
    relay.awaited = 0b100
    duty.landed(1, None)
    assert host.pokes == 0
    duty.landed(2, None)
    assert host.pokes == 1


def test_span_fetch_before_the_relay_registered_its_token_starts_when_it_does(net: Net) -> None:
    # The source may send a downstream here while this receiver is still
    # parsing the header it registers the token after.
    relay = relayed()
    net.request(b"down", fetch(xfer=1, credit=6, span=(0, 6), stage=relay.stage_id, token=relay.token))
    assert net.inbox == {} and net.scheduler.transfers == {}
    net.tick(RELAY_REGISTER_GRACE / 2)
    net.execute(net.scheduler.relay(relay, net.now))
    assert list(net.scheduler.transfers) == [(b"down", 1)]
    relay.landed_one(0, None)
    net.pump()
    assert net.data(b"down", 1) == [0]
    net.tick(RELAY_REGISTER_GRACE)
    assert net.ops(b"down") == []  # never refused


def test_the_source_reserves_each_message_for_one_member_and_then_says_none_are_left(net: Net) -> None:
    the_staged = two_members(net)
    a_token, b_token = bytes([1]) * 16, bytes([2]) * 16

    def claim(token: bytes, count: int, xfer: int) -> tuple[int, ...] | None:
        ask = wire.Request(wire.OP_HAVE, xfer, stage=the_staged.stage_id, token=token, claim=count)
        (answer,) = net.scheduler.on_request(b"q", ask, "10.0.0.1", net.now)
        assert isinstance(answer, Have)
        return answer.claimed

    runs = [claim(token, 4, n) for n, token in enumerate([a_token, b_token] * the_staged.messages)]
    granted = [run for run in runs if run]
    reserved = [seq for first, stop in granted for seq in range(first, stop)]  # type: ignore[misc]
    assert sorted(reserved) == list(range(the_staged.messages))  # every message once, to one member
    assert all(stop - first <= 4 for first, stop in granted)  # type: ignore[misc]
    assert runs[len(granted)] == ()  # then: none are left
    # A question that claims nothing, or a token no member has, reserves nothing.
    assert claim(a_token, 0, 99) is None
    assert claim(bytes([9]) * 16, 4, 100) is None
    # A new staging: a new swarm, nothing reserved.
    net.execute(net.scheduler.stage(staged(), net.now))
    assert net.scheduler.swarm.claimed == 0


def test_claims_round_trip_and_malformed_ones_are_refused() -> None:
    request = wire.decode_request(wire.have_request(7, 99, b"t" * 16, claim=4))
    assert (request.token, request.claim) == (b"t" * 16, 4)
    assert wire.decode_request(wire.have_request(7, 99, b"t" * 16)).claim == 0
    for claimed in ((3, 7), ()):
        reply = wire.decode_reply(wire.have_reply(7, None, 12, claimed=claimed), False, "x")
        assert reply.claimed == claimed
    assert wire.decode_reply(wire.have_reply(7, None, 12), False, "x").claimed is None  # an earlier release
    have = {"v": wire.PROTOCOL_VERSION, "op": wire.OP_HAVE, "id": 1, "stage": 2}
    for fields in ({"claim": 4}, {"claim": -1, "token": b"t" * 16}, {"claim": 1 << 20, "token": b"t" * 16},
                   {"claim": "4", "token": b"t" * 16}):
        with pytest.raises(ProtocolError):
            wire.decode_request(msgpack.packb({**have, **fields}))
    for claimed in ([1], [5, 5], [3, 1], ["a", 2], 7, [0, wire.MAX_MESSAGES + 1]):
        message = {"v": wire.PROTOCOL_VERSION, "op": wire.OP_HAVE, "id": 1, "claimed": claimed}
        with pytest.raises(ProtocolError):
            wire.decode_reply(msgpack.packb(message), False, "the source")
