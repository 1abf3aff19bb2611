"""The prefaulter's plan (pieces, lead by size) and what its workers fault in, read back with mincore."""

from __future__ import annotations

import ctypes
import mmap
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


def test_lead_is_32_mib_and_at_most_an_eighth_of_the_fresh_memory() -> None:
    assert buffers.prefault_lead(4 << 30) == 32 * MIB
    assert buffers.prefault_lead(1 << 30) == 32 * MIB
    assert buffers.prefault_lead(256 * MIB) == 32 * MIB
    assert buffers.prefault_lead(64 * MIB) == 8 * MIB
    assert buffers.prefault_lead(buffers.PREFAULT_MIN_BYTES) == buffers.PREFAULT_MIN_BYTES // 8


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
        prefaulter = buffers.Prefaulter([(0, base, size)], threads=2, lead=lead)
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


def test_start_takes_the_lead_from_the_fresh_size() -> None:
    mapping = mmap.mmap(-1, 64 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    try:
        prefaulter = buffers.Prefaulter.start([(0, base, 64 * MIB)], threads=1)
        assert prefaulter is not None
        prefaulter.close()
        assert prefaulter.lead == buffers.prefault_lead(64 * MIB) == 8 * MIB
        assert buffers.Prefaulter.start([(0, base, buffers.PREFAULT_MIN_BYTES - PAGE)], threads=2) is None
        assert buffers.Prefaulter.start([(0, base, 64 * MIB)], threads=0) is None
    finally:
        del base
        mapping.close()
