"""Device staging (docs/cuda.md): pinned rings, the send stager and the receive unstager.

The scheduling logic runs on CPU with the deferred fake copy engine
(``zmqtransport.testing.HostCopyEngine``), whose host buffers start as 0xA5
garbage and whose copies only happen when an event is queried or waited for:
a message sent, or a bounce buffer reused, before its copy completed shows
up as wrong bytes. The CUDA tests at the end skip without a GPU; run them with
``scripts/device_check.sh`` on a machine that has one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from zmqtransport import ZMQTransport, buffers, wire
from zmqtransport.codec import skeleton, tensors
from zmqtransport.device import (
    CPU,
    DeviceStaging,
    PinnedRing,
    RecvUnstager,
    SendPlan,
    SendStager,
    cuda_engine,
    fresh_device,
    prepare_send,
    storage_bytes,
    tensor_bytes,
)
from zmqtransport.errors import RemoteError
from zmqtransport.testing import FakeDevice, HostCopyEngine

from .conftest import TIMEOUT, fetch_racing_disallow

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU: run scripts/device_check.sh on a machine with one")

CHUNK = wire.MIN_CHUNK_BYTES  # 4 KiB: many messages from small tensors
PACK_BELOW = 1024


@dataclass
class FakeTracker:
    """A pyzmq MessageTracker stand-in whose release the test controls."""

    done: bool = False


@dataclass
class FakeLanding:
    """A receive destination as RecvUnstager sees it."""

    view: memoryview
    device_bytes: torch.Tensor | None


def _sample_state(step: int = 1) -> dict[str, Any]:
    """Large tensors (several messages each), packed small ones, aliases, and plain leaves."""
    generator = torch.Generator().manual_seed(step)
    base = torch.randn(4096, generator=generator)
    return {
        "big": torch.randn(5000, generator=generator),  # 20000 bytes: 5 messages of 4 KiB
        "bf16": torch.randn(3000, generator=generator).to(torch.bfloat16),
        "ints": torch.arange(2500, dtype=torch.int64) * step,
        "small": [torch.full((n,), float(n + step)) for n in (1, 7, 30, 100)],
        "views": {"whole": base, "slice": base[100:200], "strided": base[::3]},
        "flag": torch.tensor(step % 2 == 0),
        "meta": {"step": step, "name": "sample"},
    }


def _assert_same(got: Any, want: Any) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want.cpu())
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            _assert_same(got[key], want[key])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    else:
        assert got == want


def _expected_stream(encoded: tensors.EncodedTree, plan: list[list[wire.Piece]]) -> list[bytes]:
    """The bytes of every data message, read straight from host memory."""
    return [
        b"".join(bytes(encoded.storages[p.storage].view(p.start, p.start + p.length)) for p in pieces)
        for pieces in plan
    ]


def _plan_for(state: Any, staging: DeviceStaging) -> tuple[SendPlan, list[bytes]]:
    encoded = skeleton.encode_tree(state)
    plan = wire.plan_chunks([ref.nbytes for ref in encoded.storages], CHUNK, PACK_BELOW)
    send_plan = prepare_send(encoded, plan, staging)
    assert send_plan is not None
    return send_plan, _expected_stream(encoded, plan)


def _serve(
    stager: SendStager,
    key: Any,
    plan: SendPlan,
    *,
    credit: int = 16,
    trackers: list[FakeTracker] | None = None,
    on_take: Any = None,
) -> list[bytes]:
    """Drive the stager as the serving thread does, one transfer, releasing frames at once."""
    out: list[bytes] = []
    seq = 0
    while seq < len(plan.chunks):
        if not stager.ready(key, plan, seq, credit):
            stager.wait(0.001)
            continue
        view = stager.take(key, seq)
        assert view is not None
        if on_take is not None:
            on_take(seq)
        out.append(bytes(view))
        tracker = FakeTracker(done=trackers is None)
        if trackers is not None:
            trackers.append(tracker)
        stager.sent(key, seq, tracker)
        seq += 1
    return out


# ----------------------------------------------------------------------------- the ring


def test_ring_back_pressure_and_reuse_only_after_copy_and_frame_release() -> None:
    fake = FakeDevice()
    engine = HostCopyEngine(ops_per_query=0)  # copies run only when synchronised
    ring = PinnedRing(3, fake.host_buffer)
    slots = [ring.acquire("a", 100) for _ in range(3)]
    assert all(slot is not None for slot in slots)
    assert ring.acquire("a", 100) is None  # all three held: back-pressure
    first, second, third = (s for s in slots if s is not None)

    engine.copy([(first.buffer[:100], torch.arange(100, dtype=torch.uint8))])
    ring.release(first, event=engine.record())
    assert ring.acquire("b", 100) is None  # its copy has not run yet
    engine.synchronize()
    assert ring.acquire("b", 100) is first  # reused, not reallocated
    assert torch.equal(first.buffer[:100], torch.arange(100, dtype=torch.uint8))

    tracker = FakeTracker()
    ring.release(second, tracker=tracker)
    assert ring.acquire("c", 100) is None  # libzmq still holds the frame
    tracker.done = True
    assert ring.acquire("c", 100) is second
    assert ring.allocations == 3

    ring.release(third)
    grown = ring.acquire("d", 1000)  # a larger message: that buffer grows once
    assert grown is third and third.buffer.numel() >= 1000
    assert ring.allocations == 4


def test_ring_allocates_lazily_and_prefers_reuse() -> None:
    fake = FakeDevice()
    ring = PinnedRing(8, fake.host_buffer)
    for _ in range(20):
        slot = ring.acquire("x", 64)
        assert slot is not None
        ring.release(slot)
    assert ring.allocations == 1 and len(fake.buffers) == 1


# ----------------------------------------------------------------------------- sending


def test_send_stager_bytes_order_and_lookahead() -> None:
    fake = FakeDevice()
    staging = fake.staging(slots=4, depth=2)
    plan, expected = _plan_for(_sample_state(), staging)
    assert all(plan.chunks) and len(plan.chunks) > 8
    stager = SendStager(staging)
    ahead: list[int] = []
    n = len(plan.chunks)

    def on_take(seq: int) -> None:
        engine = fake.engines[0]
        issued = engine.copies + engine.pending  # pieces whose copy was issued
        # Never more than depth (2) messages issued counting the one going out...
        assert issued <= sum(len(plan.pieces[s]) for s in range(min(seq + 2, n)))
        # ...and the next one is already on its way (the pipelining).
        ahead.append(issued - sum(len(plan.pieces[s]) for s in range(seq + 1)))

    got = _serve(stager, "t", plan, on_take=on_take)
    assert got == expected
    assert max(ahead) > 0
    assert len(fake.engines) == 1  # one engine (stream) per device
    engine = fake.engines[0]
    # Copies ran in message order, piece by piece.
    sources = [
        plan.source(p.storage)[p.start : p.start + p.length].data_ptr() for pieces in plan.pieces for p in pieces
    ]
    assert engine.order == sources
    assert stager.ring.allocations <= 4


def test_send_stager_credit_bounds_lookahead() -> None:
    fake = FakeDevice()
    staging = fake.staging(slots=4, depth=4)
    plan, expected = _plan_for(_sample_state(), staging)
    stager = SendStager(staging)

    def on_take(seq: int) -> None:
        # With credit 1, only the message about to be sent may be staged.
        assert fake.engines[0].pending == 0
        assert stager.ring.allocations == 1

    assert _serve(stager, "t", plan, credit=1, on_take=on_take) == expected


def test_send_stager_back_pressure_until_libzmq_releases_frames() -> None:
    fake = FakeDevice()
    staging = fake.staging(slots=3, depth=3)
    plan, expected = _plan_for(_sample_state(), staging)
    stager = SendStager(staging)
    trackers: list[FakeTracker] = []
    sent: list[bytes] = []
    seq = 0
    for _ in range(1000):  # until every buffer is stuck behind an unreleased frame
        if not stager.ready("t", plan, seq, 16):
            stager.wait(0.001)
            if all(not t.done for t in trackers) and len(trackers) == 3:
                break
            continue
        view = stager.take("t", seq)
        assert view is not None
        sent.append(bytes(view))
        trackers.append(FakeTracker())
        stager.sent("t", seq, trackers[-1])
        seq += 1
    assert seq == 3  # three frames in flight, three buffers: nothing more can be staged
    for _ in range(5):
        assert not stager.ready("t", plan, seq, 16)
    trackers[0].done = True  # libzmq wrote the first frame out: a buffer is free
    for _ in range(10):  # its copy is issued now and completes a query or two later
        if stager.ready("t", plan, seq, 16):
            break
        stager.wait(0.001)
    else:
        raise AssertionError("a released buffer was not reused")
    for tracker in trackers:
        tracker.done = True
    rest = _serve_from(stager, "t", plan, seq)
    assert sent + rest == expected
    assert stager.ring.allocations == 3


def _serve_from(stager: SendStager, key: Any, plan: SendPlan, seq: int) -> list[bytes]:
    out: list[bytes] = []
    while seq < len(plan.chunks):
        if not stager.ready(key, plan, seq, 16):
            stager.wait(0.001)
            continue
        view = stager.take(key, seq)
        assert view is not None
        out.append(bytes(view))
        stager.sent(key, seq, FakeTracker(done=True))
        seq += 1
    return out


def test_send_stager_never_hands_out_a_message_before_its_copy_completed() -> None:
    fake = FakeDevice(ops_per_query=0)  # copies run only on synchronize
    staging = fake.staging(slots=2, depth=2)
    plan, expected = _plan_for(_sample_state(), staging)
    stager = SendStager(staging)
    assert not stager.ready("t", plan, 0, 16)
    assert stager.take("t", 0) is None  # buffer still holds 0xA5 garbage
    stager.synchronize()
    assert stager.ready("t", plan, 0, 16)
    view = stager.take("t", 0)
    assert view is not None and bytes(view) == expected[0]


def test_send_stager_reuses_buffers_across_steps_and_transfers() -> None:
    fake = FakeDevice()
    staging = fake.staging(slots=4, depth=2)
    stager = SendStager(staging)
    for step in (1, 2, 3):
        plan, expected = _plan_for(_sample_state(step), staging)
        assert _serve(stager, ("peer", step), plan) == expected
        stager.retain(())  # the transfer finished
    assert stager.ring.allocations <= 4
    assert len(fake.buffers) == stager.ring.allocations
    assert len(fake.engines) == 1


def test_send_stager_shares_the_ring_between_transfers() -> None:
    fake = FakeDevice()
    staging = fake.staging(slots=4, depth=4)
    plan, expected = _plan_for(_sample_state(), staging)
    stager = SendStager(staging)
    outputs: dict[str, list[bytes]] = {"a": [], "b": []}
    seqs = {"a": 0, "b": 0}
    for _ in range(10_000):
        if all(seqs[k] == len(plan.chunks) for k in seqs):
            break
        for key, seq in list(seqs.items()):  # round robin, as the server pumps transfers
            if seq == len(plan.chunks):
                continue
            if not stager.ready(key, plan, seq, 16):
                stager.wait(0.0005)
                continue
            view = stager.take(key, seq)
            assert view is not None
            outputs[key].append(bytes(view))
            stager.sent(key, seq, FakeTracker(done=True))
            seqs[key] += 1
    assert outputs["a"] == expected and outputs["b"] == expected
    assert stager.ring.allocations <= 4


def test_send_stager_retain_and_synchronize_leave_no_copy_pending() -> None:
    fake = FakeDevice(ops_per_query=0)
    staging = fake.staging(slots=4, depth=4)
    plan, _ = _plan_for(_sample_state(), staging)
    stager = SendStager(staging)
    assert not stager.ready("t", plan, 0, 16)  # issues four messages' copies
    assert fake.engines[0].pending > 0
    stager.retain(())
    stager.synchronize()  # what disallow_checkpoint does
    assert fake.engines[0].pending == 0
    assert all(slot.idle() for slot in stager.ring.slots)


def test_prepare_send_is_none_for_host_memory_by_default() -> None:
    encoded = skeleton.encode_tree(_sample_state())
    plan = wire.plan_chunks([ref.nbytes for ref in encoded.storages], CHUNK, PACK_BELOW)
    assert prepare_send(encoded, plan, DeviceStaging()) is None


def test_mixed_packed_message_copies_host_pieces_directly() -> None:
    """A packed message with a staged and an unstaged storage (CUDA beside CPU, on CPU)."""
    fake = FakeDevice()
    staging = fake.staging(slots=2, depth=1)
    encoded = skeleton.encode_tree({"a": torch.arange(10.0), "b": torch.arange(20.0)})
    plan = wire.plan_chunks([ref.nbytes for ref in encoded.storages], CHUNK, PACK_BELOW)
    send_plan = prepare_send(encoded, plan, staging)
    assert send_plan is not None and len(plan) == 1
    send_plan.staged[1] = False  # as if "b" were host memory beside a device "a"
    stager = SendStager(staging)
    assert _serve(stager, "t", send_plan) == _expected_stream(encoded, plan)
    assert fake.engines[0].copies == 1


# ----------------------------------------------------------------------------- receiving


def _landings(sizes: list[int], host: set[int]) -> tuple[list[FakeLanding], list[torch.Tensor]]:
    targets = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    landings = [
        FakeLanding(
            buffers.tensor_view(t) if i in host else memoryview(b""),
            None if i in host else tensor_bytes(t),
        )
        for i, t in enumerate(targets)
    ]
    return landings, targets


def _receive(unstager: RecvUnstager, plan: list[list[wire.Piece]], sources: list[torch.Tensor]) -> None:
    """What receive_data does per message: recv_into the bounce buffer, then deliver."""
    for pieces in plan:
        length = wire.chunk_length(pieces)
        if not unstager.wants(pieces):
            continue
        buffer = unstager.buffer(length)
        at = 0
        for p in pieces:  # the frame's bytes, as recv_into would write them
            buffer[at : at + p.length] = buffers.tensor_view(sources[p.storage])[p.start : p.start + p.length]
            at += p.length
        unstager.deliver(pieces)


def test_recv_unstager_lands_bytes_with_back_pressure_and_reuse() -> None:
    fake = FakeDevice(ops_per_query=0)  # copies wait until someone synchronises
    staging = fake.staging(slots=2, depth=1)
    sizes = [20000, 9000, 300, 40, 500]
    plan = wire.plan_chunks(sizes, CHUNK, PACK_BELOW)
    for step in (1, 2):
        sources = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in sizes]
        landings, targets = _landings(sizes, host={3})
        unstager = RecvUnstager.borrow(staging, landings)
        assert unstager is not None
        _receive(unstager, plan, sources)
        engine = fake.engines[-1]
        # Two buffers for many messages: each new message waited for the oldest copy.
        assert engine.copies > 0
        assert unstager.ring.allocations <= 2
        assert engine.after_current_calls == step  # ordered after the caller's stream
        unstager.close()
        assert engine.pending == 0
        for source, target in zip(sources, targets, strict=True):
            assert torch.equal(source, target)
    assert len(fake.buffers) <= 2  # the same kit served both receives
    assert len(fake.engines) == 1


def test_recv_unstager_is_none_without_device_destinations() -> None:
    landings = [FakeLanding(memoryview(bytearray(10)), None)]
    assert RecvUnstager.borrow(DeviceStaging(), landings) is None


def test_recv_unstager_close_synchronises_on_error_paths() -> None:
    fake = FakeDevice(ops_per_query=0)
    staging = fake.staging(slots=4, depth=1)
    sizes = [8192]
    landings, _ = _landings(sizes, host=set())
    unstager = RecvUnstager.borrow(staging, landings)
    assert unstager is not None
    unstager.buffer(CHUNK)
    unstager.deliver([wire.Piece(0, 0, CHUNK)])
    unstager.buffer(CHUNK)  # a message half received when the error struck
    unstager.close()
    assert fake.engines[0].pending == 0
    assert all(slot.idle() for slot in unstager.ring.slots)
    unstager.close()  # idempotent


# ----------------------------------------------------------------------------- small helpers


def test_storage_and_tensor_bytes_are_views() -> None:
    base = torch.arange(10, dtype=torch.int32)
    whole = storage_bytes(base[2:5])
    assert whole.numel() == 40 and whole.data_ptr() == base.data_ptr()
    part = tensor_bytes(base[2:5])
    assert part.numel() == 12 and part.data_ptr() == base[2:5].data_ptr()
    assert tensor_bytes(torch.tensor(1.5)).numel() == 4  # 0-dim


def test_device_storage_refs_have_no_host_view() -> None:
    ref = tensors.StorageRef(0, 16, None, torch.device("cuda", 0))
    with pytest.raises(RuntimeError, match="no host view"):
        ref.view()


def test_device_option_validation() -> None:
    assert fresh_device("cpu") == CPU
    with pytest.raises(ValueError, match="cpu' or a CUDA device"):
        fresh_device("meta")
    with pytest.raises(ValueError, match="cpu' or a CUDA device"):
        fresh_device("not a device")
    with pytest.raises(ValueError):
        DeviceStaging(slots=2, depth=3)


@pytest.mark.skipif(CUDA, reason="checks the CPU-only torch behaviour")
def test_gpu_path_unreachable_on_a_cpu_only_torch(make_transport: Any) -> None:
    with pytest.raises(ValueError, match="no CUDA"):
        fresh_device("cuda")
    with pytest.raises(ValueError, match="no CUDA"):
        ZMQTransport(TIMEOUT, bind_host="127.0.0.1", device="cuda")
    with pytest.raises(ValueError, match="no copy engine"):
        cuda_engine(torch.device("cuda", 0))
    # The default staging touches nothing for CPU state.
    sender = make_transport()
    receiver = make_transport(device="cpu")
    state = _sample_state()
    sender.send_checkpoint([1], 1, state, TIMEOUT)
    _assert_same(receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT), state)
    assert not sender._server._stager.engines
    assert not torch.cuda.is_initialized()  # type: ignore[no-untyped-call]


# ----------------------------------------------------------------------------- end to end, fake engine


def test_round_trip_through_the_staging_pipeline(make_transport: Any) -> None:
    """Every byte goes through the fake engine on both sides; buffers are reused across steps."""
    send_fake, recv_fake = FakeDevice(), FakeDevice()
    sender = make_transport(
        staging=send_fake.staging(slots=4, depth=2),
        chunk_bytes=CHUNK,
        pack_below=PACK_BELOW,
        checksum=True,
    )
    receiver = make_transport(staging=recv_fake.staging(slots=3, depth=1), window=4)
    for step in (1, 2, 3):
        state = _sample_state(step)
        sender.send_checkpoint([1], step, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT)
        _assert_same(got, state)
        assert got["views"]["slice"].untyped_storage().data_ptr() == (
            got["views"]["whole"].untyped_storage().data_ptr()
        )
        sender.disallow_checkpoint()
        assert all(engine.pending == 0 for engine in send_fake.engines)
    assert sum(e.copies for e in send_fake.engines) > 0
    assert sum(e.copies for e in recv_fake.engines) > 0
    assert len(send_fake.buffers) <= 4  # one ring, reused for three steps
    assert len(recv_fake.buffers) <= 3


def test_in_place_receive_through_the_staging_pipeline(make_transport: Any) -> None:
    recv_fake = FakeDevice()
    state = _sample_state(5)
    targets: dict[str, Any] = {
        "big": torch.zeros(5000),
        "bf16": torch.zeros(3000, dtype=torch.bfloat16),
        "ints": torch.zeros(2500, dtype=torch.int64),
        "small": [torch.zeros(n) for n in (1, 7, 30, 100)],
    }
    pointers = {k: v.data_ptr() for k, v in targets.items() if isinstance(v, torch.Tensor)}
    sender = make_transport(staging=FakeDevice().staging(), chunk_bytes=CHUNK, pack_below=PACK_BELOW)
    receiver = make_transport(staging=recv_fake.staging(slots=2, depth=1), state_dict=lambda: targets)
    sender.send_checkpoint([1], 5, state, TIMEOUT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 5, TIMEOUT)
    _assert_same(got, state)
    for key, pointer in pointers.items():
        assert got[key] is targets[key] and got[key].data_ptr() == pointer
    for got_small, target in zip(got["small"], targets["small"], strict=True):
        assert got_small is target
    assert receiver.last_recv_stats is not None and receiver.last_recv_stats.in_place_bytes > 0
    assert sum(e.after_current_calls for e in recv_fake.engines) == 1


def test_disallow_stops_staged_reads_before_mutation(make_transport: Any) -> None:
    """Receivers racing a disallow get the original bytes or an error, never a mix."""
    send_fake = FakeDevice()
    sender = make_transport(staging=send_fake.staging(slots=4, depth=4), chunk_bytes=CHUNK, pack_below=PACK_BELOW)
    receivers = [make_transport(window=1, staging=FakeDevice().staging()) for _ in range(2)]
    state = {f"w{i}": torch.full((1 << 14,), float(i)) for i in range(6)}
    original = {k: v.clone() for k, v in state.items()}
    sender.send_checkpoint([1, 2], 1, state, TIMEOUT)
    copies: list[int] = []

    def check_and_mutate() -> None:
        assert all(engine.pending == 0 for engine in send_fake.engines)
        copies.append(sum(engine.copies for engine in send_fake.engines))
        for tensor in state.values():
            tensor.fill_(-1.0)

    outcomes = fetch_racing_disallow(sender, receivers, 1, check_and_mutate)
    assert sum(engine.copies for engine in send_fake.engines) == copies[0]  # no read after
    for outcome in outcomes:
        if not isinstance(outcome, RemoteError):
            _assert_same(outcome, original)


# ----------------------------------------------------------------------------- the device script


@pytest.mark.slow
@pytest.mark.system
def test_device_check_script_cpu_mode() -> None:
    """scripts/device_check.sh --cpu runs the whole check on CPU with tiny sizes."""
    if os.environ.get("ZMQT_DEVICE_CHECK"):
        pytest.skip("already running inside scripts/device_check.sh")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHON"] = sys.executable
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "device_check.sh"), "--cpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "ZMQTransport, in place" in result.stdout, output
    assert "ZMQTransport, fresh" in result.stdout, output
    assert "HTTPTransport" in result.stdout, output
    assert "MISMATCH" not in result.stdout, output


# ----------------------------------------------------------------------------- CUDA (GPU only)


def _cuda_state(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    device = torch.device("cuda")
    base = torch.randn(1 << 16, device=device)
    return {
        "bf16": torch.randn(3 << 20, device=device).to(torch.bfloat16),  # 6 MiB: many chunks
        "f32": torch.randn(257, 129, device=device),
        "i64": torch.arange(1000, device=device, dtype=torch.int64) * step,
        "small": [torch.full((n,), float(n), device=device) for n in (1, 3, 64)],
        "views": {"whole": base, "slice": base[10:400], "strided": base[::5]},
        "scalar": torch.tensor(float(step), device=device),
        "host": torch.arange(5000, dtype=torch.float16),  # CPU beside CUDA
        "plain": {"step": step},
    }


@needs_cuda
def test_cuda_fresh_round_trip_on_device(make_transport: Any) -> None:
    sender = make_transport(chunk_bytes=1 << 20)
    receiver = make_transport(device="cuda")
    for step in (1, 2):
        state = _cuda_state(step)
        sender.send_checkpoint([1], step, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT)
        _assert_same(got, state)
        assert got["bf16"].device.type == "cuda" and got["host"].device.type == "cuda"
        assert got["views"]["slice"].untyped_storage().data_ptr() == (
            got["views"]["whole"].untyped_storage().data_ptr()
        )
        sender.disallow_checkpoint()
    assert sender._server._stager.ring.allocations <= DeviceStaging().slots


@needs_cuda
def test_cuda_to_host_by_default(make_transport: Any) -> None:
    sender = make_transport()
    receiver = make_transport()
    state = _cuda_state(3)
    sender.send_checkpoint([1], 3, state, TIMEOUT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    assert got["bf16"].device.type == "cpu"
    _assert_same(got, state)


@needs_cuda
def test_cuda_in_place_into_cuda_targets(make_transport: Any) -> None:
    state = _cuda_state(4)
    targets: dict[str, Any] = {
        "bf16": torch.zeros_like(state["bf16"]),
        "f32": torch.zeros_like(state["f32"]),
        "i64": torch.zeros_like(state["i64"]),
        "small": [torch.zeros_like(t) for t in state["small"]],
        "scalar": torch.zeros_like(state["scalar"]),
        "host": torch.zeros(5000, dtype=torch.float16, device="cuda"),  # CPU source, CUDA target
    }
    pointers = {k: v.data_ptr() for k, v in targets.items() if isinstance(v, torch.Tensor)}
    sender = make_transport()
    receiver = make_transport(state_dict=lambda: targets)
    sender.send_checkpoint([1], 4, state, TIMEOUT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)
    _assert_same(got, state)
    for key, pointer in pointers.items():
        assert got[key] is targets[key] and got[key].data_ptr() == pointer, key
    assert receiver.last_recv_stats is not None
    assert receiver.last_recv_stats.in_place_bytes >= state["bf16"].numel() * 2


@needs_cuda
def test_cuda_send_is_prompt_and_disallow_stops_device_reads(make_transport: Any) -> None:
    sender = make_transport(chunk_bytes=1 << 20)
    receivers = [make_transport(window=1, device="cuda") for _ in range(2)]
    state = {f"w{i}": torch.full((8 << 20,), float(i), device="cuda") for i in range(4)}
    original = {k: v.clone() for k, v in state.items()}
    torch.cuda.synchronize()
    sender.send_checkpoint([1, 2], 1, state, TIMEOUT)

    def mutate() -> None:
        for tensor in state.values():
            tensor.fill_(-1.0)  # on the caller's stream, after disallow returned
        torch.cuda.synchronize()

    for outcome in fetch_racing_disallow(sender, receivers, 1, mutate):
        if not isinstance(outcome, RemoteError):
            _assert_same(outcome, original)


@needs_cuda
def test_cuda_staging_waits_for_the_producer_stream(make_transport: Any) -> None:
    """Kernels queued on the caller's stream before send_checkpoint are seen by the copies."""
    sender = make_transport()
    receiver = make_transport(device="cuda")
    tensor = torch.zeros(32 << 20, device="cuda")
    for _ in range(20):
        tensor.add_(1.0)  # queued, likely still running when send_checkpoint returns
    sender.send_checkpoint([1], 1, {"t": tensor}, TIMEOUT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
    assert torch.equal(got["t"], torch.full_like(tensor, 20.0))


def test_ring_buffers_are_sized_for_the_largest_message_of_the_transfer() -> None:
    # Found on an H200: a buffer first used for a small (packed or tail)
    # message grew, a second pinned allocation, when a full message came to it.
    fake = FakeDevice()
    staging = fake.staging(slots=4, depth=4)
    state = {"tail": torch.randn(300), "big": torch.randn(5000), "more": torch.randn(3000)}
    plan, expected = _plan_for(state, staging)
    sizes = {wire.chunk_length(pieces) for pieces in plan.pieces}
    assert len(sizes) > 1  # messages of several sizes share the ring
    stager = SendStager(staging)
    for key in ("step1", "step2"):
        assert _serve(stager, key, plan) == expected
    assert stager.ring.allocations <= 4
    assert all(slot.buffer.numel() >= max(sizes) for slot in stager.ring.slots)


def test_ring_reserve_sizes_new_buffers() -> None:
    ring = PinnedRing(2, lambda n: torch.empty(n, dtype=torch.uint8))
    small = ring.acquire("a", 10, reserve=100)
    assert small is not None and small.buffer.numel() == 100
    ring.release(small)
    assert ring.acquire("b", 100, reserve=100) is small  # reused as it is: no growth
    assert ring.allocations == 1


@needs_cuda
def test_cuda_striped_receive_lands_every_span_on_the_device(make_transport: Any) -> None:
    # Spans arrive over three connections in any order: each message still
    # goes through a bounce buffer to its place on the GPU.
    sender = make_transport(chunk_bytes=1 << 20, checksum=True)
    receiver = make_transport(device="cuda", streams=3)
    state = _cuda_state(3)
    sender.send_checkpoint([1], 3, state, TIMEOUT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
    _assert_same(got, state)
    assert receiver.last_recv_stats.streams == 3
    sender.disallow_checkpoint()


@needs_cuda
def test_cuda_receivers_do_not_relay_device_memory(make_transport: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from zmqtransport import relayed

    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)  # chain them, as receivers on other hosts

    sender = make_transport(chunk_bytes=1 << 20)
    receivers = [make_transport(device="cuda", progress=lambda done, total: time.sleep(0.002)) for _ in range(2)]
    state = _cuda_state(4)
    sender.send_checkpoint([1, 2], 4, state, TIMEOUT)
    results: list[Any] = [None, None]

    def run(i: int) -> None:
        time.sleep(0.05 * i)
        results[i] = receivers[i].recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for got in results:
        _assert_same(got, state)
    # A receive into device memory serves nothing: the second got it all from the source.
    assert list(receivers[1].last_recv_stats.paths) == [sender.metadata()]
    sender.disallow_checkpoint()
