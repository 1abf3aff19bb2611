"""What runs on after disallow_checkpoint (issue 23), without sockets: the scheduler with a fake clock,
the frames libzmq holds, and the snapshot itself (host memory, and device memory through the
CPU test doubles of ``zmqtransport.testing``)."""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

import pytest
import torch

from zmqtransport import wire
from zmqtransport.device import DeviceStaging
from zmqtransport.serve.actions import Have
from zmqtransport.serve.frames import PAUSED_POLL, PINNED_DRAIN, HeldFrames
from zmqtransport.serve.scheduler import Scheduler
from zmqtransport.serve.snapshot import BATCH_BYTES, Run, Snapshot, plan_runs, take
from zmqtransport.serve.staged import Staged, stage
from zmqtransport.serve.withdrawn import RECHECK, Withdrawn
from zmqtransport.testing import FakeDevice

from .test_scheduler import STEP, TIMEOUT, FakeTracker, Net, credit, fetch, span, staged

BIG = 1 << 40  # a cap nothing here reaches
STALL = 2.0


def fake_snapshot(withdrawn: Withdrawn, seqs: list[int]) -> Snapshot:
    """What serve/snapshot.take returns, for a staging whose messages are one byte each (staged())."""
    source = withdrawn.staged
    views = {seq: memoryview(bytes([seq % 256])) for seq in seqs}
    return Snapshot(source.step, source.stage_id, source.plan, None, source.crcs, views, len(seqs), 0, 0)


def take_due(net: Net) -> list[list[int]]:
    """What the server does after every event: copy the withdrawn stagings that fit their cap."""
    withdrawals, transfers = net.scheduler.withdrawals, net.scheduler.transfers
    taken = []
    for withdrawn, seqs in withdrawals.due(transfers.values(), net.now):
        withdrawals.snapshotted(withdrawn, fake_snapshot(withdrawn, seqs), transfers.values())
        taken.append(seqs)
    return taken


def reading(net: Net) -> bool:
    return net.scheduler.withdrawals.reading_caller_memory


def one_running(net: Net, messages: int, credit: int, cap: int) -> None:
    """Stage ``messages``, let receiver "a" take ``credit`` of them, then disallow with ``cap``."""
    net.execute(net.scheduler.stage(staged(messages=messages), net.now))
    net.request(b"a", fetch(credit=credit))
    net.pump()
    net.scheduler.disallow(net.now, cap=cap)


def two_running(net: Net) -> tuple[Staged, tuple[int, int]]:
    """Receiver "a" took 3 of 10 messages and "b" 5 when the step is disallowed (no cap)."""
    step = staged(messages=10)
    net.execute(net.scheduler.stage(step, net.now))
    net.request(b"a", fetch(credit=3))
    net.request(b"b", fetch(credit=5))
    net.pump()
    return step, net.scheduler.disallow(net.now, BIG)


@pytest.fixture
def net() -> Net:
    return Net(Scheduler(TIMEOUT, stall=STALL))


# ----------------------------------------------------------------------------- whole transfers


def test_disallow_keeps_running_transfers_and_copies_only_what_they_have_not_been_sent(net: Net) -> None:
    step, running = two_running(net)
    assert running == (2, 7)
    assert reading(net)  # until the copy is taken
    assert take_due(net) == [[3, 4, 5, 6, 7, 8, 9]]  # a has 0..2, b 0..4: the union of the rest
    withdrawn = net.scheduler.withdrawals.by_stage[step.stage_id]
    assert net.scheduler.withdrawals.held(withdrawn, net.now) == 0b1111111000  # what a have question is told
    assert not reading(net)
    assert all(isinstance(t.staged, Snapshot) for t in net.scheduler.transfers.values())
    net.request(b"a", credit(1, 16))
    net.request(b"b", credit(1, 16))
    net.pump()
    assert net.data(b"a") == list(range(10)) and net.data(b"b") == list(range(10))
    assert net.ops(b"a") == net.ops(b"b") == [("header", None), ("end", None)]  # no disallowed
    assert net.scheduler.withdrawals.by_stage == {step.stage_id: net.scheduler.withdrawals.by_stage[step.stage_id]}
    net.tick(0)
    assert net.scheduler.withdrawals.by_stage == {}  # nobody receives it any more: the copy goes


