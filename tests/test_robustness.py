"""Bad input on both sides of the wire (issue 5).

Serving side: raw TCP garbage, hand-made ZMTP, and ZeroMQ peers sending every
kind of malformed request. After each, the serving thread must be alive, a
well-formed ``recv_checkpoint`` must still get the right bytes, and wherever a
reply is possible the peer must get an ``error`` reply with a useful code.

Receiving side: a hostile sender (a ROUTER written here that speaks just
enough of the protocol) sends headers and frames that do not add up. The
receiver must raise a clear error, before allocating anything absurd, and
return nothing.

All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import random
import resource
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import msgpack
import pytest
import torch
import zmq

from zmqtransport import IntegrityError, ProtocolError, RemoteError, ZMQTransport, wire

STEP = 5
TIMEOUT = timedelta(seconds=10)
LOOPBACK = "127.0.0.1"


def staged_state() -> dict[str, Any]:
    """Small but covering: a multi-chunk tensor, packed tiny ones, a view."""
    generator = torch.Generator().manual_seed(1234)
    big = torch.randn(300_000, generator=generator)
    return {
        "big": big,
        "view": big[10:20],
        "small": [torch.arange(i + 1, dtype=torch.int16) for i in range(5)],
        "meta": {"step": STEP, "lr": 0.1},
    }


def assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert torch.equal(got["big"], want["big"])
    assert torch.equal(got["view"], want["view"])
    assert got["view"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()
    for a, b in zip(got["small"], want["small"], strict=True):
        assert torch.equal(a, b) and a.dtype == b.dtype
    assert got["meta"] == want["meta"]


@pytest.fixture
def serving() -> Iterator[tuple[ZMQTransport[Any], dict[str, Any]]]:
    """A loopback transport serving STEP (small chunks, so transfers take many messages)."""
    state = staged_state()
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, chunk_bytes=64 * 1024, pack_below=4096)
    transport.send_checkpoint([1], STEP, state, TIMEOUT)
    yield transport, state
    transport.shutdown()


@pytest.fixture
def receiver() -> Iterator[ZMQTransport[Any]]:
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    yield transport
    transport.shutdown()


def assert_still_serves(sender: ZMQTransport[Any], state: dict[str, Any], receiver: ZMQTransport[Any]) -> None:
    assert sender._server.alive, "the serving thread died"
    got = receiver.recv_checkpoint(0, sender.metadata(), STEP, timedelta(seconds=10))
    assert_same(got, state)


# ----------------------------------------------------------------------------- raw TCP


def zmtp_greeting(mechanism: bytes = b"NULL", major: int = 3) -> bytes:
    """A ZMTP 3.x greeting (64 bytes): signature, version, mechanism, as-server, filler."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + bytes([major, 0]) + mechanism.ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def zmtp_ready(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def zmtp_frame(payload: bytes, more: bool = False) -> bytes:
    flags = 0x01 if more else 0x00
    if len(payload) < 256:
        return bytes([flags]) + bytes([len(payload)]) + payload
    return bytes([flags | 0x02]) + struct.pack(">Q", len(payload)) + payload


def handshake(port: int) -> socket.socket:
    """Open a TCP connection and complete a NULL-mechanism ZMTP handshake as a DEALER."""
    conn = socket.create_connection((LOOPBACK, port), timeout=5)
    conn.sendall(zmtp_greeting() + zmtp_ready())
    received = b""
    # The server's greeting (64 bytes) and its READY command.
    while len(received) < 64 + 2 or len(received) < 66 + received[65]:
        chunk = conn.recv(4096)
        assert chunk, "the server closed the connection during the handshake"
        received += chunk
    return conn


def wait_closed(conn: socket.socket, seconds: float) -> bool:
    """True if the peer closes ``conn`` within ``seconds`` (data before EOF is ignored)."""
    conn.settimeout(0.2)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if not conn.recv(65536):
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


