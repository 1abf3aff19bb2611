"""The skeleton's node-kind table and its walker (zmqtransport/codec/skeleton.py).

One table (``KINDS``) describes every node kind; the encoder, ``index_skeleton``,
``build_tree`` and the CLI's ``inspect`` all go through it. These tests pin the
table itself: every kind round-trips, the walker visits each node once, the
CLI counts what the walker yields, and the caller-side walk
(``iter_tensor_leaves``) classifies values exactly as the encoder does.
"""

from __future__ import annotations

import collections
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import msgpack
import pytest
import torch

from zmqtransport import cli, wire
from zmqtransport.codec import skeleton
from zmqtransport.codec.dtensor import make_dtensor
from zmqtransport.codec.skeleton import KINDS, Shape
from zmqtransport.codec.tensors import EncodedTree, decode_tensor_table
from zmqtransport.errors import ProtocolError

from .conftest import assert_same

ROOT = str(Path(__file__).resolve().parent.parent)


class Point(NamedTuple):
    x: Any
    y: Any


class Opaque:
    """Only pickle can carry it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


class TaggedTensor(torch.Tensor):
    """A tensor subclass: not a plain tensor, so the encoder pickles it."""


def over_the_wire(encoded: EncodedTree) -> tuple[Any, list[Any]]:
    """The skeleton and tensor table as the receiver unpacks them."""
    body = msgpack.packb([encoded.skeleton, encoded.tensors], use_bin_type=True)
    skeleton_, tensors = msgpack.unpackb(body, raw=False, strict_map_key=False)
    return skeleton_, tensors


def roundtrip(obj: Any, allow_pickle: bool = False) -> tuple[Any, dict[int, Any]]:
    """encode_tree -> msgpack -> decode_tensor_table, index_skeleton -> build_tree."""
    encoded = skeleton.encode_tree(obj, allow_pickle)
    skel, table = over_the_wire(encoded)
    specs = decode_tensor_table(table, [ref.nbytes for ref in encoded.storages])
    dtensor_specs: dict[int, Any] = {}
    paths = skeleton.index_skeleton(skel, len(specs), allow_pickle, dtensor_specs)

    def leaf(index: int) -> torch.Tensor:
        spec = specs[index]
        source = encoded.storages[spec.storage].owner.untyped_storage()
        tensor = torch.empty(0, dtype=spec.dtype).set_(source, spec.offset, spec.shape, spec.stride).clone()
        if spec.is_param:
            return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
        return tensor.requires_grad_(spec.requires_grad)

    def dtensor(index: int, spec_obj: Any, requires_grad: bool) -> Any:
        return make_dtensor(leaf(index).detach(), spec_obj, requires_grad)

    return skeleton.build_tree(skel, leaf, dtensor), paths


def _sample_dtensor() -> Any:
    """A DTensor on a 2x4 mesh that needs no process group (as in test_dtensor.py)."""
    pytest.importorskip("torch.distributed.tensor")
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    mesh = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), _init_backend=False, _rank=5)
    local = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    meta = TensorMeta(torch.Size([4, 3]), (3, 1), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (Shard(0), Shard(1)), tensor_meta=meta), requires_grad=False)


# One value of each kind, by tag. A kind added to the table without a sample here fails below.
SAMPLES: dict[str, Any] = {
    skeleton.TAG_LIST: [1, "a", None],
    skeleton.TAG_TUPLE: (1.5, b"x"),
    skeleton.TAG_DICT: {"a": 1, 2: "b"},
    skeleton.TAG_ORDERED_DICT: collections.OrderedDict([("z", 1), ("a", 2)]),
    skeleton.TAG_NAMEDTUPLE: Point(1, [2]),
    skeleton.TAG_TENSOR: torch.arange(5, dtype=torch.int16),
    skeleton.TAG_DTENSOR: None,  # built lazily: needs torch.distributed
    skeleton.TAG_BIGINT: 2**70,
    skeleton.TAG_DTYPE: torch.bfloat16,
    skeleton.TAG_SIZE: torch.Size([3, 0, 2]),
    skeleton.TAG_DEVICE: torch.device("cpu"),
    skeleton.TAG_PICKLE: Opaque(7),
}


def test_the_table_lists_every_tag_once() -> None:
    assert set(SAMPLES) == set(KINDS)
    assert all(kind.tag == tag for tag, kind in KINDS.items())
    tags = {value for name, value in vars(skeleton).items() if name.startswith("TAG_")}
    assert tags == set(KINDS)


@pytest.mark.parametrize("tag", sorted(KINDS))
def test_every_kind_round_trips(tag: str) -> None:
    value = _sample_dtensor() if tag == skeleton.TAG_DTENSOR else SAMPLES[tag]
    encoded = skeleton.encode_tree({"v": value}, allow_pickle=True)
    assert encoded.skeleton[1][0][1][0] == tag  # the value was encoded as this kind
    got, _ = roundtrip({"v": value}, allow_pickle=True)
    if tag == skeleton.TAG_DTENSOR:
        assert type(got["v"]) is type(value)
        assert torch.equal(got["v"]._local_tensor, value._local_tensor)
        assert got["v"]._spec == value._spec
    else:
        assert_same(got, {"v": value})


def test_a_kind_nested_in_every_container_keeps_its_key_path() -> None:
    tensor = torch.ones(2)
    state = {
        "l": [tensor],
        "t": (0, tensor),
        "o": collections.OrderedDict(k=tensor),
        "n": Point(tensor, None),
        (1, "k"): {"deep": tensor},
    }
    got, paths = roundtrip(state)
    assert sorted(paths.values(), key=repr) == sorted(
        [("l", 0), ("t", 1), ("o", "k"), ("n", 0), ((1, "k"), "deep")], key=repr
    )
    assert_same(got, state)


def _reference_nodes(node: Any) -> list[str]:
    """Every tagged node's tag, found by reading the raw lists (independent of the table)."""
    if not isinstance(node, list):
        return []
    tag, args = node[0], node[1:]
    if tag in (skeleton.TAG_LIST, skeleton.TAG_TUPLE, skeleton.TAG_NAMEDTUPLE):
        children = args[-1]
    elif tag in (skeleton.TAG_DICT, skeleton.TAG_ORDERED_DICT):
        children = [item for pair in args[0] for item in pair]
    else:
        children = []
    return [tag] + [t for child in children for t in _reference_nodes(child)]


