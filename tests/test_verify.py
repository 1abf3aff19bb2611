"""Digests (docs/protocol.md, "Digests"): the bookkeeping, the wire, the source's rules, and rogue relays on loopback.

The pure parts first (algorithms, the digest book, the span book's held
messages, the request and reply fields, the source's chain rules and its digest
work). Then real transports on loopback (``RELAY_LOOPBACK`` on, as in
tests/test_relay.py): the head of the source's relay chain is a rogue, a
transport whose relaying is modified (the patch is on the class, and the rogue
is the only transport here that relays), and the receiver sent to it must
complete bit-exact and name it in a WARNING. tests/test_rogue_lab.py does the
same with real processes on their own hosts.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import quote

import pytest
import torch

from zmqtransport import ZMQTransport, digests, relayed, security, wire
from zmqtransport.bench.rogue import become_rogue
from zmqtransport.codec.tensors import EncodedTree
from zmqtransport.device import DeviceStaging, SendStager
from zmqtransport.errors import IntegrityError, ProtocolError
from zmqtransport.fetch import planner
from zmqtransport.fetch.liveness import RECONNECT_GRACE
from zmqtransport.fetch.planner import (
    AHEAD_FIRST_RUN,
    AHEAD_PATIENCE,
    AHEAD_REQUESTS,
    AHEAD_RUN,
    Action,
    Cancel,
    Outgoing,
    ReceivePlanner,
    Send,
    Swarm,
)
from zmqtransport.fetch.requests import SpanTerms
from zmqtransport.fetch.spans import DEPTH, HELD, LANDED, MISSING, SOURCE, SpanBook
from zmqtransport.fetch.verify import DigestBook, DigestRequest, Verdict
from zmqtransport.net import parse_metadata
from zmqtransport.serve import actions, scheduler, swarm
from zmqtransport.serve.actions import SendHeader
from zmqtransport.serve.digests import DigestWork
from zmqtransport.serve.router import Router
from zmqtransport.serve.scheduler import Scheduler
from zmqtransport.serve.staged import Staged, stage
from zmqtransport.testing import FakeDevice

from .conftest import TIMEOUT
from .test_relay import once_a_member, three_heal_at_once
from .test_relay import state as relay_state

SHA = digests.algorithm(digests.SHA256)
MIB = 1 << 20


# ----------------------------------------------------------------------------- algorithms


def test_sha256_is_always_offered_and_unknown_names_are_skipped() -> None:
    assert digests.SHA256 in digests.offered()
    assert digests.offered()[-1] == digests.SHA256  # the fallback comes last
    assert digests.choose(["md5", "sha256"]) == SHA
    assert digests.choose(["md5"]) is None
    assert digests.digest_of(SHA, b"abc") == bytes.fromhex(
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


# ----------------------------------------------------------------------------- the digest book


def test_digest_book_checks_held_messages_when_the_digests_come() -> None:
    book = DigestBook(8, 32)
    assert book.wanted(0, 4) == [(0, 4)]
    book.asking(11, stream=2, first=0, stop=4, now=0.0)
    assert book.wanted(0, 6) == [(4, 6)]
    good, bad = digests.digest_of(SHA, b"m0"), digests.digest_of(SHA, b"forged")
    assert book.check(0, good, stream=0) is None  # its digest is not known yet: it waits
    assert book.check(1, bad, stream=0) is None
    blob = b"".join(digests.digest_of(SHA, f"m{i}".encode()) for i in range(4))
    assert book.on_digests(11, 0, blob) == [Verdict(0, 0, True), Verdict(1, 0, False)]
    assert book.check(2, digests.digest_of(SHA, b"m2"), stream=1) is True  # known now: at once
    assert book.check(3, bad, stream=1) is False
    assert book.on_digests(99, 0, blob) is None  # not ours (cancelled, or its stream was dropped)


def test_digest_book_refuses_an_answer_that_does_not_cover_the_request() -> None:
    book = DigestBook(8, 32)
    book.asking(1, stream=0, first=2, stop=4, now=0.0)
    with pytest.raises(ValueError, match="asked"):
        book.on_digests(1, 2, b"\0" * 32)
    with pytest.raises(ValueError, match="asked"):
        book.on_digests(1, 3, b"\0" * 64)


def test_digest_book_asks_again_what_a_lost_stream_was_asked() -> None:
    book = DigestBook(8, 32)
    book.asking(1, stream=3, first=0, stop=4, now=0.0)
    book.check(2, b"x" * 32, stream=0)
    assert [r.xfer for r in book.lost(3)] == [1]
    assert book.wanted(0, 4) == [(0, 4)]
    assert book.unverified_wanted() == [(2, 3)]
    # A dropped relay's held messages are not believed.
    assert book.forget(0) == [2] and book.pending == {}


def test_digest_book_finds_the_next_run_to_read_ahead() -> None:
    book = DigestBook(10, 32)
    assert book.ahead(0, 4) == (0, 4)
    book.asking(1, stream=0, first=2, stop=3, now=0.0)
    assert book.ahead(0, 4) == (0, 2)  # up to what is asked already
    assert book.ahead(2, 4) == (3, 7)
    assert book.ahead(8, 4) == (8, 10)  # the plan's end
    book.asking(2, stream=0, first=0, stop=10, now=0.0)
    assert book.ahead(0, 4) is None


def _checking(known: Any = (), questions: bool = False, digests_ahead: bool = False) -> ReceivePlanner:
    """A receive's planner (tests/test_planner.py) with a connection to the source that is up, and
    ``known`` peers (none of them connected), checking what peers send against the source's digests
    (``digests_ahead``: the source's header said it hashes any message on request)."""
    terms = SpanTerms(1, 7, False, time.monotonic() + 60, None, SHA, digests_ahead=digests_ahead)
    plan = ReceivePlanner(list(range(101)), terms, 4, "the source", Swarm(None, known))
    plan.add_stream(SOURCE, None, False, "tcp://source:1", 0.0)
    plan.connection(0, True, None)
    if questions:
        plan.add_stream(SOURCE, None, True, "tcp://source:1", 0.0)  # its handshake is not done
    plan.start()
    return plan


def _asked(plan: ReceivePlanner, actions: list[Action], kind: type = DigestRequest) -> list[Send]:
    """The requests of one kind (digest requests by default) among ``actions``."""
    return [a for a in actions if isinstance(a, Send) and isinstance(plan.registry.asked.get(a.xfer), kind)]


def test_a_receive_with_peers_reads_digests_ahead_and_a_refused_read_ahead_only_stops_it() -> None:
    lonely = _checking()
    assert _asked(lonely, lonely.tick(0.0)) == []  # no peers yet: nothing is asked ahead (the source would hash
    # for nothing)
    plan = _checking([("tcp://a:1", b"a" * 16)])
    check = plan.digests
    assert check is not None
    sent = _asked(plan, plan.tick(0.0))
    requests = sorted(check.requests.values(), key=lambda r: r.first)
    # A short first run (its answer releases what peers send first), then long ones (few requests to the source).
    bounds = [0, AHEAD_FIRST_RUN] + [AHEAD_FIRST_RUN + n * AHEAD_RUN for n in range(1, AHEAD_REQUESTS)]
    runs = [(bounds[n], bounds[n + 1], True) for n in range(AHEAD_REQUESTS)]
    assert [(r.first, r.stop, r.ahead) for r in requests] == runs
    assert AHEAD_FIRST_RUN < AHEAD_RUN and len(sent) == AHEAD_REQUESTS
    reply = wire.Reply("digests", requests[0].xfer, False, seq=0, dg=b"d" * 32 * AHEAD_FIRST_RUN)
    plan.on_reply(0, reply, "the source", 0.05)
    plan.tick(0.1)
    assert max(r.stop for r in check.requests.values()) == bounds[-1] + AHEAD_RUN  # the next run, a long one
    # The source refuses one (it may hash device memory only as it sends it): reading ahead stops,
    # peers are still used, and what it covered is asked for as spans reach it.
    assert plan.out.digests_refused(requests[1].xfer) is False and not plan.out.reads_ahead
    assert _asked(plan, plan.tick(0.2)) == []
    assert plan.out.digests_refused(12345) is None  # not a digest request of this receive
    assert check.wanted(bounds[1], bounds[1] + 1) == [(bounds[1], bounds[1] + 1)]


def test_a_read_ahead_the_source_does_not_answer_soon_is_cancelled_and_reading_ahead_stops() -> None:
    plan = _checking([("tcp://a:1", b"a" * 16)])
    check = plan.digests
    assert check is not None
    plan.tick(0.0)
    ahead = set(check.requests)
    assert len(ahead) == AHEAD_REQUESTS
    plan.tick(AHEAD_PATIENCE / 2)
    assert len(check.requests) == AHEAD_REQUESTS and plan.out.reads_ahead
    actions = plan.tick(AHEAD_PATIENCE * 1.5)  # e.g. device memory: hashed only as it is sent
    assert check.requests == {} and not plan.out.reads_ahead
    cancels = [a for a in actions if isinstance(a, Cancel)]
    assert sorted(c.xfer for c in cancels) == sorted(ahead) and len(cancels) == AHEAD_REQUESTS
    assert check.ahead(0, 4) == (0, 4)  # asked for again as spans reach those messages


def test_a_late_read_ahead_is_waited_for_where_the_source_said_it_hashes_ahead() -> None:
    # A source staging host memory hashes any message on request: a late answer means it is busy, and
    # cancelling made each member ask for every span's digests on its own (23 members: 3257 requests).
    plan = _checking([("tcp://a:1", b"a" * 16)], digests_ahead=True)
    check = plan.digests
    assert check is not None
    plan.tick(0.0)
    ahead = sorted(check.requests)
    assert len(ahead) == AHEAD_REQUESTS
    actions = plan.tick(AHEAD_PATIENCE * 10)
    assert not [a for a in actions if isinstance(a, Cancel)] and _asked(plan, actions) == []
    assert sorted(check.requests) == ahead and plan.out.reads_ahead
    first = check.requests[ahead[0]]
    reply = wire.Reply("digests", first.xfer, False, seq=first.first, dg=b"d" * 32 * (first.stop - first.first))
    plan.on_reply(0, reply, "the source", AHEAD_PATIENCE * 10)
    assert _asked(plan, plan.tick(AHEAD_PATIENCE * 10 + 0.01))  # answered: the next run is asked for


# ----------------------------------------------------------------------------- held messages in the span book


def test_a_held_message_lands_only_once_verified_and_a_rejected_one_is_asked_again() -> None:
    book = SpanBook(6, streams=1, span=3)
    book.connected(0, True)
    span = book.assign(0, 7, 0.0)
    assert span is not None and (span.first, span.stop) == (0, 3)
    for seq in range(3):
        assert book.on_data(7, seq, 0.01, held=True) is True
    assert list(book.landed[:3]) == [HELD] * 3 and book.missing == 6
    book.verified(0)
    book.rejected([1, 2])
    assert list(book.landed[:3]) == [LANDED, MISSING, MISSING] and book.missing == 5
    book.on_end(7)
    again = book.assign(0, 8, 0.02)
    assert again is not None and (again.first, again.stop) == (1, 4)  # asked for again first
    assert book.prefix() == 1


def test_a_held_message_is_not_asked_for_twice_while_it_is_checked() -> None:
    book = SpanBook(4, streams=2, span=2)
    book.connected(0, True)
    book.connected(1, True)
    first = book.assign(0, 1, 0.0)
    assert first is not None
    assert book.on_data(1, 0, 0.01, held=True) and book.on_data(1, 1, 0.01, held=True)
    book.on_end(1)
    second = book.assign(1, 2, 0.02)
    assert second is not None and (second.first, second.stop) == (2, 4)
    assert book.on_data(2, 2, 0.03) is True and book.on_data(2, 3, 0.03) is True
    assert not book.complete
    book.verified(0)
    book.verified(1)
    assert book.complete


def test_a_relay_that_sends_nothing_is_taken_over_after_the_first_quiet_bound_and_then_found_idle() -> None:
    # Stream 0 the source, stream 1 a peer (it reported holding everything), asked for two spans at once.
    book = SpanBook(4, streams=1, span=2, peer_depth=2)
    peer = book.add_stream(7)
    book.holds(7, 0b1111)
    book.connected(0, True)
    book.connected(peer, True)
    held = [book.assign(peer, xfer, 0.0) for xfer in (1, 2)]
    assert all(span is not None for span in held)
    assert book.assign(0, 3, 0.4) is None  # nothing free, nothing quiet yet
    takeover = book.assign(0, 3, 0.5)  # nothing from the peer yet: QUIET_FIRST
    assert takeover is not None and (takeover.first, takeover.stop) == (0, 2)
    assert held[0] is not None and book.idle_since_taken_over(held[0]) and book.did_nothing(held[0], 0.5)
    book.on_data(2, 2, 0.6, held=True)  # the peer sends something after all: not idle
    assert not book.idle_since_taken_over(held[0])


# ----------------------------------------------------------------------------- the wire


def test_digest_fields_round_trip_and_are_checked() -> None:
    request = wire.decode_request(
        wire.fetch_request(1, 2, 3, 4, False, span=(0, 4), stage=5, verify=["sha256"], digests_only=True)
    )
    assert request.verify == ("sha256",) and request.digests_only and not request.inline
    request = wire.decode_request(wire.fetch_request(1, 2, 3, 4, False, verify=["blake3", "sha256"], inline=True))
    assert request.verify == ("blake3", "sha256") and request.inline
    plain = wire.fetch_request(1, 2, 3, 4, False)
    assert b"verify" not in plain  # a plain fetch stays what an earlier source parses
    bad = [
        {"verify": "sha256"},
        {"verify": ["x" * 33]},
        {"verify": ["a"] * 9},
        {"inline": True},
        {"digests_only": True, "verify": ["sha256"]},  # not a span fetch
        {"digests_only": 1, "verify": ["sha256"], "span": [0, 1], "stage": 1},
        {"digests_only": True, "verify": ["sha256"], "span": [0, 1], "stage": 1, "token": b"T" * 16},
    ]
    base = {"v": 1, "op": "fetch", "id": 1, "step": 1, "wait_ms": 0, "credit": 1}
    for extra in bad:
        with pytest.raises(ProtocolError):
            wire.decode_request(wire.pack({**base, **extra}))
    data = wire.decode_reply(wire.data_envelope(3, 4, None, b"d" * 32), True, "peer")
    assert data.dg == b"d" * 32
    assert wire.data_envelope(3, 4, 5) == wire.data_envelope(3, 4, 5, None)
    answer = wire.decode_reply(wire.digests_reply(3, 8, b"e" * 64), False, "peer")
    assert (answer.op, answer.seq, answer.dg) == (wire.OP_DIGESTS, 8, b"e" * 64)
    header = wire.decode_reply(wire.header_envelope(3, 9, None, "sha256"), True, "peer")
    assert header.digest == "sha256"
    with pytest.raises(ProtocolError):
        wire.decode_reply(wire.pack({"v": 1, "op": "data", "id": 1, "seq": 0, "dg": "text"}), True, "peer")
    with pytest.raises(ProtocolError):
        wire.decode_reply(wire.pack({"v": 1, "op": "digests", "id": 1, "first": -1, "dg": b""}), False, "peer")


# ----------------------------------------------------------------------------- the source's rules


def staged(messages: int = 4, nbytes: int = 64) -> Staged:
    memory = torch.arange(messages * nbytes, dtype=torch.uint8)
    tree = EncodedTree(skeleton=None)
    tree.add_tensor(memory, ())
    plan = wire.plan_chunks([messages * nbytes], nbytes, 0)
    return Staged(7, b"header", tree, plan, None)


def fetch(xfer: int = 1, **kwargs: Any) -> wire.Request:
    return wire.Request(wire.OP_FETCH, xfer, step=7, wait_ms=1000, credit=4, **kwargs)


def test_an_offer_to_relay_is_kept_to_the_host_the_connection_comes_from() -> None:
    key = quote(security.generate_keypair().public.decode(), safe="")  # z85 has '&', '=', '?' ...
    offer = f"tcp://10.0.0.2:5000?curve={key}&paths=10.9.9.9:5000,10.0.0.2:5001"
    kept = swarm.believable_offer(offer, "10.0.0.2", curve=True)
    assert kept is not None
    assert parse_metadata(kept) == parse_metadata(f"tcp://10.0.0.2:5000?curve={key}&paths=10.0.0.2:5001")
    assert swarm.believable_offer(offer, "::ffff:10.0.0.2", curve=True) is not None  # IPv4 on a dual-stack socket
    assert swarm.believable_offer("tcp://10.9.9.9:5000?paths=10.0.0.2:7", "10.0.0.2") == "tcp://10.0.0.2:7"
    assert swarm.believable_offer("tcp://victim.example:80", "10.0.0.2") is None  # names are not resolved
    assert swarm.believable_offer("tcp://10.9.9.9:80", "10.0.0.2") is None
    assert swarm.believable_offer("not metadata", "10.0.0.2") is None
    assert swarm.believable_offer("tcp://10.0.0.2:1", "unknown peer") is None


def test_an_offer_is_believed_only_with_the_sources_own_security() -> None:
    """A member's offer the next receivers could not use (CurveZMQ where they have none, or none where
    they require it, a malformed key, a parameter nobody knows) would fail every receive sent there."""
    key = security.generate_keypair().public.decode()
    with_curve, plain = f"tcp://10.0.0.2:5000?curve={quote(key, safe='')}", "tcp://10.0.0.2:5000"
    assert swarm.believable_offer(plain, "10.0.0.2", curve=False) == plain
    assert swarm.believable_offer(with_curve, "10.0.0.2", curve=True) is not None
    assert swarm.believable_offer(with_curve, "10.0.0.2", curve=False) is None
    assert swarm.believable_offer(plain, "10.0.0.2", curve=True) is None
    for bad_key in ("KEY", "#" * 40, key[:-1], key + "0"):
        bad = f"tcp://10.0.0.2:5000?curve={quote(bad_key, safe='')}"
        assert swarm.believable_offer(bad, "10.0.0.2", curve=True) is None
    assert swarm.believable_offer(f"{plain}?zap=1", "10.0.0.2", curve=False) is None
    members = swarm.Swarm(curve=False)
    assert members.offer(b"a", with_curve, "10.0.0.2", b"t" * 16, None) is None  # served directly, not a member
    assert members.members == []
    assert members.offer(b"b", plain, "10.0.0.2", b"u" * 16, None) is not None


def test_only_a_receiver_that_verifies_is_sent_to_a_relay_and_only_offers_from_their_own_host() -> None:
    sched = Scheduler(10.0)
    sched.stage(staged(), 0.0)
    verify = ("sha256",)
    head = sched.on_request(b"a", fetch(relay="tcp://10.0.0.1:1", verify=verify), "10.0.0.1", 0.0)[0]
    assert isinstance(head, SendHeader) and head.digest == "sha256" and head.relay is not None
    # An offer naming another host is not believed: served directly, and nobody is sent there.
    liar = sched.on_request(b"x", fetch(relay="tcp://10.0.0.1:2", verify=verify), "10.0.0.66", 0.0)[0]
    assert isinstance(liar, SendHeader) and liar.relay is None and not liar.header_only
    # A receiver that does not verify (an earlier release) is served by the source, and may relay.
    old = sched.on_request(b"o", fetch(relay="tcp://10.0.0.3:1"), "10.0.0.3", 0.0)[0]
    assert isinstance(old, SendHeader) and old.digest is None and old.relay is not None
    assert old.relay.upstream is None and not old.header_only
    follower = sched.on_request(b"b", fetch(relay="tcp://10.0.0.2:1", verify=verify), "10.0.0.2", 0.0)[0]
    assert isinstance(follower, SendHeader) and follower.relay is not None
    assert follower.relay.upstream == "tcp://10.0.0.3:1" and follower.header_only


def test_the_header_says_digests_ahead_beside_a_digest_for_host_and_device_memory() -> None:
    class DevicePlan:
        chunks = (True, False, False, False)  # one message built from device memory: hashed through the stager

    verify = ("sha256",)
    for device, want in ((None, True), (DevicePlan(), True)):
        sched, steps = Scheduler(10.0), staged()
        steps.device_plan = device  # type: ignore[assignment]
        sched.stage(steps, 0.0)
        head = sched.on_request(b"a", fetch(relay="tcp://10.0.0.1:1", verify=verify), "10.0.0.1", 0.0)[0]
        assert isinstance(head, SendHeader) and head.digest == "sha256" and head.digests_ahead is want
        plain = sched.on_request(b"p", fetch(2), "10.0.0.5", 0.0)[0]
        assert isinstance(plain, SendHeader) and plain.digest is None and not plain.digests_ahead
    envelope = wire.header_envelope(1, 7, None, "sha256", digests_ahead=True)
    assert wire.decode_reply(envelope, True, "source").digests_ahead
    assert not wire.decode_reply(wire.header_envelope(1, 7, None, "sha256"), True, "source").digests_ahead
    for bad in ({"digest": "sha256", "ahead": 1}, {"ahead": True}):  # not a boolean; no digests to read ahead
        forged = wire.pack({"v": wire.PROTOCOL_VERSION, "op": wire.OP_HEADER, "id": 1, "stage": 7, **bad})
        with pytest.raises(ProtocolError, match="'ahead'"):
            wire.decode_reply(forged, True, "source")


class FakeRouter:
    def __init__(self) -> None:
        self.sent: list[tuple[bytes, wire.Reply]] = []

    def send(self, peer: bytes, frames: list[Any]) -> bool:
        self.sent.append((peer, wire.decode_reply(frames[0], False, "source")))
        return True


def test_digest_requests_are_answered_with_bounded_hashing_per_round() -> None:
    sched = Scheduler(10.0)
    steps = staged(messages=4, nbytes=64)
    sched.stage(steps, 0.0)
    router = FakeRouter()
    work = DigestWork(sched, router, SendStager(DeviceStaging()), round_bytes=100)  # type: ignore[arg-type]
    request = fetch(9, span=(1, 4), stage=steps.stage_id, verify=("md5", "sha256"), digests_only=True)
    assert sched.on_request(b"r", request, "10.0.0.9", 0.0) == []
    assert sched.next_round() == []  # a digest request sends no data
    rounds = 0
    while not router.sent:
        assert work.run() or router.sent
        rounds += 1
    assert rounds == 2  # 192 bytes at 100 per round
    peer, reply = router.sent[0]
    want = b"".join(digests.digest_of(SHA, steps.payload(seq)[0]) for seq in (1, 2, 3))
    assert (peer, reply.op, reply.xfer, reply.seq, reply.dg) == (b"r", wire.OP_DIGESTS, 9, 1, want)
    assert sched.transfers == {}
    assert work.run() is False
    # A digest request for another staging, or none at all, is refused; one without a known algorithm too.
    for bad, code in [
        (fetch(10, span=(0, 1), stage=steps.stage_id + 1, verify=("sha256",), digests_only=True), "wrong_step"),
        (fetch(11, span=(0, 1), stage=steps.stage_id, verify=("md5",), digests_only=True), "bad_request"),
    ]:
        refusal = sched.on_request(b"r", bad, "10.0.0.9", 0.0)
        assert [a.code for a in refusal] == [code]  # type: ignore[union-attr]
    sched.disallow(0.0, cap=0)  # nothing of it runs: nothing is kept
    assert [a.code for a in sched.on_request(b"r", request, "10.0.0.9", 0.0)] == ["disallowed"]  # type: ignore[union-attr]


def test_digests_of_device_memory_are_hashed_from_copies_through_the_stager() -> None:
    # A message built from device memory is copied to the stager's pinned ring and hashed there, one at a
    # time per request, whether or not the pump has sent it; one the pump hashed meanwhile is not copied
    # again, and every buffer is given back.
    device = FakeDevice(ops_per_query=0)  # a copy completes only once the engine is synchronised
    staging = device.staging(slots=2, depth=1)
    generator = torch.Generator().manual_seed(4)
    state = {"big": torch.randn(3 * (1 << 18) + 5, generator=generator), "small": torch.arange(9.0)}
    steps = stage(state, 7, allow_pickle=False, chunk_bytes=1 << 18, pack_below=1 << 12, checksum=None,
                  staging=staging)
    assert steps.device_plan is not None and all(steps.device_plan.chunks[:3])
    plain = stage(state, 7, allow_pickle=False, chunk_bytes=1 << 18, pack_below=1 << 12, checksum=None,
                  staging=DeviceStaging())  # the same bytes, from host memory
    messages = steps.messages
    want = [digests.digest_of(SHA, plain.payload(seq)[0]) for seq in range(messages)]
    sched = Scheduler(10.0, stall=5.0)
    sched.stage(steps, 0.0)
    router, stager = FakeRouter(), SendStager(staging)
    work = DigestWork(sched, router, stager)
    request = fetch(3, span=(0, messages), stage=steps.stage_id, verify=("sha256",), digests_only=True)
    sched.on_request(b"r", request, "10.0.0.9", 0.0)
    assert work.run() is True and not router.sent  # message 0's copy issued, not complete: due again
    steps.digests["sha256"] = [want[0]] + [None] * (messages - 1)  # the pump sent it to a relay meanwhile
    for _ in range(4 * messages):
        for engine in device.engines:
            engine.synchronize()
        work.run()
        stager.retain(list(sched.transfers))
        if router.sent:
            break
    peer, reply = router.sent[0]
    assert (peer, reply.op, reply.seq, reply.dg) == (b"r", wire.OP_DIGESTS, 0, b"".join(want))
    copied = sum(engine.copied_bytes for engine in device.engines)
    assert 0 < copied <= sum(len(plain.payload(seq)[0]) for seq in range(1, messages)) + len(plain.payload(0)[0])
    assert not stager.pending() and all(slot.idle() for slot in stager.ring.slots)


# ----------------------------------------------------------------------------- rogue relays on loopback


@pytest.fixture(autouse=True)
def relay_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)