GARBAGE = {
    "random bytes": random.Random(7).randbytes(8192),
    "http request": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: keep-alive\r\n\r\n",
    "truncated greeting": zmtp_greeting()[:10],
    "greeting, unknown mechanism": zmtp_greeting(b"XYZZY"),
    "greeting, CURVE mechanism": zmtp_greeting(b"CURVE"),
    "greeting, future version": zmtp_greeting(major=9) + b"\x00" * 64,
    "greeting then a PUB socket": zmtp_greeting() + zmtp_ready(b"PUB"),
    "greeting then a garbage command": zmtp_greeting() + b"\x04\x05\x03abc\x01",
    "null bytes": b"\x00" * 100_000,
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_raw_tcp_garbage(
    name: str, serving: tuple[ZMQTransport[Any], dict[str, Any]], receiver: ZMQTransport[Any]
) -> None:
    sender, state = serving
    with socket.create_connection((LOOPBACK, sender._server.port), timeout=5) as conn:
        # libzmq may hang up on us mid-send: that is a fine reaction.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            conn.sendall(GARBAGE[name])
        # The connection stays open (or half-dead) while a real receiver is served.
        assert_still_serves(sender, state, receiver)
    assert_still_serves(sender, state, receiver)


def test_idle_and_half_open_connections_do_not_block_serving(
    serving: tuple[ZMQTransport[Any], dict[str, Any]], receiver: ZMQTransport[Any]
) -> None:
    sender, state = serving
    port = sender._server.port
    idle = [socket.create_connection((LOOPBACK, port), timeout=5) for _ in range(20)]
    truncated = [socket.create_connection((LOOPBACK, port), timeout=5) for _ in range(5)]
    for conn in truncated:
        conn.sendall(zmtp_greeting()[:11])  # a greeting that never completes
    silent = handshake(port)  # a full handshake, then nothing
    try:
        for _ in range(2):
            assert_still_serves(sender, state, receiver)
    finally:
        for conn in [*idle, *truncated, silent]:
            conn.close()
    assert_still_serves(sender, state, receiver)


@pytest.mark.parametrize("claimed", [4 * 2**30, 2**40], ids=["4 GiB", "1 TiB"])
def test_a_frame_claiming_gigabytes_is_refused_at_once(
    claimed: int, serving: tuple[ZMQTransport[Any], dict[str, Any]], receiver: ZMQTransport[Any]
) -> None:
    """ZMQ_MAXMSGSIZE on the ROUTER: libzmq drops the peer on reading the frame length.

    Without it libzmq would allocate the claimed size (lazily, so 4 GiB succeeds)
    and hold the connection open waiting for the body; 1 TiB fails to allocate
    and is dropped either way.
    """
    sender, state = serving
    conn = handshake(sender._server.port)
    try:
        conn.sendall(b"\x02" + struct.pack(">Q", claimed))  # a long frame header, no body
        assert wait_closed(conn, 5.0), f"the server kept a connection announcing {claimed} bytes"
    finally:
        conn.close()
    assert_still_serves(sender, state, receiver)


def test_a_request_over_the_size_limit_gets_the_peer_dropped(
    serving: tuple[ZMQTransport[Any], dict[str, Any]], receiver: ZMQTransport[Any]
) -> None:
    """A complete frame just over MAX_REQUEST_BYTES: dropped by libzmq, never buffered."""
    sender, state = serving
    conn = handshake(sender._server.port)
    try:
        conn.sendall(zmtp_frame(b"\x80" * (wire.MAX_REQUEST_BYTES + 1)))
        assert wait_closed(conn, 5.0), "an oversized request was accepted"
    finally:
        conn.close()
    # Just under the limit is a (malformed) request like any other: it gets a reply.
    conn = handshake(sender._server.port)
    try:
        conn.sendall(zmtp_frame(b"\xc1" * (wire.MAX_REQUEST_BYTES - 16)))
        conn.settimeout(5)
        reply = b""
        while b"bad_request" not in reply:
            chunk = conn.recv(65536)
            assert chunk, "closed instead of replying"
            reply += chunk
    finally:
        conn.close()
    assert_still_serves(sender, state, receiver)


# ----------------------------------------------------------------------------- ZeroMQ peers


@pytest.fixture
def dealer(serving: tuple[ZMQTransport[Any], dict[str, Any]]) -> Iterator[zmq.Socket[Any]]:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{LOOPBACK}:{serving[0]._server.port}")
    yield sock
    context.destroy(linger=0)


def recv_reply(sock: zmq.Socket[Any], seconds: float = 5.0) -> list[bytes]:
    assert sock.poll(int(seconds * 1000)), "no reply from the server"
    return sock.recv_multipart()


def envelope(**fields: Any) -> bytes:
    message = {"v": wire.PROTOCOL_VERSION, "op": wire.OP_FETCH, "id": 1, "step": STEP}
    message.update(wait_ms=1000, credit=4, pickle=False, header_only=False)
    message.update(fields)
    return msgpack.packb({k: v for k, v in message.items() if v is not _DROP}, use_bin_type=True)


_DROP = object()

# (frames, expected error code, a fragment the message must contain)
BAD_REQUESTS: dict[str, tuple[list[bytes], str, str]] = {
    "empty frame": ([b""], wire.ERR_BAD_REQUEST, "undecodable"),
    "random bytes": ([random.Random(3).randbytes(200)], wire.ERR_BAD_REQUEST, ""),
    "truncated msgpack": ([envelope()[:-5]], wire.ERR_BAD_REQUEST, "undecodable"),
    "msgpack array": ([msgpack.packb([1, "fetch", 5])], wire.ERR_BAD_REQUEST, "map"),
    "msgpack string": ([msgpack.packb("fetch")], wire.ERR_BAD_REQUEST, "map"),
    "msgpack int keys": ([msgpack.packb({1: 2})], wire.ERR_BAD_REQUEST, "undecodable"),
    "msgpack ext type": ([msgpack.packb(msgpack.ExtType(5, b"xx"))], wire.ERR_BAD_REQUEST, "map"),
    "two frames": ([envelope(), b"extra"], wire.ERR_BAD_REQUEST, "one envelope frame"),
    "three frames": ([envelope(), envelope(), envelope()], wire.ERR_BAD_REQUEST, "one envelope"),
    "wrong version": ([envelope(v=2)], wire.ERR_VERSION, "version mismatch"),
    "version missing": ([envelope(v=_DROP)], wire.ERR_VERSION, "version"),
    "version as string": ([envelope(v="1")], wire.ERR_VERSION, "version"),
    "unknown op": ([envelope(op="explode")], wire.ERR_BAD_REQUEST, "unknown request op"),
    "reply op sent as request": ([envelope(op="data")], wire.ERR_BAD_REQUEST, "unknown"),
    "op as int": ([envelope(op=1)], wire.ERR_BAD_REQUEST, "unknown request op"),
    "id missing": ([envelope(id=_DROP)], wire.ERR_BAD_REQUEST, "'id'"),
    "id negative": ([envelope(id=-1)], wire.ERR_BAD_REQUEST, "transfer id"),
    "id as float": ([envelope(id=1.0)], wire.ERR_BAD_REQUEST, "'id'"),
    "negative step": ([envelope(step=-1)], wire.ERR_BAD_REQUEST, "step -1 out of range"),
    "huge step": ([envelope(step=2**64 - 1)], wire.ERR_BAD_REQUEST, "out of range"),
    "step as string": ([envelope(step="5")], wire.ERR_BAD_REQUEST, "'step'"),
    "step as bool": ([envelope(step=True)], wire.ERR_BAD_REQUEST, "'step'"),
    "step as float": ([envelope(step=5.0)], wire.ERR_BAD_REQUEST, "'step'"),
    "zero credit": ([envelope(credit=0)], wire.ERR_BAD_REQUEST, "credit"),
    "negative credit": ([envelope(credit=-(2**63))], wire.ERR_BAD_REQUEST, "credit"),
    "negative wait": ([envelope(wait_ms=-1)], wire.ERR_BAD_REQUEST, "wait_ms"),
    "credit grant out of range": (
        [msgpack.packb({"v": 1, "op": "credit", "id": 1, "n": 10**6})],
        wire.ERR_BAD_REQUEST,
        "credit",
    ),
    "credit grant of zero": (
        [msgpack.packb({"v": 1, "op": "credit", "id": 1, "n": 0})],
        wire.ERR_BAD_REQUEST,
        "credit",
    ),
    "wrong step": ([envelope(step=STEP + 1)], wire.ERR_WRONG_STEP, f"step {STEP + 1}"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_an_error_reply(
    name: str,
    serving: tuple[ZMQTransport[Any], dict[str, Any]],
    dealer: zmq.Socket[Any],
    receiver: ZMQTransport[Any],
) -> None:
    frames, code, fragment = BAD_REQUESTS[name]
    dealer.send_multipart(frames)
    reply = recv_reply(dealer)
    assert len(reply) == 1, reply
    message = msgpack.unpackb(reply[0])
    assert message["op"] == wire.OP_ERROR and message["v"] == wire.PROTOCOL_VERSION
    assert message["code"] == code, message
    assert fragment in message["msg"], message
    assert_still_serves(serving[0], serving[1], receiver)


def test_version_mismatch_names_both_versions(
    serving: tuple[ZMQTransport[Any], dict[str, Any]], dealer: zmq.Socket[Any]
) -> None:
    dealer.send(envelope(v=99))
    message = msgpack.unpackb(recv_reply(dealer)[0])
    assert "99" in message["msg"] and str(wire.PROTOCOL_VERSION) in message["msg"]


def test_credit_and_cancel_for_unknown_transfers_are_ignored(
    serving: tuple[ZMQTransport[Any], dict[str, Any]],
    dealer: zmq.Socket[Any],
    receiver: ZMQTransport[Any],
) -> None:
    for xfer in (0, 12345, 2**64 - 1):
        dealer.send(msgpack.packb({"v": 1, "op": "credit", "id": xfer, "n": 256}))
        dealer.send(msgpack.packb({"v": 1, "op": "cancel", "id": xfer}))
    assert not dealer.poll(300), "a reply to a credit or cancel message"
    assert_still_serves(serving[0], serving[1], receiver)


def test_absurd_credit_and_wait_are_clamped() -> None:
    """credit 2**63-1 must not let the sender queue the whole checkpoint for one peer."""
    sender: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, chunk_bytes=4096, pack_below=4096)
    sender.send_checkpoint([1], STEP, staged_state(), TIMEOUT)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 0)
    try:
        dealer.connect(sender.metadata())
        dealer.send(envelope(id=7, credit=2**63 - 1, wait_ms=2**63 - 1))
        header = recv_reply(dealer)
        assert msgpack.unpackb(header[0])["op"] == wire.OP_HEADER
        body = msgpack.unpackb(header[1])
        plan = wire.plan_chunks(body["storages"], body["chunk_bytes"], body["pack_below"])
        assert len(plan) > wire.MAX_CREDIT  # the state needs more messages than the cap
        received = 0
        while dealer.poll(500):
            message = msgpack.unpackb(dealer.recv_multipart()[0])
            assert message["op"] == wire.OP_DATA and message["seq"] == received
            received += 1
        assert received == wire.MAX_CREDIT, f"{received} messages against {wire.MAX_CREDIT} credits"
        dealer.send(msgpack.packb({"v": 1, "op": "cancel", "id": 7}))
    finally:
        context.destroy(linger=0)
        sender.shutdown()


def test_flood_of_requests(
    serving: tuple[ZMQTransport[Any], dict[str, Any]],
    dealer: zmq.Socket[Any],
    receiver: ZMQTransport[Any],
) -> None:
    """Thousands of bad and wrong-step requests while a real transfer runs: every one is
    answered, none is lost, and the real transfer still gets the right bytes."""
    sender, state = serving
    results: queue.Queue[Any] = queue.Queue()

    def real_transfer() -> None:
        try:
            results.put(receiver.recv_checkpoint(0, sender.metadata(), STEP, TIMEOUT))
        except BaseException as exc:  # reported to the main thread
            results.put(exc)

    worker = threading.Thread(target=real_transfer)
    worker.start()
    rng = random.Random(11)
    sent = 0
    for i in range(3000):
        kind = i % 3
        if kind == 0:
            dealer.send(rng.randbytes(rng.randrange(1, 64)))
        elif kind == 1:
            dealer.send(envelope(id=i, step=STEP + 1 + i))  # wrong step: answered at once
        else:
            dealer.send(envelope(v=1000 + i))
        sent += 1
    replies = 0
    while replies < sent and dealer.poll(5000):
        dealer.recv_multipart()
        replies += 1
    assert replies == sent, f"{sent - replies} of {sent} requests got no reply"
    worker.join(30)
    outcome = results.get_nowait()
    if isinstance(outcome, BaseException):
        raise outcome
    assert_same(outcome, state)
    assert_still_serves(sender, state, receiver)


def test_flood_of_waiting_requests_is_bounded(receiver: ZMQTransport[Any]) -> None:
    """With nothing staged, requests wait; past the cap they are refused with busy."""
    state = staged_state()
    sender: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(sender.metadata())
        for xfer in range(300):
            sock.send(envelope(id=xfer, wait_ms=60_000, credit=1))
        codes = []
        while sock.poll(1000):
            codes.append(msgpack.unpackb(sock.recv_multipart()[0])["code"])
        assert codes and set(codes) == {wire.ERR_BUSY}, codes
        assert len(codes) == 300 - 256  # the server's waiting-request cap
        for xfer in range(300):
            sock.send(msgpack.packb({"v": 1, "op": "cancel", "id": xfer}))
        sender.send_checkpoint([1], STEP, state, TIMEOUT)
        assert_still_serves(sender, state, receiver)
    finally:
        context.destroy(linger=0)
        sender.shutdown()


def test_other_socket_types(serving: tuple[ZMQTransport[Any], dict[str, Any]], receiver: ZMQTransport[Any]) -> None:
    """A REQ peer adds an empty delimiter frame: the request is answered as malformed
    (REQ itself then drops the reply, which lacks the delimiter). A PUB peer is
    refused by libzmq during the handshake. Neither disturbs serving."""
    sender, state = serving
    context = zmq.Context()
    try:
        req = context.socket(zmq.REQ)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(sender.metadata())
        req.send(envelope())
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(sender.metadata())
        for _ in range(10):
            pub.send(envelope())
        time.sleep(0.2)
        assert_still_serves(sender, state, receiver)
    finally:
        context.destroy(linger=0)


# ----------------------------------------------------------------------------- hostile sender


Script = Callable[[int, int], list[list[bytes]]]


class FakeSender:
    """A ROUTER that answers one fetch with whatever frames a test scripts.

    The script gets the request's transfer id and step and returns the messages
    to send (frames after the routing id). Later credit/cancel messages are read
    and ignored. The socket lives entirely in the fake's own thread.
    """

    def __init__(self, script: Script) -> None:
        self._script = script
        self._stop = threading.Event()
        self._port: queue.Queue[int] = queue.Queue()
        self.requests: list[dict[str, Any]] = []
        self._context = zmq.Context()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.port = self._port.get(timeout=10)

    @property
    def metadata(self) -> str:
        return f"tcp://{LOOPBACK}:{self.port}"

    def _serve(self) -> None:
        router = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"tcp://{LOOPBACK}:*")
        self._port.put(int(router.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]))
        try:
            while not self._stop.is_set():
                if not router.poll(50):
                    continue
                peer, frame = router.recv_multipart()
                request = msgpack.unpackb(frame)
                self.requests.append(request)
                if request.get("op") == wire.OP_FETCH:
                    for message in self._script(request["id"], request["step"]):
                        router.send_multipart([peer, *message])
        finally:
            router.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._context.term()


