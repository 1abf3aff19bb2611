"""DTensor specs without pickle: encode, validate and rebuild a ``DTensorSpec``.

A DTensor leaf travels as its local tensor (like any tensor, see :mod:`.tensors`)
plus the msgpack-able description of its ``_spec`` built here. The description
is a dict with exactly these keys::

    {
      "mesh": {
        "device_type": "cpu",
        "shape": [2, 4],                # size of each mesh dim ([] for a 0-d mesh)
        "rank_map": [0, 1, ...],        # global ranks, row-major over shape (unless layout)
        "dim_names": ["dp", "tp"],      # or None
        "rank": 5,                      # the sender's global rank (fallback, see make_dtensor)
        "layout": [[[2], [4]], ...],    # only for sliced / flattened meshes, see below
      },
      "placements": [["shard", 0], ["replicate"], ["partial", "sum"],
                     ["strided_shard", 0, 2]],   # one per mesh dim
      "meta": {"shape": [...], "stride": [...], "dtype": "float32"},
      "shard_order": [[tensor_dim, [mesh_dim, ...]], ...] or None,
      "strided_order": bool or None,    # DTensorSpec.use_strided_shard_as_shard_order
    }

Why each part is there: ``DTensorSpec.__eq__`` compares the mesh, the
placements, the shard order and the tensor meta, and ``DeviceMesh.__eq__``
compares the device type, the dim names, the layout and the *full* rank map.
A root mesh is row-major over its own ranks, so ``shape`` and ``rank_map`` say
it all. A mesh sliced or flattened out of a bigger one (``mesh["dp"]``) keeps
its root's rank map and reads it through a CuTe layout; for such a mesh
``rank_map`` is the root's and ``layout`` gives, per mesh dim, the sizes and
strides into it. Everything else about a mesh (its process groups, its root
mesh object, flatten bookkeeping) is process-local state that cannot travel;
the receiver gets it back only by receiving in place (``like``).

Only placement kinds that are plain values are accepted. ``_MaskPartial`` (which
holds a live mask buffer), symbolic sizes and custom mesh or placement
subclasses raise ``TypeError`` on the sender rather than arriving different.

:func:`validate_spec` checks all of this before any tensor byte is received and
imports nothing: placements are a fixed allowlist, dtypes come from
:data:`.dtypes.DTYPES`, and sizes are bounded. ``torch.distributed.tensor`` is
imported lazily by the encoder and by :func:`make_dtensor` only, because
importing it costs seconds; :func:`dtensor_type` (the one place that tells
whether a value is a DTensor) never imports it: no DTensor can exist before it
is imported.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import threading
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import ProtocolError
from .dtypes import DTYPES, dtype_name
from .keypaths import KeyPath, format_path

# Bounds on what a peer may describe. A real mesh has a handful of dims and at
# most a few hundred thousand ranks; anything beyond is refused before allocation.
MAX_MESH_DIMS = 16
MAX_MESH_RANKS = 1 << 20
MAX_TENSOR_DIMS = 64
MAX_LAYOUT_MODES = 16  # modes inside one flattened mesh dim
MAX_NAME_CHARS = 256
_MAX_SIZE = 2**62
_MAX_RANK = 2**31 - 1  # DeviceMesh stores ranks as int32

# torch.distributed.ReduceOp names that Partial documents; anything else is refused.
REDUCE_OPS = frozenset({"sum", "avg", "min", "max", "product", "band", "bor", "bxor"})

_SPEC_KEYS = frozenset({"mesh", "placements", "meta", "shard_order", "strided_order"})
_MESH_KEYS = frozenset({"device_type", "shape", "rank_map", "dim_names", "rank"})
_MESH_EXTRA_KEYS = frozenset({"layout"})
_META_KEYS = frozenset({"shape", "stride", "dtype"})
_DEVICE_TYPE = re.compile(r"[a-z][a-z0-9_]{0,31}")

_Fail = Callable[[str], ProtocolError]  # builds the error, prefixed with the key path


def dtensor_type() -> type | None:
    """The DTensor class, or None while ``torch.distributed.tensor`` is not imported.

    Looked up, never imported: importing it would cost every user a few hundred
    milliseconds for nothing, and no DTensor exists before it is imported.
    """
    module = sys.modules.get("torch.distributed.tensor")
    found = getattr(module, "DTensor", None) if module is not None else None
    return found if isinstance(found, type) else None


@functools.cache
def _torch_api() -> SimpleNamespace:
    """The torch.distributed classes used here, imported on first use.

    Lazy on purpose (see the module docstring): importing torch.distributed.tensor
    costs seconds, and only checkpoints holding DTensors need it.
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise ProtocolError("this torch build has no torch.distributed; cannot rebuild a DTensor")
    import torch.distributed.tensor._dtensor_spec as spec_mod
    import torch.distributed.tensor.placement_types as placement_mod
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    return SimpleNamespace(
        dist=dist,
        DeviceMesh=DeviceMesh,
        DTensor=DTensor,
        DTensorSpec=spec_mod.DTensorSpec,
        TensorMeta=spec_mod.TensorMeta,
        ShardOrderEntry=spec_mod.ShardOrderEntry,
        Replicate=placement_mod.Replicate,
        Shard=placement_mod.Shard,
        StridedShard=placement_mod._StridedShard,
        Partial=placement_mod.Partial,
    )


