"""The CheckpointTransport contract as torchft drives it, and its error cases."""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import msgpack
import pytest
import torch
import zmq

import zmqtransport
from zmqtransport import CheckpointTransport, ProtocolError, RemoteError, ZMQTransport, wire

from .conftest import TIMEOUT, fetch_racing_disallow


def model_state(seed: int, tensors: int = 4, numel: int = 1 << 16) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {f"w{i}": torch.randn(numel, generator=generator) for i in range(tensors)},
        "torchft": {"step": seed},
    }


def assert_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["torchft"] == want["torchft"]
    assert got["model"].keys() == want["model"].keys()
    for key, tensor in want["model"].items():
        assert torch.equal(got["model"][key], tensor), key


def test_public_api_and_defaults() -> None:
    transport: ZMQTransport[Any] = ZMQTransport(timeout=timedelta(seconds=10))
    try:
        assert isinstance(transport, CheckpointTransport)
        metadata = transport.metadata()
        assert metadata.startswith("tcp://")
        host, port = metadata.removeprefix("tcp://").rsplit(":", 1)
        assert int(port) > 0 and host not in ("*", "0.0.0.0")
    finally:
        transport.shutdown()


@pytest.mark.torchft
def test_is_a_torchft_checkpoint_transport(make_transport: Any) -> None:
    pytest.importorskip("torchft")
    from torchft.checkpointing import CheckpointTransport as TorchftTransport

    assert isinstance(make_transport(), TorchftTransport)


def test_metadata_brackets_ipv6_hosts(make_transport: Any) -> None:
    transport = make_transport(advertise_host="fe80::1")
    assert transport.metadata().startswith("tcp://[fe80::1]:")
    assert zmqtransport.net.parse_metadata(transport.metadata()).host == "fe80::1"


def test_ipv6_loopback_transfer(make_transport: Any) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        sender = make_transport(bind_host="::1")
    except zmq.ZMQError as exc:
        pytest.skip(f"cannot bind ::1 here: {exc}")
    receiver = make_transport()
    assert sender.metadata().startswith("tcp://[::1]:")
    state = model_state(1)
    sender.send_checkpoint([1], 1, state, TIMEOUT)
    assert_state_equal(receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT), state)


def test_torchft_recovery_scenario_in_threads(make_transport: Any) -> None:
    """torchft's heal sequence: rank 0 serves step 1 to ranks 1 and 2, then step 2 to rank 2."""
    ranks = [make_transport() for _ in range(3)]
    metadata = [t.metadata() for t in ranks]

    state1 = model_state(1)
    ranks[0].send_checkpoint([1, 2], 1, state1, TIMEOUT)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ranks[r].recv_checkpoint, 0, metadata[0], 1, TIMEOUT) for r in (1, 2)]
        for future in futures:
            assert_state_equal(future.result(), state1)
    ranks[0].disallow_checkpoint()

    state2 = model_state(2)
    ranks[0].send_checkpoint([2], 2, state2, TIMEOUT)
    assert_state_equal(ranks[2].recv_checkpoint(0, metadata[0], 2, TIMEOUT), state2)
    ranks[0].disallow_checkpoint()

    with pytest.raises(TimeoutError, match=r"timed out.*rank 0.*step 3"):
        ranks[2].recv_checkpoint(0, metadata[0], 3, timedelta(milliseconds=10))

    # A transport serving itself.
    ranks[1].send_checkpoint([1], 5, state2, TIMEOUT)
    assert_state_equal(ranks[1].recv_checkpoint(1, metadata[1], 5, TIMEOUT), state2)
    ranks[1].disallow_checkpoint()


def test_request_before_send_waits_for_the_step(make_transport: Any) -> None:
    sender, receiver = make_transport(), make_transport()
    state = model_state(3)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(receiver.recv_checkpoint, 0, sender.metadata(), 3, TIMEOUT)
        time.sleep(0.3)  # the request is now parked on the sender
        assert not future.done()
        sender.send_checkpoint([1], 3, state, TIMEOUT)
        assert_state_equal(future.result(), state)


