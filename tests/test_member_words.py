"""What a swarm member says is checked where it enters: an offer the next receivers cannot use is not believed.

A member's relay offer is a metadata string the source hands to the receivers
that come after it. Modified peer code in a real process offers one that asks
for CurveZMQ of a source (and receivers) without it: believed, every later
receiver was sent there and its ``recv_checkpoint`` raised ``ValueError`` at
once, nothing landed. The source now believes an offer only with its own
security settings (serve/swarm.py, ``usable_params``), so the honest receiver
is served, bit-exact. On loopback, with the source chaining local receivers as
the tests of the swarm do (``RELAY_LOOPBACK``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import pytest
import torch
import zmq

from zmqtransport import ZMQTransport, digests, relayed, security, wire
from zmqtransport.net import parse_metadata
from zmqtransport.serve import swarm

from .conftest import Processes, assert_same

pytestmark = pytest.mark.timeout(120)

LOOPBACK = "127.0.0.1"
TIMEOUT = timedelta(seconds=30)


def _offer_what_nobody_can_use(metadata: str, joined: Any, seconds: float) -> None:
    """Modified peer code: a header fetch whose relay offer asks for CurveZMQ, then it stays connected."""
    address = parse_metadata(metadata)
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{address.host}:{address.port}")
    listener = context.socket(zmq.ROUTER)  # something listens where it offers, as a member would
    port = listener.bind_to_random_port(f"tcp://{LOOPBACK}")
    key = quote(security.generate_keypair().public.decode(), safe="")
    offer = f"tcp://{LOOPBACK}:{port}?curve={key}"
    dealer.send(wire.fetch_request(1, 1, 1000, 4, False, header_only=True, relay=offer, verify=digests.offered()))
    dealer.poll(10_000)
    joined.set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:  # bounded: it stops by itself
        time.sleep(0.05)
    context.destroy(linger=0)


@contextlib.contextmanager
def _a_member_offering_curve(processes: Processes) -> Iterator[tuple[ZMQTransport[Any], ZMQTransport[Any], Any]]:
    """A plain source serving step 1, an honest receiver, and the modified member (its own process) joined."""
    want = {"w": torch.arange(1 << 20, dtype=torch.float32), "step": 1}
    source: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    honest: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    joined = processes.Event()
    member = None
    try:
        source.send_checkpoint([1, 2], 1, want, TIMEOUT)
        member = processes.Process(target=_offer_what_nobody_can_use, args=(source.metadata(), joined, 20.0))
        member.start()
        assert joined.wait(30), "the modified member never got its header"
        yield source, honest, want
    finally:
        if member is not None:
            member.kill()
            member.join(10)
        honest.shutdown()
        source.shutdown()


def test_an_offer_the_next_receivers_cannot_use_fails_nobody(
    processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)  # chain local receivers, as across hosts
    with _a_member_offering_curve(processes) as (source, honest, want):
        assert source._server._scheduler.swarm.members == [], "an offer nobody can use was believed"
        assert_same(honest.recv_checkpoint(0, source.metadata(), 1, TIMEOUT), want)


def test_an_offer_the_source_believed_and_this_receiver_cannot_use_drops_that_peer_only(
    processes: Processes, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The receiving side checks a peer's offer where it enters too (issue 34): a source that believes any
    offer (an earlier release; here the same member's offer of CurveZMQ, believed) named it to the honest
    receiver, whose ``recv_checkpoint`` raised ``ValueError`` at once. Now that peer is dropped, with one
    WARNING naming it, and the receive lands the source's bytes."""
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)
    monkeypatch.setattr(swarm, "usable_params", lambda params, curve: True)  # a source that believes any offer
    with _a_member_offering_curve(processes) as (source, honest, want):
        [member_of] = source._server._scheduler.swarm.members  # believed, as an earlier source would
        assert "curve=" in member_of.at
        with caplog.at_level(logging.WARNING, logger="zmqtransport.fetch"):
            assert_same(honest.recv_checkpoint(0, source.metadata(), 1, TIMEOUT), want)
        named = [r.getMessage() for r in caplog.records if "cannot fetch from a peer" in r.getMessage()]
        assert len(named) == 1 and "curve" in named[0].lower(), named
