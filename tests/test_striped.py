"""Striped receives on loopback: several connections, paths that die or freeze mid-transfer.

A path is made to fail with :class:`Relay`, a TCP forwarder in front of the
source's port: the receiver is given its address as one of the source's
paths, and it can cut its connections (closed with a reset: the kernel's
answer to a killed process) or freeze them (open but silent: a dead link)
once it has forwarded some bytes. The lab tests (tests/test_lab.py) do the
same with real links taken down.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

from zmqtransport import ZMQTransport
from zmqtransport.errors import ConnectionLostError
from zmqtransport.serve import outbox

LOOPBACK = "127.0.0.1"
TIMEOUT = timedelta(seconds=30)


class Relay:
    """Forwards TCP connections to ``target``; after ``after`` bytes towards the client, fails as told.

    ``how``: ``cut`` closes every connection and forwards no new one, ``freeze``
    keeps them open but forwards nothing more, ``blip`` closes every connection
    once and forwards new ones again.
    """

    def __init__(self, target: tuple[str, int], after: int | None = None, how: str = "cut") -> None:
        self.target, self.after, self.how = target, after, how
        self.forwarded = 0
        self.failed = threading.Event()
        self.blipped = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                client, _ = self._listener.accept()
                server = socket.create_connection(self.target)
                with self._lock:
                    self._sockets += [client, server]
                threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
                threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, to_client: bool) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                if self.failed.is_set():
                    if self.how == "freeze":
                        self._stop.wait(0.05)  # hold the connection open, forward nothing
                        continue
                    return
                data = source.recv(1 << 16)
                if not data:
                    return
                sink.sendall(data)
                if to_client:
                    with self._lock:
                        self.forwarded += len(data)
                        due = self.after is not None and self.forwarded >= self.after
                    if due and self.how == "blip":
                        # Every connection drops at once, and new ones are
                        # forwarded again: what a source's forced rebind does.
                        self.after = None
                        self.blipped.set()
                        self.close_connections()
                        return
                    if due and not self.failed.is_set():
                        self.failed.set()
                        if self.how == "cut":
                            self.close_connections()
                        return

    def close_connections(self) -> None:
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                # Linger 0: the close sends a reset, as for a killed process.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.close()

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self.close_connections()


@pytest.fixture
def relays() -> Any:
    made: list[Relay] = []

    def make(target: tuple[str, int], after: int | None = None, how: str = "cut") -> Relay:
        made.append(Relay(target, after, how))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


def state(megabytes: int = 32, seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(megabytes << 18, generator=g),
        "small": [torch.randn(n, generator=g) for n in (1, 100, 5000)],
        "ints": torch.arange(300_000, dtype=torch.int64),
        "step": seed,
    }


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(same(a, b) for a, b in zip(got, want, strict=True))
    return bool(got == want)


def with_paths(sender: ZMQTransport, *ports: int) -> str:
    """The sender's metadata with further paths (relays in front of it) appended."""
    metadata = sender.metadata()
    assert "?" not in metadata
    return metadata + "?paths=" + ",".join(f"{LOOPBACK}:{port}" for port in ports)


def port_of(sender: ZMQTransport) -> int:
    return int(sender.metadata().rsplit(":", 1)[1])


def test_two_paths_both_carry_data_bit_exact(make_transport: Any, relays: Any) -> None:
    sender = make_transport()
    relay = relays((LOOPBACK, port_of(sender)))
    receiver = make_transport()
    want = state()
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    got = receiver.recv_checkpoint(0, with_paths(sender, relay.port), 1, TIMEOUT)
    assert same(got, want)
    stats = receiver.last_recv_stats
    assert stats.streams == 2
    assert len(stats.paths) == 2 and all(n > 0 for n in stats.paths.values())
    assert sum(stats.paths.values()) == stats.bytes


def test_streams_one_uses_one_connection(make_transport: Any, relays: Any) -> None:
    sender = make_transport()
    relay = relays((LOOPBACK, port_of(sender)))
    receiver = make_transport(streams=1)
    want = state(8)
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    assert same(receiver.recv_checkpoint(0, with_paths(sender, relay.port), 1, TIMEOUT), want)
    stats = receiver.last_recv_stats
    assert stats.streams == 1 and list(stats.paths) == [sender.metadata()]
    assert relay.forwarded < 1024  # the greeting of the race between paths, no data


def test_several_streams_over_one_path(make_transport: Any) -> None:
    sender = make_transport()
    receiver = make_transport(streams=3)
    want = state(16)
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    assert same(receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT), want)
    stats = receiver.last_recv_stats
    assert stats.streams == 3 and stats.paths == {sender.metadata(): stats.bytes}
    served = sender.last_send_stats
    assert served is not None and served.bytes < stats.bytes  # served as spans, each recorded


def test_in_place_targets_are_written_by_every_stream(make_transport: Any, relays: Any) -> None:
    sender = make_transport()
    relay = relays((LOOPBACK, port_of(sender)))
    mine = state(16, seed=5)
    receiver = make_transport(state_dict=lambda: mine)
    want = state(16, seed=6)
    big = mine["big"]
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    got = receiver.recv_checkpoint(0, with_paths(sender, relay.port), 1, TIMEOUT)
    assert got["big"] is big and same(got, want)
    assert receiver.last_recv_stats.in_place_bytes >= big.numel() * 4