# ----------------------------------------------------------------------------- encoding


def encode_spec(spec: Any, path: KeyPath) -> dict[str, Any]:
    """Describe ``spec`` (a ``DTensorSpec``) with plain msgpack-able values.

    Raises ``TypeError`` naming ``path`` for anything that cannot be described
    faithfully. The result always passes :func:`validate_spec`, so a sender
    fails here rather than a receiver refusing the whole checkpoint later.
    """
    where = format_path(path)
    if type(spec) is not _torch_api().DTensorSpec:
        raise TypeError(f"{where}: DTensor spec of type {type(spec).__qualname__} is not supported")
    meta = spec.tensor_meta
    if meta is None:
        raise TypeError(f"{where}: DTensor spec has no tensor_meta")
    shard_order = spec.shard_order
    out = {
        "mesh": _encode_mesh(spec.mesh, where),
        "placements": [_encode_placement(p, where) for p in spec.placements],
        "meta": {
            "shape": _plain_ints(meta.shape, where, "tensor_meta.shape"),
            "stride": _plain_ints(meta.stride, where, "tensor_meta.stride"),
            "dtype": dtype_name(meta.dtype),
        },
        "shard_order": None
        if shard_order is None
        else [
            [
                _plain_int(e.tensor_dim, where, "shard_order"),
                _plain_ints(e.mesh_dims, where, "shard_order"),
            ]
            for e in shard_order
        ],
        "strided_order": spec.use_strided_shard_as_shard_order,
    }
    try:
        validate_spec(out, path)
    except ProtocolError as exc:
        raise TypeError(f"cannot encode this DTensor spec faithfully: {exc}") from None
    return out


def _plain_int(value: Any, where: str, what: str) -> int:
    # SymInts and tensors would silently become something else on the wire.
    if type(value) is not int:
        raise TypeError(f"{where}: {what} holds a {type(value).__qualname__}, not an int")
    return value


def _plain_ints(values: Any, where: str, what: str) -> list[int]:
    return [_plain_int(v, where, what) for v in values]


def _encode_mesh(mesh: Any, where: str) -> dict[str, Any]:
    if type(mesh) is not _torch_api().DeviceMesh:
        # A subclass carries behaviour the receiver could not reconstruct.
        raise TypeError(f"{where}: device mesh of type {type(mesh).__qualname__} is not supported")
    names = mesh.mesh_dim_names
    out: dict[str, Any] = {
        "device_type": mesh.device_type,
        "dim_names": None if names is None else list(names),
        "rank": int(getattr(mesh, "_rank", -1)),
    }
    layout = getattr(mesh, "_layout", None)
    rank_map = getattr(mesh, "_rank_map", None)
    if layout is None or not isinstance(rank_map, torch.Tensor):
        # Torch without mesh layouts: the public mesh tensor is all DeviceMesh has.
        public = mesh.mesh
        out["shape"] = list(public.shape)
        out["rank_map"] = public.flatten().tolist()
        return out
    # Torch with mesh layouts (2.13 among them) compares the layout and the full
    # rank map. Read them directly: the public ``mesh`` tensor of a sliced mesh
    # is only the slice holding the *current* rank, so it differs between ranks.
    shape = list(layout.top_level_sizes)
    out["shape"] = shape
    out["rank_map"] = rank_map.tolist()
    # A root mesh is row-major over its own ranks; only other layouts are spelled out.
    if len(out["rank_map"]) != math.prod(shape) or layout != type(layout).from_sizes_strides(
        tuple(shape)
    ):
        out["layout"] = [[list(axis.shape), list(axis.stride)] for axis in layout]
    return out


