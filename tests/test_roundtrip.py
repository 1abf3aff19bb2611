"""What must survive a send/recv exactly: structure, values, dtypes, shapes, views."""

from __future__ import annotations

import collections
import math
from typing import Any, NamedTuple

import pytest
import torch

from zmqtransport import ZMQTransport
from zmqtransport.codec.dtypes import DTYPES

from .conftest import TIMEOUT, assert_same, bytes_of


class Point(NamedTuple):
    x: Any
    y: Any


def roundtrip(transport: ZMQTransport[Any], state: Any, step: int = 1) -> Any:
    transport.send_checkpoint([1], step, state, TIMEOUT)
    try:
        return transport.recv_checkpoint(0, transport.metadata(), step, TIMEOUT)
    finally:
        transport.disallow_checkpoint()


def test_containers_and_plain_leaves(make_transport: Any) -> None:
    transport = make_transport()
    state = {
        "none": None,
        "bools": [True, False],
        "ints": (0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**70), 10**40),
        "floats": [0.5, -0.0, math.inf, -math.inf, math.nan],
        "text": "héllo",
        "raw": b"\x00\xff",
        "dtype": torch.bfloat16,
        "size": torch.Size([2, 3]),
        "device": torch.device("cpu"),
        "ordered": collections.OrderedDict([("b", 1), ("a", [torch.ones(2)])]),
        "named": Point(torch.zeros(3), {"deep": (1, [2, {"x": None}])}),
        "empty": [[], (), {}, collections.OrderedDict()],
        3: "int key",
        (1, "t"): "tuple key",
    }
    assert_same(roundtrip(transport, state), state)


def test_top_level_plain_values(make_transport: Any) -> None:
    transport = make_transport()
    for step, state in enumerate([None, 7, "s", [torch.ones(1)], (torch.ones(1),)]):
        assert_same(roundtrip(transport, state, step), state)


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype(make_transport: Any, name: str) -> None:
    # Arbitrary bit patterns (NaN payloads included) viewed as the dtype under test.
    raw = torch.arange(64, dtype=torch.uint8).mul_(37)
    source = raw.view(DTYPES[name])
    zero_dim = raw[: source.dtype.itemsize].clone().view(source.dtype).reshape(())
    state = {"t": source.reshape(2, -1), "zero_dim": zero_dim, "empty": source[:0]}
    assert_same(roundtrip(make_transport(), state), state)


def test_views_and_aliasing(make_transport: Any) -> None:
    transport = make_transport()
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    state = {
        "base": base,
        "slice": base[2:4, 3:7],
        "transposed": base.t(),
        "strided": base[::2, ::3],
        "as_int": base.view(torch.int32),
        "expanded": torch.ones(3, 1).expand(3, 4),
        "conj": torch.tensor([1 + 2j, 3 - 4j]).conj(),
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    got = roundtrip(transport, state)
    for key in ("slice", "transposed", "strided", "as_int"):
        assert bytes_of(got[key]) == bytes_of(state[key])
        assert got[key].stride() == state[key].stride()
        # Sent once, still one storage on arrival, as torch.save does.
        assert got[key].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    got["base"][0, 0] = -1.0
    assert got["transposed"][0, 0] == -1.0
    assert torch.equal(got["expanded"], state["expanded"]) and got["expanded"].stride() == (1, 0)
    assert torch.equal(got["conj"], state["conj"].resolve_conj())
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    assert transport.last_recv_stats.bytes == 60 * 4 + 3 * 4 + 2 * 8 + 2 * 4


def test_optimizer_and_scheduler_state(make_transport: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        scheduler.step()
    state = {
        "model": model.state_dict(),
        "optim": optimizer.state_dict(),
        "sched": scheduler.state_dict(),
        "torchft": {"step": 3, "batches_committed": 6},
    }
    transport = make_transport()
    got = roundtrip(transport, state)
    assert_same(got, state)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    fresh.load_state_dict(got["model"])
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_optimizer.load_state_dict(got["optim"])


def test_unsupported_leaf_names_key_path(make_transport: Any) -> None:
    transport = make_transport()
    with pytest.raises(TypeError, match=r"state\['optim'\]\[0\]\['fn'\].*allow_pickle"):
        transport.send_checkpoint([1], 1, {"optim": [{"fn": object()}]}, TIMEOUT)
    with pytest.raises(TypeError, match=r"sparse|Sparse"):
        transport.send_checkpoint([1], 1, {"s": torch.eye(2).to_sparse()}, TIMEOUT)


def test_pickle_needs_both_sides(make_transport: Any) -> None:
    from zmqtransport import ProtocolError, RemoteError

    sender = make_transport(allow_pickle=True)
    strict = make_transport()
    trusting = make_transport(allow_pickle=True)
    state = {"set": {1, 2, 3}, "t": torch.ones(2)}
    sender.send_checkpoint([1], 4, state, TIMEOUT)
    with pytest.raises(RemoteError, match="pickle"):
        strict.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)
    got = trusting.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)
    assert got["set"] == {1, 2, 3}
    # A receiver that did not opt in refuses pickled nodes even if the sender
    # ignores its flag: the skeleton check runs on the receiving side too.
    from zmqtransport.codec import skeleton

    encoded = skeleton.encode_tree({"x": {1}}, allow_pickle=True)
    with pytest.raises(ProtocolError, match="allow_pickle=False"):
        skeleton.index_skeleton(encoded.skeleton, 0, allow_pickle=False)
