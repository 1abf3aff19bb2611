"""The landing plan on its own: given a header and the caller's targets, where each storage lands.

No sockets: headers are encoded from real state dicts and sent through the
wire codec as a receiver would see them; the plan allocates nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zmq

from zmqtransport import ProtocolError, buffers, wire
from zmqtransport.codec import skeleton
from zmqtransport.fetch import landing
from zmqtransport.fetch.inbox import Inbox
from zmqtransport.fetch.landed import build, land
from zmqtransport.fetch.landing import Fresh, FreshBounced, InArena, InPlace, InPlaceBounced, LandingOptions
from zmqtransport.fetch.streams import MemoryStream, recv_exact

MIB = 1024 * 1024
PACK_BELOW = 64 * 1024


def parsed_for(state: Any, pack_below: int = PACK_BELOW) -> landing.ParsedHeader:
    encoded = skeleton.encode_tree(state)
    header = wire.Header(
        step=1,
        skeleton=encoded.skeleton,
        tensors=encoded.tensors,
        storages=[ref.nbytes for ref in encoded.storages],
        chunk_bytes=MIB,
        pack_below=pack_below,
        checksum=None,
    )
    received = wire.decode_header(wire.unpack(header.body(), wire.MAX_HEADER_BYTES))
    return landing.parse_header(received, allow_pickle=False)


def storage_at(parsed: landing.ParsedHeader, *path: Any) -> int:
    """The storage index of the tensor at ``path``."""
    (index,) = [i for i, p in parsed.paths.items() if p == path]
    return parsed.specs[index].storage


def plan(state: Any, targets: Any = None, **options: Any) -> tuple[landing.ParsedHeader, landing.LandingPlan]:
    parsed = parsed_for(state)
    return parsed, landing.plan_landing(parsed, targets, LandingOptions(**options))


def test_fresh_receive_allocates_each_storage_as_its_tensor() -> None:
    state = {
        "big": torch.ones(2 * MIB, dtype=torch.float32),
        "mid": torch.ones(768, 768, dtype=torch.float32),  # 2.25 MiB: less than a prefault piece
        "small": torch.ones(3, 5, dtype=torch.int64),
    }
    parsed, result = plan(state)
    big, mid, small = (storage_at(parsed, name) for name in ("big", "mid", "small"))
    assert all(isinstance(result.placements[s], Fresh) for s in (big, mid, small))
    assert result.placements[small].exact is not None and result.placements[small].exact.shape == (3, 5)
    assert result.placements[big].exact is not None and not result.placements[big].huge_pages
    assert result.arena is None and result.target_leaves == {}
    assert result.fresh_bytes == 8 * MIB + 768 * 768 * 4 + 15 * 8
    # Every fresh storage of at least PREFAULT_MIN_REGION is faulted in ahead,
    # also those smaller than a piece (a mixed-size state has many).
    offsets = {s: sum(parsed.header.storages[:s]) for s in (big, mid)}
    assert result.prefault == sorted(
        [landing.PrefaultRegion(offsets[big], big, 8 * MIB), landing.PrefaultRegion(offsets[mid], mid, 768 * 768 * 4)],
        key=lambda region: region.stream_offset,
    )


def test_matching_targets_land_in_place_and_mismatches_fresh() -> None:
    base = torch.arange(10, dtype=torch.float32)
    state = {
        "match": torch.ones(4, 4),
        "dtype": torch.ones(4, 4),
        "shape": torch.ones(4, 4),
        "absent": torch.ones(8),
        "strided": torch.ones(4, 4),
        "shared_a": base[:5],
        "shared_b": base[5:],
    }
    targets = {
        "match": torch.zeros(4, 4),
        "dtype": torch.zeros(4, 4, dtype=torch.float64),
        "shape": torch.zeros(2, 8),
        "strided": torch.zeros(4, 4).t(),
        "shared_a": torch.zeros(5),
        "shared_b": torch.zeros(5),
        "extra": torch.zeros(3),
    }
    parsed, result = plan(state, targets)
    match = result.placements[storage_at(parsed, "match")]
    assert isinstance(match, InPlace) and match.target is targets["match"] and match.local is targets["match"]
    for key in ("dtype", "shape", "absent", "strided", "shared_a"):
        assert isinstance(result.placements[storage_at(parsed, key)], Fresh), key
    # Two tensors viewing one storage never land in place, nor as "exact" tensors.
    shared = result.placements[storage_at(parsed, "shared_a")]
    assert storage_at(parsed, "shared_b") == storage_at(parsed, "shared_a")
    assert isinstance(shared, Fresh) and shared.exact is None
    assert result.fresh_bytes == parsed.header.total_bytes - 64
    assert set(result.target_leaves) == {(key,) for key in targets}


def test_many_small_storages_share_an_arena_in_stream_order() -> None:
    state = {f"t{i}": torch.full((3 + i,), float(i)) for i in range(40)}
    state["view"] = torch.arange(20.0)[2:9]  # not its whole storage: lands as bytes
    state["big"] = torch.ones(PACK_BELOW)  # travels alone: not in the arena
    parsed, result = plan(state)
    assert result.arena is not None
    small = [storage_at(parsed, f"t{i}") for i in range(40)] + [storage_at(parsed, "view")]
    assert result.arena.storages == sorted(small)
    offsets = [result.placements[s].offset for s in result.arena.storages]  # type: ignore[union-attr]
    assert offsets == buffers.arena_offsets(result.arena.sizes)
    assert offsets[0] == 0 and all(o % buffers.ARENA_ALIGN == 0 for o in offsets)
    assert offsets == sorted(offsets)
    view = result.placements[storage_at(parsed, "view")]
    assert isinstance(view, InArena) and view.exact is None and view.nbytes == 80
    t3 = result.placements[storage_at(parsed, "t3")]
    assert isinstance(t3, InArena) and t3.exact is not None and t3.exact.shape == (6,)
    assert isinstance(result.placements[storage_at(parsed, "big")], Fresh)
    # The whole arena is one prefault region, starting where its first storage
    # arrives; "big" (256 KiB) is one of its own, after it in the stream.
    first = result.arena.storages[0]
    arena_region = landing.PrefaultRegion(
        sum(parsed.header.storages[:first]), first, buffers.arena_size(result.arena.sizes), arena=True
    )
    big = storage_at(parsed, "big")
    big_region = landing.PrefaultRegion(sum(parsed.header.storages[:big]), big, PACK_BELOW * 4)
    assert result.prefault == [arena_region, big_region]


def test_few_small_storages_need_no_arena() -> None:
    state = {f"t{i}": torch.ones(4) for i in range(buffers.ARENA_MIN_STORAGES - 1)}
    _, result = plan(state)
    assert result.arena is None and all(isinstance(p, Fresh) for p in result.placements)


def test_in_place_storages_stay_out_of_the_arena() -> None:
    state = {f"t{i}": torch.ones(4) for i in range(buffers.ARENA_MIN_STORAGES)}
    targets = {"t0": torch.zeros(4)}
    parsed, result = plan(state, targets)
    assert result.arena is None  # one short of the minimum once t0 lands in place
    assert isinstance(result.placements[storage_at(parsed, "t0")], InPlace)


def test_huge_pages_allocate_large_storages_as_bytes() -> None:
    state = {"big": torch.ones(buffers.HUGE_PAGE // 4), "below": torch.ones(buffers.HUGE_PAGE // 4 - 1)}
    parsed, result = plan(state, huge_pages=True)
    big = result.placements[storage_at(parsed, "big")]
    below = result.placements[storage_at(parsed, "below")]
    assert isinstance(big, Fresh) and big.exact is None and big.huge_pages
    assert isinstance(below, Fresh) and below.exact is not None


def test_staged_devices_go_through_bounce_buffers() -> None:
    """With the target's device staged (as CUDA is), in place via bounce buffers; fresh on the staged device."""
    state = {"w": torch.ones(8), "other": torch.ones(4)} | {f"t{i}": torch.ones(2) for i in range(40)}
    targets = {"w": torch.zeros(8)}
    device = torch.device("cpu")
    parsed, result = plan(state, targets, stages=lambda d: d.type == "cpu", device=device)
    w = result.placements[storage_at(parsed, "w")]
    assert isinstance(w, InPlaceBounced) and w.local is targets["w"]
    other = result.placements[storage_at(parsed, "other")]
    assert other == FreshBounced(16, device)
    assert all(isinstance(p, InPlaceBounced | FreshBounced) for p in result.placements)
    assert result.arena is None and result.prefault == []