def _encode_placement(placement: Any, where: str) -> list[Any]:
    api = _torch_api()
    # Exact types: a subclass such as _MaskPartial holds state we cannot send.
    kind = type(placement)
    if kind is api.Replicate:
        return ["replicate"]
    if kind is api.Shard:
        return ["shard", _plain_int(placement.dim, where, "Shard.dim")]
    if kind is api.StridedShard:
        return [
            "strided_shard",
            _plain_int(placement.dim, where, "_StridedShard.dim"),
            _plain_int(placement.split_factor, where, "_StridedShard.split_factor"),
        ]
    if kind is api.Partial:
        if placement.reduce_op not in REDUCE_OPS:
            raise TypeError(f"{where}: Partial reduce_op {placement.reduce_op!r} is not supported")
        return ["partial", placement.reduce_op]
    raise TypeError(f"{where}: DTensor placement {kind.__qualname__} is not supported")


# ----------------------------------------------------------------------------- validation


def validate_spec(obj: Any, path: KeyPath) -> None:
    """Check a received spec description completely; raise ``ProtocolError`` if malformed.

    Pure structural checks (types, key sets, ranges, cross-field consistency);
    imports and calls nothing the peer names.
    """
    where = format_path(path)

    def fail(message: str) -> ProtocolError:
        return ProtocolError(f"{where}: DTensor spec: {message}")

    _keys(obj, _SPEC_KEYS, frozenset(), "spec", fail)
    mesh_ndim = _validate_mesh(obj["mesh"], fail)

    meta = obj["meta"]
    _keys(meta, _META_KEYS, frozenset(), "meta", fail)
    shape = _ints(meta["shape"], (MAX_TENSOR_DIMS, 0, _MAX_SIZE), "meta.shape", fail)
    stride = _ints(meta["stride"], (MAX_TENSOR_DIMS, 0, _MAX_SIZE), "meta.stride", fail)
    if len(shape) != len(stride):
        raise fail("meta.shape and meta.stride differ in length")
    if not isinstance(meta["dtype"], str) or meta["dtype"] not in DTYPES:
        raise fail(f"unknown dtype {meta['dtype']!r}")
    ndim = len(shape)

    placements = obj["placements"]
    if not isinstance(placements, list) or len(placements) != mesh_ndim:
        raise fail(f"placements must be a list of {mesh_ndim} (one per mesh dim)")
    for placement in placements:
        _validate_placement(placement, ndim, fail)

    order = obj["shard_order"]
    if order is not None:
        _validate_shard_order(order, placements, ndim, fail)
    if obj["strided_order"] is not None and type(obj["strided_order"]) is not bool:
        raise fail("strided_order must be a bool or None")


def _keys(
    obj: Any, required: frozenset[str], optional: frozenset[str], what: str, fail: _Fail
) -> None:
    if not isinstance(obj, dict):
        raise fail(f"{what} must be a map")
    keys = set(obj)
    if not required <= keys or not keys <= required | optional:
        raise fail(f"{what} has keys {sorted(map(repr, keys))}, expected {sorted(required)}")


def _ints(value: Any, bounds: tuple[int, int, int], what: str, fail: _Fail) -> list[int]:
    """``value`` checked as a list of at most ``max_len`` ints in ``[low, high]`` (``bounds``)."""
    max_len, low, high = bounds
    if not isinstance(value, list) or len(value) > max_len:
        raise fail(f"{what} must be a list of at most {max_len} integers")
    for item in value:
        if type(item) is not int or not low <= item <= high:
            raise fail(f"{what} holds an invalid value {item!r}")
    return value