def env(op: str, xfer: int, **fields: Any) -> bytes:
    return msgpack.packb({"v": wire.PROTOCOL_VERSION, "op": op, "id": xfer, **fields})


def header_message(
    xfer: int,
    step: int,
    *,
    tensors: list[Any],
    storages: list[int],
    skeleton: Any = None,
    chunk_bytes: int = 4096,
    pack_below: int = 0,
    checksum: str | None = None,
    **override: Any,
) -> list[bytes]:
    if skeleton is None:
        skeleton = ["l", [["T", i] for i in range(len(tensors))]]
    body = {
        "step": step,
        "skeleton": skeleton,
        "tensors": tensors,
        "storages": storages,
        "chunk_bytes": chunk_bytes,
        "pack_below": pack_below,
        "checksum": checksum,
        **override,
    }
    return [env(wire.OP_HEADER, xfer), msgpack.packb(body, use_bin_type=True)]


def data_message(xfer: int, seq: int, payload: bytes, crc: int | None = None) -> list[bytes]:
    return [env(wire.OP_DATA, xfer, seq=seq, crc=crc), payload]


FLOATS = torch.arange(100, dtype=torch.float32)
FLOAT_BYTES = struct.pack("<100f", *range(100))  # the bytes of FLOATS
ENTRY = [0, "float32", [100], [1], 0, False, False]


