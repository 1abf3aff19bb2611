"""A landing plan carried out: each storage's memory, then the object built from it.

:func:`land` allocates what :func:`.landing.plan_landing` decided (in place,
in place or fresh through CUDA bounce buffers, the small-tensor arena, fresh)
and starts faulting fresh memory in; the data messages are received into it
(:mod:`.inbox`); :func:`build` makes the received object from the skeleton
once every byte is in place. Memory only: no sockets here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import buffers, wire
from ..codec import dtensor
from ..codec.skeleton import build_tree
from ..device import fresh_storage, tensor_bytes
from . import landing


class Destination:
    """One storage's landing memory, allocated as its :data:`landing.Placement` says.

    ``view`` is the host memory its bytes are received into (empty when they go
    through bounce buffers into ``device_bytes``); ``fresh`` is the storage's
    freshly allocated memory (None in place). A plain class whose derived
    attributes are set once: a receive makes one per storage and reads them
    per storage and per packed piece (properties over the placement cost
    20 ms for 20,480 storages).
    """

    __slots__ = ("arena_offset", "device_bytes", "exact", "fresh", "in_place", "placement", "view")

    placement: landing.Placement
    view: memoryview
    device_bytes: torch.Tensor | None  # flat uint8 device memory filled through bounce buffers
    fresh: torch.Tensor | None
    in_place: Any  # the caller's tensor (or DTensor) receiving the bytes, or None
    exact: bool  # ``fresh`` was allocated as the storage's only tensor, handed out as it is
    arena_offset: int  # where ``fresh`` lies in the arena, or -1

    def __init__(
        self,
        placement: landing.Placement,
        view: memoryview,
        device_bytes: torch.Tensor | None = None,
        fresh: torch.Tensor | None = None,
    ) -> None:
        self.placement = placement
        self.view = view
        self.device_bytes = device_bytes
        self.fresh = fresh
        if type(placement) is landing.InArena:  # most storages of a many-tensor receive: first
            self.in_place = None
            self.exact = placement.exact is not None
            self.arena_offset = placement.offset
            return
        self.in_place = placement.target if isinstance(placement, _IN_PLACE) else None
        self.exact = isinstance(placement, landing.Fresh) and placement.exact is not None
        self.arena_offset = -1


_IN_PLACE = (landing.InPlace, landing.InPlaceBounced)


@dataclass
class Landed:
    """A landing plan carried out: the memory of every storage, the arena, the prefaulter."""

    plan: landing.LandingPlan
    destinations: list[Destination]
    arena: buffers.Arena | None
    prefaulter: buffers.Prefaulter | None

    def arena_run(self, pieces: list[wire.Piece]) -> memoryview | None:
        """The arena bytes a packed message fills, when its storages lie there back to back."""
        if self.arena is None:
            return None
        start = at = self.destinations[pieces[0].storage].arena_offset
        if start < 0:
            return None
        for piece in pieces:
            if self.destinations[piece.storage].arena_offset != at or piece.start:
                return None
            at += piece.length
        return self.arena.view[start:at]

    def close(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.close()  # before the fresh memory can be freed


def land(plan: landing.LandingPlan, prefault_threads: int) -> Landed:
    """Allocate what ``plan`` says and start faulting fresh memory in ahead of the data."""
    arena = buffers.Arena(plan.arena.sizes, plan.arena.offsets) if plan.arena is not None else None
    in_arena = landing.InArena
    # Arena storages first in the test: most storages of a many-tensor receive.
    destinations = [
        _carve(p, arena) if type(p) is in_arena else _allocate(p, arena)  # type: ignore[arg-type]
        for p in plan.placements
    ]
    regions = []  # (stream offset, pointer, bytes)
    for region in plan.prefault:
        if region.arena:
            assert arena is not None
            regions.append((region.stream_offset, arena.pointer, region.nbytes))
        else:
            fresh = destinations[region.storage].fresh
            assert fresh is not None
            regions.append((region.stream_offset, fresh.data_ptr(), region.nbytes))
    # Started once everything is carved: started before, its workers slowed
    # the carving of 20,480 arena tensors on a loaded machine (load average
    # 7: 60-75 ms became 90-95 ms), with no gain shown on a quiet one.
    prefaulter = buffers.Prefaulter.start(regions, prefault_threads)
    return Landed(plan, destinations, arena, prefaulter)


def _carve(placement: landing.InArena, arena: buffers.Arena) -> Destination:
    at, nbytes, exact = placement
    if exact is not None:
        view, fresh = arena.carve(at, nbytes, exact.dtype, exact.shape)
    else:
        view, fresh = arena.carve(at, nbytes, torch.uint8)
    return Destination(placement, view, None, fresh)


def _allocate(placement: landing.Placement, arena: buffers.Arena | None) -> Destination:
    if isinstance(placement, landing.InArena):
        assert arena is not None
        return _carve(placement, arena)
    empty = memoryview(b"")
    match placement:
        case landing.InPlace(local=local):
            return Destination(placement, buffers.tensor_view(local))
        case landing.InPlaceBounced(local=local):
            return Destination(placement, empty, device_bytes=tensor_bytes(local))
        case landing.FreshBounced(nbytes=nbytes, device=device):
            fresh = fresh_storage(nbytes, device)
            return Destination(placement, empty, device_bytes=fresh, fresh=fresh)
        case landing.Fresh(nbytes=nbytes, exact=exact, huge_pages=huge_pages):
            if exact is not None:
                # The storage's only tensor, allocated as itself: building it
                # later through set_() cost ~10 us per tensor, 0.2 s for 20,480.
                fresh = torch.empty(exact.shape, dtype=exact.dtype)
            else:
                fresh = buffers.allocate(nbytes, huge_pages)
            return Destination(placement, buffers.tensor_view(fresh), fresh=fresh)
    raise AssertionError(f"unknown placement {placement!r}")


def build(parsed: landing.ParsedHeader, landed: Landed) -> Any:
    """The received object: the skeleton with each tensor leaf where its storage landed."""
    specs = parsed.specs
    destinations = landed.destinations

    def plain(index: int) -> torch.Tensor:
        spec = specs[index]
        destination = destinations[spec.storage]
        placement = destination.placement
        if isinstance(placement, landing.InPlace | landing.InPlaceBounced):
            return placement.local
        assert destination.fresh is not None
        if destination.exact:
            tensor = destination.fresh
        else:
            tensor = torch.empty(0, dtype=spec.dtype, device=destination.fresh.device).set_(
                destination.fresh.untyped_storage(), spec.offset, spec.shape, spec.stride
            )
        if spec.is_param:
            return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
        if spec.requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def leaf(index: int) -> Any:
        # (index_skeleton let each index appear once, so nothing is built twice.)
        spec = specs[index]
        destination = destinations[spec.storage]
        if destination.exact and not spec.requires_grad and not spec.is_param:
            return destination.fresh  # most leaves of a fresh receive: allocated as themselves
        target = destination.in_place
        # In place: hand back the caller's own tensor object, not a new view
        # (a DTensor target is rebuilt around its shard by make_dtensor).
        if target is not None and destination.placement.local is target:  # type: ignore[union-attr]
            return target
        return plain(index)

    def make_dtensor(index: int, spec_obj: Any, requires_grad: bool) -> Any:
        # The caller's DTensor at this path, even when its bytes were not a
        # match: its live mesh is still worth reusing when the specs agree.
        like = landed.plan.target_leaves.get(parsed.paths[index])
        return dtensor.make_dtensor(plain(index), spec_obj, requires_grad, like=like)

    return build_tree(parsed.header.skeleton, leaf, make_dtensor)
