"""DTensor leaves: the spec codec on its own, and DTensors through the real transport.

The arrival condition: local tensor and ``_spec`` equal on arrival, encoded
without pickle. Meshes come in two kinds here: real CPU meshes over a
one-rank gloo process group (so shapes (), (1,) and (1, 1)), and bigger meshes
built with ``_init_backend=False``, which need no process group at all and let
the codec see real rank layouts (2x4, a sliced sub-mesh).
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import msgpack
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqtransport import ProtocolError, ZMQTransport
from zmqtransport.codec import dtensor as codec
from zmqtransport.codec import dtypes
from zmqtransport.codec import skeleton as codec_skeleton

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from torch.distributed._mesh_layout import _MeshLayout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard

TIMEOUT = timedelta(seconds=10)
PATH = ("model", "w")


@pytest.fixture
def pg(tmp_path: Any) -> Iterator[None]:
    """A one-rank gloo world on a FileStore; torn down so other tests see none."""
    assert not dist.is_initialized(), "another test left a default process group behind"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def wire(obj: Any) -> Any:
    """What the receiver sees: msgpack'd and unpacked as wire.py does."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False, strict_map_key=True)


def decode(dt: Any, like: Any = None, local: torch.Tensor | None = None) -> Any:
    obj = wire(codec.encode_spec(dt._spec, PATH))
    codec.validate_spec(obj, PATH)
    local = dt._local_tensor.clone() if local is None else local
    return codec.make_dtensor(local, obj, dt.requires_grad, like=like)


def assert_same_dtensor(got: Any, want: Any) -> None:
    assert type(got) is DTensor
    assert torch.equal(got.to_local(), want.to_local())
    assert got.to_local().dtype == want.to_local().dtype
    assert got._spec == want._spec
    # Field by field as well, so a failure names what differs (and the strided
    # flag, which DTensorSpec.__eq__ leaves out).
    assert got.placements == want.placements
    assert got._spec.shard_order == want._spec.shard_order
    assert got._spec.use_strided_shard_as_shard_order == want._spec.use_strided_shard_as_shard_order
    assert got.device_mesh.mesh_dim_names == want.device_mesh.mesh_dim_names
    assert torch.equal(got.device_mesh.mesh, want.device_mesh.mesh)
    assert got.requires_grad == want.requires_grad
    assert got.shape == want.shape and got.stride() == want.stride()


# Cases on a real (one-rank) CPU mesh: (mesh shape, dim names, placements, requires_grad).
REAL_CASES: list[tuple[tuple[int, ...], tuple[str, ...] | None, list[Any], bool]] = [
    ((1,), None, [Replicate()], False),
    ((1,), ("dp",), [Shard(0)], True),
    ((1,), None, [Shard(1)], False),
    ((1,), ("dp",), [Partial()], False),
    ((1, 1), ("dp", "tp"), [Shard(0), Shard(1)], True),
    ((1, 1), None, [Shard(1), Replicate()], False),
    ((1, 1), ("dp", "tp"), [Partial("avg"), Replicate()], False),
    ((1, 1), None, [Shard(0), Shard(0)], False),
    ((1, 1), ("dp", "tp"), [_StridedShard(0, split_factor=1), Shard(0)], False),
]


def real_dtensor(
    shape: tuple[int, ...], names: tuple[str, ...] | None, placements: list[Any], grad: bool
) -> Any:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    local = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return DTensor.from_local(local.requires_grad_(grad), mesh, placements, run_check=False)


@pytest.mark.parametrize(("shape", "names", "placements", "grad"), REAL_CASES, ids=str)
def test_codec_roundtrip_real_mesh(
    pg: None, shape: Any, names: Any, placements: Any, grad: bool
) -> None:
    dt = real_dtensor(shape, names, placements, grad)
    got = decode(dt)
    assert_same_dtensor(got, dt)
    assert got.device_mesh is not dt.device_mesh  # rebuilt, not looked up by name
    assert got.device_mesh.get_coordinate() == dt.device_mesh.get_coordinate()


