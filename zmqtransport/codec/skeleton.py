"""The skeleton: a msgpack-able mirror of the caller's containers, with tensors as table indexes.

Every kind of node is one row of :data:`KINDS` (a :class:`NodeKind`): its tag,
the Python types it stands for, how many arguments it has on the wire, how it
holds children, and the encode, check and build rules of its own arguments.
The four users of the skeleton go through that one table:

* :func:`encode_tree` (sending) picks the kind of each Python value with
  :func:`kind_of_value` and writes ``[tag, *arguments]``;
* :func:`index_skeleton` (receiving, before any tensor byte) validates every
  node and records each tensor's key path;
* :func:`build_tree` (receiving, at the end) rebuilds the object;
* the CLI counts pickled leaves with :func:`walk`.

The last three visit nodes with one walker, :func:`fold`, which refuses any
node of the wrong shape, so a hostile skeleton reaches a kind's rules only
with the right number and kinds of arguments. :func:`iter_tensor_leaves`
walks the caller's own objects with :func:`kind_of_value`, as the encoder
does, so its key paths are the encoder's. Each node kind is described in
docs/protocol.md.
"""

from __future__ import annotations

import collections
import enum
import functools
import keyword
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..errors import ProtocolError
from .dtensor import dtensor_type, encode_spec, validate_spec
from .dtypes import DTYPES, dtype_name
from .keypaths import KeyPath, format_path
from .tensors import EncodedTree, int_list

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
_MAX_BIGINT_CHARS = 4096
# Values msgpack carries as themselves (ints only within 64 bits: see TAG_BIGINT).
_PLAIN_TYPES = (bool, int, float, str, bytes)


class Shape(enum.Enum):
    """How a node holds its children."""

    LEAF = "leaf"  # no child nodes
    ITEMS = "items"  # the last argument is a list of child nodes; child i has key i
    PAIRS = "pairs"  # the last argument is a list of [key node, value node] pairs


# The members as module constants: reading ``Shape.LEAF`` costs 100 ns on
# Python 3.11 (enum attribute lookup), a global 10 ns; the walks read them per node.
_LEAF, _ITEMS, _PAIRS = Shape.LEAF, Shape.ITEMS, Shape.PAIRS


class Builders(NamedTuple):
    """How :func:`build_tree` makes the receiver's tensors (it knows where their bytes landed)."""

    leaf: Callable[[int], torch.Tensor]  # tensor table index -> tensor
    make_dtensor: Callable[[int, Any, bool], Any]  # (local tensor index, spec, requires_grad) -> DTensor


@dataclass(frozen=True)
class NodeKind:
    """One kind of skeleton node: ``[tag, *arguments]``, the children (if any) last.

    ``encode`` gives the arguments of a Python value (of a container: those
    before its children). ``accepts`` is a cheap check of the argument types
    that :func:`fold` makes before anything else. ``check`` validates the
    arguments fully for :func:`index_skeleton` (children excluded) and, for a
    leaf, returns the value it stands for as a dict key. ``build`` makes the
    Python value from the arguments and the already built children.
    """

    tag: str
    arity: int  # arguments after the tag
    shape: Shape
    types: tuple[type, ...]  # the exact Python types it encodes (others: see kind_of_value)
    encode: Callable[[Any, _Encoder, KeyPath], list[Any]]
    build: Callable[[list[Any], list[Any], Builders], Any]
    accepts: Callable[[list[Any]], bool] | None = None  # None: any arguments (of the right arity)
    check: Callable[[list[Any], KeyPath, _Index], Any] = lambda args, path, index: None
    hashable: bool = False  # an ITEMS container rebuilt as a tuple: it can be a dict key


def _no_arguments(obj: Any, encoder: _Encoder, path: KeyPath) -> list[Any]:
    return []


def _one_str(args: list[Any]) -> bool:
    return isinstance(args[0], str)


# ----------------------------------------------------------------------------- the leaves' rules


def _encode_tensor(obj: Any, encoder: _Encoder, path: KeyPath) -> list[Any]:
    return [encoder.out.add_tensor(obj, path)]


def _check_tensor(args: list[Any], path: KeyPath, index: _Index) -> Any:
    index.tensor(args[0], path)
    return (TAG_TENSOR, args[0])  # tensors hash by identity, so they may be keys


def _encode_dtensor(obj: Any, encoder: _Encoder, path: KeyPath) -> list[Any]:
    local_index = encoder.out.add_tensor(obj._local_tensor, path)
    return [local_index, encode_spec(obj._spec, path), bool(obj.requires_grad)]