def _validate_mesh(mesh: Any, fail: _Fail) -> int:
    """Returns the mesh's number of dims."""
    _keys(mesh, _MESH_KEYS, _MESH_EXTRA_KEYS, "mesh", fail)
    device_type = mesh["device_type"]
    if not isinstance(device_type, str) or not _DEVICE_TYPE.fullmatch(device_type):
        raise fail(f"invalid mesh device_type {device_type!r}")
    try:
        # Parsing only: torch.device never imports anything for a name it knows.
        parsed = torch.device(device_type)
    except RuntimeError:
        raise fail(f"unknown mesh device_type {device_type!r}") from None
    if parsed.type != device_type or parsed.index is not None:
        raise fail(f"invalid mesh device_type {device_type!r}")

    shape = _ints(mesh["shape"], (MAX_MESH_DIMS, 1, MAX_MESH_RANKS), "mesh.shape", fail)
    rank_map = _ints(mesh["rank_map"], (MAX_MESH_RANKS, 0, _MAX_RANK), "mesh.rank_map", fail)
    if len(set(rank_map)) != len(rank_map):
        raise fail("mesh.rank_map repeats a rank")
    names = mesh["dim_names"]
    if names is not None and not (
        isinstance(names, list)
        and len(names) == len(shape)
        and all(isinstance(n, str) and 0 < len(n) <= MAX_NAME_CHARS for n in names)
    ):
        raise fail(f"mesh.dim_names must be None or {len(shape)} non-empty strings")
    rank = mesh["rank"]
    if type(rank) is not int or not -1 <= rank <= _MAX_RANK:
        raise fail(f"invalid mesh.rank {rank!r}")

    if "layout" not in mesh:
        if len(rank_map) != math.prod(shape):
            raise fail(f"mesh.rank_map holds {len(rank_map)} ranks for a mesh of shape {shape}")
        return len(shape)
    layout = mesh["layout"]
    if not isinstance(layout, list) or len(layout) != len(shape):
        raise fail(f"mesh.layout must hold {len(shape)} axes")
    cosize = 1
    for size, axis in zip(shape, layout, strict=True):
        if not isinstance(axis, list) or len(axis) != 2:
            raise fail("mesh.layout axis must be [sizes, strides]")
        sizes = _ints(axis[0], (MAX_LAYOUT_MODES, 1, MAX_MESH_RANKS), "mesh.layout", fail)
        strides = _ints(axis[1], (MAX_LAYOUT_MODES, 0, MAX_MESH_RANKS), "mesh.layout", fail)
        if len(sizes) != len(strides) or math.prod(sizes) != size:
            raise fail(f"mesh.layout axis {axis!r} does not describe a dim of size {size}")
        cosize += sum((n - 1) * d for n, d in zip(sizes, strides, strict=True))
    # Overlap is left to DeviceMesh's own check; reaching past the map is caught here.
    if cosize > len(rank_map):
        raise fail("mesh.layout reaches past the end of mesh.rank_map")
    return len(shape)


def _validate_placement(placement: Any, ndim: int, fail: _Fail) -> None:
    if not isinstance(placement, list) or not placement or not isinstance(placement[0], str):
        raise fail(f"malformed placement {placement!r}")
    kind, args = placement[0], placement[1:]
    if kind == "replicate" and not args:
        return
    if kind == "shard" and len(args) == 1 and type(args[0]) is int and 0 <= args[0] < ndim:
        return
    if (
        kind == "strided_shard"
        and len(args) == 2
        and type(args[0]) is int
        and 0 <= args[0] < ndim
        and type(args[1]) is int
        and 1 <= args[1] <= MAX_MESH_RANKS
    ):
        return
    if kind == "partial" and len(args) == 1 and isinstance(args[0], str) and args[0] in REDUCE_OPS:
        return
    raise fail(f"unknown or malformed placement {placement!r}")


def _validate_shard_order(order: Any, placements: list[Any], ndim: int, fail: _Fail) -> None:
    if not isinstance(order, list) or len(order) > ndim:
        raise fail("shard_order must be a list with at most one entry per tensor dim")
    previous = -1
    used: list[int] = []
    for entry in order:
        if not isinstance(entry, list) or len(entry) != 2:
            raise fail(f"malformed shard_order entry {entry!r}")
        tensor_dim, mesh_dims = entry
        if type(tensor_dim) is not int or not previous < tensor_dim < ndim:
            raise fail("shard_order tensor dims must be increasing and within the tensor")
        previous = tensor_dim
        dims = _ints(mesh_dims, (MAX_MESH_DIMS, 0, len(placements) - 1), "shard_order", fail)
        if not dims:
            raise fail("shard_order entry without mesh dims")
        # The same rule DTensorSpec enforces (it too skips it when strided
        # placements encode the order): each listed mesh dim shards this tensor dim.
        if any(placements[d] != ["shard", tensor_dim] for d in dims) and not _has_strided(
            placements
        ):
            raise fail(f"shard_order entry {entry!r} does not match the placements")
        used.extend(dims)
    if len(set(used)) != len(used):
        raise fail("shard_order uses a mesh dim twice")
    if not _has_strided(placements) and len(used) != sum(p[0] == "shard" for p in placements):
        raise fail("shard_order does not cover every Shard placement")