def test_zero_dim_mesh_like_torchft(pg: None) -> None:
    """torchft's own transport test: DeviceMesh("cpu", 1) with no placements."""
    from torch.distributed.tensor import distribute_tensor

    dt = distribute_tensor(torch.tensor([5, 6, 7]), DeviceMesh("cpu", 1), [])
    assert_same_dtensor(decode(dt), dt)


def fake_mesh(rank: int = 5, names: tuple[str, ...] | None = ("dp", "tp")) -> DeviceMesh:
    """A 2x4 mesh over ranks 0..7 that needs no process group."""
    ranks = torch.arange(8).reshape(2, 4)
    return DeviceMesh("cpu", ranks, mesh_dim_names=names, _init_backend=False, _rank=rank)


def sliced_mesh(rank: int = 5) -> DeviceMesh:
    """What ``fake_mesh()["dp"]`` is: the root's rank map, read with stride 4.

    Needs the ``pg`` fixture: DeviceMesh asks the default group which slice holds
    this process (rank 0 here, so the slice [0, 4]).
    """
    return DeviceMesh(
        "cpu",
        mesh_dim_names=("dp",),
        _init_backend=False,
        _rank=rank,
        _layout=_MeshLayout.from_sizes_strides((2,), (4,)),
        _rank_map=torch.arange(8, dtype=torch.int),
    )


def fake_dtensor(mesh: DeviceMesh, placements: list[Any], grad: bool = False) -> Any:
    local = torch.linspace(-1, 1, 6, dtype=torch.float64).reshape(2, 3)
    global_shape = list(local.shape)
    for placement, size in zip(placements, mesh.mesh.shape, strict=True):
        if isinstance(placement, Shard):
            global_shape[placement.dim] *= size
    meta = TensorMeta(torch.Size(global_shape), (global_shape[1], 1), local.dtype)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local, spec, requires_grad=grad)


@pytest.mark.parametrize("with_pg", [False, True], ids=["no-pg", "pg"])
def test_codec_bigger_meshes(with_pg: bool, request: pytest.FixtureRequest) -> None:
    if with_pg:
        request.getfixturevalue("pg")
    cases = [
        fake_dtensor(fake_mesh(), [Shard(0), Shard(1)], grad=True),
        fake_dtensor(fake_mesh(names=None), [Replicate(), Partial("max")]),
        fake_dtensor(fake_mesh(), [_StridedShard(1, split_factor=4), Shard(1)]),
    ]
    if with_pg:
        cases.append(fake_dtensor(sliced_mesh(), [Shard(0)]))
    for dt in cases:
        got = decode(dt)
        assert_same_dtensor(got, dt)
        # Without a process group the mesh takes the sender's rank, so the shard
        # keeps its coordinate; with one, it takes this process's rank.
        expected_rank = 0 if with_pg else 5
        assert got.device_mesh._rank == expected_rank


def test_sliced_mesh_needs_its_layout(pg: None) -> None:
    """A sub-mesh rebuilt from its public ranks alone would compare unequal."""
    mesh = sliced_mesh()
    naive = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("dp",), _init_backend=False, _rank=5)
    assert naive != mesh
    assert codec.encode_spec(fake_dtensor(mesh, [Shard(0)])._spec, PATH) == SLICED_OBJ
    # A root mesh does not pay for a layout.
    root = codec.encode_spec(fake_dtensor(fake_mesh(), [Shard(0), Replicate()])._spec, PATH)
    assert "layout" not in root["mesh"] and root["mesh"]["rank_map"] == list(range(8))


def test_sliced_mesh_without_process_group_is_refused_cleanly() -> None:
    with pytest.raises(ProtocolError, match="initialised"):
        codec.make_dtensor(torch.zeros(2, 3, dtype=torch.float64), valid_obj(), False)