def test_unstaged_fresh_device_keeps_in_place_targets_direct() -> None:
    state = {"w": torch.ones(8), "other": torch.ones(4)}
    targets = {"w": torch.zeros(8)}
    parsed, result = plan(state, targets, stages=lambda d: False)
    assert isinstance(result.placements[storage_at(parsed, "w")], InPlace)
    assert isinstance(result.placements[storage_at(parsed, "other")], Fresh)


def test_fresh_memory_limit_counts_only_fresh_storages() -> None:
    state = {"a": torch.ones(1000), "b": torch.ones(1000)}
    with pytest.raises(ProtocolError, match="8000 bytes of tensors, more than the limit of 7999"):
        plan(state, max_bytes=7999)
    _, result = plan(state, {"a": torch.zeros(1000)}, max_bytes=4000)
    assert result.fresh_bytes == 4000


def test_execution_allocates_what_the_plan_says() -> None:
    state = {f"t{i}": torch.ones(3) for i in range(40)} | {"w": torch.ones(4), "big": torch.ones(MIB)}
    targets = {"w": torch.zeros(4)}
    parsed, result = plan(state, targets)
    landed = land(result, prefault_threads=0)
    try:
        w = landed.destinations[storage_at(parsed, "w")]
        assert w.in_place is targets["w"] and w.fresh is None
        assert len(w.view) == 16
        t0 = landed.destinations[storage_at(parsed, "t0")]
        assert t0.exact and t0.arena_offset == 0 and t0.fresh is not None and t0.fresh.shape == (3,)
        big = landed.destinations[storage_at(parsed, "big")]
        assert big.exact and big.fresh is not None and big.fresh.shape == (MIB,) and len(big.view) == 4 * MIB
        assert landed.arena is not None and landed.arena.nbytes == buffers.arena_size(result.arena.sizes)  # type: ignore[union-attr]
    finally:
        landed.close()


