"""Security options (issue 5): pickle refusal, CurveZMQ, binding one interface.

Every test here checks a protection by showing what an attacker (a peer without
the job secret, a plain ZeroMQ or TCP client, a passive observer of the bytes)
gets: nothing, while authorised peers keep being served. All traffic stays on
loopback addresses.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import msgpack
import pytest
import torch
import zmq

from zmqtransport import RemoteError, ZMQTransport, security, wire
from zmqtransport.net import PeerAddress, parse_metadata

LOOPBACK = "127.0.0.1"
TIMEOUT = timedelta(seconds=10)
SHORT = timedelta(seconds=1.5)
PATTERN = b"TOP-SECRET-WEIGHTS|"


def secret_state() -> dict[str, Any]:
    """A state whose bytes are easy to spot on the wire."""
    payload = bytearray(PATTERN * (2**20 // len(PATTERN)))
    return {"w": torch.frombuffer(payload, dtype=torch.uint8), "step": 1}


@pytest.fixture
def made() -> Iterator[list[ZMQTransport[Any]]]:
    transports: list[ZMQTransport[Any]] = []
    yield transports
    for transport in transports:
        transport.shutdown()


def make(made: list[ZMQTransport[Any]], **options: Any) -> ZMQTransport[Any]:
    options.setdefault("bind_host", LOOPBACK)
    transport: ZMQTransport[Any] = ZMQTransport(options.pop("timeout", TIMEOUT), **options)
    made.append(transport)
    return transport


def fetch_ok(receiver: ZMQTransport[Any], sender: ZMQTransport[Any], step: int = 1) -> None:
    got = receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT)
    assert torch.equal(got["w"], secret_state()["w"]) and got["step"] == 1


# ----------------------------------------------------------------------------- pickle


class Opaque:
    """No pickle-free encoding exists for this."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_pickle_needs_both_sides_to_opt_in(made: list[ZMQTransport[Any]]) -> None:
    plain_sender = make(made)
    with pytest.raises(TypeError, match=r"state\['extra'\]"):
        plain_sender.send_checkpoint([1], 1, {"extra": Opaque(1)}, TIMEOUT)

    pickling_sender = make(made, allow_pickle=True)
    pickling_sender.send_checkpoint([1], 1, {"extra": Opaque(7), "w": torch.ones(3)}, TIMEOUT)
    with pytest.raises(RemoteError) as caught:
        make(made).recv_checkpoint(0, pickling_sender.metadata(), 1, TIMEOUT)
    assert caught.value.code == wire.ERR_PICKLE
    got = make(made, allow_pickle=True).recv_checkpoint(0, pickling_sender.metadata(), 1, TIMEOUT)
    assert got["extra"].value == 7


def test_a_receiver_that_lies_about_pickle_still_cannot_unpickle(
    made: list[ZMQTransport[Any]],
) -> None:
    """The sender's check is a courtesy; the receiver's own refusal is what protects it.
    A hand-made fetch claiming pickle=True gets the header, and a default receiver
    would still refuse that header (tests/test_robustness.py checks that side)."""
    sender = make(made, allow_pickle=True)
    sender.send_checkpoint([1], 1, {"extra": OrderedDict(a=Opaque(1))}, TIMEOUT)
    context = zmq.Context()
    try:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(sender.metadata())
        sock.send(wire.fetch_request(1, 1, 1000, 4, True, header_only=True))
        assert sock.poll(5000)
        frames = sock.recv_multipart()
        body = msgpack.unpackb(frames[1])
        from zmqtransport.codec import skeleton

        with pytest.raises(wire.ProtocolError, match="pickled object"):
            skeleton.index_skeleton(body["skeleton"], len(body["tensors"]), allow_pickle=False)
    finally:
        context.destroy(linger=0)


# ----------------------------------------------------------------------------- CURVE keys


