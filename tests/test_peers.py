"""A receive's view of the swarm (zmqtransport/fetch/peers.py), driven directly: explicit time, no sockets."""

from __future__ import annotations

import math

from zmqtransport import wire
from zmqtransport.fetch.peers import (
    HAVE_EVERY,
    MEMBERS_EVERY,
    QUESTION_BURST,
    QUESTION_FLOOR,
    QUESTIONS_PER_MIB,
    Peers,
    QuestionBudget,
    start_offset,
)
from zmqtransport.fetch.spans import SOURCE

A, B, C, OWN = (bytes([n]) * 16 for n in (1, 2, 3, 9))


def test_members_are_learned_once_and_never_oneself() -> None:
    peers = Peers(OWN, [("tcp://a:1", A)])
    first = peers.learn()
    assert [(p.peer, p.at, p.token) for p in first] == [(1, "tcp://a:1", A)]
    again = peers.learn([("tcp://a:1", A), ("tcp://me:1", OWN), ("tcp://b:1", B)])
    assert [(p.peer, p.token) for p in again] == [(2, B)]
    assert peers.token_of(1) == A and peers.token_of(2) == B and peers.token_of(SOURCE) == OWN


def test_each_peer_is_asked_every_so_often_with_one_question_outstanding() -> None:
    peers = Peers(OWN, [("tcp://a:1", A), ("tcp://b:1", B)])
    peers.learn()
    assert peers.due(0.0, {SOURCE, 1, 2}) == [1, 2, SOURCE]
    peers.asking(1, 100, 0.0)
    peers.asking(SOURCE, 101, 0.0)
    assert peers.due(0.0, {SOURCE, 1, 2}) == [2]  # 1 and the source have a question outstanding
    assert peers.answered(100) == 1 and peers.answered(100) is None and peers.answered(None) is None
    assert peers.due(HAVE_EVERY / 2, {SOURCE, 1}) == []  # not its turn yet; 2 is unreachable
    assert peers.due(HAVE_EVERY, {SOURCE, 1}) == [1]
    assert peers.answered(101) == SOURCE
    assert SOURCE in peers.due(MEMBERS_EVERY, {SOURCE})
    peers.drop(1)
    assert peers.dropped(1) and 1 not in peers.due(10.0, {SOURCE, 1, 2})


def test_a_peer_that_cannot_be_asked_has_no_turn() -> None:
    # The receiving loop waits until next_due: a turn that due() would not take (the peer's
    # connection down, the peer dropped, a question outstanding) made it pass again without waiting.
    peers = Peers(OWN, [("tcp://a:1", A), ("tcp://b:1", B)])
    peers.learn()
    assert peers.due(0.0, {SOURCE}) == [SOURCE] and peers.next_due({SOURCE}) == -math.inf
    peers.asking(SOURCE, 1, 0.0)
    assert peers.due(0.0, {SOURCE}) == [] and peers.next_due({SOURCE}) == math.inf  # 1 and 2 are down
    assert peers.next_due({SOURCE, 1}) == -math.inf  # 1 is back: due at once
    peers.drop(1)
    assert peers.next_due({SOURCE, 1}) == math.inf
    assert peers.answered(1) == SOURCE
    assert peers.next_due({SOURCE}) == MEMBERS_EVERY


def test_a_receive_without_a_token_never_asks_the_source_for_members() -> None:
    peers = Peers(None, [("tcp://c:1", C)])
    peers.learn()
    assert peers.due(0.0, {SOURCE, 1}) == [1]


def test_members_start_their_walks_far_apart() -> None:
    starts = [start_offset(members, 100) for members in range(4)]
    assert starts[0] == 0 and len(set(starts)) == 4
    gaps = sorted((b - a) % 100 for a in starts for b in starts if a != b)
    assert gaps[0] >= 14  # no two of the first four start within a seventh of the plan of each other
    assert start_offset(3, 0) == 0


def test_a_peer_with_work_left_is_asked_less_often() -> None:
    from zmqtransport.fetch.peers import HAVE_REFRESH

    peers = Peers(None, [("tcp://a:1", A), ("tcp://b:1", B)])
    peers.learn()
    for peer, xfer in ((1, 10), (2, 11)):
        peers.asking(peer, xfer, 0.0)
        peers.answered(xfer)
    assert peers.due(HAVE_EVERY, {1, 2}, busy={1}) == [2]
    assert peers.next_due({1, 2}, busy={1, 2}) == HAVE_REFRESH
    assert peers.due(HAVE_REFRESH, {1, 2}, busy={1}) == [1, 2]