def test_equal_meshes_are_shared() -> None:
    """All DTensors of a checkpoint on one mesh get one rebuilt mesh object."""
    a = decode(fake_dtensor(fake_mesh(), [Shard(0), Replicate()]))
    b = decode(fake_dtensor(fake_mesh(), [Replicate(), Shard(1)]))
    assert a.device_mesh is b.device_mesh


def test_like_reuses_live_mesh_and_object() -> None:
    dt = fake_dtensor(fake_mesh(), [Shard(0), Shard(1)], grad=True)
    target = fake_dtensor(fake_mesh(), [Shard(0), Shard(1)], grad=True)
    # Received in place: the target's own local tensor holds the bytes.
    target._local_tensor.detach().copy_(dt._local_tensor)
    got = decode(dt, like=target, local=target._local_tensor)
    assert got is target

    # Same mesh, other grad flag: a new DTensor, but on the target's mesh object.
    obj = wire(codec.encode_spec(dt._spec, PATH))
    other = codec.make_dtensor(target._local_tensor, obj, False, like=target)
    assert other is not target and other.device_mesh is target.device_mesh
    assert other._spec == dt._spec and not other.requires_grad

    # A target on a different mesh (other dim names) lends nothing.
    elsewhere = fake_dtensor(fake_mesh(names=("a", "b")), [Shard(0), Shard(1)])
    got = decode(dt, like=elsewhere)
    assert got.device_mesh is not elsewhere.device_mesh
    assert_same_dtensor(got, dt)

    # Non-DTensor targets are ignored.
    assert_same_dtensor(decode(dt, like=torch.zeros(2, 3)), dt)


def test_spec_matches() -> None:
    dt = fake_dtensor(fake_mesh(), [Shard(0), Shard(1)])
    obj = wire(codec.encode_spec(dt._spec, PATH))
    assert codec.spec_matches(fake_dtensor(fake_mesh(rank=3), [Shard(0), Shard(1)]), obj)
    assert not codec.spec_matches(fake_dtensor(fake_mesh(), [Shard(0), Replicate()]), obj)
    assert not codec.spec_matches(fake_dtensor(fake_mesh(names=None), [Shard(0), Shard(1)]), obj)
    assert not codec.spec_matches(torch.zeros(2, 3), obj)
    assert not codec.spec_matches(None, obj)


# ------------------------------------------------------------------------- through the transport


@pytest.fixture
def transports() -> Iterator[Callable[..., ZMQTransport[Any]]]:
    made: list[ZMQTransport[Any]] = []

    def make(**options: Any) -> ZMQTransport[Any]:
        transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1", **options)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.shutdown()


def send_and_receive(transport: ZMQTransport[Any], state: Any) -> Any:
    transport.send_checkpoint([1], 1, state, TIMEOUT)
    try:
        return transport.recv_checkpoint(0, transport.metadata(), 1, TIMEOUT)
    finally:
        transport.disallow_checkpoint()


def test_transport_roundtrip(pg: None, transports: Callable[..., ZMQTransport[Any]]) -> None:
    dt = real_dtensor((1, 1), ("dp", "tp"), [Shard(0), Replicate()], True)
    dt2 = real_dtensor((1,), None, [Partial()], False)
    dt3 = fake_dtensor(sliced_mesh(), [Shard(1)])
    state = {"w": dt, "nested": [dt2, {"sliced": dt3}], "plain": torch.ones(2), "step": 7}
    got = send_and_receive(transports(), state)
    assert torch.equal(got["w"].to_local(), dt.to_local())
    assert got["w"]._spec == dt._spec
    assert_same_dtensor(got["w"], dt)
    assert_same_dtensor(got["nested"][0], dt2)
    assert_same_dtensor(got["nested"][1]["sliced"], dt3)
    assert torch.equal(got["plain"], state["plain"]) and got["step"] == 7


def test_dtensor_header_has_no_pickle(pg: None) -> None:
    """A DTensor leaf is a "D" node with a plain spec; nothing is pickled."""
    encoded = codec_skeleton.encode_tree({"w": real_dtensor((1,), ("dp",), [Shard(0)], False)})
    assert not encoded.has_pickle
    assert encoded.skeleton[1][0][1][0] == codec_skeleton.TAG_DTENSOR