def state(megabytes: int = 16, seed: int = 3) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    small = [torch.randn(n, generator=g) for n in (5, 50)]
    return {"w": torch.randn(megabytes * MIB // 4, generator=g), "small": small}


def same(got: Any, want: Any) -> bool:
    return torch.equal(got["w"], want["w"]) and all(
        torch.equal(a, b) for a, b in zip(got["small"], want["small"], strict=True)
    )


def slow(per_message: float) -> Any:
    def progress(done: int, total: int) -> None:
        time.sleep(per_message)

    return progress


def forging(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relays flip bytes of what they forward and send a CRC32 that matches the forgery (the benchmark's rogue)."""
    monkeypatch.setattr(relayed.Relayed, "payload", relayed.Relayed.payload)  # restored after the test
    monkeypatch.setattr(relayed.Relayed, "crc", relayed.Relayed.crc)
    become_rogue("flip")


def refusing(code: str) -> Any:
    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        def refuse(self: Scheduler, peer: bytes, request: wire.Request, address: str, now: float) -> Any:
            return [actions.Refuse(peer, request.xfer, code, "rogue")]

        monkeypatch.setattr(Scheduler, "_start_relayed", refuse)

    return patch


def garbling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Relays answer span fetches with a data message numbered out of the span's order."""
    honest = relayed.Relayed.payload

    def payload(self: relayed.Relayed, seq: int) -> tuple[bytes, bool]:
        data, referenced = honest(self, seq)
        return data + b"extra", referenced  # longer than the plan says

    monkeypatch.setattr(relayed.Relayed, "payload", payload)


def silent(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, tuple[int, int]]]:
    """Relays take span fetches and send nothing; returns the spans they were asked for, by which scheduler."""
    asked: list[tuple[int, tuple[int, int]]] = []
    honest = Scheduler._start_relayed

    def start(self: Scheduler, peer: bytes, request: wire.Request, address: str, now: float) -> Any:
        assert request.span is not None
        asked.append((id(self), request.span))
        return honest(self, peer, request, address, now)

    monkeypatch.setattr(Scheduler, "_start_relayed", start)
    monkeypatch.setattr(relayed.Relayed, "available", lambda self, seq: False)
    return asked


def _heal_behind_a_rogue(
    make_transport: Any,
    caplog: pytest.LogCaptureFixture,
    rogue_pace: float = 0.02,
    through_device: bool = False,
    **downstream: Any,
) -> tuple[Any, Any, Any]:
    """The source, a rogue at the head of its chain, and an honest receiver sent to it; the honest outcome.

    ``rogue_pace``: seconds the rogue's own receive spends per message (it relays while that runs).
    ``through_device``: the source's memory and the honest receiver's go through (fake) device staging."""
    staging = (lambda: {"staging": FakeDevice().staging()}) if through_device else dict
    sender = make_transport(checksum=True, **staging())
    rogue = make_transport(progress=slow(rogue_pace))
    honest = make_transport(**staging(), **downstream)
    want = state()
    sender.send_checkpoint([1, 2], 1, want, TIMEOUT)
    rogue_done: list[Any] = []

    def behind_the_rogue() -> Any:  # once the rogue heads the chain
        with caplog.at_level(logging.WARNING, logger="zmqtransport.fetch"):
            return honest.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)

    got = once_a_member(sender, lambda: rogue_done.append(_receive(rogue, sender)), behind_the_rogue, wait=20, join=30)
    assert same(got, want)
    named = [r.getMessage() for r in caplog.records if rogue.metadata() in r.getMessage()]
    return honest.last_recv_stats, named, rogue


def _heal_until_named(
    make_transport: Any,
    caplog: pytest.LogCaptureFixture,
    check: Any,
    attempts: int = 3,
    through_device: bool = False,
    **downstream: Any,
) -> list[str]:
    """:func:`_heal_behind_a_rogue` until the honest receive met the rogue (named it), ``check``-ing each heal.

    Whether the honest receiver asks the rogue at all is a race: a slow member's
    claims lapse after one claim bound (fetch/claims.py), and on a loaded
    machine the honest receive may then take everything from the source. Such a
    heal still has to be right; it just shows nothing about the rogue, so it is
    tried again (a bounded number of times)."""
    for _ in range(attempts):
        stats, named, _ = _heal_behind_a_rogue(make_transport, caplog, through_device=through_device, **downstream)
        check(stats)
        if named:
            return named
    raise AssertionError(f"the honest receive never met the rogue in {attempts} heals")


def _receive(transport: ZMQTransport[Any], sender: ZMQTransport[Any]) -> Any:
    try:
        return transport.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
    except Exception as exc:  # the rogue's own outcome does not matter
        return exc


@pytest.mark.parametrize(
    "rogue",
    [forging, refusing("shutdown"), refusing("bad_request"), refusing("busy"), garbling],
    ids=["flips-bytes-forges-crc", "error-shutdown", "error-bad_request", "error-busy", "malformed"],
)
def test_a_rogue_relay_changes_nothing_and_is_named(
    rogue: Any, make_transport: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rogue(monkeypatch)

    def check(stats: Any) -> None:
        assert sum(stats.paths.values()) == stats.bytes

    named = _heal_until_named(make_transport, caplog, check)
    assert "WARNING" in {r.levelname for r in caplog.records if r.getMessage() in named}


def test_an_in_place_receive_keeps_no_forged_byte(
    make_transport: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    forging(monkeypatch)
    mine = state(seed=9)

    def check(stats: Any) -> None:
        assert stats.in_place_bytes == stats.bytes
        assert same(mine, state())  # the caller's own tensors hold the source's bytes, every one

    _heal_until_named(make_transport, caplog, check, state_dict=lambda: mine)


def test_a_rogue_relay_ahead_of_a_device_receive(
    make_transport: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The source's memory and the receiver's go through (fake) device staging: the
    # source hashes what it sends its relay; the receiver hashes its bounce buffers.
    forging(monkeypatch)
    _heal_until_named(make_transport, caplog, lambda stats: None, through_device=True, device="cpu")


def test_a_relay_that_serves_nothing_costs_one_quiet_bound(
    make_transport: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Dropped at its first quiet bound (the source takes over then): never asked for more, so
    # it costs one bound, not one per pair of spans as it would if it were kept (16 MiB: 4 spans).
    asked = silent(monkeypatch)
    # Its own receive outlasts the quiet bound (16 x 0.1 s): a relay whose receive has ended is
    # refused at once as stopped (INFO), which is not what this test is about.
    stats, named, rogue = _heal_behind_a_rogue(make_transport, caplog, rogue_pace=0.1, stall_timeout=None)
    assert named and "sent nothing" in named[0]
    assert list(stats.paths) == [stats.peer]
    of_the_rogue = [span for who, span in asked if who == id(rogue._server._scheduler)]
    assert len(of_the_rogue) <= DEPTH, asked


def test_a_source_without_digests_is_never_relayed_from(
    make_transport: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An earlier source: it chains every receiver that offers, and publishes no digests.
    forging(monkeypatch)
    monkeypatch.setattr(scheduler.digests, "choose", lambda names: None)
    honest_join = swarm.Swarm.join

    def join(self: swarm.Swarm, peer: bytes, at: str, token: bytes, follows: bool = True) -> wire.RelayOrder:
        return honest_join(self, peer, at, token)

    monkeypatch.setattr(swarm.Swarm, "join", join)
    stats, _, _ = _heal_behind_a_rogue(make_transport, caplog)
    assert list(stats.paths) == [stats.peer]  # everything from the source, nothing from the relay it was sent to
    sender = make_transport()
    sender.send_checkpoint([1], 2, state(1), TIMEOUT)
    with pytest.raises(IntegrityError, match="publishes no digests"):
        make_transport(verify="all").recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)


# ----------------------------------------------------------------------------- verify="all": the source's own bytes


def corrupting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes change on their way from the source (a bad NIC, a middlebox): one byte of message 2."""
    honest = Router.send_data

    def send_data(self: Router, peer: bytes, envelope: bytes, payload: Any, track: bool) -> Any:
        if wire.decode_reply(envelope, True, "x").seq == 2:
            payload = bytearray(memoryview(payload).cast("B"))
            payload[7] ^= 1
        return honest(self, peer, envelope, payload, track)

    monkeypatch.setattr(Router, "send_data", send_data)


@pytest.mark.parametrize("streams", [1, 2], ids=["one-connection", "striped"])
def test_verify_all_checks_the_sources_own_bytes(
    make_transport: Any, monkeypatch: pytest.MonkeyPatch, streams: int
) -> None:
    sender = make_transport()
    want = state(4)
    sender.send_checkpoint([1], 1, want, TIMEOUT)
    # The first two stop serving as their receives return (relay_after_return=False), as in
    # test_relay's late receiver: the last takes message 2 from the source under test, not from them.
    first = make_transport(verify="all", streams=streams, relay_after_return=False)
    assert same(first.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT), want)
    corrupting(monkeypatch)
    # By default the source's own bytes are trusted (TCP's checksum only) ...
    trusting = make_transport(streams=streams, relay_after_return=False)
    assert not same(trusting.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT), want)
    # ... with verify="all" every byte is checked against its digest.
    with pytest.raises(IntegrityError, match="digest mismatch in data message 2"):
        make_transport(verify="all", streams=streams).recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)


def test_verify_option_is_checked() -> None:
    with pytest.raises(ValueError, match="verify="):
        ZMQTransport(TIMEOUT, bind_host="127.0.0.1", verify="none")


def test_digests_are_asked_over_the_question_connection_even_before_it_is_up() -> None:
    plan = _checking([("tcp://a:1", b"a" * 16)], questions=True)  # its handshake is not done: the request waits
    sent = _asked(plan, plan.tick(0.0))
    data_sent = [s for s in sent if s.stream == 0]
    question_sent = [s for s in sent if s.stream == 1]
    assert data_sent == [] and len(question_sent) == AHEAD_REQUESTS  # never behind the data
    plan.connection(1, True, 0.0)  # up, then lost for good
    sent = _asked(plan, plan.tick(RECONNECT_GRACE))
    assert plan.lanes[1].gone and sent and all(s.stream == 0 for s in sent)
    # with no question connection left, a data connection carries them


@pytest.mark.parametrize("device", [False, True], ids=["host-memory", "fake-device-memory"])
def test_members_read_digests_ahead_however_late_the_answers(
    device: bool, make_transport: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every read-ahead is late at once here (patience 0). A member that did not take the header's 'ahead'
    # would cancel its read-aheads and read ahead no more, as it does from an earlier source; this source
    # hashes any message on request (device memory through its pinned ring), so each member waits for them.
    monkeypatch.setattr(planner, "AHEAD_PATIENCE", 0.0)
    ahead: list[Outgoing] = []
    asking = Outgoing._digest_request

    def recorded(out: Outgoing, index: int, first: int, stop: int, now: float, is_ahead: bool) -> Any:
        if is_ahead:
            ahead.append(out)
        return asking(out, index, first, stop, now, is_ahead)

    monkeypatch.setattr(Outgoing, "_digest_request", recorded)
    source = make_transport(staging=FakeDevice().staging()) if device else make_transport()
    three_heal_at_once(source, [make_transport(progress=slow(0.002)) for _ in range(3)], relay_state())
    assert ahead, "no member read digests ahead"
    assert all(out.reads_ahead for out in ahead)
