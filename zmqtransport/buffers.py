"""Receive memory: raw views of tensor memory, fresh storage, and its pre-faulting.

On virtual machines the first touch of freshly allocated memory (one page fault
per 4 KiB page) can cost more than copying the bytes into it: on the 2-vCPU
Firecracker VMs this project is measured on, 1 GiB of fresh memory takes about
0.6 s to fault in when the guest recycles pages it used recently, and up to
3 s when the host has to back it anew. Two levers live here:

* :class:`Prefaulter` faults fresh storage in on worker threads, ahead of the
  data that fills it, so the receive loop copies into memory that is already
  mapped and the faults overlap with the network instead of following it;
* :func:`allocate` can ask for transparent huge pages (``huge_pages=True``),
  which cuts the faults 512-fold where huge pages are cheap (bare metal with
  free huge pages). It is off by default: on the VMs above a huge page that the
  host must back costs several times more than 512 small ones (measured 2.5 s
  per GiB against 0.6 s), and direct compaction can stall the fault further.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
PAGE = mmap.PAGESIZE
# MADV_POPULATE_WRITE (Linux 5.14): fault a range in as if written, without
# writing. The mmap module only names it from Python 3.13 on.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
# Pre-fault work is handed out in pieces this big: large enough that the
# syscall cost vanishes, small enough that the workers stay just ahead of the
# receive loop and can stop soon after it catches up.
PREFAULT_PIECE = 4 * 1024 * 1024
# A worker leaves a piece to the data when the piece starts less than this
# far ahead of it (at most an eighth of the fresh memory: see prefault_plan).
PREFAULT_LEAD = 32 * 1024 * 1024
# From this much fresh memory on the workers keep pace with the data, at
# normal priority, at most PREFAULT_AHEAD beyond it; below it they fault as
# far ahead as they get, at PREFAULT_NICE (see prefault_plan).
PREFAULT_PACED_FROM = 2 * 1024 * 1024 * 1024
PREFAULT_AHEAD = 256 * 1024 * 1024
# Fresh memory below this (per transfer) is not worth starting threads for.
PREFAULT_MIN_BYTES = 16 * 1024 * 1024
# A fresh storage below this is left to the copy: a piece of its own would
# cost about what faulting its few pages in the copy costs. Not the piece size:
# a state of mixed sizes (a transformer's 2.25 MiB projections and their Adam
# moments) holds many storages between the two, a third of its bytes or more.
PREFAULT_MIN_REGION = 64 * 1024
# Seconds close() waits for each worker: one finishes at most the piece it is
# on (4 MiB of page faults, milliseconds even on a loaded machine). A worker
# left behind is harmless: MADV_POPULATE_WRITE never changes bytes, and on memory
# already unmapped it fails with ENOMEM.
PREFAULT_JOIN_TIMEOUT = 5.0
PREFAULT_NICE = 10  # niceness of prefault threads, relative to nothing (absolute, like nice(1))


def raw_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``ptr``; the caller keeps the owner alive."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)).cast("B")


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return raw_view(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def allocate(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """A fresh uint8 CPU tensor of ``nbytes``; with ``huge_pages``, THP-advised if large."""
    if not huge_pages or nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # Over-map by one huge page so the tensor can start on a 2 MiB boundary,
    # which transparent huge pages need.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -base % HUGE_PAGE
    with contextlib.suppress(OSError):  # THP disabled or unsupported: ordinary pages work
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE)
    # torch.frombuffer keeps a reference to the mapping; it is unmapped with the tensor.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)


@functools.cache
def _madvise() -> Any:
    """libc's madvise through ctypes, which drops the GIL for the call (unlike mmap.madvise)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


# glibc raises its mmap threshold to the size of any mmapped block the process
# frees (up to this, on 64-bit), and its trim threshold to twice that.
GLIBC_DYNAMIC_MMAP_MAX = 32 * 1024 * 1024