def test_transport_in_place(pg: None, transports: Callable[..., ZMQTransport[Any]]) -> None:
    dt = real_dtensor((1, 1), ("dp", "tp"), [Shard(0), Shard(1)], False)
    zeros = torch.zeros_like(dt.to_local())
    target = {"w": DTensor.from_local(zeros, dt.device_mesh, dt.placements, run_check=False)}
    receiver = transports(state_dict=lambda: target)
    sender = transports()
    sender.send_checkpoint([1], 1, {"w": dt}, TIMEOUT)
    try:
        got = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
    finally:
        sender.disallow_checkpoint()
    assert torch.equal(target["w"].to_local(), dt.to_local())
    assert target["w"].to_local().data_ptr() == zeros.data_ptr()
    assert got["w"] is target["w"]  # the caller's own DTensor, live mesh included
    assert got["w"]._spec == dt._spec


def test_in_place_needs_matching_spec(pg: None, transports: Callable[..., ZMQTransport[Any]]) -> None:
    """A shard never lands in a DTensor (or plain tensor) that would misdescribe it."""
    dt = real_dtensor((1, 1), ("dp", "tp"), [Shard(0), Shard(1)], False)
    other_placement = DTensor.from_local(
        torch.zeros_like(dt.to_local()), dt.device_mesh, [Replicate(), Replicate()], run_check=False
    )
    plain = torch.zeros_like(dt.to_local())
    target = {"w": other_placement, "p": plain, "t": other_placement}
    receiver = transports(state_dict=lambda: target)
    sender = transports()
    sender.send_checkpoint([1], 1, {"w": dt, "p": dt.to_local().clone() + 1, "t": torch.ones(3, 4)}, TIMEOUT)
    try:
        got = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
    finally:
        sender.disallow_checkpoint()
    assert not other_placement.to_local().any()  # wrong placements: not written
    assert got["w"]._spec == dt._spec and torch.equal(got["w"].to_local(), dt.to_local())
    assert got["p"] is plain and torch.equal(plain, dt.to_local() + 1)  # plain into plain: in place
    assert torch.equal(got["t"], torch.ones(3, 4)) and type(got["t"]) is torch.Tensor
    stats = receiver.last_recv_stats
    assert stats is not None and stats.in_place_bytes == plain.nbytes


# ----------------------------------------------------------------------------- refusals


# What encode_spec gives for fake_dtensor(sliced_mesh(), [Shard(0)]) (checked by
# test_sliced_mesh_needs_its_layout); written out so that building it needs no
# process group. It exercises every key, layout included.
SLICED_OBJ: dict[str, Any] = {
    "mesh": {
        "device_type": "cpu",
        "dim_names": ["dp"],
        "rank": 5,
        "shape": [2],
        "rank_map": [0, 1, 2, 3, 4, 5, 6, 7],
        "layout": [[[2], [4]]],
    },
    "placements": [["shard", 0]],
    "meta": {"shape": [4, 3], "stride": [3, 1], "dtype": "float64"},
    "shard_order": [[0, [0]]],
    "strided_order": False,
}


def valid_obj() -> dict[str, Any]:
    obj: dict[str, Any] = wire(SLICED_OBJ)
    return obj


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        target: Any = obj
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value

    return mutate


