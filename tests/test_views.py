"""Which members the source names to each swarm member, and which a receive keeps as peers, once a swarm
outgrows wire.MAX_PEERS and fetch.peers.MAX_PEERS (docs/sim.md, "Balanced views"): every member named to,
and kept by, about as many others as any other, however late it joined."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from zmqtransport import wire
from zmqtransport.fetch.peers import MAX_PEERS, Peers
from zmqtransport.fetch.planner import Question
from zmqtransport.fetch.spans import SOURCE
from zmqtransport.serve.swarm import Swarm

from .test_planner import OWN, planner
from .test_planner import Swarm as ReceiveSwarm


def token(n: int) -> bytes:
    return n.to_bytes(2, "big") * 8


def at(n: int) -> str:
    return f"tcp://10.1.{n // 250}.{n % 250 + 1}:7000"


def joined_one_by_one(members: int) -> dict[int, Peers]:
    """``members`` receives join in turn; after each join every one asks the source, which names all
    members so far; each retires what leaves its view (as the planner does, nothing being asked of them)."""
    views = {n: Peers(token(n)) for n in range(members)}
    for joined in range(1, members + 1):
        named = [(at(n), token(n), n) for n in range(joined)]
        for n in range(joined):
            views[n].learn(named)
            for peer in views[n].surplus():
                views[n].drop(peer)
    return views


def in_degree(views: dict[int, Peers]) -> Counter[bytes]:
    return Counter(
        peers.tokens[peer] for peers in views.values() for peer in peers.tokens if not peers.dropped(peer)
    )


def test_every_member_is_in_about_as_many_views_however_late_it_joined() -> None:
    """64 members joining in turn. Taking on a random sample of each answer put the first to join in every
    view and the last in few; kept by rank, each member is in 21-42 views (32 on average: independent draws)."""
    views = joined_one_by_one(64)
    kept = [sum(1 for peer in p.tokens if not p.dropped(peer)) for p in views.values()]
    assert kept == [MAX_PEERS] * 64
    counts = in_degree(views)
    assert len(counts) == 64
    assert min(counts.values()) >= 18 and max(counts.values()) <= 46, sorted(counts.values())


def test_a_small_swarm_keeps_everyone() -> None:
    """Up to MAX_PEERS + 1 members nobody chooses: every member is every other's peer, nobody is retired."""
    views = joined_one_by_one(MAX_PEERS + 1)
    assert all(p.surplus() == [] for p in views.values())
    assert set(in_degree(views).values()) == {MAX_PEERS}


def test_a_dropped_peers_place_goes_to_the_next_in_rank() -> None:
    peers = Peers(OWN)
    named = [(at(n), token(n), n) for n in range(1, 65)]
    first = {new.token for new in peers.learn(named)}
    assert len(first) == MAX_PEERS
    dropped = next(iter(peers.tokens))
    peers.drop(dropped)
    [refill] = peers.learn(named)
    assert refill.token not in first and peers.surplus() == []


def test_the_planner_retires_a_peer_that_left_the_view_once_nothing_is_asked_of_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A receive that took on the first members to join retires those that later fall out of its view:
    at once where it has no span out to them, later where it has (nothing asked is lost)."""
    net = planner(messages=64, swarm=ReceiveSwarm(OWN))
    net.carry_out(net.plan.start())
    source = net.add()
    peers = net.plan.peers
    assert peers is not None

    def answer_source(named: list[tuple[str, bytes, int]]) -> None:
        net.now += 0.1
        net.tick()
        [question] = [q for q in net.plan.registry.of(Question) if q.peer == SOURCE]
        net.answer(source, wire.have_reply(question.xfer, None, 64, named))

    early = [(at(n), token(n), n) for n in range(1, 9)]
    answer_source(early)
    assert sorted(net.connects) == list(range(1, 9))
    # One early peer holds something; the receive asks it for a span.
    streams = {peer: net.add(peer, peers.tokens[peer]) for peer in range(1, 9)}
    later = [(at(n), token(n), n) for n in range(1, 65)]
    view_after = Peers(OWN)
    view_after.learn(later)
    leaving = [peer for peer in range(1, 9) if not any(t == peers.tokens[peer] for t in view_after.tokens.values())]
    assert leaving, "the test needs an early member that leaves the view"
    busy = leaving[0]
    net.plan.book.holds(busy, 1 << 63)
    net.tick()
    assert net.spans(streams[busy])
    with caplog.at_level(logging.DEBUG, logger="zmqtransport.fetch"):
        answer_source(later)
    retired = {peer for peer in range(1, 9) if peers.dropped(peer)}
    assert retired == set(leaving) - {busy}
    assert streams[busy] not in net.closed and all(streams[p] in net.closed for p in retired)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "view" in r.getMessage()]
    # Its span served, the next answer retires it too.
    net.serve(streams[busy], net.spans(streams[busy])[0])
    answer_source(later)
    assert peers.dropped(busy)


# ----------------------------------------------------------------------------- what the source names


def named_to(swarm: Swarm, asker: int) -> set[bytes]:
    named = swarm.peers_for(token(asker), wire.NAMES_FULL)
    assert named is not None
    return {entry[1] for entry in named if not isinstance(entry, int)}


def test_the_source_names_each_member_about_as_often_as_any_other() -> None:
    """256 members that joined in turn and ask as they join and after. Naming the newest 64 named the last
    64 to join to every member (each in 255 answers); ranked, each is named to 46-82 (64 on average)."""
    swarm = Swarm()
    for n in range(256):
        swarm.join(token(n), at(n), token(n))
        named_to(swarm, n)  # a member asks at once: its list is kept from then on as others join
    counts = Counter(member for asker in range(256) for member in named_to(swarm, asker))
    assert len(counts) == 256
    assert min(counts.values()) >= 35 and max(counts.values()) <= 95, sorted(counts.values())


def test_what_the_source_keeps_for_each_asker_is_what_it_would_rank_afresh() -> None:
    """Joins update each asker's list by one hash; a leave makes the lists that named the leaver afresh at
    their next question: after any mix of both, each names what a source that just met them all would."""
    swarm, members = Swarm(), list(range(100))
    for n in members:
        swarm.join(token(n), at(n), token(n))
        named_to(swarm, n)
    for n in [3, 50, 51, 99, *range(10, 40)]:
        swarm.left(token(n))
        members.remove(n)
    for n in range(100, 130):
        swarm.join(token(n), at(n), token(n))
        members.append(n)
    afresh = Swarm()
    for n in members:
        afresh.join(token(n), at(n), token(n))
    for asker in members:
        assert named_to(swarm, asker) == named_to(afresh, asker)
        assert len(swarm.named[token(asker)]) == wire.MAX_PEERS
    assert set(swarm.named) <= {token(n) for n in members}  # a leaver's own list goes with it


def test_up_to_65_members_the_source_names_every_other_one() -> None:
    swarm = Swarm()
    for n in range(wire.MAX_PEERS + 1):
        swarm.join(token(n), at(n), token(n))
    assert all(len(named_to(swarm, n)) == wire.MAX_PEERS for n in range(wire.MAX_PEERS + 1))
