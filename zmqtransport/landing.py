"""Where each received storage lands: a plan, decided before any byte arrives.

:func:`plan_landing` is pure: given a validated header and the caller's
in-place targets it decides, storage by storage, one :data:`Placement`

* :class:`InPlace` -- straight into the caller's CPU tensor (or DTensor shard);
* :class:`InPlaceBounced` -- into the caller's device tensor, through pinned
  bounce buffers (docs/cuda.md);
* :class:`FreshBounced` -- fresh device memory on ``device``, through bounce buffers;
* :class:`InArena` -- a small fresh storage carved out of one shared mapping;
* :class:`Fresh` -- a fresh CPU allocation of its own;

and which fresh memory is worth faulting in ahead of the data
(:class:`PrefaultRegion`). It allocates nothing: the receive loop
(:mod:`zmqtransport.receiver`) executes the plan. A storage lands in place only
when its one tensor matches the target at the same key path exactly (dtype,
shape, whole contiguous storage, a device this side can fill, and for a
DTensor shard the same DTensor spec); anything else lands fresh.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import buffers, wire
from .codec.dtensor import spec_matches
from .codec.paths import KeyPath
from .codec.skeleton import index_skeleton, iter_tensor_leaves
from .codec.tensors import TensorSpec, decode_tensor_table
from .device import CPU, can_fill
from .errors import ProtocolError


@dataclass(frozen=True)
class ParsedHeader:
    """A validated header with its tensor table and key paths decoded."""

    header: wire.Header
    specs: list[TensorSpec]
    paths: dict[int, KeyPath]
    dtensor_specs: dict[int, Any] = field(default_factory=dict)  # local tensor index -> spec


def parse_header(header: wire.Header, allow_pickle: bool) -> ParsedHeader:
    """Decode and validate the tensor table and the skeleton of ``header``."""
    specs = decode_tensor_table(header.tensors, header.storages)
    dtensor_specs: dict[int, Any] = {}
    paths = index_skeleton(header.skeleton, len(specs), allow_pickle, dtensor_specs)
    return ParsedHeader(header, specs, paths, dtensor_specs)


# ----------------------------------------------------------------------------- placements


@dataclass(frozen=True)
class InPlace:
    """Into the caller's CPU tensor ``local`` (``target`` itself, or the shard of a DTensor)."""

    target: Any
    local: torch.Tensor


@dataclass(frozen=True)
class InPlaceBounced:
    """Into the caller's device tensor ``local``, through pinned bounce buffers."""

    target: Any
    local: torch.Tensor


@dataclass(frozen=True)
class FreshBounced:
    """Fresh memory on a staged ``device``, filled through pinned bounce buffers."""

    nbytes: int
    device: torch.device


@dataclass(frozen=True)
class InArena:
    """``nbytes`` at ``offset`` of the arena; ``exact`` when it is its only tensor's whole storage."""

    offset: int
    nbytes: int
    exact: TensorSpec | None


@dataclass(frozen=True)
class Fresh:
    """A fresh CPU allocation; allocated as its only tensor when ``exact`` is set."""

    nbytes: int
    exact: TensorSpec | None
    huge_pages: bool


Placement = InPlace | InPlaceBounced | FreshBounced | InArena | Fresh


@dataclass(frozen=True)
class PrefaultRegion:
    """Fresh memory to fault in ahead of the data: one storage, or the whole arena.

    ``stream_offset`` is where its bytes start in the data stream (the
    prefaulter skips what the data has already reached).
    """

    stream_offset: int
    storage: int  # the storage it belongs to (the arena's first storage when ``arena``)
    nbytes: int
    arena: bool = False


@dataclass(frozen=True)
class ArenaLayout:
    """The small fresh storages that share one mapping, by storage index, at their offsets."""

    storages: list[int]
    sizes: list[int]


@dataclass(frozen=True)
class LandingPlan:
    placements: list[Placement]  # one per storage, in stream order
    arena: ArenaLayout | None
    prefault: list[PrefaultRegion]
    # The caller's tensor leaves by key path (also the DTensors whose mesh a
    # fresh shard may reuse when the specs agree).
    target_leaves: dict[KeyPath, Any]
    fresh_bytes: int  # bytes this receive allocates


@dataclass(frozen=True)
class LandingOptions:
    max_bytes: int | None = None  # refuse headers claiming more fresh memory than this
    device: torch.device = CPU  # where fresh (not in-place) tensors go
    # Whether memory on a device is filled through pinned bounce buffers
    # (the transport passes DeviceStaging.stages).
    stages: Callable[[torch.device], bool] = lambda device: device.type == "cuda"
    huge_pages: bool = False