def _has_strided(placements: list[Any]) -> bool:
    return any(p[0] == "strided_shard" for p in placements)


# ----------------------------------------------------------------------------- rebuilding

# Rebuilt meshes, shared by every DTensor of a checkpoint (and of later ones):
# all parameters of a model normally share one mesh object, and DTensor's own
# comparisons short-circuit on identity. Bounded in entries and in ranks per
# entry, so a peer cannot make this process keep large meshes alive.
_MESH_CACHE: dict[tuple[Any, ...], Any] = {}
_MESH_CACHE_SIZE = 32
_MESH_CACHE_MAX_RANKS = 1 << 16
_MESH_CACHE_LOCK = threading.Lock()


def make_dtensor(
    local: torch.Tensor, spec_obj: dict[str, Any], requires_grad: bool, like: Any = None
) -> Any:
    """Rebuild a DTensor from its local tensor and a description checked by :func:`validate_spec`.

    ``like`` is the receiver's own object at the same key path (None or anything
    else is ignored). When it is a DTensor on an equal mesh its mesh object is
    reused, so a recovering worker keeps its live process groups; when its whole
    spec matches too and ``local`` is its local tensor (received in place), it is
    returned itself, as plain tensors received in place are.

    Otherwise the mesh is rebuilt with ``_init_backend=False``: no process group
    is created or looked up, so it describes the layout but collectives on it
    fail until the caller redistributes onto a live mesh. ``DeviceMesh`` then
    needs only this process's global rank, which it would otherwise ask the
    default process group for (``get_rank()`` raises when torch.distributed is
    not initialised). So: when torch.distributed is initialised the mesh gets
    this process's rank; when not, it gets the sender's, which is the rank the
    local shard was taken on. Neither affects ``DTensorSpec`` equality.

    One exception: a sliced or flattened mesh (one sent with ``layout``) asks
    ``get_rank()`` itself, to pick the slice that holds this process, whatever
    ``_rank`` says. Rebuilding one therefore needs torch.distributed initialised
    and this process's rank in the mesh's ``rank_map``, as using it would anyway.

    Raises ``ProtocolError`` if torch refuses the description.
    """
    api = _torch_api()
    meta = spec_obj["meta"]
    dtype = DTYPES[meta["dtype"]]
    if local.dtype != dtype:
        raise ProtocolError(f"DTensor local tensor is {local.dtype} but its spec says {dtype}")
    like_spec = like._spec if type(like) is api.DTensor else None
    like_obj = _encode_or_none(like_spec)
    try:
        if like_obj is not None and _same_mesh(like_obj["mesh"], spec_obj["mesh"]):
            mesh = like_spec.mesh  # type: ignore[union-attr]
        else:
            mesh = _rebuild_mesh(spec_obj["mesh"])
        order = spec_obj["shard_order"]
        shard_order = (
            None
            if order is None
            else tuple(api.ShardOrderEntry(tensor_dim=d, mesh_dims=tuple(m)) for d, m in order)
        )
        strided_order = spec_obj["strided_order"]
        spec = api.DTensorSpec(
            mesh,
            tuple(_placement(p) for p in spec_obj["placements"]),
            tensor_meta=api.TensorMeta(torch.Size(meta["shape"]), tuple(meta["stride"]), dtype),
            # The constructor refuses an explicit order next to strided placements;
            # it is restored below in the rare case the sender's spec had both.
            shard_order=None if strided_order else shard_order,
            use_strided_shard_as_shard_order=strided_order,
        )
        if spec.shard_order != shard_order:
            spec.shard_order = shard_order
        if (
            like_spec is not None
            and like._local_tensor is local
            and like.requires_grad == requires_grad
            and like_spec == spec
            and like_spec.use_strided_shard_as_shard_order == spec.use_strided_shard_as_shard_order
        ):
            return like
        return api.DTensor(local, spec, requires_grad=requires_grad)
    except ProtocolError:
        raise
    except (AssertionError, ValueError, TypeError, RuntimeError, IndexError) as exc:
        # torch's own checks (layout overlap, shard order, grad on integers...).
        raise ProtocolError(f"DTensor spec refused by torch: {exc}") from None


