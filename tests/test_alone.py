"""A swarm member the source tells ``alone`` (docs/protocol.md, "Swarm", "Stepping aside"): the source's
uplink, measured within the step, feeds every receiver faster than the swarm would, so the member drops its
peers and fetches the rest from the source in spans of full size; only the source may say so."""

from __future__ import annotations

import logging

import pytest

from zmqtransport import wire
from zmqtransport.fetch.planner import Question
from zmqtransport.fetch.spans import DEPTH, SOURCE

from .test_planner import OWN, Net, planner
from .test_planner import Swarm as ReceiveSwarm

MESSAGES = 64
SPAN = 4


def token(n: int) -> bytes:
    return bytes([n]) * 16


def named(*members: int) -> list[tuple[str, bytes, int]]:
    return [(f"tcp://10.1.0.{n}:7000", token(n), n) for n in members]


def answer_source(net: Net, source: int, **fields: object) -> None:
    """The source answers the receive's next question about the swarm (a tenth of a second on)."""
    net.now += 0.1
    net.tick()
    [question] = [q for q in net.plan.registry.of(Question) if q.peer == SOURCE]
    net.answer(source, wire.have_reply(question.xfer, None, MESSAGES, **fields))  # type: ignore[arg-type]


def member_with_peers() -> tuple[Net, int, dict[int, int]]:
    """A member that took on three peers, each holding the first half, and asked them for spans."""
    net = planner(messages=MESSAGES, span=SPAN, swarm=ReceiveSwarm(OWN))
    net.carry_out(net.plan.start())
    source = net.add()
    answer_source(net, source, peers=named(1, 2, 3), claimed=(0, 1))
    peers = net.plan.peers
    assert peers is not None and sorted(net.connects) == [1, 2, 3]
    streams = {peer: net.add(peer, peers.tokens[peer]) for peer in (1, 2, 3)}
    for peer in (1, 2, 3):
        net.plan.book.holds(peer, (1 << (MESSAGES // 2)) - 1)
    net.tick()
    assert all(net.spans(stream) for stream in streams.values())
    return net, source, streams


def test_a_member_told_alone_drops_its_peers_and_fetches_the_rest_from_the_source_in_full_spans(
    caplog: pytest.LogCaptureFixture,
) -> None:
    net, source, streams = member_with_peers()
    # Before: the source is asked for what it reserved, one message at a time.
    assert [(s.first, s.stop) for s in net.spans(source)] == [(0, 1)]
    with caplog.at_level(logging.DEBUG, logger="zmqtransport.fetch"):
        answer_source(net, source, alone=True)
    peers = net.plan.peers
    assert peers is not None and all(peers.dropped(peer) for peer in (1, 2, 3))
    assert all(stream in net.closed for stream in streams.values())
    # No warning per peer: stepping aside is routine, said once at INFO.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        f"step {net.plan.terms.step}: the source's uplink outpaces the swarm: fetching the rest from it alone"
    ]
    # Everything else comes from the source, in spans of full size, as many out as a stream to it keeps.
    net.tick()
    spans = net.spans(source)
    assert len(spans) == DEPTH and all(s.stop - s.first == SPAN for s in spans[1:])
    while not net.plan.complete:
        for span in net.spans(source):
            net.serve(source, span)
        net.tick()
    assert sorted(net.landed) == list(range(MESSAGES))
    assert not net.failed


def test_after_stepping_aside_a_member_takes_on_no_peer_the_source_names() -> None:
    """An earlier source, or answers that crossed: members named after ``alone`` are not taken on."""
    net, source, _ = member_with_peers()
    answer_source(net, source, alone=True)
    connects = list(net.connects)
    answer_source(net, source, peers=named(4, 5))
    assert net.connects == connects


def test_only_the_source_says_alone_a_peer_that_does_is_dropped() -> None:
    """A peer that answers ``alone`` speaks for the source: dropped as malformed, the others kept."""
    net, _, streams = member_with_peers()
    net.now += 0.2
    net.tick()
    [question] = [q for q in net.plan.registry.of(Question) if q.peer == 1]
    net.answer(streams[1], wire.have_reply(question.xfer, 0, MESSAGES, alone=True))
    peers = net.plan.peers
    assert peers is not None and peers.dropped(1) and not peers.dropped(2) and not peers.dropped(3)
    assert streams[1] in net.closed and streams[2] not in net.closed