def test_key_helpers() -> None:
    pair = security.generate_keypair()
    assert len(pair.public) == 40 and len(pair.secret) == 40
    assert "secret=<hidden>" in repr(pair) and pair.secret.decode() not in repr(pair)
    secret = security.new_job_secret()
    derived = security.client_keypair_from_secret(secret)
    assert derived == security.client_keypair_from_secret(secret.encode())  # deterministic
    assert derived != security.client_keypair_from_secret(security.new_job_secret())
    assert zmq.curve_public(derived.secret) == derived.public
    with pytest.raises(ValueError, match="at least 16 bytes"):
        security.client_keypair_from_secret("short")
    for bad in ("x" * 39, "é" * 40, b"\x00" * 40):
        with pytest.raises(ValueError):
            security.check_public_key(bad)


def test_curve_options_are_validated(made: list[ZMQTransport[Any]]) -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        make(made, curve_secret="too-short")
    with pytest.raises(ValueError, match="allowed client key"):
        make(made, curve_allowed_clients=["not-a-key"])
    one, other = security.generate_keypair(), security.generate_keypair()
    with pytest.raises(ValueError, match="does not belong"):
        make(made, curve_allowed_clients=[one.public], curve_client_keypair=(one.public, other.secret))
    with pytest.raises(ValueError, match="no client may fetch"):
        make(made, curve_client_keypair=(one.public, one.secret))


def test_server_key_travels_in_the_metadata(made: list[ZMQTransport[Any]]) -> None:
    fixed = security.generate_keypair()
    sender = make(
        made,
        curve_secret=security.new_job_secret(),
        curve_server_keypair=(fixed.public, fixed.secret),
    )
    address = parse_metadata(sender.metadata())
    assert address.params == {security.METADATA_KEY: fixed.public.decode()}
    assert address.endpoint == f"tcp://{LOOPBACK}:{sender.address.port}"
    # A fresh key pair per transport otherwise.
    keys = {parse_metadata(make(made, curve_secret="s" * 16).metadata()).params["curve"] for _ in range(2)}
    assert len(keys) == 2


# ----------------------------------------------------------------------------- CURVE in use


def test_only_holders_of_the_job_secret_are_served(made: list[ZMQTransport[Any]]) -> None:
    secret = security.new_job_secret()
    sender = make(made, curve_secret=secret, timeout=SHORT)
    sender.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    fetch_ok(make(made, curve_secret=secret), sender)

    outsider = make(made, curve_secret=security.new_job_secret())
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        outsider.recv_checkpoint(0, sender.metadata(), 1, SHORT)
    assert time.monotonic() - started < SHORT.total_seconds() + 2
    assert sender._zap is not None and sender._zap.refused >= 1

    # The server keeps serving the job after refusing the outsider.
    fetch_ok(make(made, curve_secret=secret), sender)
    assert sender._server.alive


def test_allowed_client_key_list(made: list[ZMQTransport[Any]]) -> None:
    allowed, stranger = security.generate_keypair(), security.generate_keypair()
    sender = make(made, curve_allowed_clients=[allowed.public.decode()])
    sender.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    fetch_ok(make(made, curve_allowed_clients=[allowed.public], curve_client_keypair=allowed), sender)
    refused = make(
        made,
        curve_allowed_clients=[stranger.public],
        curve_client_keypair=(stranger.public, stranger.secret),
    )
    with pytest.raises(TimeoutError):
        refused.recv_checkpoint(0, sender.metadata(), 1, SHORT)