def spec_matches(like: Any, spec_obj: dict[str, Any]) -> bool:
    """True when ``like`` is a DTensor whose spec is the one ``spec_obj`` describes.

    Meant for choosing in-place targets: writing a shard into a DTensor whose
    mesh, placements or meta differ would leave that DTensor describing bytes
    it does not hold. The sender's ``rank`` is not compared (it is not part of
    the spec's identity).
    """
    # dtensor_type() never imports: plain-tensor receivers do not pay for DTensor.
    found = dtensor_type()
    if found is None or type(like) is not found:
        return False
    obj = _encode_or_none(getattr(like, "_spec", None))
    if obj is None:
        return False
    return _same_mesh(obj["mesh"], spec_obj["mesh"]) and all(
        obj[key] == spec_obj[key] for key in _SPEC_KEYS - {"mesh"}
    )


def _encode_or_none(spec: Any) -> dict[str, Any] | None:
    if spec is None:
        return None
    try:
        return encode_spec(spec, ())
    except TypeError:
        return None


def _same_mesh(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # The sender's rank is where the shard came from, not part of mesh identity.
    return {k: v for k, v in a.items() if k != "rank"} == {
        k: v for k, v in b.items() if k != "rank"
    }


def _placement(obj: list[Any]) -> Any:
    api = _torch_api()
    kind = obj[0]
    if kind == "replicate":
        return api.Replicate()
    if kind == "shard":
        return api.Shard(obj[1])
    if kind == "strided_shard":
        return api.StridedShard(obj[1], split_factor=obj[2])
    if kind == "partial":
        return api.Partial(obj[1])
    raise ProtocolError(f"unknown placement {kind!r}")  # unreachable after validate_spec


def _rebuild_mesh(obj: dict[str, Any]) -> Any:
    api = _torch_api()
    dist, DeviceMesh = api.dist, api.DeviceMesh
    rank = dist.get_rank() if dist.is_initialized() else obj["rank"]
    # DeviceMesh records the creating thread under the "threaded" test backend
    # and compares it; a mesh cached by another thread would then differ.
    threaded = dist.is_initialized() and dist.get_backend() == "threaded"
    key = (
        obj["device_type"],
        tuple(obj["shape"]),
        tuple(obj["rank_map"]),
        None if obj["dim_names"] is None else tuple(obj["dim_names"]),
        None if "layout" not in obj else tuple(tuple(map(tuple, a)) for a in obj["layout"]),
        rank,
        threading.get_ident() if threaded else None,
    )
    with _MESH_CACHE_LOCK:
        cached = _MESH_CACHE.get(key)
    if cached is not None:
        return cached
    names = None if obj["dim_names"] is None else tuple(obj["dim_names"])
    if "layout" in obj:
        if not dist.is_initialized():
            raise ProtocolError(
                "rebuilding a sliced device mesh needs torch.distributed initialised "
                "(DeviceMesh asks the default group which slice holds this rank)"
            )
        try:
            from torch.distributed._mesh_layout import (
                _FlatLayout,
                _MeshLayout,
            )
        except ImportError:
            raise ProtocolError(
                "the peer sent a sliced device mesh, which this torch cannot rebuild"
            ) from None
        mesh = DeviceMesh(
            obj["device_type"],
            mesh_dim_names=names,
            _init_backend=False,
            _rank=rank,
            _layout=_MeshLayout([_FlatLayout(tuple(s), tuple(d)) for s, d in obj["layout"]]),
            _rank_map=torch.tensor(obj["rank_map"], dtype=torch.int),
        )
    else:
        ranks = torch.tensor(obj["rank_map"], dtype=torch.int).reshape(obj["shape"])
        mesh = DeviceMesh(
            obj["device_type"], ranks, mesh_dim_names=names, _init_backend=False, _rank=rank
        )
    if len(obj["rank_map"]) > _MESH_CACHE_MAX_RANKS:
        return mesh
    with _MESH_CACHE_LOCK:
        if len(_MESH_CACHE) >= _MESH_CACHE_SIZE:
            _MESH_CACHE.pop(next(iter(_MESH_CACHE)))
        _MESH_CACHE[key] = mesh
    return mesh
