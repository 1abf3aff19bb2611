"""Encode a state tree (nested containers of tensors and plain values) without pickle.

The sender turns the caller's object into three things (:func:`encode_tree`):

* a *skeleton*: a msgpack-able mirror of the containers and plain leaves, in
  which each tensor is replaced by an index into the tensor table;
* a *tensor table*: one entry per tensor (which storage, dtype, shape, stride,
  offset), so views and aliases survive the trip as they do with ``torch.save``;
* the *storages*: each distinct storage once, as raw bytes that travel as frames.

The receiver validates the skeleton and the table before any tensor byte arrives
(:func:`index_skeleton`, :func:`decode_tensor_table`), then rebuilds the object
(:func:`build_tree`). Every node kind is listed in docs/protocol.md.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import keyword
import math
import pickle
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import ProtocolError

KeyPath = tuple[Any, ...]

# Skeleton node tags. A msgpack array in the skeleton is always a tagged node, so
# user lists and tuples are tagged too and nothing is ambiguous.
TAG_LIST = "l"
TAG_TUPLE = "t"
TAG_DICT = "d"
TAG_ORDERED_DICT = "o"
TAG_NAMEDTUPLE = "n"
TAG_TENSOR = "T"
TAG_DTENSOR = "D"
TAG_BIGINT = "i"
TAG_DTYPE = "dt"
TAG_SIZE = "sz"
TAG_DEVICE = "dv"
TAG_PICKLE = "p"

MAX_DEPTH = 256
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1


def _usable_dtypes() -> dict[str, torch.dtype]:
    """Every dtype that can hold raw bytes on CPU, by its short name ("float32")."""
    found: dict[str, torch.dtype] = {}
    for name in dir(torch):
        value = getattr(torch, name, None)
        if not isinstance(value, torch.dtype) or "qint" in str(value) or "quint" in str(value):
            continue
        short = str(value).removeprefix("torch.")
        if short in found:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                torch.empty(1, dtype=value)
        except (RuntimeError, TypeError):
            continue  # dtypes that cannot be allocated on CPU
        if value.itemsize < 1:
            continue
        found[short] = value
    return found


DTYPES: dict[str, torch.dtype] = _usable_dtypes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def format_path(path: KeyPath) -> str:
    """Render a key path the way a user would index it: ``state['optim'][0]``."""
    return "state" + "".join(f"[{key!r}]" for key in path)


@dataclass
class StorageRef:
    """One storage to send: where its bytes live and what keeps them alive."""

    ptr: int
    nbytes: int
    owner: Any  # the tensor (or staged CPU copy) whose lifetime covers ptr
    # Set for device (CUDA) memory, which the serving thread stages through
    # pinned buffers (device.py); ptr is then 0 and view() must not be used.
    device: torch.device | None = None

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        """A zero-copy memoryview of ``[start, stop)``; valid while ``owner`` lives."""
        if self.device is not None:
            raise RuntimeError(f"storage on {self.device} has no host view; it is staged")
        stop = self.nbytes if stop is None else stop
        if stop <= start:
            return memoryview(b"")
        array = (ctypes.c_uint8 * (stop - start)).from_address(self.ptr + start)
        return memoryview(array).cast("B")


@dataclass
class EncodedTree:
    skeleton: Any
    tensors: list[list[Any]] = field(default_factory=list)
    storages: list[StorageRef] = field(default_factory=list)
    tensor_paths: list[KeyPath] = field(default_factory=list)
    has_pickle: bool = False


def _dtensor_type() -> type | None:
    # DTensor only exists once torch.distributed.tensor is imported; importing it
    # ourselves would cost every user a few hundred milliseconds for nothing.
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


class _Encoder:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.out = EncodedTree(skeleton=None)
        self._storage_index: dict[int, int] = {}
        self._dtensor = _dtensor_type()

    def tensor_entry(self, tensor: torch.Tensor, path: KeyPath) -> int:
        if tensor.layout != torch.strided:
            raise TypeError(f"{format_path(path)}: {tensor.layout} tensors are not supported")
        if tensor.device.type == "meta":
            raise TypeError(f"{format_path(path)}: meta tensors have no data to send")
        if dtype_name(tensor.dtype) not in DTYPES:
            raise TypeError(f"{format_path(path)}: dtype {tensor.dtype} is not supported")
        if tensor.is_conj() or tensor.is_neg():
            # Lazy conjugate/negative views: the raw bytes do not carry the bit.
            tensor = tensor.resolve_conj().resolve_neg()
        storage = tensor.untyped_storage()
        key = storage._cdata
        index = self._storage_index.get(key)
        if index is None:
            owner: Any = tensor
            device: torch.device | None = None
            if tensor.device.type == "cuda":
                # Not copied here: the serving thread stages it chunk by chunk
                # through pinned buffers (device.py), so send_checkpoint stays
                # prompt and no host copy of the whole state is ever made.
                device = tensor.device
            elif tensor.device.type != "cpu":
                # Staged once per send: the device memory may change after
                # send_checkpoint returns only if the caller breaks the contract,
                # and a host copy is what the frames can reference.
                storage = storage.cpu()  # type: ignore[no-untyped-call]  # untyped in torch's stubs
                owner = storage
            index = len(self.out.storages)
            self._storage_index[key] = index
            ptr = storage.data_ptr() if device is None else 0
            self.out.storages.append(StorageRef(ptr, storage.nbytes(), owner, device))
        entry = [
            index,
            dtype_name(tensor.dtype),
            list(tensor.shape),
            list(tensor.stride()),
            tensor.storage_offset(),
            bool(tensor.requires_grad),
            isinstance(tensor, torch.nn.Parameter),
        ]
        self.out.tensors.append(entry)
        self.out.tensor_paths.append(path)
        return len(self.out.tensors) - 1

    def encode(self, obj: Any, path: KeyPath, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"{format_path(path)}: nesting deeper than {MAX_DEPTH}")
        kind = type(obj)
        if obj is None or kind in (bool, float, str, bytes):
            return obj
        if kind is int:
            if _INT_MIN <= obj <= _INT_MAX:
                return obj
            return [TAG_BIGINT, str(obj)]
        if kind in (torch.Tensor, torch.nn.Parameter):
            return [TAG_TENSOR, self.tensor_entry(obj, path)]
        if self._dtensor is not None and kind is self._dtensor:
            from . import dtensor_codec

            local_index = self.tensor_entry(obj._local_tensor, path)
            spec = dtensor_codec.encode_spec(obj._spec, path)
            return [TAG_DTENSOR, local_index, spec, bool(obj.requires_grad)]
        if kind is torch.dtype:
            return [TAG_DTYPE, dtype_name(obj)]
        if kind is torch.Size:
            return [TAG_SIZE, list(obj)]
        if kind is torch.device:
            return [TAG_DEVICE, str(obj)]
        if kind is list:
            return [TAG_LIST, [self.encode(v, (*path, i), depth + 1) for i, v in enumerate(obj)]]
        if kind is tuple:
            return [TAG_TUPLE, [self.encode(v, (*path, i), depth + 1) for i, v in enumerate(obj)]]
        if kind is dict or kind is collections.OrderedDict:
            tag = TAG_DICT if kind is dict else TAG_ORDERED_DICT
            pairs = [
                [self.encode(k, (*path, k), depth + 1), self.encode(v, (*path, k), depth + 1)]
                for k, v in obj.items()
            ]
            return [tag, pairs]
        if isinstance(obj, tuple) and hasattr(kind, "_fields"):
            items = [self.encode(v, (*path, i), depth + 1) for i, v in enumerate(obj)]
            return [TAG_NAMEDTUPLE, kind.__module__, kind.__qualname__, list(kind._fields), items]
        if self.allow_pickle:
            try:
                payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:
                raise TypeError(f"{format_path(path)}: cannot pickle {kind.__qualname__}") from exc
            self.out.has_pickle = True
            return [TAG_PICKLE, payload]
        raise TypeError(
            f"{format_path(path)}: cannot send a {kind.__module__}.{kind.__qualname__} "
            "without pickle; convert it to a tensor or plain value, or pass allow_pickle=True "
            "on both sides"
        )


def encode_tree(obj: Any, allow_pickle: bool = False) -> EncodedTree:
    """Encode ``obj``; raises ``TypeError`` naming the key path of anything unsupported."""
    encoder = _Encoder(allow_pickle)
    encoder.out.skeleton = encoder.encode(obj, (), 0)
    return encoder.out


# ----------------------------------------------------------------------------- receiving side


@dataclass(frozen=True)
class TensorSpec:
    """One validated tensor-table entry."""

    storage: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    requires_grad: bool
    is_param: bool

    @property
    def covers_whole_storage(self) -> bool:
        """True when the tensor is contiguous and its bytes are exactly ``[0, nbytes)``."""
        return self.offset == 0 and self.stride == _contiguous_stride(self.shape)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    running = 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def _int_list(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > 64:
        raise ProtocolError(f"{what} must be a list of at most 64 integers")
    for item in value:
        if type(item) is not int or item < 0 or item > 2**62:
            raise ProtocolError(f"{what} holds an invalid value {item!r}")
    return tuple(value)


def _dims(value: Any, number: int, what: str) -> tuple[int, ...]:
    """:func:`_int_list` for tensor entry ``number``, composing its message only on failure."""
    if isinstance(value, list) and len(value) <= 64:
        for item in value:
            if type(item) is not int or item < 0 or item > 2**62:
                break
        else:
            return tuple(value)
    return _int_list(value, f"tensor entry {number} {what}")


def decode_tensor_table(entries: Any, storage_nbytes: list[int]) -> list[TensorSpec]:
    """Validate the tensor table against the storages; every view must lie inside its storage."""
    if not isinstance(entries, list):
        raise ProtocolError("tensor table must be a list")
    specs: list[TensorSpec] = []
    for number, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) != 7:
            raise ProtocolError(f"tensor entry {number} is malformed")
        storage, dtype, shape, stride, offset, requires_grad, is_param = entry
        if type(storage) is not int or not 0 <= storage < len(storage_nbytes):
            raise ProtocolError(f"tensor entry {number} names unknown storage {storage!r}")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ProtocolError(f"tensor entry {number} has unknown dtype {dtype!r}")
        # _dims, not _int_list: its message argument, an f-string built for every
        # entry, was a third of the cost of this loop (20,480 tensors: 90 ms).
        shape_t = _dims(shape, number, "shape")
        stride_t = _dims(stride, number, "stride")
        if len(shape_t) != len(stride_t):
            raise ProtocolError(f"tensor entry {number}: shape and stride differ in length")
        if type(offset) is not int or not 0 <= offset <= 2**62:
            raise ProtocolError(f"tensor entry {number} has invalid offset {offset!r}")
        if math.prod(shape_t) > 2**62:
            # torch counts elements in int64; a bigger product fails in set_().
            raise ProtocolError(f"tensor entry {number} has more than 2**62 elements")
        if type(requires_grad) is not bool or type(is_param) is not bool:
            raise ProtocolError(f"tensor entry {number} has invalid flags")
        spec = TensorSpec(storage, DTYPES[dtype], shape_t, stride_t, offset, requires_grad, is_param)
        if math.prod(shape_t) > 0:
            itemsize = spec.dtype.itemsize
            last = offset + sum((n - 1) * s for n, s in zip(shape_t, stride_t, strict=True))
            if (last + 1) * itemsize > storage_nbytes[storage]:
                raise ProtocolError(
                    f"tensor entry {number} reaches byte {(last + 1) * itemsize} of storage "
                    f"{storage}, which has {storage_nbytes[storage]} bytes"
                )
        specs.append(spec)
    return specs


def index_skeleton(
    skeleton: Any,
    n_tensors: int,
    allow_pickle: bool,
    dtensor_specs: dict[int, Any] | None = None,
) -> dict[int, KeyPath]:
    """Validate every node of a received skeleton; return the key path of each tensor index.

    Raises :class:`ProtocolError` for anything malformed, and for a pickled leaf
    unless ``allow_pickle``. Each tensor index must be used exactly once. When
    ``dtensor_specs`` is given, it is filled with the (validated) encoded spec of
    each DTensor, by the index of its local tensor.
    """
    paths: dict[int, KeyPath] = {}

    def tensor_index(value: Any, path: KeyPath) -> None:
        if type(value) is not int or not 0 <= value < n_tensors or value in paths:
            raise ProtocolError(f"{format_path(path)}: bad tensor index {value!r}")
        paths[value] = path

    def visit(node: Any, path: KeyPath, depth: int) -> Any:
        """Returns the python key this node decodes to (used for dict keys in paths).

        Lists and dicts return :data:`_UNHASHABLE`: build_tree could not use them
        as dict keys, so a dict item keyed by one is refused here, not there.
        """
        if depth > MAX_DEPTH:
            raise ProtocolError(f"{format_path(path)}: nesting deeper than {MAX_DEPTH}")
        if node is None or type(node) in (bool, int, float, str, bytes):
            return node
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise ProtocolError(f"{format_path(path)}: malformed node")
        tag, args = node[0], node[1:]
        if tag in (TAG_LIST, TAG_TUPLE) and len(args) == 1 and isinstance(args[0], list):
            keys = tuple(visit(item, (*path, i), depth + 1) for i, item in enumerate(args[0]))
            return keys if tag == TAG_TUPLE and _UNHASHABLE not in keys else _UNHASHABLE
        if tag in (TAG_DICT, TAG_ORDERED_DICT) and len(args) == 1 and isinstance(args[0], list):
            for pair in args[0]:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ProtocolError(f"{format_path(path)}: malformed dict item")
                key = visit(pair[0], path, depth + 1)
                if key is _UNHASHABLE:
                    raise ProtocolError(f"{format_path(path)}: unhashable dict key")
                visit(pair[1], (*path, key), depth + 1)
            return _UNHASHABLE
        if tag == TAG_NAMEDTUPLE and len(args) == 4:
            module, qualname, fields, items = args
            if not (
                isinstance(module, str)
                and isinstance(qualname, str)
                and isinstance(fields, list)
                and all(_valid_field(f) for f in fields)
                and len(set(fields)) == len(fields)
                and isinstance(items, list)
                and len(items) == len(fields)
            ):
                raise ProtocolError(f"{format_path(path)}: malformed namedtuple")
            keys = tuple(visit(item, (*path, i), depth + 1) for i, item in enumerate(items))
            return keys if _UNHASHABLE not in keys else _UNHASHABLE
        if tag == TAG_TENSOR and len(args) == 1:
            tensor_index(args[0], path)
            return (TAG_TENSOR, args[0])  # tensors hash by identity, so they may be keys
        if tag == TAG_DTENSOR and len(args) == 3 and type(args[2]) is bool:
            tensor_index(args[0], path)
            from . import dtensor_codec

            dtensor_codec.validate_spec(args[1], path)
            if dtensor_specs is not None:
                dtensor_specs[args[0]] = args[1]
            return (TAG_DTENSOR, args[0])
        if tag == TAG_BIGINT and len(args) == 1 and isinstance(args[0], str):
            # Python refuses to parse more than 4300 digits (CPython's default
            # int_max_str_digits); refuse here so build_tree never meets it.
            if len(args[0]) > _MAX_BIGINT_CHARS:
                where = format_path(path)
                raise ProtocolError(f"{where}: big integer of {len(args[0])} characters")
            try:
                return int(args[0])
            except ValueError:
                raise ProtocolError(f"{format_path(path)}: malformed big integer") from None
        if tag == TAG_DTYPE and len(args) == 1 and isinstance(args[0], str) and args[0] in DTYPES:
            return DTYPES[args[0]]
        if tag == TAG_SIZE and len(args) == 1:
            return torch.Size(_int_list(args[0], format_path(path)))
        if tag == TAG_DEVICE and len(args) == 1 and isinstance(args[0], str):
            return _device(args[0], path)
        if tag == TAG_PICKLE and len(args) == 1 and isinstance(args[0], bytes):
            if not allow_pickle:
                raise ProtocolError(
                    f"{format_path(path)}: the peer sent a pickled object and this receiver "
                    "has allow_pickle=False; refusing it"
                )
            return (TAG_PICKLE, args[0])  # hashability unknown until unpickled (trusted peer)
        raise ProtocolError(f"{format_path(path)}: unknown or malformed node tag {tag!r}")

    visit(skeleton, (), 0)
    if len(paths) != n_tensors:
        raise ProtocolError(f"skeleton uses {len(paths)} of {n_tensors} tensor table entries")
    return paths


_UNHASHABLE = object()  # index_skeleton's key for nodes that decode to lists or dicts
_MAX_BIGINT_CHARS = 4096


def _valid_field(name: Any) -> bool:
    """Whether collections.namedtuple accepts ``name`` as a field name."""
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
    )


def _device(text: str, path: KeyPath) -> torch.device:
    try:
        return torch.device(text)
    except RuntimeError:
        raise ProtocolError(f"{format_path(path)}: invalid device {text!r}") from None


def _namedtuple_class(module: str, qualname: str, fields: list[str]) -> type:
    """The sender's namedtuple class if this process has it loaded, else a stand-in.

    Only modules already imported are consulted: a peer must never make us import code.
    Names are looked up in ``__dict__`` rather than with ``getattr`` so that a
    module-level ``__getattr__`` (lazy submodule imports, as torch has) never runs.
    """
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        namespace = getattr(target, "__dict__", None)
        target = namespace.get(part) if isinstance(namespace, Mapping) else None
    if isinstance(target, type) and issubclass(target, tuple) and list(getattr(target, "_fields", ())) == fields:
        return target
    name = qualname.rsplit(".", 1)[-1]
    return _stand_in(name if _valid_field(name.lstrip("_")) else "Record", tuple(fields))


@functools.lru_cache(maxsize=1024)
def _stand_in(name: str, fields: tuple[str, ...]) -> type:
    """A namedtuple class for a sender's class this process lacks.

    Cached: building a class costs an ``exec``, and a header may hold
    thousands of records of one type.
    """
    return collections.namedtuple(name, fields)


def build_tree(
    skeleton: Any,
    leaf: Callable[[int], torch.Tensor],
    make_dtensor: Callable[[int, Any, bool], Any],
) -> Any:
    """Rebuild the object from a skeleton already checked by :func:`index_skeleton`."""

    def build(node: Any) -> Any:
        if not isinstance(node, list):
            return node
        tag, args = node[0], node[1:]
        if tag == TAG_LIST:
            return [build(item) for item in args[0]]
        if tag == TAG_TUPLE:
            return tuple(build(item) for item in args[0])
        if tag == TAG_DICT:
            return {build(k): build(v) for k, v in args[0]}
        if tag == TAG_ORDERED_DICT:
            return collections.OrderedDict((build(k), build(v)) for k, v in args[0])
        if tag == TAG_NAMEDTUPLE:
            cls = _namedtuple_class(args[0], args[1], args[2])
            return cls(*(build(item) for item in args[3]))
        if tag == TAG_TENSOR:
            return leaf(args[0])
        if tag == TAG_DTENSOR:
            return make_dtensor(args[0], args[1], args[2])
        if tag == TAG_BIGINT:
            return int(args[0])
        if tag == TAG_DTYPE:
            return DTYPES[args[0]]
        if tag == TAG_SIZE:
            return torch.Size(args[0])
        if tag == TAG_DEVICE:
            return torch.device(args[0])
        if tag == TAG_PICKLE:
            return pickle.loads(args[0])  # noqa: S301 - only reached when both sides opted in
        raise ProtocolError(f"unknown node tag {tag!r}")

    return build(skeleton)


def iter_tensor_leaves(obj: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Yield ``(path, tensor_or_dtensor)`` for each tensor leaf of a caller's structure.

    Walks containers exactly as :func:`encode_tree` does, so the paths line up
    with :func:`index_skeleton` for in-place receives.
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from iter_tensor_leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from iter_tensor_leaves(value, (*path, i))