@functools.cache
def settle_malloc_thresholds() -> bool:
    """Let glibc keep libzmq's receive buffers mapped between messages (once per process).

    libzmq mallocs a buffer for every large message it receives, in its I/O
    thread, and the receive loop frees it after copying the bytes out. In a
    fresh process glibc's thresholds are still at their start values (mmap
    above 128 KiB, give the heap's top back above 128 KiB): each time the
    receive loop drained the queue, the I/O thread's arena was trimmed and the
    next window of messages faulted its buffers in again. Measured on 1 GiB
    in place as 1 MiB messages: 40,000 to 110,000 page faults and 0.1 to 0.2
    CPU-seconds of a 0.4 to 1.2 s receive. Allocating and freeing one block
    of 32 MiB moves the thresholds exactly where glibc itself moves them after
    any process frees a block that size (a PyTorch process usually has): mmap
    above 32 MiB, trim above 64 MiB; they stay dynamic. The block is never
    touched. Returns whether it was done (glibc only; a process whose
    thresholds were set with ``mallopt`` keeps them, as glibc itself would).
    """
    if not _glibc():
        return False
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free.restype = None
    # Just below the maximum, so that the block's chunk (size plus header,
    # page-rounded) still counts for the dynamic rule.
    block = libc.malloc(GLIBC_DYNAMIC_MMAP_MAX - 2 * PAGE)
    if not block:
        return False
    libc.free(block)
    return True


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError, AttributeError):
        return False


@dataclass
class PrefaultCounts:
    """What a :class:`Prefaulter`'s workers did, in bytes (read after :meth:`Prefaulter.close`)."""

    faulted: int = 0  # faulted in by a worker
    skipped: int = 0  # left to the data: it was less than the lead behind (or past it)
    overtaken: int = 0  # faulted by a worker while the data entered the same piece (both faulted it)


@dataclass(frozen=True)
class PrefaultPlan:
    """How a :class:`Prefaulter`'s workers go about it (:func:`prefault_plan` chooses by size).

    ``lead``: a piece starting less than this beyond the data is left to the
    data. ``ahead``: a worker waits while its piece starts this far or more
    beyond the data (0: never waits). ``nice``: the workers' niceness (None:
    the process's own).
    """

    lead: int = 0
    ahead: int = 0
    nice: int | None = None