def test_a_member_named_under_more_paths_is_learned_again_with_them() -> None:
    peers = Peers(OWN, [("tcp://10.0.0.2:5", A)])
    (first,) = peers.learn()
    assert (first.peer, first.at) == (1, "tcp://10.0.0.2:5")
    assert peers.learn([("tcp://10.0.0.2:5", A)]) == []
    (again,) = peers.learn([("tcp://10.0.0.2:5?paths=10.0.1.2:5", A)])
    assert (again.peer, again.at) == (1, "tcp://10.0.0.2:5?paths=10.0.1.2:5")
    peers.drop(1)
    assert peers.learn([("tcp://10.0.0.2:5?paths=10.0.1.2:5,10.0.2.2:5", A)]) == []


def test_a_claim_makes_the_source_due_at_once() -> None:
    peers = Peers(b"m" * 16)
    peers.asking(SOURCE, 1, 0.0)
    assert peers.due(0.001, {SOURCE}, claim=True) == []  # one question to the source at a time
    assert peers.answered(1) == SOURCE
    assert peers.due(0.001, {SOURCE}) == []  # the members question is not due for MEMBERS_EVERY
    assert peers.due(0.001, {SOURCE}, claim=True) == [SOURCE]
    assert peers.next_due({SOURCE}, claim=True) == -math.inf
    assert peers.next_due(set(), claim=True) == math.inf  # the source unreachable: no claim can go
    assert Peers(None).due(0.001, {SOURCE}, claim=True) == []  # not a member: no claims


def test_questions_go_over_question_connections_and_the_sources_in_turn() -> None:
    from zmqtransport import digests
    from zmqtransport.fetch.planner import ReceivePlanner, Send, Swarm
    from zmqtransport.fetch.registry import Question
    from zmqtransport.fetch.requests import SpanTerms

    sent: dict[str, list[bytes]] = {}
    names = ["source-data", "source-q0", "source-q1", "peer-data", "peer-q"]
    terms = SpanTerms(1, 7, False, 1e9, None, digests.algorithm(digests.SHA256))
    plan = ReceivePlanner(list(range(9)), terms, 2, "the source", Swarm(OWN, [("tcp://a:1", A)]))
    plan.start()
    for name, peer, questions in [("source-data", SOURCE, False), ("source-q0", SOURCE, True),
                                  ("source-q1", SOURCE, True), ("peer-data", 1, False), ("peer-q", 1, True)]:
        plan.add_stream(peer, None if peer == SOURCE else A, questions, name, 0.0)

    def send(now: float) -> None:
        """The questions (have requests) the planner sends now, by the name of the connection they go on."""
        for action in plan.tick(now):
            if isinstance(action, Send) and wire.decode_request(action.request).op == wire.OP_HAVE:
                sent.setdefault(names[action.stream], []).append(action.request)

    send(0.0)
    first = set(sent) - {"peer-q"}
    assert "peer-q" in sent and first in ({"source-q0"}, {"source-q1"})  # nothing where data flows
    question = next(q for q in plan.registry.of(Question) if q.peer == SOURCE)
    plan.out.source_answered(question, None)
    peers = plan.peers
    assert peers is not None
    peers.answered(question.xfer)
    send(MEMBERS_EVERY + 0.001)
    assert {"source-q0", "source-q1"} <= set(sent)  # the next question to the source: over its other path
    assert "source-data" not in sent and "peer-data" not in sent


