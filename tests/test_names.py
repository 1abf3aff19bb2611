"""How the source names a swarm's members in its ``have`` answers (wire.NamedPeer), driven directly.

Every member asks the source who the others are about ten times a second,
and each answer named the newest 64 members in full, about 40 bytes each. In
the model at 256 receivers those answers were a sixth of the source's
uplink, the link that bounds the swarm (docs/sim.md). A member that asks
with ``names=NAMES_SHORT`` is now sent an entry the source named to it
before as its number alone; what the member learns from each answer is the
same. The source's Swarm, the wire's encoding and a receive's Peers, with
explicit time; then real transports on loopback.
"""

from __future__ import annotations

from typing import Any

import pytest

from zmqtransport import relayed, wire
from zmqtransport.errors import ProtocolError
from zmqtransport.fetch.peers import Peers
from zmqtransport.fetch.planner import Question
from zmqtransport.fetch.spans import SOURCE
from zmqtransport.serve.swarm import MAX_MEMBERS, Swarm
from zmqtransport.wire import NAMES_FULL, NAMES_PLAIN, NAMES_SHORT

from .conftest import TIMEOUT
from .test_planner import OWN, planner
from .test_planner import Swarm as ReceiveSwarm
from .test_relay import fetch_all, same, slow, state


def token(n: int) -> bytes:
    return n.to_bytes(16, "big")


def at(n: int) -> str:
    return f"tcp://10.0.{n // 250}.{n % 250 + 1}:29500"


def swarm_of(count: int) -> Swarm:
    swarm = Swarm()
    for n in range(count):
        swarm.join(token(n), at(n), token(n))
    return swarm


def answer(swarm: Swarm, asker: int, names: int) -> tuple[bytes, tuple[wire.NamedPeer, ...]]:
    """The source's answer to ``asker``'s question, as the wire carries it, and as the asker decodes it."""
    named = swarm.peers_for(token(asker), names)
    assert named is not None
    frame = wire.have_reply(7, None, 256, named)
    return frame, wire.decode_reply(frame, False, "the source").peers


def test_an_entry_named_before_goes_as_its_number_and_an_answer_shrinks_tenfold() -> None:
    swarm = swarm_of(100)
    first, entries = answer(swarm, 0, NAMES_SHORT)
    assert len(entries) == wire.MAX_PEERS and all(isinstance(e, tuple) and len(e) == 3 for e in entries)
    again, entries = answer(swarm, 0, NAMES_SHORT)
    assert all(isinstance(e, int) for e in entries)
    assert len(again) * 10 < len(first)  # 64 numbers against 64 metadata strings and tokens
    # A newcomer is named in full; the oldest of the 64 named before falls out of the window.
    swarm.join(token(100), at(100), token(100))
    _, entries = answer(swarm, 0, NAMES_SHORT)
    assert [e for e in entries if not isinstance(e, int)] == [(at(100), token(100), 101)]
    # Named under more paths (the member asked from another address): a new number, in full.
    swarm.members = [m for m in swarm.members if m.token != token(50)]
    swarm.join(token(50), at(50), token(50))
    _, entries = answer(swarm, 0, NAMES_SHORT)
    assert [e for e in entries if not isinstance(e, int)] == [(at(50), token(50), 102)]


def test_a_receive_learns_the_same_members_from_numbers_as_from_full_names() -> None:
    """The names only shrink: two receives with the same token, one told in full every time and one
    asking with NAMES_SHORT, take on the same peers at every answer, refills after drops included."""
    swarm = swarm_of(40)
    plain, short = Peers(token(0)), Peers(token(0))
    for round_ in range(30):
        if round_ % 3 == 0:  # members keep joining: more than one view holds
            n = 40 + round_
            swarm.join(token(n), at(n), token(n))
        if round_ == 12:
            for peer in (1, 2, 3, 4, 5):  # dropped: room for members it was named and did not take on
                plain.drop(peer)
                short.drop(peer)
        learned_plain = plain.learn(answer(swarm, 0, NAMES_PLAIN)[1])
        learned_short = short.learn(answer(swarm, 0, short.names())[1])
        assert learned_short == learned_plain, f"round {round_}"
        assert short.names() == NAMES_SHORT
    assert plain.tokens == short.tokens and len(plain.tokens) > 32  # past MAX_PEERS: a refill took some