def _check_dtensor(args: list[Any], path: KeyPath, index: _Index) -> Any:
    index.tensor(args[0], path)
    validate_spec(args[1], path)
    if index.dtensor_specs is not None:
        index.dtensor_specs[args[0]] = args[1]
    return (TAG_DTENSOR, args[0])


def _check_bigint(args: list[Any], path: KeyPath, index: _Index) -> Any:
    # Python refuses to parse more than 4300 digits (CPython's default
    # int_max_str_digits); refuse here so build_tree never meets it.
    if len(args[0]) > _MAX_BIGINT_CHARS:
        raise ProtocolError(f"{format_path(path)}: big integer of {len(args[0])} characters")
    try:
        return int(args[0])
    except ValueError:
        raise ProtocolError(f"{format_path(path)}: malformed big integer") from None


def _check_device(args: list[Any], path: KeyPath, index: _Index) -> Any:
    try:
        return torch.device(args[0])
    except RuntimeError:
        raise ProtocolError(f"{format_path(path)}: invalid device {args[0]!r}") from None


def _encode_pickle(obj: Any, encoder: _Encoder, path: KeyPath) -> list[Any]:
    kind = type(obj)
    if not encoder.allow_pickle:
        raise TypeError(
            f"{format_path(path)}: cannot send a {kind.__module__}.{kind.__qualname__} "
            "without pickle; convert it to a tensor or plain value, or pass allow_pickle=True "
            "on both sides"
        )
    try:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"{format_path(path)}: cannot pickle {kind.__qualname__}") from exc
    encoder.out.has_pickle = True
    return [payload]


def _check_pickle(args: list[Any], path: KeyPath, index: _Index) -> Any:
    if not index.allow_pickle:
        raise ProtocolError(
            f"{format_path(path)}: the peer sent a pickled object and this receiver "
            "has allow_pickle=False; refusing it"
        )
    return (TAG_PICKLE, args[0])  # hashability unknown until unpickled (trusted peer)


def _unpickle(args: list[Any], parts: list[Any], builders: Builders) -> Any:
    return pickle.loads(args[0])  # noqa: S301 - only reached when index_skeleton allowed pickle


# ----------------------------------------------------------------------------- namedtuples


def _encode_namedtuple(obj: Any, encoder: _Encoder, path: KeyPath) -> list[Any]:
    kind = type(obj)
    return [kind.__module__, kind.__qualname__, list(kind._fields)]


def _check_namedtuple(args: list[Any], path: KeyPath, index: _Index) -> Any:
    module, qualname, fields, items = args
    if not (
        isinstance(module, str)
        and isinstance(qualname, str)
        and isinstance(fields, list)
        and all(_valid_field(f) for f in fields)
        and len(set(fields)) == len(fields)
        and len(items) == len(fields)
    ):
        raise ProtocolError(f"{format_path(path)}: malformed namedtuple")


def _valid_field(name: Any) -> bool:
    """Whether collections.namedtuple accepts ``name`` as a field name."""
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
    )


def _build_namedtuple(args: list[Any], parts: list[Any], builders: Builders) -> Any:
    return _namedtuple_class(args[0], args[1], args[2])(*parts)


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


# ----------------------------------------------------------------------------- the table