def test_past_have_peers_each_peer_is_asked_less_often_so_a_member_asks_as_many_questions() -> None:
    # A job start of 64 to 256 replica groups: every member knows up to 128 peers. Asking each every
    # HAVE_EVERY made a member's `have` questions (and its peers' answers) grow with N (the model at 32
    # receivers: 1084 questions to members per receiver, at 16: 419).
    from zmqtransport.fetch.peers import HAVE_PEERS, HAVE_REFRESH

    def asked_again(members: int, busy: bool) -> float:
        tokens = [bytes([1 + n % 250, n // 250]) * 8 for n in range(members)]
        peers = Peers(None, [(f"tcp://m{n}:1", token) for n, token in enumerate(tokens)])
        peers.learn()
        peers.asking(1, 7, 0.0)
        peers.answered(7)
        return peers.next_due({1}, busy={1} if busy else set())

    assert asked_again(HAVE_PEERS, busy=False) == HAVE_EVERY  # up to HAVE_PEERS: as before
    assert asked_again(HAVE_PEERS, busy=True) == HAVE_REFRESH
    # Past it, an idle peer as often as a busy one: a member's questions a second stay what 16 busy peers
    # cost (at 64 receivers of 256 MiB in the model, control messages per receiver 5424 -> 3652, as fast).
    # (128 members named: it takes on half, 64, test_past_max_peers_...)
    assert math.isclose(asked_again(8 * HAVE_PEERS, busy=False), 4 * HAVE_REFRESH)
    assert math.isclose(asked_again(8 * HAVE_PEERS, busy=True), 4 * HAVE_REFRESH)
    many = [bytes([1 + n % 250, n // 250]) * 8 for n in range(2 * HAVE_PEERS)]
    peers = Peers(None, [(f"tcp://m{n}:1", token) for n, token in enumerate(many)])
    peers.learn()
    for peer in range(2, HAVE_PEERS + 2):  # half dropped: the rest are asked at the rates of HAVE_PEERS
        peers.drop(peer)
    peers.asking(1, 7, 0.0)
    peers.answered(7)
    assert peers.next_due({1}) == HAVE_EVERY


def test_past_max_peers_a_member_keeps_the_members_of_lowest_rank_among_half_it_hears_of() -> None:
    # A job start of 64 to 256 replica groups (docs/sim.md, "A partial view", "Balanced views"): a member
    # fetches from at most MAX_PEERS, or half the members the source named to it if more: those of lowest
    # rank (a hash of its token and theirs), so every member is in about as many views (tests/test_views.py).
    from zmqtransport.fetch.peers import MAX_PEERS

    def named(first: int, count: int) -> list[wire.Peer]:
        return [(f"tcp://m{n}:1", bytes([1 + n % 250, n // 250]) * 8) for n in range(first, first + count)]

    def kept(peers: Peers) -> set[bytes]:
        for peer in peers.surplus():
            peers.drop(peer)  # as the planner retires them (nothing asked of them in this test)
        return {token for peer, token in peers.tokens.items() if not peers.dropped(peer)}

    def lowest(peers: Peers, tokens: list[bytes], count: int) -> set[bytes]:
        return set(sorted(tokens, key=peers._rank)[:count])

    few = Peers(OWN, named(0, MAX_PEERS))
    assert len(few.learn()) == MAX_PEERS  # up to MAX_PEERS: every member, as before
    peers = Peers(OWN, named(0, 40))
    first = peers.learn()
    assert {p.token for p in first} == lowest(peers, [t for _, t in named(0, 40)], MAX_PEERS)
    peers.learn(named(0, 100))  # the source names again whom it named, and more: 100 heard of, half kept
    everyone = [t for _, t in named(0, 100)]
    assert kept(peers) == lowest(peers, everyone, 50)
    assert not peers.learn(named(0, 100))  # nothing new, nothing more
    gone = sorted(kept(peers))[:10]
    for peer, token in peers.tokens.items():
        if token in gone:
            peers.drop(peer)  # dropped ones free their places for the next in rank
    out = {token for peer, token in peers.tokens.items() if peers.dropped(peer)}  # retired or dropped: for good
    peers.learn(named(0, 120))
    assert kept(peers) == lowest(peers, [t for _, t in named(0, 120) if t not in out], 60)
    # The same receive's token ranks the same way (the model's runs repeat); another's differently.
    twin = Peers(OWN, named(0, 40))
    assert [p.token for p in twin.learn()] == [p.token for p in first]
    other = Peers(A, named(0, 40))
    assert {p.token for p in other.learn()} != {p.token for p in first}


def test_a_question_budget_is_earned_by_what_lands_and_by_time_and_saved_up_to_a_burst() -> None:
    budget = QuestionBudget()
    assert budget.allows(0.0) == QUESTION_BURST  # a receive starts with a burst saved
    budget.spend(int(QUESTION_BURST))
    assert budget.allows(0.0) == 0 and budget.ready_at() == 1 / QUESTION_FLOOR
    assert budget.allows(0.125) == int(0.125 * QUESTION_FLOOR) == 5  # the floor
    budget.spend(5)
    budget.landed(1 << 19)  # half a MiB landed
    assert budget.allows(0.125) == QUESTIONS_PER_MIB / 2 and budget.ready_at() == -math.inf
    budget.landed(1 << 19)  # the same total again: nothing new
    assert budget.allows(0.125) == QUESTIONS_PER_MIB / 2
    budget.landed(100 << 20)
    assert budget.allows(100.0) == QUESTION_BURST  # never more than a burst


def test_paced_questions_go_to_the_peers_whose_turn_came_first_and_the_source_is_not_counted() -> None:
    peers = Peers(OWN, [(f"tcp://p{n}:1", bytes([n + 10]) * 16) for n in range(4)])
    peers.learn()
    reachable = {SOURCE, 1, 2, 3, 4}
    for peer, at in ((1, 0.5), (2, 0.5), (3, 0.0), (4, 0.2)):  # 3's turn comes first, then 4's
        peers.asking(peer, 100 + peer, at)
        peers.answered(100 + peer)
    now = 1.0
    peers.budget.spend(peers.budget.allows(now) - 2)  # two questions left
    assert peers.due(now, reachable, paced=True) == [3, 4, SOURCE]
    for n, peer in enumerate((3, 4)):
        peers.asking(peer, 300 + n, now)
    assert peers.due(now, reachable, paced=True) == [SOURCE]  # none left: 1 and 2 wait for the floor
    assert peers.next_due(reachable - {SOURCE}, paced=True) == now + 1 / QUESTION_FLOOR
    assert peers.due(now, reachable - {SOURCE}) == [1, 2]  # unpaced: the clock alone