@pytest.mark.parametrize("how", ["cut", "freeze"])
def test_a_path_failing_mid_transfer_is_replaced_by_the_other(make_transport: Any, relays: Any, how: str) -> None:
    # No stall bound: a frozen path is never declared dead, its spans are
    # taken over by the live path once it has nothing left to do.
    sender = make_transport(checksum=True)
    relay = relays((LOOPBACK, port_of(sender)), after=6 << 20, how=how)
    receiver = make_transport(stall_timeout=None, timeout=timedelta(seconds=20))
    want = state(48, seed=2)
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    # The failing path is the preferred one: the one a single connection would use.
    metadata = f"tcp://{LOOPBACK}:{relay.port}?paths={LOOPBACK}:{port_of(sender)}"
    got = receiver.recv_checkpoint(0, metadata, 1, timedelta(seconds=20))
    assert relay.failed.is_set()
    assert same(got, want)
    stats = receiver.last_recv_stats
    direct = stats.paths[sender.metadata()]
    assert direct > stats.bytes // 2  # the surviving path carried most of it
    assert stats.paths.get(f"tcp://{LOOPBACK}:{relay.port}", 0) <= relay.forwarded


def test_every_path_failing_fails_the_receive_naming_them(make_transport: Any, relays: Any) -> None:
    sender = make_transport()
    target = (LOOPBACK, port_of(sender))
    first, second = relays(target, after=2 << 20), relays(target, after=2 << 20)
    receiver = make_transport()
    sender.send_checkpoint([1], 1, state(32), TIMEOUT)
    metadata = f"tcp://{LOOPBACK}:{first.port}?paths={LOOPBACK}:{second.port}"
    with pytest.raises(ConnectionLostError) as info:
        receiver.recv_checkpoint(0, metadata, 1, TIMEOUT)
    assert str(first.port) in str(info.value) and str(second.port) in str(info.value)
    # The receiver is usable again at once.
    assert same(receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT), state(32))


def test_a_sender_without_span_fetches_is_read_over_one_connection(
    make_transport: Any, relays: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A sender of an earlier release: its header envelope carries no staging id.
    plain = outbox.wire.header_envelope
    monkeypatch.setattr(outbox.wire, "header_envelope", lambda xfer, *_: plain(xfer))
    sender = make_transport()
    relay = relays((LOOPBACK, port_of(sender)))
    receiver = make_transport()
    want = state(8)
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    assert same(receiver.recv_checkpoint(0, with_paths(sender, relay.port), 1, TIMEOUT), want)
    assert receiver.last_recv_stats.streams == 1


def test_streams_option_is_checked() -> None:
    for bad in (0, -1, 17, 2.0, "2", True):
        with pytest.raises(ValueError, match="streams="):
            ZMQTransport(TIMEOUT, streams=bad, bind_host=LOOPBACK)  # type: ignore[arg-type]


def test_a_striped_receive_leaves_no_garbage_cycle(make_transport: Any, relays: Any) -> None:
    # A cycle through the receive keeps its parsed header (objects per tensor)
    # alive until a collection: tens of milliseconds for many tensors.
    import gc

    sender = make_transport()
    relay = relays((LOOPBACK, port_of(sender)))
    receiver = make_transport()
    want = {"many": [torch.full((4,), float(i)) for i in range(2000)]}
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    metadata = with_paths(sender, relay.port)
    receiver.recv_checkpoint(0, metadata, 1, TIMEOUT)  # warm: imports, caches
    gc.collect()
    gc.disable()
    try:
        got = receiver.recv_checkpoint(0, metadata, 1, TIMEOUT)
        assert receiver.last_recv_stats.streams == 2
        del got
        assert gc.collect() < 2000
    finally:
        gc.enable()


def test_every_connection_dropping_at_once_and_coming_back_resumes(make_transport: Any, relays: Any) -> None:
    # A source that closes and rebinds its ROUTER (to release frames a stuck
    # receiver holds) drops every connection at once; the DEALERs reconnect
    # within milliseconds and the receive goes on.
    sender = make_transport(checksum=True)
    relay = relays((LOOPBACK, port_of(sender)), after=8 << 20, how="blip")
    receiver = make_transport(streams=2)
    want = state(32, seed=3)
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    got = receiver.recv_checkpoint(0, f"tcp://{LOOPBACK}:{relay.port}", 1, TIMEOUT)
    assert relay.blipped.is_set()
    assert same(got, want)


def test_a_frozen_path_does_not_make_the_receiving_loop_spin(
    make_transport: Any, relays: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The frozen path's span goes quiet while the live path is busy with its own: nothing can take it
    # over until the live path has room, which a message arriving tells. Meanwhile the loop must wait
    # on its sockets; it used to pass again at once, as long as the live path stayed busy.
    from zmqtransport.fetch import owner

    waits: list[int] = []
    wait_ms = owner.Owner._wait_ms

    def recorded(self: owner.Owner, now: float) -> int:
        waits.append(wait_ms(self, now))
        return waits[-1]

    monkeypatch.setattr(owner.Owner, "_wait_ms", recorded)
    sender = make_transport(checksum=True)
    relay = relays((LOOPBACK, port_of(sender)), after=6 << 20, how="freeze")
    receiver = make_transport(stall_timeout=None, timeout=timedelta(seconds=20))
    want = state(96, seed=3)
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    metadata = f"tcp://{LOOPBACK}:{relay.port}?paths={LOOPBACK}:{port_of(sender)}"
    got = receiver.recv_checkpoint(0, metadata, 1, timedelta(seconds=20))
    assert relay.failed.is_set() and same(got, want)
    zero = waits.count(0)
    assert zero <= max(20, len(waits) // 4), f"{zero} of {len(waits)} passes of the loop did not wait"