LIST = NodeKind(TAG_LIST, 1, Shape.ITEMS, (list,), _no_arguments, lambda args, parts, b: parts)
TUPLE = NodeKind(
    TAG_TUPLE, 1, Shape.ITEMS, (tuple,), _no_arguments, lambda args, parts, b: tuple(parts), hashable=True
)
DICT = NodeKind(TAG_DICT, 1, Shape.PAIRS, (dict,), _no_arguments, lambda args, parts, b: dict(parts))
ORDERED_DICT = NodeKind(
    TAG_ORDERED_DICT,
    1,
    Shape.PAIRS,
    (collections.OrderedDict,),
    _no_arguments,
    lambda args, parts, b: collections.OrderedDict(parts),
)
NAMEDTUPLE = NodeKind(
    TAG_NAMEDTUPLE,
    4,
    Shape.ITEMS,
    (),  # any tuple subclass with _fields: kind_of_value
    _encode_namedtuple,
    _build_namedtuple,
    check=_check_namedtuple,
    hashable=True,
)
TENSOR = NodeKind(
    TAG_TENSOR,
    1,
    Shape.LEAF,
    (torch.Tensor, torch.nn.Parameter),
    _encode_tensor,
    lambda args, parts, b: b.leaf(args[0]),
    check=_check_tensor,
)
DTENSOR = NodeKind(
    TAG_DTENSOR,
    3,
    Shape.LEAF,
    (),  # DTensor's class exists only once torch.distributed.tensor is imported: kind_of_value
    _encode_dtensor,
    lambda args, parts, b: b.make_dtensor(args[0], args[1], args[2]),
    accepts=lambda args: type(args[2]) is bool,
    check=_check_dtensor,
)
BIGINT = NodeKind(
    TAG_BIGINT,
    1,
    Shape.LEAF,
    (int,),  # only beyond 64 bits: smaller ints are plain values
    lambda obj, e, p: [str(obj)],
    lambda args, parts, b: int(args[0]),
    accepts=_one_str,
    check=_check_bigint,
)
DTYPE = NodeKind(
    TAG_DTYPE,
    1,
    Shape.LEAF,
    (torch.dtype,),
    lambda obj, e, p: [dtype_name(obj)],
    lambda args, parts, b: DTYPES[args[0]],
    accepts=lambda args: isinstance(args[0], str) and args[0] in DTYPES,
    check=lambda args, path, index: DTYPES[args[0]],
)
SIZE = NodeKind(
    TAG_SIZE,
    1,
    Shape.LEAF,
    (torch.Size,),
    lambda obj, e, p: [list(obj)],
    lambda args, parts, b: torch.Size(args[0]),
    check=lambda args, path, index: torch.Size(int_list(args[0], format_path(path))),
)
DEVICE = NodeKind(
    TAG_DEVICE,
    1,
    Shape.LEAF,
    (torch.device,),
    lambda obj, e, p: [str(obj)],
    lambda args, parts, b: torch.device(args[0]),
    accepts=_one_str,
    check=_check_device,
)
PICKLE = NodeKind(
    TAG_PICKLE,
    1,
    Shape.LEAF,
    (),  # anything no other kind takes: kind_of_value
    _encode_pickle,
    _unpickle,
    accepts=lambda args: isinstance(args[0], bytes),
    check=_check_pickle,
)

KINDS: dict[str, NodeKind] = {
    kind.tag: kind
    for kind in (LIST, TUPLE, DICT, ORDERED_DICT, NAMEDTUPLE, TENSOR, DTENSOR, BIGINT, DTYPE, SIZE, DEVICE, PICKLE)
}
_KIND_OF_TYPE: dict[type, NodeKind] = {t: kind for kind in KINDS.values() for t in kind.types}


def is_plain(value: Any) -> bool:
    """Whether ``value`` travels as itself (msgpack nil, bool, int within 64 bits, float, str, bytes)."""
    kind = type(value)
    if kind is int:
        return bool(_INT_MIN <= value <= _INT_MAX)
    return value is None or kind in _PLAIN_TYPES


def kind_of_value(value: Any, dtensor: type | None) -> NodeKind:
    """The kind a Python value (not plain) is encoded as; ``dtensor`` is :func:`.dtensor.dtensor_type`.

    Exact types, not ``isinstance``: a subclass of ``dict`` or of ``Tensor`` may
    carry state or behaviour a plain one would lose, so it is pickled (or
    refused) rather than sent as its base type. Namedtuples are the exception:
    any tuple subclass with ``_fields`` travels as its fields.
    """
    kind = type(value)
    found = _KIND_OF_TYPE.get(kind)
    if found is not None:
        return found
    if dtensor is not None and kind is dtensor:
        return DTENSOR
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return NAMEDTUPLE
    return PICKLE


# ----------------------------------------------------------------------------- the walker

Visit = Callable[[NodeKind, list[Any], list[Any], KeyPath], Any]
TensorVisit = Callable[[Any, KeyPath], Any]


def fold(skeleton: Any, visit: Visit, paths: bool = True, tensor: TensorVisit | None = None) -> Any:
    """Visit every node of a skeleton once, children before their parent; return the root's value.

    A plain value stands for itself; a node's value is ``visit(kind, arguments,
    parts, path)``, where ``parts`` holds its children's values (``(key,
    value)`` pairs for dicts; nothing for a leaf) and a dict value's path ends
    with its key's value. With ``paths=False`` every path is ``()`` (building
    them is a third of the cost when they are not needed).

    ``tensor``, when given, stands in for ``visit`` on the tensor nodes
    (``["T", index]``) that are a container's children: ``tensor(index, path)``
    must return what ``visit(TENSOR, [index], [], path)`` would. A state dict's
    nodes are nearly all such children, and the generic route (a call per
    node, its checks, ``visit``, the kind's rule) cost 1.5 us each.

    Raises :class:`ProtocolError` for a node that is not ``[tag, *arguments]``
    of a known kind with the right arity and argument types (``accepts``), for
    a malformed dict item and for nesting deeper than :data:`MAX_DEPTH`.
    """
    if skeleton is None or type(skeleton) in _PLAIN_TYPES:
        return skeleton
    return _Folder(visit, paths, tensor).node(skeleton, (), 0)