def honest(xfer: int, step: int) -> list[list[bytes]]:
    return [
        header_message(xfer, step, tensors=[ENTRY], storages=[400]),
        data_message(xfer, 0, FLOAT_BYTES),
        [env(wire.OP_END, xfer)],
    ]


@pytest.fixture
def fake() -> Iterator[Callable[[Script], FakeSender]]:
    made: list[FakeSender] = []

    def make(script: Script) -> FakeSender:
        made.append(FakeSender(script))
        return made[-1]

    yield make
    for sender in made:
        sender.close()


def fetch_from(receiver: ZMQTransport[Any], sender: FakeSender, seconds: float = 5.0) -> Any:
    return receiver.recv_checkpoint(0, sender.metadata, STEP, timedelta(seconds=seconds))


def test_fake_sender_is_understood_when_honest(
    fake: Callable[[Script], FakeSender], receiver: ZMQTransport[Any]
) -> None:
    """The baseline every hostile variant below departs from."""
    got = fetch_from(receiver, fake(honest))
    assert len(got) == 1 and torch.equal(got[0], FLOATS)


def _with(**changes: Any) -> Script:
    """The honest script with header fields replaced."""

    def script(xfer: int, step: int) -> list[list[bytes]]:
        fields: dict[str, Any] = {"tensors": [ENTRY], "storages": [400], **changes}
        return [
            header_message(xfer, step, **fields),
            data_message(xfer, 0, FLOAT_BYTES),
            [env(wire.OP_END, xfer)],
        ]

    return script


