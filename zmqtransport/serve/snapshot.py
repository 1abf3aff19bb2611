"""A copy of what running transfers may still ask of a withdrawn staging (docs/protocol.md, "Releasing staged memory").

``disallow_checkpoint`` lets its caller mutate the staged tensors as soon as it
returns, yet transfers that were running then must still complete with the
staged bytes. They finish from a :class:`Snapshot`: the data messages they may
still ask for, copied into memory of this side's own. It serves like the
:class:`~zmqtransport.serve.staged.Staged` it was taken from (the same plan,
step, staging id and checksums), but only the messages it holds, and its
frames never reference the caller's memory.

:func:`take` runs on a thread of its own while the serving thread goes on
sending from the tensors (the caller waits, so they do not change): it copies
from the last message backwards, and stops where every transfer that needs the
copy has already been sent (``floor``), so the copy and the network meet in
the middle instead of the network waiting for the copy. Host storages are
copied with ``memmove`` (no GIL, one core: the other keeps sending), each batch
of fresh memory faulted in first with one ``madvise``; device
(CUDA) storages through copy engines of its own (after the producer markers)
into a buffer from :attr:`DeviceStaging.host_buffer` (pinned: DMA). It returns
once every byte it holds is in place.
"""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .. import buffers, wire
from ..device import CopyEngine, DeviceStaging, storage_bytes
from .staged import Staged, cached_crc

# Bytes copied between two looks at how far the network has got (the floor).
BATCH_BYTES = 8 << 20

Engines = dict[torch.device, CopyEngine]  # the copy's own, one per device
PAGE = buffers.PAGE
# What a snapshot may take when the transport sets no cap: this share of the
# memory the kernel reports available at the moment of the disallow.
DEFAULT_CAP_SHARE = 0.25


class Run(NamedTuple):
    """``length`` bytes of storage ``storage`` from ``start`` go to byte ``at`` of the snapshot."""

    at: int
    storage: int
    start: int
    length: int


@dataclass(eq=False)
class Snapshot:
    """Data messages of one staging, copied: what a withdrawn staging's running transfers read."""

    step: int
    stage_id: int
    plan: list[list[wire.Piece]]
    checksum: str | None
    crcs: list[int | None]  # shared with the Staged it was taken from: the same bytes, the same CRCs
    views: dict[int, memoryview]  # data message -> its bytes in the copy
    nbytes: int  # memory the copy holds
    total_bytes: int  # of the whole staging (statistics)
    tensor_count: int
    # Shared with the Staged too: digests computed before the copy serve after it (serve/digests.py).
    digests: dict[str, list[bytes | None]] = field(default_factory=dict)
    device_plan: None = None  # a snapshot is host memory: it never goes through the stager

    @property
    def messages(self) -> int:
        return len(self.plan)

    def available(self, seq: int) -> bool:
        return seq in self.views

    def span_bytes(self, first: int, stop: int) -> int:
        return wire.plan_bytes(self.plan[first:stop])

    def payload(self, seq: int) -> tuple[memoryview, bool]:
        """Message ``seq``'s bytes: a view of the copy, which it keeps alive (never the caller's memory)."""
        return self.views[seq], False

    def crc(self, seq: int, payload: Any) -> int | None:
        return cached_crc(self.checksum, self.crcs, seq, payload)


def take(staged: Staged, seqs: Sequence[int], staging: DeviceStaging, floor: Callable[[], int]) -> Snapshot:
    """Copy data messages ``seqs`` (ascending) of ``staged``, last first, down to ``floor()`` at most.

    ``floor()`` is read between batches of :data:`BATCH_BYTES`: no transfer
    will ask for a message below it (any thread may move it up). Returns once
    the copies are complete; the snapshot holds the messages it copied.
    """
    sizes = {seq: wire.chunk_length(staged.plan[seq]) for seq in seqs}
    nbytes = sum(sizes.values())
    device = staged.device_plan
    buffer = staging.host_buffer(nbytes) if device is not None else torch.empty(nbytes, dtype=torch.uint8)
    offsets = dict(zip(seqs, itertools.accumulate((sizes[seq] for seq in seqs), initial=0), strict=False))
    engines: Engines = {}
    copied: list[int] = []
    for batch in _batches_from_the_end(seqs, sizes):
        lowest = floor()
        wanted = [seq for seq in batch if seq >= lowest]
        if not wanted:
            break
        at = offsets[wanted[0]]
        if device is None:
            _populate(buffer, at, offsets[wanted[-1]] + sizes[wanted[-1]])
        _copy(buffer, staged, plan_runs(staged.plan, wanted, at=at), staging, engines)
        copied += wanted
    whole = owning_view(buffer)
    views = {seq: whole[offsets[seq] : offsets[seq] + sizes[seq]] for seq in copied}
    return Snapshot(
        staged.step,
        staged.stage_id,
        staged.plan,
        staged.checksum,
        staged.crcs,
        views,
        sum(sizes[seq] for seq in copied),
        staged.total_bytes,
        staged.tensor_count,
        staged.digests,
    )