def test_data_messages_land_from_any_stream_the_same_way() -> None:
    # The stream seam (fetch/streams.py): an in-memory stream in place of a DEALER, the same Inbox.
    state = {f"t{i}": torch.arange(3, dtype=torch.float32) + i for i in range(40)} | {"big": torch.ones(MIB)}
    targets = {"big": torch.zeros(MIB)}
    parsed, result = plan(state, targets)
    chunks = wire.plan_chunks(parsed.header.storages, parsed.header.chunk_bytes, parsed.header.pack_below)
    encoded = skeleton.encode_tree(state)
    stream = MemoryStream()
    for seq, pieces in enumerate(chunks):
        data = b"".join(bytes(encoded.storages[p.storage].view(p.start, p.start + p.length)) for p in pieces)
        stream.put(wire.data_envelope(1, seq, None), data)
    landed = land(result, prefault_threads=0)
    try:
        inbox = Inbox(parsed, chunks, landed, None)
        for _ in chunks:
            reply = stream.reply("the source")
            assert reply is not None
            inbox.land(stream, reply, "the source")
        assert stream.reply("the source") is None and all(inbox.done)
        got = build(parsed, landed)
    finally:
        landed.close()
    assert got["big"] is targets["big"] and torch.equal(got["big"], state["big"])
    assert all(torch.equal(got[f"t{i}"], state[f"t{i}"]) for i in range(40))