def test_a_number_the_receive_does_not_know_makes_it_ask_for_every_name_once() -> None:
    swarm = swarm_of(10)
    peers = Peers(token(0))
    peers.learn(answer(swarm, 0, NAMES_SHORT)[1])
    # An answer lost on its way (or two that crossed): the source believes it named the newcomer.
    swarm.join(token(10), at(10), token(10))
    swarm.peers_for(token(0), NAMES_SHORT)
    swarm.join(token(11), at(11), token(11))
    _, entries = answer(swarm, 0, peers.names())
    assert (at(11), token(11), 12) in entries and 11 in entries
    learned = peers.learn(entries)
    assert [p.token for p in learned] == [token(11)]  # the number it cannot look up is skipped ...
    assert peers.names() == NAMES_FULL  # ... and the next question asks for everything in full
    _, entries = answer(swarm, 0, peers.names())
    assert all(not isinstance(e, int) for e in entries)
    assert [p.token for p in peers.learn(entries)] == [token(10)]
    assert peers.names() == NAMES_SHORT


def test_an_earlier_release_on_either_side_sees_what_it_saw() -> None:
    swarm = swarm_of(5)
    # A member that says nothing of names is told [metadata, token] pairs, every time, as before.
    for _ in range(2):
        frame, entries = answer(swarm, 0, NAMES_PLAIN)
        assert sorted(entries) == [(at(n), token(n)) for n in range(1, 5)]  # in the asker's order (wire.rank)
        assert frame == wire.have_reply(7, None, 256, list(entries))
    # A source that numbers nothing: its pairs are learned, and no number is missed.
    peers = Peers(token(0))
    assert len(peers.learn([(at(n), token(n)) for n in range(1, 5)])) == 4
    assert peers.names() == NAMES_SHORT
    # The question's field is left out unless it says something.
    assert b"names" not in wire.have_request(1, 2, token(0))
    assert wire.decode_request(wire.have_request(1, 2, token(0), names=NAMES_SHORT)).names == NAMES_SHORT


def test_the_planner_asks_the_source_with_short_names() -> None:
    net = planner(swarm=ReceiveSwarm(OWN))
    net.carry_out(net.plan.start())
    index = net.add()
    net.tick()
    [question] = net.requests(index, wire.OP_HAVE)
    assert question.token == OWN and question.names == NAMES_SHORT


@pytest.mark.parametrize("names", [3, -1, True, "short", 1.0])
def test_a_question_with_names_the_source_does_not_know_is_refused(names: object) -> None:
    message = wire.unpack(wire.have_request(1, 2, token(0)), wire.MAX_REQUEST_BYTES) | {"names": names}
    with pytest.raises(ProtocolError, match="'names'"):
        wire.decode_request(wire.pack(message))


@pytest.mark.parametrize(
    "entry",
    [-1, 2**32, True, "3", [at(1), token(1), -1], [at(1), token(1), "3"], [at(1), token(1), 3, 4], [at(1)]],
)
def test_a_have_answer_with_a_malformed_name_is_malformed(entry: object) -> None:
    frame = wire.pack({"v": wire.PROTOCOL_VERSION, "op": wire.OP_HAVE, "id": 7, "peers": [entry]})
    with pytest.raises(ProtocolError):
        wire.decode_reply(frame, False, "the source")


def test_a_relay_order_names_members_in_full_only() -> None:
    with pytest.raises(ProtocolError, match=r"\[metadata, token\]"):
        wire.decode_peers([[at(1), token(1), 3]])
    with pytest.raises(ProtocolError, match=r"\[metadata, token\]"):
        wire.decode_peers([3])


def test_what_the_source_remembers_of_its_answers_is_bounded_and_leaves_with_the_member() -> None:
    swarm = swarm_of(MAX_MEMBERS)
    for asker in range(MAX_MEMBERS):
        swarm.peers_for(token(asker), NAMES_SHORT)
    assert len(swarm.told) == MAX_MEMBERS and max(map(len, swarm.told.values())) == wire.MAX_PEERS
    swarm.left(token(3))
    assert token(3) not in swarm.told and len(swarm.told) == MAX_MEMBERS - 1
    # Past MAX_MEMBERS the oldest members go, and what they were told with them.
    for n in range(MAX_MEMBERS, MAX_MEMBERS + 10):
        swarm.join(token(n), at(n), token(n))
    assert len(swarm.told) == MAX_MEMBERS - 10  # 1023 askers, 9 of them gone
    swarm.clear()
    assert swarm.told == {}
    # A non-member is named nothing and nothing is kept for it.
    assert swarm.peers_for(token(5), NAMES_SHORT) is None and swarm.told == {}


