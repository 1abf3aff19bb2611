"""Property tests of every decoder a peer's bytes reach (issue 5).

Contract under test: given anything at all, a decoder either returns a result
that the next stage can use without failing, or raises
:class:`zmqtransport.errors.ProtocolError`. Any other exception type (a
``TypeError`` from an unhashable key, a ``ValueError`` from ``int()``, a
``RuntimeError`` from torch) is a bug: it escapes the callers' error handling
and tells the user nothing about which peer sent what.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zmqtransport import wire
from zmqtransport.codec import dtypes, tensors
from zmqtransport.codec import skeleton as codec_skeleton
from zmqtransport.errors import ProtocolError

PROPERTY = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Values msgpack can carry, including the awkward ones: ints at both ends of the
# 64-bit range, NaN and infinities, empty and non-UTF-8 binaries.
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.sampled_from([-1, 0, 1, 2**31, 2**50, 2**62, 2**63 - 1, 2**64 - 1, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=12)
)
MSGPACK_VALUES = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=8), children, max_size=6),
    max_leaves=40,
)

TAGS = [
    codec_skeleton.TAG_LIST,
    codec_skeleton.TAG_TUPLE,
    codec_skeleton.TAG_DICT,
    codec_skeleton.TAG_ORDERED_DICT,
    codec_skeleton.TAG_NAMEDTUPLE,
    codec_skeleton.TAG_TENSOR,
    codec_skeleton.TAG_DTENSOR,
    codec_skeleton.TAG_BIGINT,
    codec_skeleton.TAG_DTYPE,
    codec_skeleton.TAG_SIZE,
    codec_skeleton.TAG_DEVICE,
    codec_skeleton.TAG_PICKLE,
    "?",
]


def _node(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Tagged skeleton nodes: mostly well-formed shapes with hostile contents."""
    items = st.lists(children, max_size=5)
    pairs = st.lists(st.lists(children, min_size=1, max_size=3), max_size=4)
    names = st.sampled_from(["a", "b", "_x", "class", "def", "1a", "a b", "", "x"])
    return st.one_of(
        st.tuples(st.sampled_from([codec_skeleton.TAG_LIST, codec_skeleton.TAG_TUPLE]), items).map(list),
        st.tuples(st.sampled_from([codec_skeleton.TAG_DICT, codec_skeleton.TAG_ORDERED_DICT]), pairs).map(list),
        st.tuples(
            st.just(codec_skeleton.TAG_NAMEDTUPLE),
            st.sampled_from(["collections", "torch", "os", "no.such.module", ""]),
            st.sampled_from(["Point", "def", "_private", "A.B", "x y", "OrderedDict"]),
            st.lists(names, max_size=3),
            items,
        ).map(list),
        st.tuples(st.just(codec_skeleton.TAG_TENSOR), st.integers(-2, 5) | SCALARS).map(list),
        st.tuples(st.just(codec_skeleton.TAG_DTENSOR), st.integers(-1, 5), MSGPACK_VALUES, SCALARS).map(list),
        st.tuples(
            st.just(codec_skeleton.TAG_BIGINT),
            st.text(alphabet="0123456789-+_ x", max_size=20) | st.integers(4000, 6000).map(lambda n: "7" * n) | SCALARS,
        ).map(list),
        st.tuples(
            st.just(codec_skeleton.TAG_DTYPE),
            st.sampled_from([*dtypes.DTYPES, "qint8", "float"]) | MSGPACK_VALUES,
        ).map(list),
        st.tuples(st.just(codec_skeleton.TAG_SIZE), MSGPACK_VALUES).map(list),
        st.tuples(
            st.just(codec_skeleton.TAG_DEVICE),
            st.sampled_from(["cpu", "cuda:1", "meta", "cuda:99999999999999999999", "x:y", "\x00"]) | SCALARS,
        ).map(list),
        st.tuples(st.just(codec_skeleton.TAG_PICKLE), SCALARS).map(list),
        # Any tag with any arguments: wrong arity, wrong types.
        st.lists(st.sampled_from(TAGS) | SCALARS, min_size=1, max_size=1).flatmap(
            lambda head: st.lists(children, max_size=4).map(lambda rest: head + rest)
        ),
    )


SKELETONS = st.recursive(SCALARS, _node, max_leaves=30)


def _stub_leaf(index: int) -> torch.Tensor:
    return torch.zeros(1)


def _stub_dtensor(index: int, spec: Any, requires_grad: bool) -> Any:
    return ("dtensor", index)