def _drop(*keys: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        target: Any = obj
        for key in keys[:-1]:
            target = target[key]
        del target[keys[-1]]

    return mutate


def _compose(*steps: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(obj: dict[str, Any]) -> None:
        for step in steps:
            step(obj)

    return mutate


MALFORMED: dict[str, Callable[[dict[str, Any]], None]] = {
    "extra key": _set("pickle", value=b"\x80"),
    "missing key": _drop("meta"),
    "mesh not a map": _set("mesh", value=[1, 2]),
    "unknown placement": _set("placements", 0, value=["os.system", "rm"]),
    "placement not a list": _set("placements", 0, value="shard"),
    "shard dim out of range": _set("placements", 0, value=["shard", 2]),
    "shard dim bool": _set("placements", 0, value=["shard", True]),
    "unknown reduce op": _set("placements", 0, value=["partial", "premul_sum"]),
    "unhashable reduce op": _set("placements", 0, value=["partial", ["sum"]]),
    "strided split 0": _set("placements", 0, value=["strided_shard", 0, 0]),
    "too many placements": _set("placements", value=[["replicate"], ["replicate"]]),
    "unknown dtype": _set("meta", "dtype", value="float128"),
    "dtype not str": _set("meta", "dtype", value=7),
    "stride length": _set("meta", "stride", value=[1]),
    "negative size": _set("meta", "shape", value=[-4, 3]),
    "shape of floats": _set("meta", "shape", value=[4.0, 3]),
    "device names a module": _set("mesh", "device_type", value="onnx"),
    "device with index": _set("mesh", "device_type", value="cpu:0"),
    "device not str": _set("mesh", "device_type", value=None),
    "rank map vs shape": _compose(_drop("mesh", "layout"), _set("mesh", "shape", value=[3])),
    "repeated rank": _set("mesh", "rank_map", value=[0, 1, 2, 3, 4, 5, 6, 4]),
    "rank beyond int32": _set("mesh", "rank_map", 7, value=2**31),
    "rank map of str": _set("mesh", "rank_map", 7, value="7"),
    "empty mesh dim": _set("mesh", "shape", value=[0]),
    "dim names count": _set("mesh", "dim_names", value=["a", "b"]),
    "dim name type": _set("mesh", "dim_names", value=[b"dp"]),
    "own rank": _set("mesh", "rank", value=-2),
    "missing rank map": _drop("mesh", "rank_map"),
    "layout not a list": _set("mesh", "layout", value={"0": [[2], [4]]}),
    "layout axis shape": _set("mesh", "layout", 0, value=[[2], [4], [1]]),
    "layout negative stride": _set("mesh", "layout", value=[[[2], [-4]]]),
    "layout past rank map": _set("mesh", "rank_map", value=[0, 1, 2, 3]),
    "layout size": _set("mesh", "layout", value=[[[3], [4]]]),
    "huge rank list": _set("mesh", "rank_map", value=list(range(codec.MAX_MESH_RANKS + 1))),
    "order vs placements": _set("shard_order", value=[[1, [0]]]),
    "order misses a shard": _set("shard_order", value=[]),
    "order repeats mesh dim": _set("shard_order", value=[[0, [0, 0]]]),
    "strided flag": _set("strided_order", value="yes"),
}


@pytest.mark.parametrize("mutate", MALFORMED.values(), ids=MALFORMED.keys())
def test_validate_refuses(mutate: Callable[[dict[str, Any]], None]) -> None:
    obj = valid_obj()
    codec.validate_spec(copy.deepcopy(obj), PATH)  # the unmutated one passes
    mutate(obj)
    with pytest.raises(ProtocolError, match=r"state\['model'\]\['w'\]"):
        codec.validate_spec(obj, PATH)


@pytest.mark.parametrize("obj", [None, [], "spec", b"", 3, {b"mesh": 1}])
def test_validate_refuses_non_maps(obj: Any) -> None:
    with pytest.raises(ProtocolError):
        codec.validate_spec(obj, PATH)


def test_validation_imports_nothing() -> None:
    """Receiving side checks run before torch.distributed.tensor is ever imported."""
    script = f"""
import sys
from zmqtransport import ProtocolError
from zmqtransport.codec.dtensor import validate_spec
spec = {SLICED_OBJ!r}
validate_spec(spec, ("w",))
spec["placements"] = [["torch.distributed.tensor", 0]]
try:
    validate_spec(spec, ("w",))
except ProtocolError:
    pass
else:
    raise SystemExit("accepted")
loaded = sorted(m for m in sys.modules if m.startswith("torch.distributed.tensor"))
raise SystemExit(f"imported {{loaded}}" if loaded else 0)
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_index_skeleton_refuses_bad_dtensor_node() -> None:
    obj = valid_obj()
    obj["placements"] = [["magic"]]
    skeleton = [codec_skeleton.TAG_DICT, [["w", [codec_skeleton.TAG_DTENSOR, 0, obj, False]]]]
    with pytest.raises(ProtocolError, match="placement"):
        codec_skeleton.index_skeleton(skeleton, 1, allow_pickle=False)


def test_make_dtensor_refuses_what_torch_refuses(pg: None) -> None:
    local = torch.zeros(2, 3, dtype=torch.float64)
    codec.make_dtensor(local, valid_obj(), False)  # the unmodified one builds
    # Two mesh dims reading the same ranks: structurally fine, refused by DeviceMesh.
    obj = valid_obj()
    obj["mesh"].update(shape=[2, 2], dim_names=None, layout=[[[2], [1]], [[2], [1]]])
    obj["placements"].append(["replicate"])
    codec.validate_spec(obj, PATH)
    with pytest.raises(ProtocolError, match="refused by torch"):
        codec.make_dtensor(local, obj, False)
    # A local tensor of another dtype than the spec says.
    with pytest.raises(ProtocolError, match="float32"):
        codec.make_dtensor(local.float(), valid_obj(), False)
    # Gradients on integers.
    obj = valid_obj()
    obj["meta"]["dtype"] = "int64"
    with pytest.raises(ProtocolError):
        codec.make_dtensor(torch.zeros(2, 3, dtype=torch.int64), obj, True)


def _leaf_paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _leaf_paths(v, (*prefix, k))] or [prefix]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in _leaf_paths(v, (*prefix, i))] or [prefix]
    return [prefix]


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
)
_ANY_VALUE = st.recursive(
    _SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)
_VALID = valid_obj()
_PATHS = [p for p in _leaf_paths(_VALID) if p]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_PATHS), _ANY_VALUE)
def test_validate_never_leaks_other_errors(path: tuple[Any, ...], value: Any) -> None:
    """Any single-leaf corruption is either accepted or refused with ProtocolError."""
    obj = copy.deepcopy(_VALID)
    _set(*path, value=value)(obj)
    try:
        codec.validate_spec(obj, PATH)
    except ProtocolError:
        return
    # Accepted: then the rebuild must succeed or refuse cleanly, never crash otherwise.
    local = torch.zeros(2, 3, dtype=dtypes.DTYPES[obj["meta"]["dtype"]])
    with contextlib.suppress(ProtocolError):
        codec.make_dtensor(local, obj, False)


# ---------------------------------------------------------------------------- what cannot be sent


def test_encode_refuses_unfaithful(pg: None) -> None:
    mesh = init_device_mesh("cpu", (1,))
    masked = DTensor.from_local(torch.ones(3), mesh, [_MaskPartial()], run_check=False)
    with pytest.raises(TypeError, match=r"state\['model'\]\['w'\].*_MaskPartial"):
        codec.encode_spec(masked._spec, PATH)
    # Through the tree encoder too: the key path names the leaf.
    with pytest.raises(TypeError, match=r"state\['emb'\]"):
        codec_skeleton.encode_tree({"emb": masked})

    no_meta = copy.copy(real_dtensor((1,), None, [Replicate()], False)._spec)
    no_meta.tensor_meta = None
    with pytest.raises(TypeError, match="tensor_meta"):
        codec.encode_spec(no_meta, PATH)

    odd = real_dtensor((1,), None, [Partial("sum")], False)._spec
    odd = DTensorSpec(odd.mesh, (Partial("premul_sum"),), tensor_meta=odd.tensor_meta)
    with pytest.raises(TypeError, match="premul_sum"):
        codec.encode_spec(odd, PATH)

    with pytest.raises(TypeError, match="spec of type"):
        codec.encode_spec(object(), PATH)