def _mixed_state() -> Any:
    return {
        "model": collections.OrderedDict(w=torch.zeros(2), b=torch.zeros(1)),
        "meta": [Point(torch.float32, torch.Size([2])), (torch.device("cpu"), 2**65)],
        Opaque(1): [Opaque(2), {"x": Opaque(3)}],
        "empty": [[], (), {}],
    }


def test_walk_visits_each_node_once() -> None:
    encoded = skeleton.encode_tree(_mixed_state(), allow_pickle=True)
    walked = [tag for tag, _ in skeleton.walk(encoded.skeleton)]
    assert sorted(walked) == sorted(_reference_nodes(encoded.skeleton))
    assert walked.count(skeleton.TAG_PICKLE) == 3
    assert walked.count(skeleton.TAG_TENSOR) == 2
    assert list(skeleton.walk(5)) == []  # a plain value has no nodes


def test_cli_counts_the_pickled_leaves_the_walker_yields() -> None:
    encoded = skeleton.encode_tree(_mixed_state(), allow_pickle=True)
    skel, table = over_the_wire(encoded)
    header = wire.Header(
        step=1,
        skeleton=skel,
        tensors=table,
        storages=[ref.nbytes for ref in encoded.storages],
        chunk_bytes=1 << 20,
        pack_below=1 << 16,
        checksum=None,
    )
    info = cli.describe_header(header, "peer")
    walked = sum(tag == skeleton.TAG_PICKLE for tag, _ in skeleton.walk(skel))
    assert info["pickled_leaves"] == walked == 3