def _frames(*messages: Callable[[int], list[bytes]]) -> Script:
    """A script of the honest header followed by the given messages."""

    def script(xfer: int, step: int) -> list[list[bytes]]:
        return [header_message(xfer, step, tensors=[ENTRY], storages=[400])] + [make(xfer) for make in messages]

    return script


def _entry(**changes: Any) -> list[Any]:
    fields = dict(zip(["storage", "dtype", "shape", "stride", "offset", "grad", "param"], ENTRY, strict=True))
    fields.update(changes)
    return list(fields.values())


HOSTILE: dict[str, tuple[Script, type[Exception], str]] = {
    # Header vs tensor table vs storages
    "shape larger than its storage": (
        _with(tensors=[_entry(shape=[1000])]),
        ProtocolError,
        "reaches byte 4000",
    ),
    "stride walks out of the storage": (
        _with(tensors=[_entry(stride=[2])]),
        ProtocolError,
        "reaches byte",
    ),
    "offset past the end": (
        _with(tensors=[_entry(offset=99, shape=[2])]),
        ProtocolError,
        "reaches",
    ),
    "negative offset": (_with(tensors=[_entry(offset=-1)]), ProtocolError, "invalid offset"),
    "negative shape": (_with(tensors=[_entry(shape=[-100])]), ProtocolError, "invalid value"),
    "shape and stride lengths differ": (
        _with(tensors=[_entry(shape=[10, 10], stride=[1])]),
        ProtocolError,
        "differ in length",
    ),
    "dtype wider than the bytes": (
        _with(tensors=[_entry(dtype="float64")]),
        ProtocolError,
        "reaches byte 800",
    ),
    "unknown dtype": (_with(tensors=[_entry(dtype="float128")]), ProtocolError, "unknown dtype"),
    "unknown storage": (_with(tensors=[_entry(storage=1)]), ProtocolError, "unknown storage"),
    "tensor entry too short": (_with(tensors=[ENTRY[:5]]), ProtocolError, "malformed"),
    "skeleton uses a missing tensor": (
        _with(skeleton=["l", [["T", 0], ["T", 1]]]),
        ProtocolError,
        "bad tensor index 1",
    ),
    "skeleton skips a tensor": (_with(skeleton=["l", []]), ProtocolError, "uses 0 of 1"),
    "skeleton reuses a tensor": (
        _with(skeleton=["l", [["T", 0], ["T", 0]]]),
        ProtocolError,
        "bad tensor index 0",
    ),
    "header for another step": (
        lambda xfer, step: honest(xfer, step + 1),
        ProtocolError,
        f"peer sent step {STEP + 1}",
    ),
    "storage beyond 2**50": (_with(storages=[2**50 + 1]), ProtocolError, "invalid storage size"),
    "chunk size out of range": (_with(chunk_bytes=1), ProtocolError, "chunk_bytes"),
    "unknown checksum": (_with(checksum="md5"), ProtocolError, "unknown checksum"),
    # Frames that do not match the plan
    "short data frame": (
        _frames(lambda x: data_message(x, 0, FLOAT_BYTES[:300]), lambda x: [env("end", x)]),
        ProtocolError,
        "has 300 bytes, expected 400",
    ),
    "long data frame": (
        _frames(lambda x: data_message(x, 0, FLOAT_BYTES + b"!" * 100), lambda x: [env("end", x)]),
        ProtocolError,
        "has 500 bytes, expected 400",
    ),
    "data envelope without its frame": (
        _frames(lambda x: [env(wire.OP_DATA, x, seq=0, crc=None)], lambda x: [env("end", x)]),
        ProtocolError,
        "expected data message 0",
    ),
    "data message with an extra frame": (
        _frames(lambda x: [*data_message(x, 0, FLOAT_BYTES), b"extra"], lambda x: [env("end", x)]),
        ProtocolError,
        "unexpected extra frames",
    ),
    "end before any data": (_frames(lambda x: [env("end", x)]), ProtocolError, "data message 0"),
    "extra data after the plan": (
        _frames(
            lambda x: data_message(x, 0, FLOAT_BYTES),
            lambda x: data_message(x, 1, FLOAT_BYTES),
            lambda x: [env("end", x)],
        ),
        ProtocolError,
        "expected the end marker",
    ),
    "wrong seq": (
        _frames(lambda x: data_message(x, 1, FLOAT_BYTES), lambda x: [env("end", x)]),
        ProtocolError,
        "expected data message 0",
    ),
    "header without its body": (
        lambda xfer, step: [[env(wire.OP_HEADER, xfer)]],
        ProtocolError,
        "expected a header",
    ),
    "header with an extra frame": (
        lambda xfer, step: [[*header_message(xfer, step, tensors=[ENTRY], storages=[400]), b"x"]],
        ProtocolError,
        "unexpected extra frames",
    ),
    "header body is not msgpack": (
        lambda xfer, step: [[env(wire.OP_HEADER, xfer), b"\xc1\xc1\xc1"]],
        ProtocolError,
        "undecodable",
    ),
    # Envelopes
    "reply for another transfer id": (
        lambda xfer, step: honest(xfer + 1, step),
        ProtocolError,
        "another transfer",
    ),
    "data for another transfer id": (
        _frames(lambda x: data_message(x + 1, 0, FLOAT_BYTES)),
        ProtocolError,
        "another transfer",
    ),
    "reply in another protocol version": (
        lambda xfer, step: [[msgpack.packb({"v": 7, "op": "header", "id": xfer}), b""]],
        ProtocolError,
        "version 7",
    ),
    "unknown reply op": (
        lambda xfer, step: [[env("surprise", xfer)]],
        ProtocolError,
        "unknown reply",
    ),
    "garbage envelope": (lambda xfer, step: [[b"\xc1garbage"]], ProtocolError, "undecodable"),
    "error reply": (
        lambda xfer, step: [[env(wire.OP_ERROR, xfer, code="disallowed", msg="gone")]],
        RemoteError,
        "gone",
    ),
    # Integrity
    "checksum present but missing from the data": (
        _with(checksum="crc32"),
        IntegrityError,
        "checksum mismatch",
    ),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_sender(name: str, fake: Callable[[Script], FakeSender], receiver: ZMQTransport[Any]) -> None:
    script, error, fragment = HOSTILE[name]
    sender = fake(script)
    started = time.monotonic()
    with pytest.raises(error) as caught:
        fetch_from(receiver, sender)
    assert fragment in str(caught.value), caught.value
    # Refused as soon as the bad message arrived, not by the 5 s timeout.
    assert time.monotonic() - started < 4.0
    # The receiving transport is unharmed: the next (honest) fetch works.
    assert torch.equal(fetch_from(receiver, fake(honest))[0], FLOATS)


def test_sender_silent_after_header_times_out(
    fake: Callable[[Script], FakeSender], receiver: ZMQTransport[Any]
) -> None:
    sender = fake(lambda xfer, step: [header_message(xfer, step, tensors=[ENTRY], storages=[400])])
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out") as caught:
        fetch_from(receiver, sender, seconds=1.0)
    assert "data message 0" in str(caught.value) and f"step {STEP}" in str(caught.value)
    assert time.monotonic() - started < 1.0 + 1.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize(
    ("storages", "entry_shape"),
    [([2**40], [2**40]), ([2**39] * 100, [2**39]), ([2**50], [2**50])],
    ids=["one 1 TiB tensor", "a hundred 512 GiB storages", "1 PiB"],
)
def test_terabyte_claims_are_refused_before_allocating(
    storages: list[int],
    entry_shape: list[int],
    fake: Callable[[Script], FakeSender],
    receiver: ZMQTransport[Any],
) -> None:
    entries = [[i, "uint8", entry_shape, [1], 0, False, False] for i in range(len(storages))]

    def script(xfer: int, step: int) -> list[list[bytes]]:
        # Header only: a receiver that allocated first would then sit in the
        # allocation or wait for data; one that checks first fails at once.
        return [header_message(xfer, step, tensors=entries, storages=storages)]

    before = _rss_bytes()
    with pytest.raises(ProtocolError, match="more than the limit"):
        fetch_from(receiver, fake(script))
    assert _rss_bytes() - before < 64 * 1024 * 1024


def test_max_recv_bytes_option_is_enforced(fake: Callable[[Script], FakeSender]) -> None:
    small: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, max_recv_bytes=399)
    try:
        with pytest.raises(ProtocolError, match="400 bytes of tensors, more than the limit of 399"):
            fetch_from(small, fake(honest))
    finally:
        small.shutdown()


