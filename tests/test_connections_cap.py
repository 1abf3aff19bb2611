"""A peer cannot open connections without bound: each serving socket keeps at most so many (serve/connections.py).

The book's decisions are pure (descriptors and an explicit time). Then modified
peer code on real sockets: DEALERs from one address (127.0.0.3) that complete
ZeroMQ's handshake and never send a request, and do not reconnect once closed
(so what the source keeps open can be counted), against a source on
127.0.0.1. Before the caps every one of them stayed open, for as long as the
attacker liked (libzmq's handshake timeout does not apply: the handshake
completed). Now the source keeps at most the per-host cap of them; under the
total cap, an idle one makes room for an honest receiver, which lands its
state bit-exact; one WARNING names the attacker's address.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import zmq

from zmqtransport import ZMQTransport
from zmqtransport.serve import connections
from zmqtransport.serve.connections import ConnectionBook

from .conftest import assert_same

pytestmark = pytest.mark.timeout(60)

ATTACKER = "127.0.0.3"
TIMEOUT = timedelta(seconds=30)


def test_a_connection_beyond_the_cap_is_refused_while_the_others_are_young_or_busy() -> None:
    book = ConnectionBook(limit=3, per_host=10, idle=5.0)
    for fd in (10, 11, 12):
        assert book.accepted(fd, "10.0.0.9", 0.0, busy=()) == (None, "")
    closing, why = book.accepted(13, "10.0.0.8", 1.0, busy=())
    assert closing == 13 and "refused" in why  # the others were accepted a second ago
    book.closed(13)
    # Idle long enough: the one idle longest makes room, unless something runs on it.
    book.seen(10, 2.0)
    closing, why = book.accepted(14, "10.0.0.8", 9.0, busy={11})
    assert closing == 12 and "idle" in why
    book.closed(12)
    assert len(book) == 3


def test_one_host_keeps_at_most_its_share_and_others_still_get_in() -> None:
    book = ConnectionBook(limit=100, per_host=2, idle=5.0)
    assert book.accepted(1, "10.0.0.9", 0.0, busy=())[0] is None
    assert book.accepted(2, "10.0.0.9", 0.0, busy=())[0] is None
    assert book.accepted(3, "10.0.0.9", 0.0, busy=())[0] == 3  # a third from that host
    book.closed(3)
    assert book.accepted(4, "10.0.0.7", 0.0, busy=())[0] is None  # another host is not held back
    assert book.accepted(5, "10.0.0.9", 6.0, busy=())[0] == 1  # the host's own idle one makes room


def _established(port: int, local: str) -> int:
    """TCP connections from ``local`` to ``port`` the kernel holds established, seen from the connecting side.

    (The source's ROUTER listens dual-stack: its ends are in /proc/net/tcp6; the attacker's in /proc/net/tcp.)
    """
    want = "".join(f"{int(part):02X}" for part in reversed(local.split(".")))
    count = 0
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            mine, theirs, state = line.split()[1:4]
            if mine.split(":")[0] == want and int(theirs.split(":")[1], 16) == port and state == "01":
                count += 1
    return count


def _silent_dealers(port: int, count: int) -> tuple[zmq.Context[Any], list[zmq.Socket[Any]]]:
    """Modified peer code: DEALERs from ATTACKER that complete the handshake, never send, never reconnect."""
    context: zmq.Context[Any] = zmq.Context()
    dealers = []
    for _ in range(count):
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RECONNECT_IVL, -1)  # once closed, it stays closed: what is open can be counted
        dealer.connect(f"tcp://{ATTACKER}:0;127.0.0.1:{port}")
        dealers.append(dealer)
    return context, dealers


def _settled(port: int, seconds: float) -> int:
    """The attacker's established connections once the source has had ``seconds`` to act on them."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # a hang detector only: the count is read at the end
        time.sleep(0.1)
    return _established(port, ATTACKER)


def _attack(caplog: pytest.LogCaptureFixture, silent: int, cap: int, settle: float) -> None:
    """A source serving a small state; ``silent`` silent connections from ATTACKER, then an honest receive."""
    want = {"w": torch.arange(1 << 18, dtype=torch.float32), "step": 1}
    source: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1")  # reads the patched caps
    honest: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1")
    context = None
    try:
        source.send_checkpoint([1], 1, want, TIMEOUT)
        port = int(source.metadata().split(":")[2].split("?")[0])
        with caplog.at_level(logging.WARNING, logger="zmqtransport.serve"):
            context, _ = _silent_dealers(port, silent)
            open_now = _settled(port, settle)
            assert open_now <= cap, f"the source keeps {open_now} silent connections of one host open"
            # An honest receiver (from 127.0.0.1) gets in and lands its state.
            assert_same(honest.recv_checkpoint(0, source.metadata(), 1, TIMEOUT), want)
        refused = [r for r in caplog.records if "closed a connection of" in r.getMessage()]
        assert len(refused) == 1, [r.getMessage() for r in refused]  # one WARNING, the rest counted at DEBUG
        assert ATTACKER in refused[0].getMessage()
    finally:
        if context is not None:
            context.destroy(linger=0)
        honest.shutdown()
        source.shutdown()


def test_one_host_cannot_open_more_than_its_share(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(connections, "MAX_PER_HOST", 16)
    _attack(caplog, silent=48, cap=16, settle=2.0)


def test_a_full_socket_makes_room_for_a_newcomer_by_closing_an_idle_connection(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The total cap binds (the attacker is one host, but under its share): the honest
    # receiver's connection gets in once the silent ones have been idle for the bound.
    monkeypatch.setattr(connections, "MAX_CONNECTIONS", 24)
    monkeypatch.setattr(connections, "MAX_PER_HOST", 1000)
    monkeypatch.setattr(connections, "IDLE_CONNECTION", 1.0)
    _attack(caplog, silent=48, cap=24, settle=2.0)