def test_fold_refuses_malformed_shapes() -> None:
    def visit(kind: Any, args: Any, parts: Any, path: Any) -> Any:
        return None

    bad = [
        [],  # no tag
        [1, 2],  # tag not a string
        ["?", 1],  # unknown tag
        [skeleton.TAG_LIST, [], []],  # wrong arity
        [skeleton.TAG_LIST, "ab"],  # children not a list
        [skeleton.TAG_DICT, [[1, 2, 3]]],  # a dict item that is not a pair
        [skeleton.TAG_DTENSOR, 0, {}, "yes"],  # requires_grad not a bool
        {"a": 1},  # a map is never a node
    ]
    for node in bad:
        with pytest.raises(ProtocolError):
            skeleton.fold([skeleton.TAG_LIST, [node]], visit)
    deep: Any = 0
    for _ in range(skeleton.MAX_DEPTH + 1):
        deep = [skeleton.TAG_LIST, [deep]]
    with pytest.raises(ProtocolError, match="nesting deeper"):
        skeleton.fold(deep, visit)


def test_fold_visits_children_first_with_their_paths() -> None:
    seen: list[tuple[str, Any]] = []

    def visit(kind: Any, args: Any, parts: Any, path: Any) -> Any:
        seen.append((kind.tag, path))
        return kind.tag

    node = [skeleton.TAG_DICT, [["a", [skeleton.TAG_LIST, [[skeleton.TAG_TENSOR, 0]]]]]]
    assert skeleton.fold(node, visit) == skeleton.TAG_DICT
    assert seen == [(skeleton.TAG_TENSOR, ("a", 0)), (skeleton.TAG_LIST, ("a",)), (skeleton.TAG_DICT, ())]
    seen.clear()
    skeleton.fold(node, visit, paths=False)
    assert [path for _, path in seen] == [(), (), ()]


def test_fold_tensor_shortcut_sees_what_visit_would() -> None:
    """``tensor`` gets exactly the tensor nodes visit would get as children, with the same paths and results."""
    node = [
        skeleton.TAG_DICT,
        [
            ["a", [skeleton.TAG_TENSOR, 0]],
            ["b", [skeleton.TAG_LIST, [[skeleton.TAG_TENSOR, 1], [skeleton.TAG_TUPLE, [[skeleton.TAG_TENSOR, 2]]]]]],
        ],
    ]
    generic: list[Any] = []
    shortcut: list[Any] = []

    def visit(kind: Any, args: Any, parts: Any, path: Any) -> Any:
        generic.append((kind.tag, args, path))
        return (kind.tag, tuple(map(str, parts)))

    def tensor(index: Any, path: Any) -> Any:
        shortcut.append((skeleton.TAG_TENSOR, [index], path))
        return visit(skeleton.TENSOR, [index], [], path)

    plain = skeleton.fold(node, visit)
    tensors = [seen for seen in generic if seen[0] == skeleton.TAG_TENSOR]
    generic.clear()
    assert skeleton.fold(node, visit, tensor=tensor) == plain
    assert shortcut == tensors and len(tensors) == 3
    # A malformed tensor node is not taken by the shortcut: fold refuses it as before.
    with pytest.raises(ProtocolError, match="unknown or malformed"):
        skeleton.fold([skeleton.TAG_LIST, [[skeleton.TAG_TENSOR, 0, 1]]], visit, tensor=tensor)


def test_fold_leaves_no_reference_cycle_behind() -> None:
    """What the visitor holds is freed as fold returns, without the cyclic collector.

    A cycle there kept a received header's objects (246,000 for 20,480
    tensors) alive until a collection that cost 38 ms at the end of the receive.
    """

    class Held:
        pass

    held = Held()
    alive = weakref.ref(held)
    node = [
        skeleton.TAG_DICT,
        [["a", [skeleton.TAG_TENSOR, 0]], ["b", [skeleton.TAG_LIST, [1, [skeleton.TAG_TENSOR, 1]]]]],
    ]

    def visit(kind: Any, args: Any, parts: Any, path: Any, held: Any = held) -> Any:
        return None

    enabled = gc.isenabled()
    gc.disable()
    try:
        skeleton.fold(node, visit, tensor=lambda index, path, held=held: None)
        del visit, held
        assert alive() is None
    finally:
        if enabled:
            gc.enable()