def test_too_many_storages_are_refused(fake: Callable[[Script], FakeSender], receiver: ZMQTransport[Any]) -> None:
    """A million zero-byte storages claim no memory but would cost an allocation each."""
    count = wire.MAX_TENSORS + 1
    sender = fake(lambda xfer, step: [header_message(xfer, step, tensors=[], storages=[0] * count)])
    with pytest.raises(ProtocolError, match="storages, more than"):
        fetch_from(receiver, sender)


def test_corrupted_frame_raises_integrity_error_naming_the_tensor(
    fake: Callable[[Script], FakeSender], receiver: ZMQTransport[Any]
) -> None:
    corrupted = bytearray(FLOAT_BYTES)
    corrupted[123] ^= 0x10  # one flipped bit

    def script(xfer: int, step: int) -> list[list[bytes]]:
        skeleton = ["d", [["weights", ["T", 0]], ["other", ["T", 1]]]]
        tensors = [ENTRY, [1, "int8", [4], [1], 0, False, False]]
        return [
            header_message(xfer, step, tensors=tensors, storages=[400, 4], skeleton=skeleton, checksum="crc32"),
            data_message(xfer, 0, bytes(corrupted), crc=zlib.crc32(FLOAT_BYTES)),
            data_message(xfer, 1, b"\x01\x02\x03\x04", crc=zlib.crc32(b"\x01\x02\x03\x04")),
            [env(wire.OP_END, xfer)],
        ]

    with pytest.raises(IntegrityError) as caught:
        fetch_from(receiver, fake(script))
    message = str(caught.value)
    assert "storages [0]" in message and "state['weights']" in message, message
    assert "other" not in message