def test_a_receive_nearly_done_takes_on_no_new_peer() -> None:
    """Near its end (a quarter or less missing) a receive takes on nobody new (planner.LATE_PEERS): in the
    model a member that took on a liar then asked it for its last messages and waited a quiet bound."""

    def answered_with_a_newcomer(land: int) -> list[int]:
        net = planner(messages=32, swarm=ReceiveSwarm(OWN))
        net.carry_out(net.plan.start())
        source = net.add()
        at = 0.0
        while 32 - len(net.landed) > 32 - land:
            at += 0.01
            net.tick(at)
            for question in [q for q in net.plan.registry.of(Question) if q.peer == SOURCE]:
                net.answer(source, wire.have_reply(question.xfer, None, 32, claimed=()))
            for span in net.spans(source):
                if len(net.landed) < land:
                    net.serve(source, span, count=land - len(net.landed))
        net.tick(at + 1.0)
        [question] = [q for q in net.plan.registry.of(Question) if q.peer == SOURCE]
        net.answer(source, wire.have_reply(question.xfer, None, 32, [("tcp://10.0.0.9:1", token(9), 1)]))
        return net.connects

    assert answered_with_a_newcomer(0) == [1]
    assert answered_with_a_newcomer(23) == [1]  # 9 of 32 missing: more than a quarter
    assert answered_with_a_newcomer(24) == []  # 8 missing: a quarter (with 1/16: taken on, then a liar held them)
    assert answered_with_a_newcomer(30) == []


def test_real_members_ask_for_short_names_and_are_named_by_number(
    make_transport: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three receives on loopback (the source chains them, as across hosts): their questions ask for short
    names, later answers name by number, and every receive ends bit-exact."""
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)
    answers: list[tuple[int, tuple[wire.NamedPeer, ...]]] = []
    honest = Swarm.peers_for

    def peers_for(self: Swarm, token: bytes, names: int = NAMES_PLAIN) -> tuple[wire.NamedPeer, ...] | None:
        named = honest(self, token, names)
        if named:
            answers.append((names, named))
        return named

    monkeypatch.setattr(Swarm, "peers_for", peers_for)
    sender = make_transport()
    receivers = [make_transport(progress=slow(0.004)) for _ in range(3)]
    want = state(16)
    sender.send_checkpoint([1, 2, 3], 1, want, TIMEOUT)
    results = fetch_all(receivers, sender.metadata(), 1, stagger=0.02)
    assert all(same(got, want) for got in results)
    assert answers and {names for names, _ in answers} == {NAMES_SHORT}
    assert any(isinstance(entry, int) for _, named in answers for entry in named)


def test_a_member_asking_under_anothers_token_delays_that_one_by_a_question_at_most() -> None:
    """Every member is told the others' tokens, so a modified one can ask the source with another's: the
    source then believes that member was named what the impostor was. The member skips the numbers it
    cannot look up and asks for everything in full next: each newcomer reaches it one answer later, and no
    wrong peer ever does."""
    swarm = swarm_of(10)
    victim = Peers(token(0))
    victim.learn(answer(swarm, 0, victim.names())[1])
    for n in range(10, 20):
        swarm.join(token(n), at(n), token(n))
        swarm.peers_for(token(0), NAMES_SHORT)  # the impostor, with the victim's token
        first = victim.learn(answer(swarm, 0, victim.names())[1])
        assert first == [] and victim.names() == NAMES_FULL  # the newcomer came as a number it lacks
        [second] = victim.learn(answer(swarm, 0, victim.names())[1])
        assert (second.at, second.token) == (at(n), token(n)) and victim.names() == NAMES_SHORT
    assert sorted(victim.tokens.values()) == [token(n) for n in range(1, 20)]


def test_answers_kept_between_questions_are_what_a_fresh_reckoning_gives() -> None:
    """The source keeps each member's last answer of numbers alone and its members by token, so a question
    costs the same at 16 members as at 256 (it built a dictionary of every member per question:
    scripts/source_questions.py). Members join, leave, are named under new paths, and ask with each kind
    of names, in a seeded random order; every answer equals the one a swarm that forgets what it kept
    reckons afresh, and a member that left is no longer found."""
    import random

    rng = random.Random(5)
    kept, fresh = swarm_of(70), swarm_of(70)
    joined = 70
    for _ in range(3000):
        tokens = [m.token for m in kept.members]
        roll = rng.random()
        if roll < 0.03:
            for swarm in (kept, fresh):
                swarm.join(token(joined), at(joined), token(joined))
            joined += 1
        elif roll < 0.05 and tokens:
            peer = rng.choice(tokens)
            for swarm in (kept, fresh):
                swarm.left(peer)
            assert kept.peers_for(peer, NAMES_SHORT) is None
        elif roll < 0.06 and tokens:
            renamed = rng.choice(tokens)  # asked from another address: named anew (as Swarm.seen does)
            for swarm in (kept, fresh):
                swarm.members = [m for m in swarm.members if m.token != renamed]
                swarm.join(renamed, at(int.from_bytes(renamed, "big")), renamed)
        elif tokens:
            asker, names = rng.choice(tokens), rng.choice((NAMES_PLAIN, NAMES_FULL, NAMES_SHORT, NAMES_SHORT))
            fresh._repeats.clear()
            assert kept.peers_for(asker, names) == fresh.peers_for(asker, names)
    assert [m.token for m in kept.members] == [m.token for m in fresh.members]