# ----------------------------------------------------------------------------- one classification


def _caller_states() -> list[Any]:
    tensor = torch.arange(3.0)
    return [
        {"a": tensor, "b": [tensor, (tensor,)]},
        collections.OrderedDict(w=torch.nn.Parameter(torch.ones(2))),
        {"point": Point(tensor, {"in": tensor})},
        # Subclasses are not what they derive from: the encoder pickles them whole,
        # so no tensor node exists at the paths inside them.
        {"dd": collections.defaultdict(list, {"t": tensor}), "keep": tensor},
        {"sub": tensor.as_subclass(TaggedTensor), "keep": tensor},
        {"deque": collections.deque([tensor]), "size": torch.Size([1])},
    ]


@pytest.mark.parametrize("state", _caller_states(), ids=range(len(_caller_states())))
def test_iter_tensor_leaves_walks_as_the_encoder_does(state: Any) -> None:
    encoded = skeleton.encode_tree(state, allow_pickle=True)
    assert [path for path, _ in skeleton.iter_tensor_leaves(state)] == encoded.tensor_paths


def test_iter_tensor_leaves_skips_subclasses_of_containers_and_tensors() -> None:
    tensor = torch.zeros(1)
    state = {"dd": collections.defaultdict(list, {"t": tensor}), "sub": tensor.as_subclass(TaggedTensor)}
    assert list(skeleton.iter_tensor_leaves(state)) == []
    assert skeleton.kind_of_value(state["dd"], None) is skeleton.PICKLE
    assert skeleton.kind_of_value(state["sub"], None) is skeleton.PICKLE
    assert skeleton.kind_of_value(torch.nn.Parameter(tensor), None) is skeleton.TENSOR
    assert skeleton.kind_of_value(torch.Size([1]), None) is skeleton.SIZE  # a tuple subclass of its own
    assert skeleton.kind_of_value(Point(1, 2), None) is skeleton.NAMEDTUPLE


def test_iter_tensor_leaves_yields_dtensors_whole() -> None:
    dtensor = _sample_dtensor()
    assert list(skeleton.iter_tensor_leaves({"w": [dtensor]})) == [(("w", 0), dtensor)]


def test_plain_values_are_not_nodes() -> None:
    for value in (None, True, 0, -(2**63), 2**64 - 1, 1.5, "s", b"b"):
        assert skeleton.is_plain(value)
        assert skeleton.encode_tree(value).skeleton == value
    for value in (2**64, -(2**63) - 1):
        assert not skeleton.is_plain(value)
        assert skeleton.encode_tree(value).skeleton == [skeleton.TAG_BIGINT, str(value)]


def test_shapes_match_the_wire_layout() -> None:
    """Containers keep their children last; leaves have none (what fold relies on)."""
    for kind in KINDS.values():
        if kind.shape is Shape.LEAF:
            continue
        value = SAMPLES[kind.tag]
        node = skeleton.encode_tree(value, allow_pickle=True).skeleton
        assert len(node) == 1 + kind.arity
        assert isinstance(node[-1], list) and len(node[-1]) == len(value)


def test_no_distributed_import_for_plain_states() -> None:
    """Looking for DTensor never imports torch.distributed.tensor (it costs seconds)."""
    code = (
        "import sys, torch\n"
        "from zmqtransport.codec import skeleton\n"
        "skeleton.encode_tree({'a': torch.zeros(1)})\n"
        "list(skeleton.iter_tensor_leaves({'a': torch.zeros(1)}))\n"
        "assert 'torch.distributed.tensor' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