class _Folder:
    """:func:`fold`'s walk. A class, not nested functions: two nested functions
    that call each other reach each other through their closure cells, a
    reference cycle that kept ``visit``'s objects (for :func:`build_tree`, the
    whole received header) alive until the cyclic collector ran: a collection
    of 246,000 objects, 38 ms, at the end of a receive of 20,480 tensors.
    """

    __slots__ = ("paths", "tensor", "visit")

    def __init__(self, visit: Visit, paths: bool, tensor: TensorVisit | None) -> None:
        self.visit = visit
        self.paths = paths
        self.tensor = tensor

    def node(self, node: Any, path: KeyPath, depth: int) -> Any:
        # Plain values are returned by the callers below without a call (most dict
        # keys are); the kind's checks are inline: this runs for every node of every header.
        if not isinstance(node, list) or not node or not isinstance(node[0], str):
            raise ProtocolError(f"{format_path(path)}: malformed node")
        args = node[1:]
        kind = KINDS.get(node[0])
        if kind is None or len(args) != kind.arity or (kind.accepts is not None and not kind.accepts(args)):
            raise ProtocolError(f"{format_path(path)}: unknown or malformed node tag {node[0]!r}")
        shape = kind.shape
        if shape is _LEAF:
            return self.visit(kind, args, _NO_PARTS, path)
        children = args[-1]
        if not isinstance(children, list):
            raise ProtocolError(f"{format_path(path)}: unknown or malformed node tag {node[0]!r}")
        if children and depth >= MAX_DEPTH:
            raise ProtocolError(f"{format_path(path)}: nesting deeper than {MAX_DEPTH}")
        depth += 1
        paths = self.paths
        child = self.child
        if shape is _ITEMS:
            parts = [
                item
                if item is None or type(item) in _PLAIN_TYPES
                else child(item, (*path, i) if paths else path, depth)
                for i, item in enumerate(children)
            ]
            return self.visit(kind, args, parts, path)
        parts = []
        tensor = self.tensor
        for pair in children:
            if not isinstance(pair, list) or len(pair) != 2:
                raise ProtocolError(f"{format_path(path)}: malformed dict item")
            key, value = pair
            if key is not None and type(key) not in _PLAIN_TYPES:
                key = self.node(key, path, depth)
            if value is not None and type(value) not in _PLAIN_TYPES:
                at = (*path, key) if paths else path
                if tensor is not None and type(value) is list and len(value) == 2 and value[0] == TAG_TENSOR:
                    value = tensor(value[1], at)  # child(), inline: most values of a state dict are tensors
                else:
                    value = self.node(value, at, depth)
            parts.append((key, value))
        return self.visit(kind, args, parts, path)

    def child(self, node: Any, path: KeyPath, depth: int) -> Any:
        # A tensor node straight to ``tensor``: exactly the nodes node() would
        # send to visit(TENSOR, ...) (a list of the tag and one argument).
        tensor = self.tensor
        if tensor is not None and type(node) is list and len(node) == 2 and node[0] == TAG_TENSOR:
            return tensor(node[1], path)
        return self.node(node, path, depth)


_NO_PARTS: list[Any] = []  # the parts of every leaf (never written to)


def walk(skeleton: Any) -> Iterator[tuple[str, list[Any]]]:
    """``(tag, arguments)`` of every tagged node, each once (children first); plain values are skipped.

    For a skeleton :func:`index_skeleton` accepted; a malformed one raises
    :class:`ProtocolError` as :func:`fold` does.
    """
    nodes: list[tuple[str, list[Any]]] = []
    fold(skeleton, lambda kind, args, parts, path: nodes.append((kind.tag, args)), paths=False)
    return iter(nodes)


# ----------------------------------------------------------------------------- sending