def test_a_new_receive_after_the_disallow_is_parked_not_served(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=10), net.now))
    net.request(b"a", fetch(credit=2))
    net.pump()
    net.scheduler.disallow(net.now, BIG)
    take_due(net)
    net.request(b"c", fetch(xfer=4))
    assert net.inbox.get(b"c") is None and len(net.scheduler.parked) == 1
    net.execute(net.scheduler.stage(staged(step=STEP + 1), net.now))
    assert net.ops(b"c") == [("error", wire.ERR_WRONG_STEP)]


def test_nothing_running_nothing_kept(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=10), net.now))
    assert net.scheduler.disallow(net.now, BIG) == (0, 0)
    assert net.scheduler.withdrawals.by_stage == {} and not reading(net)
    assert take_due(net) == []


# ----------------------------------------------------------------------------- readers and span fetches


def test_a_reader_may_ask_any_span_so_its_snapshot_holds_every_message(net: Net) -> None:
    step = staged(messages=10)
    net.execute(net.scheduler.stage(step, net.now))
    net.request(b"r", fetch(header_only=True))
    net.request(b"r", span(2, 0, 4, step.stage_id))
    net.pump()
    assert net.data(b"r", 2) == [0, 1, 2, 3]
    assert net.scheduler.disallow(net.now, BIG) == (1, 10)
    assert take_due(net) == [list(range(10))]  # spans it has not asked for yet are needed too
    # Its spans come over other connections (routing ids) too.
    net.request(b"r2", span(3, 4, 10, step.stage_id))
    net.pump()
    assert net.data(b"r2", 3) == [4, 5, 6, 7, 8, 9] and net.ops(b"r2") == [("end", None)]
    net.request(b"x", span(4, 0, 4, step.stage_id + 1))  # a staging never withdrawn: nothing to serve
    assert net.ops(b"x") == [("error", wire.ERR_DISALLOWED)]
    net.request(b"x", span(5, 0, 4, step.stage_id, step=STEP + 1))
    net.request(b"x", span(6, 8, 11, step.stage_id))
    assert net.ops(b"x")[1:] == [("error", wire.ERR_WRONG_STEP), ("error", wire.ERR_BAD_REQUEST)]


def reader_at_a_disallow(net: Net, reader: bytes = b"r") -> Staged:
    """Stage 10 messages, send ``reader`` the header alone, disallow, take the snapshot."""
    step = staged(messages=10)
    net.execute(net.scheduler.stage(step, net.now))
    net.request(reader, fetch(header_only=True))
    net.scheduler.disallow(net.now, BIG)
    take_due(net)
    return step


def test_readers_leave_when_their_connection_closes_or_nothing_moves_for_the_stall_bound(net: Net) -> None:
    reader_at_a_disallow(net)
    net.scheduler.disconnected(b"r")
    net.tick(0)
    assert net.scheduler.withdrawals.by_stage == {}

    again = reader_at_a_disallow(net, b"q")
    net.tick(STALL - 0.1)
    net.request(b"q2", span(7, 0, 2, again.stage_id))  # activity: it is still receiving
    net.pump()
    net.tick(STALL - 0.1)
    assert again.stage_id in net.scheduler.withdrawals.by_stage
    net.tick(0.2)  # quiet for the stall bound: a frozen or vanished receiver is let go
    assert net.scheduler.withdrawals.by_stage == {}
    net.request(b"q2", span(8, 2, 4, again.stage_id))
    assert net.ops(b"q2")[-1] == ("error", wire.ERR_DISALLOWED)