# ----------------------------------------------------------------------------- DTensor shards


def test_dtensor_shard_lands_only_in_a_dtensor_with_the_same_spec() -> None:
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp"), _init_backend=False, _rank=5)

    def dtensor(local: torch.Tensor, placements: list[Any]) -> Any:
        return DTensor.from_local(local, mesh, placements, run_check=False)

    def sent() -> Any:  # one per path: a shared storage never lands in place
        return dtensor(torch.arange(12.0).reshape(3, 4), [Shard(0), Shard(1)])

    same = dtensor(torch.zeros(3, 4), [Shard(0), Shard(1)])
    other = dtensor(torch.zeros(3, 4), [Replicate(), Shard(1)])
    plain = torch.zeros(3, 4)
    state = {"same": sent(), "other": sent(), "plain": sent(), "into_dtensor": torch.ones(3, 4)}
    targets = {"same": same, "other": other, "plain": plain, "into_dtensor": same}
    parsed, result = plan(state, targets)
    into_same = result.placements[storage_at(parsed, "same")]
    assert isinstance(into_same, InPlace) and into_same.target is same and into_same.local is same._local_tensor
    # Another spec, a plain tensor for a shard, a DTensor for a plain tensor: fresh.
    for key in ("other", "plain", "into_dtensor"):
        assert isinstance(result.placements[storage_at(parsed, key)], Fresh), key
    assert result.target_leaves[("other",)] is other  # a fresh shard may still reuse its mesh


# ----------------------------------------------------------------------------- exact receive


def test_recv_exact_refuses_a_frame_of_another_size() -> None:
    context = zmq.Context()
    try:
        a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        a.bind("inproc://exact")
        b.connect("inproc://exact")
        into = memoryview(bytearray(8))
        a.send(b"12345678")
        assert bytes(recv_exact(b, into, "data message 0", 8)) == b"12345678"
        a.send(b"1234")
        with pytest.raises(ProtocolError, match="data message 3 has 4 bytes, expected 8"):
            recv_exact(b, into, "data message 3", 8)
        a.send(b"123456789")  # longer than the view: refused, not truncated silently
        with pytest.raises(ProtocolError, match="has 9 bytes, expected 8"):
            recv_exact(b, into, "data message 4", 8)
        a.send(b"abcd")
        assert bytes(recv_exact(b, None, "data message 5", 4)) == b"abcd"  # zero-copy frame
        a.send(b"abc")
        with pytest.raises(ProtocolError, match="has 3 bytes, expected 4"):
            recv_exact(b, None, "data message 6", 4)
        a.close(0)
        b.close(0)
    finally:
        context.term()


_MALLOC_PROBE = """
import ctypes, sys
from zmqtransport import buffers

libc = ctypes.CDLL(None)
libc.malloc.argtypes = [ctypes.c_size_t]
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def mmapped(nbytes):
    # glibc marks a chunk served by its own mmap with bit 0x2 of the size word before it.
    block = libc.malloc(nbytes)
    flag = bool(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2)
    libc.free(block)
    return flag

before = mmapped(1 << 20)
done = buffers.settle_malloc_thresholds()
# Freeing that block raised the threshold to 1 MiB only: 16 MiB is mmapped unless settled.
print(before, done, mmapped(16 << 20), buffers.settle_malloc_thresholds() is done)
"""


def test_malloc_thresholds_let_megabyte_buffers_come_from_the_heap() -> None:
    """libzmq's large receive buffers: mmapped (fresh pages every time) in a fresh process, heap after."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "confstr") or os.confstr("CS_GNU_LIBC_VERSION") is None:
        pytest.skip("glibc only")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("GLIBC_TUNABLES", None)
    done = subprocess.run([sys.executable, "-c", _MALLOC_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "False", "True"]