def default_max_bytes() -> int:
    """Physical memory: a header claiming more than this cannot be honest."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 2**40


def plan_landing(parsed: ParsedHeader, targets: Any, options: LandingOptions) -> LandingPlan:
    """Decide where each storage of ``parsed`` lands; refuse absurd sizes (``ProtocolError``)."""
    storages = parsed.header.storages
    users = _users(parsed.specs)
    leaves = dict(iter_tensor_leaves(targets)) if targets is not None else {}
    chosen = _choose_in_place(parsed, users, leaves)
    fresh_bytes = sum(n for i, n in enumerate(storages) if i not in chosen)
    limit = options.max_bytes if options.max_bytes is not None else default_max_bytes()
    if fresh_bytes > limit:
        raise ProtocolError(f"the peer announced {fresh_bytes} bytes of tensors, more than the limit of {limit}")
    placements: dict[int, Placement] = {}
    for storage, target in chosen.items():
        local = local_tensor(target)
        assert local is not None
        bounced = options.stages(local.device)
        placements[storage] = InPlaceBounced(target, local) if bounced else InPlace(target, local)
    if options.stages(options.device):
        for storage, nbytes in enumerate(storages):
            placements.setdefault(storage, FreshBounced(nbytes, options.device))
    arena = _arena_layout(parsed.header, placements)
    placements.update(_arena_placements(arena, parsed.specs, users))
    # Page faults of fresh memory would otherwise be taken one by one inside
    # the copy loop, after the network, on one core (buffers.Prefaulter).
    prefault: list[PrefaultRegion] = []
    offset = 0  # where the storage starts in the data stream
    for storage, nbytes in enumerate(storages):
        placement = placements.get(storage)
        if placement is None:
            exact = _exact_spec(parsed.specs, users.get(storage), nbytes)
            if options.huge_pages and nbytes >= buffers.HUGE_PAGE:
                exact = None  # the huge-page mapping is allocated as bytes
            placements[storage] = Fresh(nbytes, exact, options.huge_pages)
            if nbytes >= buffers.PREFAULT_PIECE:
                prefault.append(PrefaultRegion(offset, storage, nbytes))
        elif isinstance(placement, InArena) and placement.offset == 0 and arena is not None:
            prefault.append(PrefaultRegion(offset, storage, buffers.arena_size(arena.sizes), arena=True))
        offset += nbytes
    ordered = [placements[storage] for storage in range(len(storages))]
    return LandingPlan(ordered, arena, prefault, leaves, fresh_bytes)


def _users(specs: list[TensorSpec]) -> dict[int, list[int]]:
    """The tensors (indices) viewing each storage."""
    users: dict[int, list[int]] = {}
    for index, spec in enumerate(specs):
        users.setdefault(spec.storage, []).append(index)
    return users


def _choose_in_place(
    parsed: ParsedHeader, users: dict[int, list[int]], leaves: dict[KeyPath, Any]
) -> dict[int, Any]:
    """The caller's target for each storage that can be received in place."""
    chosen: dict[int, Any] = {}
    # Without targets (a fresh receive) nothing can be chosen: skip the walk.
    for storage, nbytes in enumerate(parsed.header.storages if leaves else ()):
        tensor_indices = users.get(storage, [])
        if len(tensor_indices) != 1:
            continue
        index = tensor_indices[0]
        target = leaves.get(parsed.paths[index])
        local = local_tensor(target)
        if local is None or not _fits(local, parsed.specs[index], nbytes):
            continue
        # A DTensor shard goes only into a DTensor with the same spec: other
        # placements or another mesh would describe bytes it does not hold.
        dtensor_spec = parsed.dtensor_specs.get(index)
        dtensor_involved = dtensor_spec is not None or local is not target
        if dtensor_involved and (dtensor_spec is None or not spec_matches(target, dtensor_spec)):
            continue
        chosen[storage] = target
    return chosen


def _arena_layout(header: wire.Header, placed: dict[int, Placement]) -> ArenaLayout | None:
    """The storages that travel packed (``plan_chunks``) and land in fresh CPU memory, if many."""
    small = [i for i, n in enumerate(header.storages) if 0 < n < header.pack_below and i not in placed]
    if len(small) < buffers.ARENA_MIN_STORAGES:
        return None
    return ArenaLayout(small, [header.storages[i] for i in small])


def _arena_placements(
    arena: ArenaLayout | None, specs: list[TensorSpec], users: dict[int, list[int]]
) -> dict[int, InArena]:
    if arena is None:
        return {}
    offsets = buffers.arena_offsets(arena.sizes)
    return {
        storage: InArena(offset, nbytes, _exact_spec(specs, users.get(storage), nbytes))
        for storage, nbytes, offset in zip(arena.storages, arena.sizes, offsets, strict=True)
    }


def local_tensor(target: Any) -> torch.Tensor | None:
    """The tensor whose memory an in-place target offers: itself, or a DTensor's local shard."""
    if target is None:
        return None
    local = getattr(target, "_local_tensor", None)  # DTensor: write into its shard
    if isinstance(local, torch.Tensor):
        return local
    return target if isinstance(target, torch.Tensor) else None


def _exact_spec(specs: list[TensorSpec], users: list[int] | None, nbytes: int) -> TensorSpec | None:
    """The spec of a storage's only tensor when that tensor is exactly the whole storage."""
    if users is None or len(users) != 1:
        return None
    spec = specs[users[0]]
    return spec if _whole(spec, nbytes) else None


def _whole(spec: TensorSpec, nbytes: int) -> bool:
    """Whether ``spec`` is exactly its ``nbytes``-byte storage: contiguous, from byte 0 to the end."""
    if spec.offset:
        return False
    shape = spec.shape
    if len(shape) == 1:  # the common case, without computing a contiguous stride
        return spec.stride == (1,) and shape[0] * spec.dtype.itemsize == nbytes
    return spec.covers_whole_storage and spec.nbytes == nbytes


def _fits(target: torch.Tensor, spec: TensorSpec, storage_nbytes: int) -> bool:
    return (
        _whole(spec, storage_nbytes)  # first: no torch attribute access
        and target.dtype == spec.dtype
        and target.shape == spec.shape  # torch.Size compares equal to the tuple
        and can_fill(target.device)
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and target.layout == torch.strided
    )