def test_what_a_readers_transfers_moved_counts_after_they_end(net: Net) -> None:
    """A span transfer ends once libzmq has its frames; a slow reader lands them and asks again later."""
    step = reader_at_a_disallow(net)
    net.tick(STALL - 0.5)
    net.request(b"r2", fetch(xfer=7, credit=2, span=(0, 4), stage=step.stage_id))
    net.pump()
    net.tick(STALL - 0.5)
    net.scheduler.progress({(b"r2", 7)}, net.now)  # its frames left: the reader is taking data
    net.tick(0)
    net.scheduler.disconnected(b"r2")  # the transfer is gone with that connection; the reader is not
    net.tick(STALL - 0.1)
    assert step.stage_id in net.scheduler.withdrawals.by_stage
    net.tick(0.2)
    assert net.scheduler.withdrawals.by_stage == {}


def test_readers_are_given_the_rebind_grace_to_come_back(net: Net) -> None:
    """A forced rebind drops every reader's connections and queued data: they need time to ask again."""
    step = reader_at_a_disallow(net)
    net.tick(STALL - 0.5)
    net.scheduler.rebound(net.now)
    grace = net.scheduler.limits.rebind_grace
    assert grace > STALL
    net.tick(grace - 0.1)
    assert step.stage_id in net.scheduler.withdrawals.by_stage
    assert min(net.scheduler.withdrawals.deadlines(net.scheduler.transfers.values())) <= net.now + 0.1
    net.request(b"r3", span(8, 0, 4, step.stage_id))  # back over a new connection
    net.pump()
    assert net.data(b"r3", 8) == [0, 1, 2, 3]
    net.tick(STALL + 0.1)  # then quiet for the stall bound: let go as before
    assert net.scheduler.withdrawals.by_stage == {}


def test_a_swarm_member_is_kept_while_its_peer_receives_and_served_from_the_copy(net: Net) -> None:
    step = staged(messages=10)
    net.execute(net.scheduler.stage(step, net.now))
    for peer, xfer, host, verify in ((b"head", 1, "10.0.0.1", ()), (b"down", 2, "10.0.0.2", ("sha256",))):
        # Each offers to relay at its own address: "head" (which does not verify: it is sent the data at once,
        # as the first member) and "down", which verifies what relays send and is sent to "head".
        offer = fetch(xfer=xfer, credit=2, relay=f"tcp://{host}:1", verify=verify)
        net.execute(net.scheduler.on_request(peer, offer, host, net.now))
    net.pump()
    assert net.ops(b"down") == [("header", None), ("end", None)]
    assert net.scheduler.disallow(net.now, BIG) == (2, 10)  # the downstream may ask for anything
    assert take_due(net) == [list(range(10))]
    for _ in range(3):  # the head takes data for longer than the stall bound: the chain lives
        net.tick(STALL * 0.9)
        net.request(b"head", credit(1, 1))
        net.pump()
    assert step.stage_id in net.scheduler.withdrawals.by_stage
    # Its relay stopped: the downstream asks the source (its standby connection) for the rest.
    net.request(b"down", span(9, 5, 10, step.stage_id))
    net.pump()
    assert net.data(b"down", 9) == [5, 6, 7, 8, 9]
    # Its have questions: the source still holds everything for it.
    (answer,) = net.scheduler.on_request(b"down", wire.Request(wire.OP_HAVE, 11, stage=step.stage_id), "x", net.now)
    assert isinstance(answer, Have) and answer.bits is None and answer.messages == 10
    # And for the source's digests of what its relay sent (serve/digests.py hashes the copy).
    net.request(b"down", span(10, 0, 5, step.stage_id, digests_only=True, verify=("sha256",)))
    digests = net.scheduler.transfers[(b"down", 10)]
    assert digests.digests_only and isinstance(digests.staged, Snapshot)


# ----------------------------------------------------------------------------- the cap, the timeout, stalls


def test_beyond_the_cap_transfers_read_the_tensors_until_what_they_need_fits(net: Net) -> None:
    step = staged(messages=10)  # one byte per message
    net.execute(net.scheduler.stage(step, net.now))
    net.request(b"a", fetch(credit=3))
    net.pump()
    net.scheduler.disallow(net.now, cap=4)
    assert take_due(net) == [] and reading(net)  # 7 needed, 4 allowed
    net.request(b"a", credit(1, 3))
    net.pump()  # served from the staged step meanwhile (the caller still waits)
    assert net.data(b"a") == [0, 1, 2, 3, 4, 5]
    assert take_due(net) == []  # looked at most every RECHECK
    net.now += RECHECK * 1.01
    assert take_due(net) == [[6, 7, 8, 9]]
    assert not reading(net)