@PROPERTY
@given(st.binary(max_size=256) | MSGPACK_VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_unpack_returns_a_map_or_protocol_error(frame: bytes) -> None:
    try:
        value = wire.unpack(frame, wire.MAX_REQUEST_BYTES)
    except ProtocolError:
        return
    assert isinstance(value, dict)


def test_unpack_refuses_oversized_and_deeply_nested_frames() -> None:
    for frame in (b"\x80" * (wire.MAX_REQUEST_BYTES + 1), b"\x91" * 100_000 + b"\xc0"):
        try:
            wire.unpack(frame, wire.MAX_REQUEST_BYTES * 4)
        except ProtocolError:
            continue
        raise AssertionError("accepted a hostile frame")


def _request_maps() -> st.SearchStrategy[bytes]:
    """Request envelopes: the right keys with valid, boundary and wrong-typed values."""
    value = st.one_of(
        SCALARS,
        st.sampled_from(wire.REQUEST_OPS),
        st.integers(-(2**63), 2**64 - 1),
        st.just(wire.PROTOCOL_VERSION),
        MSGPACK_VALUES,
    )
    keys = st.sampled_from(["v", "op", "id", "step", "wait_ms", "credit", "n", "pickle", "header_only"])
    maps = st.dictionaries(keys, value, max_size=9)
    return maps.map(lambda m: msgpack.packb(m, use_bin_type=True))


@PROPERTY
@given(st.binary(max_size=128) | _request_maps())
def test_decode_request_validates_or_raises_protocol_error(frame: bytes) -> None:
    try:
        request = wire.decode_request(frame)
    except ProtocolError:
        return
    # Everything the serving thread relies on without checking again.
    assert request.op in wire.REQUEST_OPS
    assert 0 <= request.xfer < 2**64
    assert 0 <= request.step <= wire.MAX_STEP
    assert request.wait_ms >= 0
    if request.op in (wire.OP_FETCH, wire.OP_CREDIT):
        assert 1 <= request.credit <= wire.MAX_CREDIT
    assert isinstance(request.accept_pickle, bool) and isinstance(request.header_only, bool)


def _header_maps() -> st.SearchStrategy[Any]:
    sizes = st.lists(st.integers(-1, 2**20) | st.sampled_from([2**50, 2**50 + 1, 2**63]) | SCALARS, max_size=6)
    field_values = {
        "step": st.integers(-(2**63), 2**64 - 1) | SCALARS,
        "skeleton": SKELETONS,
        "tensors": st.lists(MSGPACK_VALUES, max_size=4) | SCALARS,
        "storages": sizes | SCALARS,
        "chunk_bytes": st.sampled_from([0, 4095, 4096, 1 << 20, 64 << 20, (64 << 20) + 1]) | SCALARS,
        "pack_below": st.integers(-1, 1 << 21) | SCALARS,
        "checksum": st.sampled_from([None, "crc32", "md5"]) | SCALARS,
    }
    return st.fixed_dictionaries({}, optional=field_values)


@PROPERTY
@given(_header_maps() | MSGPACK_VALUES)
def test_decode_header_validates_or_raises_protocol_error(message: Any) -> None:
    try:
        header = wire.decode_header(message)
    except ProtocolError:
        return
    assert 0 <= header.step <= wire.MAX_STEP
    assert all(type(n) is int and 0 <= n <= 2**50 for n in header.storages)
    assert wire.MIN_CHUNK_BYTES <= header.chunk_bytes <= wire.MAX_CHUNK_BYTES
    assert 0 <= header.pack_below <= header.chunk_bytes
    assert header.checksum in (None, *wire.CHECKSUMS)
    assert isinstance(header.tensors, list)
    # The chunk plan must be computable and cover every byte exactly once.
    plan = wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below)
    assert sum(wire.chunk_length(pieces) for pieces in plan) == header.total_bytes


def _tensor_entries() -> st.SearchStrategy[Any]:
    ints = st.integers(-2, 40) | st.sampled_from([2**31, 2**40, 2**62, 2**62 + 1, 2**63 - 1])
    entry = st.tuples(
        st.integers(-1, 3) | SCALARS,
        st.sampled_from([*dtypes.DTYPES, "qint8", "nope"]) | SCALARS,
        st.lists(ints, max_size=4) | SCALARS,
        st.lists(ints, max_size=4) | SCALARS,
        ints | SCALARS,
        st.booleans() | SCALARS,
        st.booleans() | SCALARS,
    ).map(list)
    return st.lists(entry | MSGPACK_VALUES, max_size=4) | MSGPACK_VALUES


@PROPERTY
@given(_tensor_entries(), st.lists(st.integers(0, 4096), min_size=1, max_size=4))
def test_decode_tensor_table_yields_buildable_views(entries: Any, storages: list[int]) -> None:
    try:
        specs = tensors.decode_tensor_table(entries, storages)
    except ProtocolError:
        return
    backing = [torch.empty(n, dtype=torch.uint8) for n in storages]
    for spec in specs:
        # What the receiver does with each spec: it must not fail, and a
        # non-empty view must lie inside the bytes that will be received.
        view = torch.empty(0, dtype=spec.dtype).set_(
            backing[spec.storage].untyped_storage(), spec.offset, spec.shape, spec.stride
        )
        assert tuple(view.shape) == spec.shape
        if view.numel() > 0:
            last = spec.offset + sum((n - 1) * s for n, s in zip(spec.shape, spec.stride, strict=True))
            assert (last + 1) * spec.dtype.itemsize <= storages[spec.storage]
        assert math.prod(spec.shape) == view.numel()