def test_job_secret_from_the_environment(made: list[ZMQTransport[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(security.CURVE_SECRET_ENV, security.new_job_secret())
    sender = make(made)
    assert "?curve=" in sender.metadata()
    sender.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    fetch_ok(make(made), sender)
    monkeypatch.delenv(security.CURVE_SECRET_ENV)
    with pytest.raises(ValueError, match="requires CurveZMQ"):
        make(made).recv_checkpoint(0, sender.metadata(), 1, SHORT)


def test_mismatched_configurations_fail_clearly(made: list[ZMQTransport[Any]]) -> None:
    secret = security.new_job_secret()
    curve_side, plain_side = make(made, curve_secret=secret), make(made)
    curve_side.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    plain_side.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    with pytest.raises(ValueError, match=r"requires CurveZMQ: pass curve_secret="):
        plain_side.recv_checkpoint(0, curve_side.metadata(), 1, SHORT)
    # CURVE on means never in the clear, even towards a peer that offers it.
    with pytest.raises(ValueError, match="refusing to fetch a checkpoint in the clear"):
        curve_side.recv_checkpoint(0, plain_side.metadata(), 1, SHORT)
    # A metadata string with a broken key is refused before connecting.
    broken = PeerAddress(LOOPBACK, curve_side.address.port, {"curve": "x" * 12}).to_metadata()
    with pytest.raises(ValueError, match="z85"):
        make(made, curve_secret=secret).recv_checkpoint(0, broken, 1, SHORT)


def send_if_accepted(sock: zmq.Socket[Any], frame: bytes) -> None:
    """Send ``frame`` unless the socket has no peer to queue it for within a second: a DEALER whose
    handshake the server refused may already have dropped its pipe, and then a plain send blocks forever
    (seen once in CI, the oldest environment). Either way nothing may come back."""
    sock.setsockopt(zmq.SNDTIMEO, 1000)
    with contextlib.suppress(zmq.Again):
        sock.send(frame)


def test_plain_clients_get_nothing_from_a_curve_server(made: list[ZMQTransport[Any]]) -> None:
    secret = security.new_job_secret()
    sender = make(made, curve_secret=secret)
    sender.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    endpoint = parse_metadata(sender.metadata()).endpoint
    context = zmq.Context()
    try:
        # A plain ZeroMQ peer: the handshake fails (NULL vs CURVE), no reply.
        plain = context.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(endpoint)
        send_if_accepted(plain, wire.fetch_request(1, 1, 1000, 16, False))
        assert not plain.poll(1000), "a plain client got a reply"
        # A CURVE peer that knows the server key but holds an unknown client key.
        rogue = context.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        stranger = security.generate_keypair()
        rogue.curve_secretkey, rogue.curve_publickey = stranger.secret, stranger.public
        rogue.curve_serverkey = parse_metadata(sender.metadata()).params["curve"].encode()
        rogue.connect(endpoint)
        send_if_accepted(rogue, wire.fetch_request(2, 1, 1000, 16, False))
        assert not rogue.poll(1000), "an unauthorised CURVE client got a reply"
    finally:
        context.destroy(linger=0)
    # Raw TCP speaking the NULL mechanism is dropped during the handshake.
    with socket.create_connection((LOOPBACK, sender.address.port), timeout=5) as conn:
        greeting = b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32
        conn.sendall(greeting)
        closed = False
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not closed:
            try:
                closed = conn.recv(4096) == b""
            except (TimeoutError, ConnectionResetError):
                closed = True
        assert closed, "the CURVE server kept a NULL-mechanism connection"
    fetch_ok(make(made, curve_secret=secret), sender)


def test_without_a_zap_handler_nobody_is_served(made: list[ZMQTransport[Any]]) -> None:
    """Fail closed: if the handler is gone, libzmq refuses clients instead of admitting all."""
    secret = security.new_job_secret()
    sender = make(made, curve_secret=secret)
    assert sender._zap is not None
    sender._zap.close()
    sender.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    with pytest.raises(TimeoutError):
        make(made, curve_secret=secret).recv_checkpoint(0, sender.metadata(), 1, SHORT)


class RecordingProxy:
    """A loopback TCP relay that keeps a copy of every byte it forwards, both ways."""

    def __init__(self, target_port: int) -> None:
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._target = target_port
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((LOOPBACK, self._target))
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(1 << 16):
                with self._lock:
                    self.seen += chunk
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_what_an_eavesdropper_sees(curve: bool, made: list[ZMQTransport[Any]]) -> None:
    """Plain: the weights cross the wire verbatim. CURVE: not a trace of them."""
    options = {"curve_secret": "job-secret-0123456789"} if curve else {}
    sender = make(made, **options)
    sender.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    proxy = RecordingProxy(sender.address.port)
    try:
        address = parse_metadata(sender.metadata())
        via_proxy = PeerAddress(LOOPBACK, proxy.port, address.params).to_metadata()
        got = make(made, **options).recv_checkpoint(0, via_proxy, 1, TIMEOUT)
        assert torch.equal(got["w"], secret_state()["w"])
    finally:
        proxy.close()
    assert len(proxy.seen) > 2**20  # the whole checkpoint went through the relay
    assert (PATTERN * 2 in proxy.seen) is not curve


def test_forced_rebind_keeps_curve(made: list[ZMQTransport[Any]]) -> None:
    """The ROUTER rebuilt after a stalled receiver is a CURVE server again: the
    Server re-applies the security options to every socket it makes."""
    secret = security.new_job_secret()
    timeout = timedelta(seconds=1.5)
    sender = make(made, curve_secret=secret, timeout=timeout)
    big = {"w": torch.ones(16 * 2**20), "step": 1}  # 64 MiB: enough to stall on
    sender.send_checkpoint([1], 1, big, timeout)
    endpoint = parse_metadata(sender.metadata()).endpoint
    server_key = parse_metadata(sender.metadata()).params["curve"].encode()
    client = security.client_keypair_from_secret(secret)
    context = zmq.Context()
    try:
        staller = context.socket(zmq.DEALER)
        staller.setsockopt(zmq.LINGER, 0)
        staller.setsockopt(zmq.RCVHWM, 1)
        staller.setsockopt(zmq.RCVBUF, 4096)
        staller.curve_secretkey, staller.curve_publickey = client.secret, client.public
        staller.curve_serverkey = server_key
        staller.connect(endpoint)
        staller.send(wire.fetch_request(5, 1, 1000, wire.MAX_CREDIT, False))
        time.sleep(0.5)
        started = time.monotonic()
        sender.disallow_checkpoint()
        assert time.monotonic() - started < timeout.total_seconds() + 5
        sender.send_checkpoint([1], 2, secret_state(), timeout)
        # After the rebind: plain clients still get nothing ...
        plain = context.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(endpoint)
        plain.send(wire.fetch_request(6, 2, 1000, 16, False))
        assert not plain.poll(1000), "the rebuilt ROUTER served a plain client"
        assert not staller.closed  # referenced until here: a collected socket would unstall
    finally:
        context.destroy(linger=0)
    # ... and the job still is.
    fetch_ok(make(made, curve_secret=secret), sender, step=2)


def test_curve_transports_leave_no_threads_behind() -> None:
    before = threading.active_count()
    secret = security.new_job_secret()
    for _ in range(3):
        a: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, curve_secret=secret)
        b: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, curve_secret=secret)
        a.send_checkpoint([1], 1, secret_state(), TIMEOUT)
        fetch_ok(b, a)
        a.shutdown()
        b.shutdown()
    assert threading.active_count() <= before


# ----------------------------------------------------------------------------- bind one interface


def _connectable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.settimeout(2)
        return probe.connect_ex((host, port)) == 0


def test_bind_host_listens_on_that_interface_only(made: list[ZMQTransport[Any]]) -> None:
    """127.0.0.1 and 127.0.0.2 are both loopback, but distinct addresses: a socket bound
    to the first is not reachable through the second; one bound to all interfaces is."""
    one = make(made, bind_host="127.0.0.1")
    assert one.metadata().startswith("tcp://127.0.0.1:")
    assert _connectable("127.0.0.1", one.address.port)
    assert not _connectable("127.0.0.2", one.address.port)

    everywhere = make(made, bind_host="*", advertise_host="127.0.0.2")
    assert _connectable("127.0.0.2", everywhere.address.port)
    everywhere.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    fetch_ok(make(made), everywhere)  # through 127.0.0.2, as advertised


def test_bind_host_ipv6_loopback(made: list[ZMQTransport[Any]]) -> None:
    if not socket.has_ipv6 or not _ipv6_loopback_works():
        pytest.skip("no IPv6 loopback on this machine")
    sender = make(made, bind_host="::1")
    assert sender.metadata().startswith("tcp://[::1]:")
    assert not _connectable("127.0.0.1", sender.address.port)
    sender.send_checkpoint([1], 1, secret_state(), TIMEOUT)
    fetch_ok(make(made), sender)


def _ipv6_loopback_works() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_environment_does_not_leak_a_secret_into_metadata_or_repr(
    made: list[ZMQTransport[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "env-secret-" + os.urandom(8).hex()
    monkeypatch.setenv(security.CURVE_SECRET_ENV, secret)
    transport = make(made)
    derived = security.client_keypair_from_secret(secret)
    for text in (transport.metadata(), repr(transport)):
        assert secret not in text and derived.secret.decode() not in text