def _populate(buffer: torch.Tensor, start: int, stop: int) -> None:
    """Fault bytes [start, stop) of fresh ``buffer`` in at once, before they are copied into.

    The kernel's MADV_POPULATE_WRITE maps a range in one call, without a trap
    per page: measured on a 2-vCPU VM, 512 MiB copied into fresh memory in
    190 ms this way against 225-280 ms faulting page by page. Where the kernel
    lacks it (before Linux 5.14) the copy takes the faults, as it would anyway.
    """
    base = buffer.data_ptr()
    first = (base + start + PAGE - 1) // PAGE * PAGE
    last = (base + stop) // PAGE * PAGE
    if last > first:
        buffers._madvise()(first, last - first, buffers.MADV_POPULATE_WRITE)  # drops the GIL; a failure is harmless


def _batches_from_the_end(seqs: Sequence[int], sizes: dict[int, int]) -> Iterator[list[int]]:
    """``seqs`` in runs of about :data:`BATCH_BYTES`, the last run first (each ascending)."""
    batch: list[int] = []
    held = 0
    for seq in reversed(seqs):
        batch.append(seq)
        held += sizes[seq]
        if held >= BATCH_BYTES:
            yield batch[::-1]
            batch, held = [], 0
    if batch:
        yield batch[::-1]


def _copy(buffer: torch.Tensor, staged: Staged, runs: list[Run], staging: DeviceStaging, engines: Engines) -> None:
    """Carry out ``runs``: host memory with memmove, device memory on engines of this copy's own."""
    device = staged.device_plan
    storages = staged.tree.storages
    base = buffer.data_ptr()
    pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for run in runs:
        ref = storages[run.storage]
        if device is None or not device.staged[run.storage]:
            ctypes.memmove(base + run.at, ref.ptr + run.start, run.length)
            continue
        source = storage_bytes(ref.owner)[run.start : run.start + run.length]
        pairs.setdefault(device.device_of(run.storage), []).append((buffer[run.at : run.at + run.length], source))
    for where, device_pairs in pairs.items():
        assert device is not None
        engine = engines.get(where)
        if engine is None:
            engine = engines[where] = staging.make_engine(where)
            marker = device.markers.get(where)
            if marker is not None:
                engine.wait_marker(marker)  # the producer's kernels first
        engine.copy(device_pairs)
        engine.record().synchronize()


def plan_runs(plan: list[list[wire.Piece]], seqs: Sequence[int], at: int = 0) -> list[Run]:
    """The copies that lay messages ``seqs`` out back to back from byte ``at``: one per stretch of one storage."""
    runs: list[Run] = []
    for seq in seqs:
        for piece in plan[seq]:
            last = runs[-1] if runs else None
            if last is not None and last.storage == piece.storage and last.start + last.length == piece.start:
                runs[-1] = last._replace(length=last.length + piece.length)
            else:
                runs.append(Run(at, piece.storage, piece.start, piece.length))
            at += piece.length
    return runs


def owning_view(buffer: torch.Tensor) -> memoryview:
    """The bytes of a flat uint8 CPU tensor as a memoryview that keeps the tensor alive.

    A frame sent without a copy holds the object it was given until libzmq
    lets go of it; a view made from the raw address alone would not keep the
    memory from being freed while libzmq still reads it.
    """
    nbytes = buffer.numel()
    if nbytes == 0:
        return memoryview(b"")
    array = (ctypes.c_uint8 * nbytes).from_address(buffer.data_ptr())
    array.owner = buffer  # type: ignore[attr-defined]  # ctypes instances take attributes
    return memoryview(array).cast("B")


def default_cap() -> int:
    """:data:`DEFAULT_CAP_SHARE` of the memory available now (``MemAvailable``; else physical memory)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * DEFAULT_CAP_SHARE)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * DEFAULT_CAP_SHARE)
    except (OSError, ValueError):
        return 0  # unknown: never snapshot, wait (the contract still holds)