def test_a_cap_of_zero_waits_until_the_transfer_ends(net: Net) -> None:
    one_running(net, messages=4, credit=2, cap=0)
    assert take_due(net) == [] and reading(net)
    net.request(b"a", credit(1, 2))
    net.pump()
    net.tick(0)
    assert net.ops(b"a") == [("header", None), ("end", None)]
    assert not reading(net) and net.scheduler.withdrawals.by_stage == {}


def test_the_transport_timeout_ends_what_a_disallow_still_serves(net: Net) -> None:
    one_running(net, messages=100, credit=1, cap=0)
    for _ in range(int(TIMEOUT / 1.0) - 1):  # slow but alive: one message a second
        net.tick(1.0)
        net.request(b"a", credit(1, 1))
        net.pump()
    assert net.ops(b"a") == [("header", None)]
    net.tick(1.0)
    assert net.ops(b"a") == [("header", None), ("error", wire.ERR_DISALLOWED)]
    assert not reading(net)


def test_a_stalled_receive_releases_a_waiting_disallow_at_the_stall_bound(net: Net) -> None:
    one_running(net, messages=100, credit=2, cap=0)
    net.tick(STALL)
    assert reading(net)
    net.tick(0.01)
    assert net.ops(b"a")[-1] == ("error", wire.ERR_STALLED)
    assert not reading(net)


def test_wakeup_covers_the_recheck_and_the_readers_stall(net: Net) -> None:
    step = staged(messages=10)
    net.execute(net.scheduler.stage(step, net.now))
    net.request(b"r", fetch(header_only=True))
    net.scheduler.disallow(net.now, cap=0)
    assert take_due(net) == []
    withdrawals = net.scheduler.withdrawals
    assert min(withdrawals.deadlines([])) - net.now == pytest.approx(RECHECK)  # beyond the cap: look again
    withdrawn = withdrawals.by_stage[step.stage_id]
    withdrawals.snapshotted(withdrawn, fake_snapshot(withdrawn, list(range(10))), [])
    assert min(withdrawals.deadlines([])) - net.now == pytest.approx(STALL)  # when a quiet reader is let go


# ----------------------------------------------------------------------------- paused transfers


def test_a_paused_transfer_waits_for_its_connection_and_stalls_if_it_never_drains(net: Net) -> None:
    net.execute(net.scheduler.stage(staged(messages=100), net.now))
    net.request(b"a", fetch(credit=50))
    transfer = net.scheduler.transfers[(b"a", 1)]
    transfer.paused = True  # what the pump does when HeldFrames.may_send says no
    assert net.scheduler.next_round() == []
    assert net.scheduler.wakeup_in(net.now) > 0  # no busy loop: the frames' look wakes it
    net.scheduler.progress({(b"a", 99)}, net.now)  # another transfer of its connection drained
    assert not transfer.paused and net.scheduler.next_round() == [transfer]
    transfer.paused = True
    net.tick(STALL + 0.01)  # credit left, but nothing drains: stalled all the same
    assert net.ops(b"a")[-1] == ("error", wire.ERR_STALLED)


# ----------------------------------------------------------------------------- frames held by libzmq


A = (b"a", 1)