class _Encoder:
    def __init__(self, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.out = EncodedTree(skeleton=None)
        self._dtensor = dtensor_type()

    def encode(self, obj: Any, path: KeyPath, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise TypeError(f"{format_path(path)}: nesting deeper than {MAX_DEPTH}")
        if is_plain(obj):
            return obj
        kind = kind_of_value(obj, self._dtensor)
        node = [kind.tag, *kind.encode(obj, self, path)]
        if kind.shape is _ITEMS:
            node.append([self.encode(v, (*path, i), depth + 1) for i, v in enumerate(obj)])
        elif kind.shape is _PAIRS:
            node.append(
                [
                    [self.encode(k, (*path, k), depth + 1), self.encode(v, (*path, k), depth + 1)]
                    for k, v in obj.items()
                ]
            )
        return node


def encode_tree(obj: Any, allow_pickle: bool = False) -> EncodedTree:
    """Encode ``obj``; raises ``TypeError`` naming the key path of anything unsupported."""
    encoder = _Encoder(allow_pickle)
    encoder.out.skeleton = encoder.encode(obj, (), 0)
    return encoder.out


def iter_tensor_leaves(obj: Any, path: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """Yield ``(path, tensor_or_dtensor)`` for each tensor leaf of a caller's structure.

    Classifies values with :func:`kind_of_value`, as :func:`encode_tree` does,
    so it yields exactly the paths at which the encoder would put a tensor or
    DTensor node: the paths :func:`index_skeleton` reports, for in-place receives.
    """
    yield from _tensor_leaves(obj, path, dtensor_type())


def _tensor_leaves(obj: Any, path: KeyPath, dtensor: type | None) -> Iterator[tuple[KeyPath, Any]]:
    if is_plain(obj):
        return
    kind = kind_of_value(obj, dtensor)
    if kind is TENSOR or kind is DTENSOR:
        yield path, obj
    elif kind.shape is _ITEMS:
        for i, value in enumerate(obj):
            yield from _tensor_leaves(value, (*path, i), dtensor)
    elif kind.shape is _PAIRS:
        for key, value in obj.items():
            yield from _tensor_leaves(value, (*path, key), dtensor)


# ----------------------------------------------------------------------------- receiving side

_UNHASHABLE = object()  # index_skeleton's key for nodes that decode to lists or dicts


class _Index:
    """What :func:`index_skeleton` gathers while it checks a skeleton."""

    def __init__(self, n_tensors: int, allow_pickle: bool, dtensor_specs: dict[int, Any] | None) -> None:
        self.n_tensors = n_tensors
        self.allow_pickle = allow_pickle
        self.dtensor_specs = dtensor_specs
        self.paths: dict[int, KeyPath] = {}

    def tensor(self, value: Any, path: KeyPath) -> None:
        if type(value) is not int or not 0 <= value < self.n_tensors or value in self.paths:
            raise ProtocolError(f"{format_path(path)}: bad tensor index {value!r}")
        self.paths[value] = path

    def tensor_node(self, value: Any, path: KeyPath) -> Any:
        """:meth:`visit` of a tensor node ``["T", value]`` (``fold``'s shortcut): ``_check_tensor``'s work."""
        if type(value) is not int or not 0 <= value < self.n_tensors or value in self.paths:
            raise ProtocolError(f"{format_path(path)}: bad tensor index {value!r}")
        self.paths[value] = path
        return (TAG_TENSOR, value)

    def visit(self, kind: NodeKind, args: list[Any], parts: list[Any], path: KeyPath) -> Any:
        """The python key a node decodes to (used for dict keys in paths), once checked.

        Lists and dicts give :data:`_UNHASHABLE`: build_tree could not use them
        as dict keys, so a dict item keyed by one is refused here, not there.
        """
        key = kind.check(args, path, self)
        if kind.shape is _LEAF:
            return key
        if kind.shape is _PAIRS:
            for key, _ in parts:
                if key is _UNHASHABLE:
                    raise ProtocolError(f"{format_path(path)}: unhashable dict key")
            return _UNHASHABLE
        keys = tuple(parts)
        return keys if kind.hashable and _UNHASHABLE not in keys else _UNHASHABLE


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
    index = _Index(n_tensors, allow_pickle, dtensor_specs)
    fold(skeleton, index.visit, tensor=index.tensor_node)
    if len(index.paths) != n_tensors:
        raise ProtocolError(f"skeleton uses {len(index.paths)} of {n_tensors} tensor table entries")
    return index.paths


def build_tree(
    skeleton: Any,
    leaf: Callable[[int], torch.Tensor],
    make_dtensor: Callable[[int, Any, bool], Any],
) -> Any:
    """Rebuild the object from a skeleton already checked by :func:`index_skeleton`."""
    builders = Builders(leaf, make_dtensor)
    return fold(
        skeleton,
        lambda kind, args, parts, path: kind.build(args, parts, builders),
        paths=False,
        tensor=lambda index, path: leaf(index),
    )
