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
(:class:`PrefaultRegion`). It allocates nothing: :mod:`.landed` carries the
plan out. A storage lands in place only
when its one tensor matches the target at the same key path exactly (dtype,
shape, whole contiguous storage, a device this side can fill, and for a
DTensor shard the same DTensor spec); anything else lands fresh.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .. import buffers, wire
from ..codec.dtensor import spec_matches
from ..codec.keypaths import KeyPath
from ..codec.skeleton import index_skeleton, iter_tensor_leaves
from ..codec.tensors import TensorSpec, decode_tensor_table
from ..device import CPU, can_fill
from ..errors import ProtocolError


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


# Placements are named tuples, not frozen dataclasses: a receive makes one per
# storage, and a frozen dataclass's __init__ cost 1.1 us against 0.35 us,
# 22 ms of a receive of 20,480 small tensors.


class InPlace(NamedTuple):
    """Into the caller's CPU tensor ``local`` (``target`` itself, or the shard of a DTensor)."""

    target: Any
    local: torch.Tensor


class InPlaceBounced(NamedTuple):
    """Into the caller's device tensor ``local``, through pinned bounce buffers."""

    target: Any
    local: torch.Tensor


class FreshBounced(NamedTuple):
    """Fresh memory on a staged ``device``, filled through pinned bounce buffers."""

    nbytes: int
    device: torch.device


class InArena(NamedTuple):
    """``nbytes`` at ``offset`` of the arena; ``exact`` when it is its only tensor's whole storage."""

    offset: int
    nbytes: int
    exact: TensorSpec | None


class Fresh(NamedTuple):
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
    offsets: list[int]  # buffers.arena_offsets(sizes)

    @property
    def nbytes(self) -> int:
        """The bytes the arena spans (:func:`buffers.arena_size`, from the offsets)."""
        return self.offsets[-1] + buffers.arena_size(self.sizes[-1:]) if self.sizes else 0


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
    sole = sole_users(parsed.specs, len(storages))
    leaves = dict(iter_tensor_leaves(targets)) if targets is not None else {}
    chosen = _choose_in_place(parsed, sole, leaves)
    fresh_bytes = sum(storages) - sum(storages[storage] for storage in chosen)
    limit = options.max_bytes if options.max_bytes is not None else default_max_bytes()
    if fresh_bytes > limit:
        raise ProtocolError(f"the peer announced {fresh_bytes} bytes of tensors, more than the limit of {limit}")
    placements: list[Placement | None] = [None] * len(storages)
    for storage, target in chosen.items():
        local = local_tensor(target)
        assert local is not None
        bounced = options.stages(local.device)
        placements[storage] = InPlaceBounced(target, local) if bounced else InPlace(target, local)
    if options.stages(options.device):
        placements = [
            p if p is not None else FreshBounced(n, options.device) for p, n in zip(placements, storages, strict=True)
        ]
    arena = _arena_layout(parsed.header, placements)
    if arena is not None:
        specs = parsed.specs
        for storage, nbytes, offset in zip(arena.storages, arena.sizes, arena.offsets, strict=True):
            index = sole[storage]  # _exact_spec, inline: this runs for every small storage
            exact = specs[index] if index >= 0 else None
            placements[storage] = InArena(
                offset, nbytes, exact if exact is not None and _whole(exact, nbytes) else None
            )
    prefault = _fill_fresh(placements, storages, parsed.specs, sole, options.huge_pages)
    if arena is not None:
        # Page faults of fresh memory would otherwise be taken one by one
        # inside the copy loop, after the network, on one core (buffers.Prefaulter).
        first = arena.storages[0]
        region = PrefaultRegion(sum(storages[:first]), first, arena.nbytes, arena=True)
        prefault = sorted([*prefault, region], key=lambda r: r.stream_offset)
    ordered: list[Placement] = placements  # type: ignore[assignment]  # every storage has one now
    return LandingPlan(ordered, arena, prefault, leaves, fresh_bytes)


def _fill_fresh(
    placements: list[Placement | None],
    storages: list[int],
    specs: list[TensorSpec],
    sole: list[int],
    huge_pages: bool,
) -> list[PrefaultRegion]:
    """Place every storage not yet placed in fresh CPU memory of its own; return what to prefault of it."""
    prefault: list[PrefaultRegion] = []
    offset = 0  # where the storage starts in the data stream
    for storage, nbytes in enumerate(storages):
        if placements[storage] is None:
            exact = _exact_spec(specs, sole[storage], nbytes)
            if huge_pages and nbytes >= buffers.HUGE_PAGE:
                exact = None  # the huge-page mapping is allocated as bytes
            placements[storage] = Fresh(nbytes, exact, huge_pages)
            if nbytes >= buffers.PREFAULT_MIN_REGION:
                prefault.append(PrefaultRegion(offset, storage, nbytes))
        offset += nbytes
    return prefault


# sole_users' marks for a storage without exactly one tensor.
NO_USER = -1
SHARED = -2


def sole_users(specs: list[TensorSpec], n_storages: int) -> list[int]:
    """For each storage, the index of its only tensor, or :data:`NO_USER` / :data:`SHARED`."""
    sole = [NO_USER] * n_storages
    for index, spec in enumerate(specs):
        storage = spec.storage
        sole[storage] = index if sole[storage] == NO_USER else SHARED
    return sole


def _choose_in_place(parsed: ParsedHeader, sole: list[int], leaves: dict[KeyPath, Any]) -> dict[int, Any]:
    """The caller's target for each storage that can be received in place."""
    chosen: dict[int, Any] = {}
    # Without targets (a fresh receive) nothing can be chosen: skip the walk.
    for storage, nbytes in enumerate(parsed.header.storages if leaves else ()):
        index = sole[storage]
        if index < 0:
            continue
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


def _arena_layout(header: wire.Header, placed: list[Placement | None]) -> ArenaLayout | None:
    """The storages that travel packed (``plan_chunks``) and land in fresh CPU memory, if many."""
    pack_below = header.pack_below
    small = [i for i, n in enumerate(header.storages) if 0 < n < pack_below and placed[i] is None]
    if len(small) < buffers.ARENA_MIN_STORAGES:
        return None
    sizes = [header.storages[i] for i in small]
    return ArenaLayout(small, sizes, buffers.arena_offsets(sizes))


def local_tensor(target: Any) -> torch.Tensor | None:
    """The tensor whose memory an in-place target offers: itself, or a DTensor's local shard."""
    if target is None:
        return None
    if type(target) in _PLAIN_TENSORS:  # no attribute lookup: a miss on a tensor costs 0.5 us
        return target  # type: ignore[no-any-return]
    local = getattr(target, "_local_tensor", None)  # DTensor: write into its shard
    if isinstance(local, torch.Tensor):
        return local
    return target if isinstance(target, torch.Tensor) else None


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _exact_spec(specs: list[TensorSpec], sole: int, nbytes: int) -> TensorSpec | None:
    """The spec of a storage's only tensor (``sole``, see :func:`sole_users`) when it is exactly the whole storage."""
    if sole < 0:
        return None
    spec = specs[sole]
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