def prefault_plan(fresh_bytes: int) -> PrefaultPlan:
    """The prefault strategy for a receive of ``fresh_bytes`` of fresh memory, chosen by measured size.

    The lead, at every size: a piece the data reaches while a worker faults
    it is faulted twice (the copy and the worker each zero a page for the
    same address, the kernel keeps one) under one page-table lock. That
    happens whenever the workers fall behind the data, as they do on a loaded
    machine, where first touch is dear, and through seconds-long receives of
    several GiB (a 4 GiB receive measured up to 214,000 double faults, a
    sixth of its faults). With a 32 MiB lead (several pieces of work at any
    fault rate measured here; at most an eighth of the memory, so that a small
    receive is still mostly faulted ahead) the workers never meet the data.

    Below :data:`PREFAULT_PACED_FROM` the workers run at nice
    :data:`PREFAULT_NICE`, as far ahead as they get: they use the CPU nobody
    else wants, and leave the sender's I/O thread its share where a sender
    serves several receivers on the same few cores (three fresh 1 GiB
    receivers on two vCPUs: 1.86 s at nice 10, 2.08 s at normal priority).
    From it on they run at normal priority, at most :data:`PREFAULT_AHEAD`
    beyond the data: niced through a receive that lasts seconds, they get
    little CPU whenever anything else runs, fall behind, and the copy takes
    the faults one at a time (cold 4 GiB receives on a busy two-vCPU machine,
    alternating: niced 2.3-7.1 s, median 5.2 s, a third to two thirds of the
    memory faulted by the copy; paced 2.0-4.2 s, median 2.4 s, 91-99% faulted
    ahead). At 2 GiB paced was the faster of the two (medians 1.19 s against
    1.28 s), at 1 GiB the niced one (0.54 s against 0.77 s). Keeping to a
    window, normal-priority workers never run far ahead of a pipeline that
    needs the same cores.
    """
    lead = min(PREFAULT_LEAD, fresh_bytes // 8)
    if fresh_bytes >= PREFAULT_PACED_FROM:
        return PrefaultPlan(lead=lead, ahead=PREFAULT_AHEAD, nice=None)
    return PrefaultPlan(lead=lead, ahead=0, nice=PREFAULT_NICE)


def prefault_pieces(regions: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(stream_offset, pointer, nbytes)`` regions cut into page-aligned pieces of at most :data:`PREFAULT_PIECE`.

    Partial pages at a region's ends are left out (madvise works on whole
    pages; the copy faults those few itself).
    """
    pieces: list[tuple[int, int, int]] = []
    for offset, pointer, nbytes in regions:
        start = -pointer % PAGE  # madvise wants page-aligned ranges
        for at in range(start, nbytes - PAGE + 1, PREFAULT_PIECE):
            length = min(PREFAULT_PIECE, nbytes - at)
            length -= length % PAGE
            pieces.append((offset + at, pointer + at, length))
    return pieces


class Prefaulter:
    """Fault fresh receive memory in on worker threads, ahead of the data.

    ``regions`` are ``(stream_offset, pointer, nbytes)`` in the order the data
    arrives; the receive loop publishes how far it got in :attr:`received`.
    ``plan`` (:func:`prefault_plan`) says how far ahead of the data a worker
    must be to fault a piece (nearer pieces are left to the data), how far
    ahead it may go, and at what priority.

    ``MADV_POPULATE_WRITE`` maps pages without writing to them, so a worker
    and the receive loop may touch the same pages at once without any risk to
    the bytes the loop wrote. Where the kernel lacks it (before Linux 5.14) the
    workers stop at the first ``EINVAL`` and the receive loop takes the faults
    itself, as without a prefaulter. The caller keeps the memory alive until
    :meth:`close` returns.
    """

    def __init__(self, regions: Sequence[tuple[int, int, int]], threads: int, plan: PrefaultPlan) -> None:
        self._received = 0
        self.plan = plan
        self.counts = PrefaultCounts()  # complete once close() has returned
        self._pieces = prefault_pieces(regions)
        self._next = itertools.count()  # atomic under the GIL: each piece goes to one worker
        self._stopped = False
        self._counts_lock = threading.Lock()
        self._advanced = threading.Condition()
        self._threads = [
            threading.Thread(target=self._work, name="zmqtransport-prefault", daemon=True)
            for _ in range(min(threads, len(self._pieces)))
        ]
        try:
            for thread in self._threads:
                thread.start()
        except BaseException:
            self.close()  # the workers already started must not outlive the memory
            raise

    @classmethod
    def start(cls, regions: Sequence[tuple[int, int, int]], threads: int) -> Prefaulter | None:
        """A running prefaulter, or None when there is too little memory to bother."""
        fresh = sum(nbytes for _, _, nbytes in regions)
        if threads < 1 or fresh < PREFAULT_MIN_BYTES:
            return None
        return cls(regions, threads, prefault_plan(fresh))

    @property
    def received(self) -> int:
        """Stream bytes the receive loop has written; set by that loop."""
        return self._received

    @received.setter
    def received(self, nbytes: int) -> None:
        self._received = nbytes
        if self.plan.ahead:
            with self._advanced:  # wake workers waiting for the data to come nearer
                self._advanced.notify_all()

    def _wait_for_data(self, offset: int) -> None:
        """Block while ``offset`` lies ``plan.ahead`` or more beyond the data (until close())."""
        ahead = self.plan.ahead
        with self._advanced:
            while not self._stopped and offset >= self._received + ahead:
                self._advanced.wait(0.1)

    def _work(self) -> None:
        if self.plan.nice is not None:
            # Lowering its own priority needs no privilege (Linux: per thread).
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.plan.nice)
        counts = PrefaultCounts()
        try:
            self._fault_pieces(counts)
        finally:
            with self._counts_lock:
                self.counts.faulted += counts.faulted
                self.counts.skipped += counts.skipped
                self.counts.overtaken += counts.overtaken

    def _fault_pieces(self, counts: PrefaultCounts) -> None:
        madvise = _madvise()
        lead, ahead = self.plan.lead, self.plan.ahead
        for index in self._next:
            if self._stopped or index >= len(self._pieces):
                return
            offset, pointer, length = self._pieces[index]
            if ahead and offset >= self._received + ahead:
                self._wait_for_data(offset)
                if self._stopped:
                    return
            if offset < self._received + lead:
                counts.skipped += length
                continue
            failed = madvise(pointer, length, MADV_POPULATE_WRITE) != 0
            if failed and ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                self._stopped = True  # not supported here: leave the faults to the copy
                return
            # Other failures (ENOMEM, EFAULT): the receive loop meets the same
            # condition when it touches these pages, and reports it then.
            counts.faulted += length
            if self._received > offset:
                counts.overtaken += length

    def close(self) -> None:
        """Stop and join the workers (each finishes at most the piece it is on)."""
        self._stopped = True
        with self._advanced:
            self._advanced.notify_all()
        for thread in self._threads:
            if thread.ident is not None:  # started (a failed start leaves the rest unstarted)
                thread.join(PREFAULT_JOIN_TIMEOUT)
                if thread.is_alive():
                    logger.warning("zmqtransport: a prefault worker did not stop within %g s", PREFAULT_JOIN_TIMEOUT)


class Arena:
    """One fresh mapping holding many small storages, each a tensor with a storage of its own.

    Allocating 20,480 tensors of 4 KiB one by one cost 90 ms in a fresh
    process (malloc touches a new page for each, one page fault at a time)
    plus 40 ms for their byte views; carving them out of one mapping costs
    about 1 us each, and the mapping is faulted in by a :class:`Prefaulter`
    like any large storage. Storages are laid out in stream order at
    :data:`ARENA_ALIGN`-byte offsets (what torch's allocator guarantees), so a
    packed frame whose storages are all here, and all multiples of that size,
    is received straight into place with no per-tensor copy.

    Each tensor keeps the mapping alive (``torch.frombuffer``); it is unmapped
    when the last one is freed. Unlike storages from torch's allocator, these
    cannot be resized (``resize_`` raises), as with tensors loaded through
    ``torch.load(mmap=True)`` or safetensors.
    """

    def __init__(self, sizes: Sequence[int], offsets: list[int] | None = None) -> None:
        """An arena for storages of ``sizes``; ``offsets``: :func:`arena_offsets` of them, when already known."""
        self.offsets = arena_offsets(sizes) if offsets is None else offsets
        at = self.nbytes = self.offsets[-1] + _aligned(sizes[-1]) if sizes else 0
        self._mapping = mmap.mmap(-1, max(at, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._mapping)
        self.pointer = ctypes.addressof(ctypes.c_char.from_buffer(self._mapping))

    def carve(
        self, offset: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int] | None = None
    ) -> tuple[memoryview, torch.Tensor]:
        """``nbytes`` (> 0) at ``offset``: their bytes, and a 1-D tensor of ``dtype`` over them (``shape`` if given).

        The tensor is made from the byte view (which keeps the mapping alive):
        ``torch.frombuffer`` of the mapping with ``count`` and ``offset`` cost
        0.2 us more per storage, and the receive wants the view anyway.
        """
        view = self.view[offset : offset + nbytes]
        tensor = torch.frombuffer(view, dtype=dtype)
        if shape is not None and (len(shape) != 1 or shape[0] != nbytes // dtype.itemsize):
            tensor = tensor.view(shape)
        return view, tensor


ARENA_ALIGN = 64


def arena_offsets(sizes: Sequence[int]) -> list[int]:
    """Where storages of ``sizes`` lie in an :class:`Arena`: in order, each at an aligned offset."""
    offsets: list[int] = []
    append = offsets.append
    at = 0
    for nbytes in sizes:
        append(at)
        at += -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN  # _aligned, inline: called for every small storage
    return offsets


def arena_size(sizes: Sequence[int]) -> int:
    """The bytes an :class:`Arena` for storages of ``sizes`` spans."""
    return sum(_aligned(nbytes) for nbytes in sizes)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ARENA_ALIGN) * ARENA_ALIGN


# Below this many small fresh storages, plain allocations are as cheap.
ARENA_MIN_STORAGES = 32