def test_pickled_leaf_from_a_peer_is_refused_by_default(
    tmp_path: Any, fake: Callable[[Script], FakeSender], receiver: ZMQTransport[Any]
) -> None:
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.mkdir, (str(marker),))

    payload = pickle.dumps(Payload())

    def script(xfer: int, step: int) -> list[list[bytes]]:
        skeleton = ["l", [["T", 0], ["p", payload]]]
        return [
            header_message(xfer, step, tensors=[ENTRY], storages=[400], skeleton=skeleton),
            data_message(xfer, 0, FLOAT_BYTES),
            [env(wire.OP_END, xfer)],
        ]

    with pytest.raises(ProtocolError, match="pickled object"):
        fetch_from(receiver, fake(script))
    assert not marker.exists(), "the peer's pickle ran"


def test_sender_refuses_more_tensors_than_receivers_accept(
    monkeypatch: pytest.MonkeyPatch, receiver: ZMQTransport[Any]
) -> None:
    """The cap receivers enforce is checked at send_checkpoint too, with a clear error,
    instead of every receiver failing later (patched small: a million tensors is slow)."""
    monkeypatch.setattr(wire, "MAX_TENSORS", 10)
    with pytest.raises(ValueError, match="11 tensors; receivers accept at most 10"):
        receiver.send_checkpoint([1], 1, [torch.zeros(1) for _ in range(11)], TIMEOUT)
    receiver.send_checkpoint([1], 1, [torch.zeros(1) for _ in range(10)], TIMEOUT)


def test_parked_requests_from_one_peer_respect_the_per_peer_limit(receiver: ZMQTransport[Any]) -> None:
    """Requests parked before a step is staged start together when it is: one peer still gets
    at most 4 transfers, so it cannot take the sender's 64 slots from everyone else."""
    state = staged_state()
    sender: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, chunk_bytes=4096, pack_below=4096)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(sender.metadata())
        for xfer in range(100):
            sock.send(envelope(id=xfer, wait_ms=60_000, credit=1))
        deadline = time.monotonic() + 10
        while len(sender._server._scheduler.parked) < 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        sender.send_checkpoint([1], STEP, state, TIMEOUT)
        ops: list[tuple[str, Any]] = []
        while sock.poll(1000):
            message = msgpack.unpackb(sock.recv_multipart()[0])
            ops.append((message["op"], message.get("code")))
        assert ops.count(("header", None)) == 4
        assert ops.count(("error", wire.ERR_BUSY)) == 96
        assert_still_serves(sender, state, receiver)  # the 4 idle transfers hold no one else up
    finally:
        context.destroy(linger=0)
        sender.shutdown()