def test_pinned_frames_wait_while_the_connection_would_take_too_long_to_drain() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    mib = 1 << 20
    assert held.may_send(A, mib)  # nothing queued
    first = FakeTracker()
    held.track(A, first, pinned=True, now=0.0, nbytes=mib)
    assert not held.may_send(A, mib)  # queued, and the drain rate is unknown
    assert held.wakeup_in(0.0) == PAUSED_POLL
    second_transfer = (b"a", 2)
    assert not held.may_send(second_transfer, mib)  # the connection is what drains
    first.done = True
    assert held.poll(0.001) == {A}  # 1 MiB in 1 ms: 1 GB/s
    assert held.wakeup_in(0.001) is None
    budget = int(PINNED_DRAIN * mib / 0.001)  # what drains within PINNED_DRAIN at that rate
    for _ in range(budget // mib):
        assert held.may_send(A, mib)
        held.track(A, FakeTracker(), pinned=True, now=0.001, nbytes=mib)
    assert not held.may_send(A, mib)


def test_a_slow_connection_keeps_a_single_pinned_frame_queued() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    size = 1 << 20
    tracker = FakeTracker()
    held.track(A, tracker, pinned=True, now=0.0, nbytes=size)
    tracker.done = True
    held.poll(0.05)  # 1 MiB in 50 ms: 21 MB/s
    assert held.may_send(A, size)  # nothing queued
    held.track(A, FakeTracker(), pinned=True, now=0.05, nbytes=size)
    assert not held.may_send(A, size)  # a second would take 100 ms to drain


def test_a_waiting_disallow_frees_a_stuck_receivers_frames_even_while_others_run() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    held.track(A, FakeTracker(), pinned=True, now=0.0)
    assert not held.must_close(STALL + 0.1, transfers_running=True)  # no disallow waits: others come first
    done = threading.Event()
    held.wait(done, deadline=100.0)
    assert held.must_close(STALL + 0.1, transfers_running=True)  # a disallow waits for these frames alone


def test_drain_rates_are_forgotten_with_their_connections() -> None:
    held: HeldFrames[FakeTracker] = HeldFrames(STALL)
    tracker = FakeTracker()
    held.track(A, tracker, pinned=True, now=0.0, nbytes=10)
    tracker.done = True
    held.poll(0.001)
    held.track(A, FakeTracker(), pinned=True, now=0.001, nbytes=10)
    assert held.may_send(A, 10)
    held.retain(set())
    assert not held.may_send(A, 10)  # rate unknown again, a frame queued


# ----------------------------------------------------------------------------- the snapshot


def host_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(5)
    return {
        "big": torch.randn(3 * (1 << 20) // 4 + 17, generator=generator),
        "small": [torch.randn(n, generator=generator) for n in (1, 10, 100, 1000)],
        "bytes": torch.arange(256, dtype=torch.uint8),
    }


def staged_of(state: Any, staging: DeviceStaging | None = None, checksum: str | None = None) -> Staged:
    return stage(
        state,
        STEP,
        allow_pickle=False,
        chunk_bytes=1 << 20,
        pack_below=64 << 10,
        checksum=checksum,
        staging=staging or DeviceStaging(),
    )


def payloads(source: Staged | Snapshot, seqs: list[int]) -> list[bytes]:
    return [bytes(source.payload(seq)[0]) for seq in seqs]


def test_plan_runs_coalesce_consecutive_bytes_of_one_storage() -> None:
    piece = wire.Piece
    plan = [[piece(0, 0, 4)], [piece(0, 4, 4)], [piece(1, 0, 2), piece(2, 0, 3)], [piece(0, 12, 4)]]
    assert plan_runs(plan, [0, 1, 2, 3]) == [Run(0, 0, 0, 8), Run(8, 1, 0, 2), Run(10, 2, 0, 3), Run(13, 0, 12, 4)]
    assert plan_runs(plan, [1, 3]) == [Run(0, 0, 4, 4), Run(4, 0, 12, 4)]


def test_a_snapshot_serves_the_staged_bytes_after_the_caller_mutates() -> None:
    state = host_state()
    staged = staged_of(state, checksum="crc32")
    seqs = list(range(1, staged.messages))  # message 0 was sent already
    want = payloads(staged, seqs)
    crcs = [staged.crc(seq, staged.payload(seq)[0]) for seq in seqs]
    staged.crcs[:] = [None] * staged.messages  # the snapshot computes them from its own bytes
    copy = take(staged, seqs, DeviceStaging(), lambda: 0)
    with torch.no_grad():
        state["big"].add_(1.0)
        for tensor in state["small"]:
            tensor.zero_()
        state["bytes"].fill_(0)
    assert payloads(copy, seqs) == want
    assert [copy.crc(seq, copy.payload(seq)[0]) for seq in seqs] == crcs
    assert not copy.available(0) and all(copy.available(seq) for seq in seqs)
    assert copy.nbytes == sum(len(b) for b in want)
    assert all(copy.payload(seq)[1] is False for seq in seqs)  # never the caller's memory


def test_a_snapshot_frame_keeps_its_memory_alive() -> None:
    staged = staged_of(host_state())
    copy = take(staged, list(range(staged.messages)), DeviceStaging(), lambda: 0)
    view = copy.payload(0)[0]
    owner = weakref.ref(view.obj.owner)  # type: ignore[attr-defined]
    want = bytes(view)
    del copy
    gc.collect()
    assert owner() is not None and bytes(view) == want  # a frame libzmq still holds stays valid
    del view
    gc.collect()
    assert owner() is None


def test_a_snapshot_of_device_memory_goes_through_the_copy_engine() -> None:
    """CUDA on CPU: HostCopyEngine performs its copies only when waited for, like a stream."""
    device = FakeDevice(ops_per_query=1)
    staging = device.staging(slots=2, depth=1)
    state = host_state()
    staged = staged_of(state, staging)
    assert staged.device_plan is not None
    seqs = list(range(staged.messages))
    want = payloads(staged_of(host_state()), seqs)
    copy = take(staged, seqs, staging, lambda: 0)
    with torch.no_grad():
        state["big"].add_(1.0)
    assert payloads(copy, seqs) == want  # complete when take returned, before the mutation
    assert sum(engine.copied_bytes for engine in device.engines) == copy.nbytes
    assert copy.device_plan is None  # served from host memory, not through the stager again


def test_default_cap_is_a_share_of_available_memory() -> None:
    from zmqtransport.serve.snapshot import DEFAULT_CAP_SHARE, default_cap

    cap = default_cap()
    assert cap > 0
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert cap <= total * DEFAULT_CAP_SHARE



def test_the_copy_runs_from_the_end_and_stops_where_the_network_has_been() -> None:
    big = {"w": torch.arange(12 * BATCH_BYTES // 4, dtype=torch.int32)}  # 12 batches of 8 messages
    staged = staged_of(big)
    seqs = list(range(staged.messages))
    looks: list[int] = []

    def floor() -> int:  # the network moves on as the copy goes: 10 messages per look
        looks.append(10 * len(looks))
        return looks[-1]

    copy = take(staged, seqs, DeviceStaging(), floor)
    held = sorted(copy.views)
    assert held == list(range(held[0], staged.messages)) and held[0] >= looks[-2]
    assert 0 < copy.nbytes < staged.total_bytes  # they met in the middle: the front was never copied
    assert payloads(copy, held) == payloads(staged, held)


def test_floors_follow_the_slowest_whole_transfer_and_stay_zero_for_readers(net: Net) -> None:
    two_running(net)
    withdrawals = net.scheduler.withdrawals
    (withdrawn, seqs), = withdrawals.due(net.scheduler.transfers.values(), net.now)
    assert withdrawn.copying and seqs == list(range(3, 10))
    assert withdrawals.due(net.scheduler.transfers.values(), net.now + 1) == []  # one copy at a time
    withdrawals.publish_floors(net.scheduler.transfers.values())
    assert withdrawn.floor == 3
    net.request(b"a", credit(1, 4))
    net.pump()
    withdrawals.publish_floors(net.scheduler.transfers.values())
    assert withdrawn.floor == 5  # a is at 7 now, b still at 5
    withdrawals.copy_failed(withdrawn)  # no memory: the receives are waited for instead
    assert not withdrawn.copying and withdrawals.due(net.scheduler.transfers.values(), net.now + 1) == []
    assert reading(net)

    again = staged(messages=10)
    net.execute(net.scheduler.stage(again, net.now))
    net.request(b"r", fetch(xfer=3, header_only=True))
    net.scheduler.disallow(net.now, BIG)
    (reader_withdrawn, _), = withdrawals.due(net.scheduler.transfers.values(), net.now)
    withdrawals.publish_floors(net.scheduler.transfers.values())
    assert reader_withdrawn.floor == 0
