"""The prefaulter's plan (pieces; lead, window, priority by size) and what its workers fault, read back with mincore."""

from __future__ import annotations

import ctypes
import mmap
import threading
import time

from zmqtransport import buffers

MIB = 1 << 20
PAGE = buffers.PAGE


def resident(mapping: mmap.mmap) -> list[bool]:
    """Per page of ``mapping``: whether it is mapped in (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = len(mapping) // PAGE
    vector = ctypes.create_string_buffer(pages)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    if libc.mincore(base, len(mapping), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return [bool(byte & 1) for byte in vector.raw]


def test_the_plan_follows_the_fresh_size() -> None:
    plan = buffers.prefault_plan
    # The lead: 32 MiB, at most an eighth of the fresh memory.
    assert plan(4 << 30).lead == plan(1 << 30).lead == plan(256 * MIB).lead == 32 * MIB
    assert plan(64 * MIB).lead == 8 * MIB
    assert plan(buffers.PREFAULT_MIN_BYTES).lead == buffers.PREFAULT_MIN_BYTES // 8
    # Below 2 GiB: niced workers, as far ahead as they get; from 2 GiB on: normal priority, a 256 MiB window.
    for small in (64 * MIB, 1 << 30, (2 << 30) - 1):
        assert plan(small) == buffers.PrefaultPlan(lead=32 * MIB if small >= 256 * MIB else small // 8, nice=10)
    for large in (2 << 30, 4 << 30, 48 << 30):
        assert plan(large) == buffers.PrefaultPlan(lead=32 * MIB, ahead=256 * MIB, nice=None)


def test_pieces_are_whole_pages_inside_their_region_in_stream_order() -> None:
    pointer = 1_000_000 * PAGE + 100  # not page-aligned: the first partial page is left out
    regions = [(0, pointer, 9 * MIB + 300), (9 * MIB + 300, 5_000_000 * PAGE, 3 * PAGE)]
    pieces = buffers.prefault_pieces(regions)
    for offset, at, length in pieces:
        assert at % PAGE == 0 and length % PAGE == 0 and 0 < length <= buffers.PREFAULT_PIECE
        region = next(r for r in regions if r[1] <= at < r[1] + r[2])
        assert at + length <= region[1] + region[2]
        assert offset - region[0] == at - region[1]  # the stream offset of the same byte
    assert [p[0] for p in pieces] == sorted(p[0] for p in pieces)
    first = [p for p in pieces if p[1] < 5_000_000 * PAGE]
    assert first[0][1] == pointer + (PAGE - 100) and len(first) == 3  # 4 + 4 + the rest, in whole pages
    assert pieces[-1] == (9 * MIB + 300, 5_000_000 * PAGE, 3 * PAGE)
    assert buffers.prefault_pieces([(0, pointer, PAGE)]) == []  # no whole page inside


def test_workers_leave_the_lead_to_the_data_and_fault_the_rest() -> None:
    size, lead = 64 * MIB, 16 * MIB
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    try:
        prefaulter = buffers.Prefaulter([(0, base, size)], threads=2, plan=buffers.PrefaultPlan(lead=lead))
        deadline = time.monotonic() + 30
        while not resident(mapping)[-1] and time.monotonic() < deadline:
            time.sleep(0.01)
        prefaulter.close()
        pages = resident(mapping)
        # The data is at 0: what starts within the lead is left to it, the rest faulted in ahead.
        assert not any(pages[: lead // PAGE]), "a worker faulted memory within the lead of the data"
        assert all(pages[lead // PAGE :]), "memory beyond the lead was not faulted in"
        assert prefaulter.counts == buffers.PrefaultCounts(faulted=size - lead, skipped=lead, overtaken=0)
    finally:
        del base
        mapping.close()


def test_workers_keep_within_the_window_ahead_of_the_data() -> None:
    size, lead, ahead = 64 * MIB, 4 * MIB, 12 * MIB
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))

    def wait_resident(page: int) -> None:
        deadline = time.monotonic() + 30
        while not resident(mapping)[page] and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        plan = buffers.PrefaultPlan(lead=lead, ahead=ahead)
        prefaulter = buffers.Prefaulter([(0, base, size)], threads=2, plan=plan)
        wait_resident(ahead // PAGE - 1)
        time.sleep(0.2)  # time enough to fault far beyond the window, if a worker would
        pages = resident(mapping)
        assert all(pages[lead // PAGE : ahead // PAGE]) and not any(pages[ahead // PAGE :])
        prefaulter.received = 32 * MIB  # the data moves on: the workers follow, again within the window
        wait_resident((32 * MIB + ahead) // PAGE - 1)
        time.sleep(0.2)
        pages = resident(mapping)
        assert all(pages[(32 * MIB + lead) // PAGE : (32 * MIB + ahead) // PAGE])
        assert not any(pages[(32 * MIB + ahead) // PAGE :])
        assert not any(pages[ahead // PAGE : (32 * MIB + lead) // PAGE]), "what the data passed was faulted"
        prefaulter.close()  # workers waiting for the data stop at once
        assert not any(thread.is_alive() for thread in threading.enumerate() if thread.name == "zmqtransport-prefault")
    finally:
        del base
        mapping.close()


def test_start_chooses_the_plan_by_the_fresh_size() -> None:
    mapping = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    try:
        prefaulter = buffers.Prefaulter.start([(0, base, 64 * MIB)], threads=1)
        assert prefaulter is not None
        prefaulter.close()
        assert prefaulter.plan == buffers.prefault_plan(64 * MIB)
        assert buffers.Prefaulter.start([(0, base, buffers.PREFAULT_MIN_BYTES - PAGE)], threads=2) is None
        assert buffers.Prefaulter.start([(0, base, 64 * MIB)], threads=0) is None
    finally:
        del base
        mapping.close()