def test_wrong_step_names_both_steps(make_transport: Any) -> None:
    sender, receiver = make_transport(), make_transport()
    sender.send_checkpoint([1], 7, model_state(7), TIMEOUT)
    with pytest.raises(RemoteError, match=r"requested step 6 but this peer serves step 7") as info:
        receiver.recv_checkpoint(0, sender.metadata(), 6, TIMEOUT)
    assert info.value.code == wire.ERR_WRONG_STEP


def test_nothing_at_the_address_times_out(make_transport: Any) -> None:
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    receiver = make_transport()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"timed out.*rank 4.*127\.0\.0\.1:{port}.*step 9"):
        receiver.recv_checkpoint(4, f"tcp://127.0.0.1:{port}", 9, timedelta(milliseconds=300))
    assert time.monotonic() - started < 10  # bounded, not hung


@pytest.mark.parametrize(
    "metadata",
    ["", "http://host:1", "tcp://host", "tcp://:80", "tcp://host:0", "tcp://host:99999", "tcp://[::1:80", 42],
)
def test_bad_metadata_is_a_clear_error(make_transport: Any, metadata: Any) -> None:
    with pytest.raises(ValueError, match="metadata"):
        make_transport().recv_checkpoint(0, metadata, 1, TIMEOUT)


def test_version_mismatch_is_clear_both_ways(make_transport: Any) -> None:
    sender = make_transport()
    sender.send_checkpoint([1], 1, model_state(1), TIMEOUT)
    # An old/new receiver talking to us: the error reply names both versions.
    context = zmq.Context.instance()
    with context.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(sender.metadata())
        dealer.send(msgpack.packb({"v": 99, "op": "fetch", "id": 1, "step": 1, "wait_ms": 0, "credit": 4}))
        assert dealer.poll(10_000)
        reply = msgpack.unpackb(dealer.recv())
    assert reply["op"] == "error" and reply["code"] == wire.ERR_VERSION
    assert "version 99" in reply["msg"] and f"version {wire.PROTOCOL_VERSION}" in reply["msg"]

    # A receiver talking to an old/new sender: a clear ProtocolError.
    with context.socket(zmq.ROUTER) as router:
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        receiver = make_transport()
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(receiver.recv_checkpoint, 0, f"tcp://127.0.0.1:{port}", 1, TIMEOUT)
            peer, _request = router.recv_multipart()
            router.send_multipart([peer, msgpack.packb({"v": 2, "op": "header", "id": 0})])
            with pytest.raises(ProtocolError, match=r"version mismatch.*version 2"):
                future.result()


def test_disallow_then_mutate_never_leaks_mutated_bytes(make_transport: Any) -> None:
    """Receivers racing a disallow get the original bytes or an error, never a mix."""
    sender = make_transport(chunk_bytes=64 * 1024)
    receivers = [make_transport(window=1) for _ in range(3)]
    state = {"model": {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(8)}, "torchft": {"step": 1}}
    original = {k: v.clone() for k, v in state["model"].items()}
    sender.send_checkpoint([1, 2, 3], 1, state, TIMEOUT)

    def mutate() -> None:
        for tensor in state["model"].values():
            tensor.fill_(-1.0)  # allowed now: nothing may read this memory any more

    for outcome in fetch_racing_disallow(sender, receivers, 1, mutate):
        if not isinstance(outcome, RemoteError):
            for key, tensor in original.items():
                assert torch.equal(outcome["model"][key], tensor), key