@PROPERTY
@given(SKELETONS, st.integers(0, 4), st.booleans())
def test_index_skeleton_accepts_only_buildable_trees(skeleton: Any, n_tensors: int, allow_pickle: bool) -> None:
    try:
        paths = codec_skeleton.index_skeleton(skeleton, n_tensors, allow_pickle)
    except ProtocolError:
        return
    assert sorted(paths) == list(range(n_tensors))
    if allow_pickle and _has_pickle(skeleton):
        return  # unpickling arbitrary bytes is what allow_pickle=True opts into
    codec_skeleton.build_tree(skeleton, _stub_leaf, _stub_dtensor)


def _has_pickle(node: Any) -> bool:
    if isinstance(node, list):
        return (bool(node) and node[0] == codec_skeleton.TAG_PICKLE) or any(_has_pickle(n) for n in node)
    return False


@PROPERTY
@given(SKELETONS)
def test_pickle_nodes_are_refused_without_opt_in(skeleton: Any) -> None:
    wrapped = [codec_skeleton.TAG_LIST, [skeleton, [codec_skeleton.TAG_PICKLE, b"cos\nsystem\n(S'true'\ntR."]]]
    try:
        codec_skeleton.index_skeleton(wrapped, 0, allow_pickle=False)
    except ProtocolError:
        return
    raise AssertionError("a pickled leaf was accepted with allow_pickle=False")


@PROPERTY
@given(st.binary(max_size=512) | _header_maps().map(lambda m: msgpack.packb(m, use_bin_type=True)))
def test_whole_header_pipeline_over_bytes(body: bytes) -> None:
    """The receiver's order of checks, applied to arbitrary header bytes."""
    try:
        header = wire.decode_header(wire.unpack(body, wire.MAX_HEADER_BYTES))
        specs = tensors.decode_tensor_table(header.tensors, header.storages)
        codec_skeleton.index_skeleton(header.skeleton, len(specs), allow_pickle=False)
    except ProtocolError:
        return
    codec_skeleton.build_tree(header.skeleton, _stub_leaf, _stub_dtensor)


def test_known_leaks_stay_fixed() -> None:
    """Inputs that once escaped as TypeError/ValueError at build time (regressions)."""
    bad_skeletons = [
        [codec_skeleton.TAG_DTYPE, [1]],  # unhashable lookup in DTYPES
        [codec_skeleton.TAG_DICT, [[[codec_skeleton.TAG_LIST, []], 1]]],  # list as a dict key
        [codec_skeleton.TAG_BIGINT, "1" * 5000],  # beyond int()'s digit limit
        [codec_skeleton.TAG_NAMEDTUPLE, "m", "X", ["class"], [1]],  # keyword field
        [codec_skeleton.TAG_NAMEDTUPLE, "m", "X", ["_a"], [1]],  # underscore field
        [codec_skeleton.TAG_NAMEDTUPLE, "m", "X", ["a", "a"], [1, 2]],  # duplicate field
    ]
    for skeleton in bad_skeletons:
        try:
            codec_skeleton.index_skeleton(skeleton, 0, allow_pickle=False)
        except ProtocolError:
            continue
        raise AssertionError(f"accepted {skeleton!r}")
    # A keyword as the class name is harmless: the stand-in is renamed.
    keyword_named = [codec_skeleton.TAG_NAMEDTUPLE, "m", "def", ["a"], [1]]
    record = codec_skeleton.build_tree(keyword_named, _stub_leaf, _stub_dtensor)
    assert tuple(record) == (1,)
    # Tuple keys keep their value in key paths (in-place receive matches them).
    tagged = [codec_skeleton.TAG_DICT, [[[codec_skeleton.TAG_TUPLE, [1, "a"]], [codec_skeleton.TAG_TENSOR, 0]]]]
    paths = codec_skeleton.index_skeleton(tagged, 1, allow_pickle=False)
    assert paths == {0: ((1, "a"),)}
    for shape, stride in (([2**62, 2**62], [0, 0]), ([2**31, 2**31, 4], [0, 0, 0])):
        entry = [[0, "float32", shape, stride, 0, False, False]]
        try:
            tensors.decode_tensor_table(entry, [16])
        except ProtocolError:
            continue
        raise AssertionError(f"accepted a tensor of shape {shape}")
    for message in ({"step": -1}, [1, 2], "header"):
        try:
            wire.decode_header(message)  # type: ignore[arg-type]
        except ProtocolError:
            continue
        raise AssertionError(f"accepted header {message!r}")
