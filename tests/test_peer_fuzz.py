"""Nothing a peer sends can fail a receive (issue 34): every peer-derived field, fuzzed against a real receive.

A swarm member is only a helper: whatever it answers (a have reply, a span
reply, anything else on its connection), malformed, oversized, of the wrong
type or contradicting itself or the plan, costs the receive that peer and no
more: the peer is dropped with one WARNING naming it, and the rest comes from
the source, bit-exact. Here the peer is a raw ROUTER on loopback that offered
to relay to a real source (a header fetch with ``relay=``), so the source
names it to an honest receiver (``RELAY_LOOPBACK``, as tests/test_relay.py
does); it answers every question about what it holds, and every span fetch,
with one fault. Its offer is usable; offers that are not are played in
tests/test_member_words.py. The source's own replies stay errors
(tests/test_faults.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import zmq

from zmqtransport import ZMQTransport, digests, relayed, wire
from zmqtransport.net import parse_metadata

from .conftest import assert_same

pytestmark = pytest.mark.timeout(120)

LOOPBACK = "127.0.0.1"
TIMEOUT = timedelta(seconds=20)
CHUNK = 64 << 10  # 64 messages of the 4 MiB state: the receive asks the peer for several spans
V = wire.PROTOCOL_VERSION

# (request, messages, chunk) -> the frames the fake peer answers with (None: nothing).
Answer = Callable[[wire.Request, int, int], list[bytes] | None]


def everything(messages: int) -> int:
    return (1 << messages) - 1


def holds_all(request: wire.Request, messages: int, chunk: int) -> list[bytes]:
    return [wire.have_reply(request.xfer, everything(messages), messages)]


HAVE_FAULTS: dict[str, Answer] = {
    "not msgpack": lambda r, m, c: [b"\xc1\xc1 not msgpack"],
    "not a map": lambda r, m, c: [b"\x93\x01\x02\x03"],
    "bits of the wrong type": lambda r, m, c: [wire.pack({"v": V, "op": "have", "id": r.xfer, "bits": 12345})],
    "coming of the wrong type": lambda r, m, c: [wire.pack({"v": V, "op": "have", "id": r.xfer, "coming": [1]})],
    "bits oversized": lambda r, m, c: [wire.pack({"v": V, "op": "have", "id": r.xfer, "bits": b"\xff" * (8 << 20)})],
    "bits beyond the plan": lambda r, m, c: [wire.have_reply(r.xfer, everything(m + 9), m + 9)],
    "speaks for the source": lambda r, m, c: [
        wire.have_reply(r.xfer, everything(m), m, peers=[("tcp://10.9.9.9:1", b"t" * 16)], claimed=(0, m))
    ],
    "another id": lambda r, m, c: [wire.have_reply(r.xfer ^ 1, everything(m), m)],
    "extra frames": lambda r, m, c: [wire.have_reply(r.xfer, everything(m), m), b"more"],
    "another version": lambda r, m, c: [wire.pack({"v": V + 7, "op": "have", "id": r.xfer})],
    "an error": lambda r, m, c: [wire.error_reply(r.xfer, "\u2603" * 1000, "x" * 100_000)],
    "claims everything, holds nothing": lambda r, m, c: [wire.have_reply(r.xfer, 0, m, coming=everything(m))],
}

SPAN_FAULTS: dict[str, Answer] = {
    "seq out of range": lambda r, m, c: [wire.data_envelope(r.xfer, m + 5, None), b"x" * c],
    "seq out of order": lambda r, m, c: [wire.data_envelope(r.xfer, _first(r) + 1, None), b"x" * c],
    "seq negative": lambda r, m, c: [wire.pack({"v": V, "op": "data", "id": r.xfer, "seq": -1}), b"x" * c],
    "frame too short": lambda r, m, c: [wire.data_envelope(r.xfer, _first(r), None), b"x"],
    "frame too long": lambda r, m, c: [wire.data_envelope(r.xfer, _first(r), None), b"x" * (c + 1)],
    "no frame": lambda r, m, c: [wire.data_envelope(r.xfer, _first(r), None)],
    "two frames": lambda r, m, c: [wire.data_envelope(r.xfer, _first(r), None), b"x" * c, b"y"],
    "forged bytes": lambda r, m, c: [wire.data_envelope(r.xfer, _first(r), None), b"\x5a" * c],
    "crc of the wrong type": lambda r, m, c: [
        wire.pack({"v": V, "op": "data", "id": r.xfer, "seq": _first(r), "crc": "no"}),
        b"x" * c,
    ],
    "end before its data": lambda r, m, c: [wire.end_reply(r.xfer)],
    "an end whose holdings go beyond the plan": lambda r, m, c: [wire.end_reply(r.xfer, (everything(m + 9), 0, m + 9))],
    "an end whose holdings are of the wrong type": lambda r, m, c: [
        wire.pack({"v": V, "op": "end", "id": r.xfer, "bits": 12345})
    ],
    "digests from a peer": lambda r, m, c: [wire.digests_reply(r.xfer, _first(r), b"\0" * 32)],
    "a header from a peer": lambda r, m, c: [wire.pack({"v": V, "op": "header", "id": r.xfer})],
    "an op nobody knows": lambda r, m, c: [wire.pack({"v": V, "op": "gimme", "id": r.xfer})],
    "an error of no known code": lambda r, m, c: [wire.error_reply(r.xfer, "no-such-code", "\0" * 1000)],
}


def _first(request: wire.Request) -> int:
    assert request.span is not None
    return request.span[0]


class FakePeer:
    """A raw ROUTER that offers to relay to ``metadata``'s source and answers have questions with ``on_have``
    and span fetches with ``on_span``; it records what it was asked."""

    def __init__(self, metadata: str, messages: int, on_have: Answer, on_span: Answer) -> None:
        self.messages, self.on_have, self.on_span = messages, on_have, on_span
        self.asked: list[str] = []
        self.context = zmq.Context()
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port(f"tcp://{LOOPBACK}")
        self.endpoint = f"tcp://{LOOPBACK}:{port}"
        address = parse_metadata(metadata)
        self.dealer = self.context.socket(zmq.DEALER)  # its header fetch stays connected, as a member's does
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(f"tcp://{address.host}:{address.port}")
        self.dealer.send(
            wire.fetch_request(1, 1, 1000, 4, False, header_only=True, relay=self.endpoint, verify=digests.offered())
        )
        assert self.dealer.poll(10_000), "the source never answered the fake peer's header fetch"
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            if not self.router.poll(20):
                continue
            routing, *frames = self.router.recv_multipart()
            request = wire.decode_request(frames[0])
            self.asked.append(request.op if request.span is None else "span")
            answer = self.on_have if request.op == wire.OP_HAVE else self.on_span if request.span else None
            reply = answer(request, self.messages, CHUNK) if answer is not None else None
            if reply:
                self.router.send_multipart([routing, *reply])

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        self.context.destroy(linger=0)


def _receive_beside(on_have: Answer, on_span: Answer, caplog: pytest.LogCaptureFixture) -> tuple[FakePeer, list[str]]:
    """A real receive from a real source that names the fake peer; returns the peer (closed) and the
    WARNINGs that name it."""
    want = {"w": torch.arange(1 << 20, dtype=torch.float32), "step": 1}
    source: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, chunk_bytes=CHUNK)
    honest: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    peer = None
    try:
        source.send_checkpoint([1, 2], 1, want, TIMEOUT)  # the fake peer and the honest receiver
        messages = len(honest.fetch_digests(source.metadata(), 1).digests)
        peer = FakePeer(source.metadata(), messages, on_have, on_span)
        assert [member.at for member in source._server._scheduler.swarm.members] == [peer.endpoint]
        with caplog.at_level(logging.WARNING, logger="zmqtransport.fetch"):
            assert_same(honest.recv_checkpoint(0, source.metadata(), 1, TIMEOUT), want)  # bit-exact
    finally:
        if peer is not None:
            peer.close()
        honest.shutdown()
        source.shutdown()
    named = [r.getMessage() for r in caplog.records if f"the peer at {peer.endpoint}" in r.getMessage()]
    return peer, named


@pytest.mark.parametrize("fault", HAVE_FAULTS)
def test_a_have_answer_nobody_can_use_drops_that_peer_only(
    fault: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)
    peer, named = _receive_beside(HAVE_FAULTS[fault], lambda r, m, c: None, caplog)
    assert "have" in peer.asked and "span" not in peer.asked
    if fault == "claims everything, holds nothing":
        # It reserved nothing at the source, so this receive's own reservations carried it (its claims
        # cost nothing): dropped only if it was still believed past the claim bound.
        assert len(named) <= 1, named
    else:
        assert len(named) == 1, named  # one WARNING, naming it


@pytest.mark.parametrize("fault", SPAN_FAULTS)
def test_a_span_reply_nobody_can_use_drops_that_peer_only(
    fault: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)
    peer, named = _receive_beside(holds_all, SPAN_FAULTS[fault], caplog)
    assert "span" in peer.asked  # it was asked for what it holds, and answered with the fault
    assert len(named) == 1, named  # one WARNING, naming it


def test_a_span_end_that_claims_beyond_the_plan_is_what_drops_the_peer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A relay's span end says what it holds (wire.end_reply): a peer's word like its have answer. Sent
    # before the span's data, the end's holdings are judged first: the WARNING names them.
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)
    fault = SPAN_FAULTS["an end whose holdings go beyond the plan"]
    peer, named = _receive_beside(holds_all, fault, caplog)
    assert "span" in peer.asked
    assert len(named) == 1 and "holdings do not fit the plan" in named[0], named