def test_in_place_receive_fills_matching_targets(make_transport: Any) -> None:
    sender = make_transport()
    state = {
        "model": {"a": torch.randn(1000), "b": torch.randn(3, 4), "odd": torch.randn(5)},
        "step": 4,
    }
    target = {
        "model": {
            "a": torch.zeros(1000),  # matches: filled in place
            "b": torch.zeros(3, 4, dtype=torch.float64),  # dtype differs: fresh
            "odd": torch.zeros(6),  # shape differs: fresh
        }
    }
    a_before = target["model"]["a"]
    receiver = make_transport(state_dict=lambda: target)
    sender.send_checkpoint([1], 4, state, TIMEOUT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 4, TIMEOUT)
    assert got["model"]["a"] is a_before and torch.equal(a_before, state["model"]["a"])
    assert got["model"]["b"] is not target["model"]["b"] and torch.equal(got["model"]["b"], state["model"]["b"])
    assert torch.equal(got["model"]["odd"], state["model"]["odd"])
    assert not target["model"]["b"].any() and not target["model"]["odd"].any()
    stats = receiver.last_recv_stats
    assert stats is not None and stats.in_place_bytes == 4000 and stats.bytes == 4000 + 48 + 20


def test_one_info_line_per_transfer(make_transport: Any, caplog: pytest.LogCaptureFixture) -> None:
    sender, receiver = make_transport(), make_transport()
    sender.send_checkpoint([1], 2, model_state(2, tensors=1), TIMEOUT)
    with caplog.at_level(logging.INFO, logger="zmqtransport"):
        receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)
        sender.disallow_checkpoint()
    served = [r for r in caplog.records if r.name == "zmqtransport.serve" and r.levelno == logging.INFO]
    received = [r for r in caplog.records if r.name == "zmqtransport.fetch" and r.levelno == logging.INFO]
    assert len(served) == 1 and len(received) == 1
    for record in served + received:
        text = record.getMessage()
        assert "step 2" in text and "bytes" in text and "GB/s" in text


def test_shutdown_is_idempotent_and_leaves_no_threads() -> None:
    before = {t.ident for t in threading.enumerate()}
    transports = [ZMQTransport[Any](TIMEOUT, bind_host="127.0.0.1") for _ in range(3)]
    transports[0].send_checkpoint([1], 1, model_state(1), TIMEOUT)
    transports[1].recv_checkpoint(0, transports[0].metadata(), 1, TIMEOUT)
    transports[0].shutdown()
    transports[0].shutdown()
    transports[1].shutdown(wait=False)
    transports[1].shutdown(wait=False)
    transports[2].shutdown(wait=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        ours = [t for t in threading.enumerate() if t.name.startswith("zmqtransport") and t.ident not in before]
        if not ours:
            break
        time.sleep(0.05)
    assert not ours, ours
    with pytest.raises(RuntimeError, match="shut down"):
        transports[0].send_checkpoint([1], 2, {}, TIMEOUT)
    transports[0].disallow_checkpoint()  # harmless after shutdown


def test_failing_state_dict_callable_falls_back_to_fresh_memory(make_transport: Any) -> None:
    def broken() -> Any:
        raise RuntimeError("model not built yet")

    sender, receiver = make_transport(), make_transport(state_dict=broken)
    state = model_state(5, tensors=2)
    sender.send_checkpoint([1], 5, state, TIMEOUT)
    assert_state_equal(receiver.recv_checkpoint(0, sender.metadata(), 5, TIMEOUT), state)
    assert receiver.last_recv_stats is not None and receiver.last_recv_stats.in_place_bytes == 0


def test_timeout_none_means_the_constructors(make_transport: Any) -> None:
    # torchft's newest PGTransport takes timeout=None on send and receive as "the constructor's".
    sender, receiver = make_transport(), make_transport()
    state = model_state(3)
    sender.send_checkpoint([1], 3, state, None)
    assert_state_equal(receiver.recv_checkpoint(0, sender.metadata(), 3, None), state)
    assert receiver.fetch_header(sender.metadata(), 3, None) == sender.fetch_header(sender.metadata(), 3)
    # The bound is the constructor's: a peer that accepts the connection and never speaks.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        quick = make_transport(timeout=timedelta(seconds=0.7))
        with pytest.raises(TimeoutError, match=r"timed out after 0\.7 s"):
            quick.recv_checkpoint(0, f"tcp://127.0.0.1:{port}", 3, None)
