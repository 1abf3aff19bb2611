"""The swarm as one receive sees it: its peers, and when to ask each what it holds (docs/protocol.md, "Swarm").

A receive that the source made a swarm member (its relay order) knows the
members that joined before it; it learns of later ones by asking the source
(a ``have`` request showing its own token), and learns what each peer holds
by asking that peer (a ``have`` request showing the peer's token), each every
so often, one question outstanding per peer. What the answers say goes into
the span book (:class:`.spans.SpanBook`); new peers get connections.

:class:`Peers` is pure (explicit ``now``, no sockets); the receive's planner
(:mod:`.planner`) asks the questions and feeds it the answers, which are kept
in the receive's one :class:`~.registry.Registry` of requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from .. import wire
from .registry import Question, Registry
from .spans import SOURCE

# Seconds between two questions to one peer about what it holds, while this
# receive has nothing left to ask it for. Each question costs a pass of both
# receives' loops and of the peer's serving thread, and brings back what the
# peer landed since: at 10 ms a member of three at 400 Mbit/s asked its peers
# about once per data message it received, most answers naming one new
# message (then a span of one). At 50 ms it asks a third as often, each answer
# names a few, and its spans grow: 4.5 against 5.7 CPU-s per GiB received
# (one run of three trials), the slowest receive no slower (docs/fast-links.md,
# "Relaying CPU") ...
HAVE_EVERY = 0.05
# ... and while it has: only to keep what it is fetching known. Each question
# costs both serving threads some CPU: with six peers, asking each every
# 10 ms is 600 questions a second per receiver.
HAVE_REFRESH = 0.1
# Peers a receive asks at the rates above; with more, each is asked that much less
# often, so that a member's questions (and the answers its peers' serving threads
# give) stay at what this many peers cost, however large the swarm (a job start
# of 64 to 256 replica groups: every member knows up to 128 peers, and asking
# each every 10-100 ms made `have` questions nine in ten control messages, per
# member in proportion to N). Nothing changes in a swarm of up to 17 receivers.
# Past it, an idle peer is asked as often as a busy one (HAVE_REFRESH, not
# HAVE_EVERY, times the spread): at 64 more peers are idle than at 16, and the
# questions a second per member were still twice those at 16; at the busy rate
# they are what 16 busy peers cost, and the model's 32 and 64 receivers finish
# as fast (docs/sim.md, "Questions past 16 peers").
HAVE_PEERS = 16
# Peers one receive keeps (not counting those it dropped): every member it hears
# of up to this many; past it, this many or half of those it has heard of,
# whichever is more, as a BitTorrent client keeps a few dozen of a swarm's
# peers. The source names a member at most its relay order's 64 and 64 others
# (serve.swarm.Swarm.peers_for), so at 256 receivers a member keeps 32 to
# about 64 peers, and its lanes, its planner's pass and the wait between two
# questions to one peer stay what that many cost. Which ones: those of lowest
# rank (Peers._rank, a hash of its own token and theirs) among the members
# heard of and not dropped, so each member is in about as many views as any
# other, however late it joined (rendezvous hashing); one that leaves the view
# as more are heard of is retired once nothing is asked of it
# (Peers.surplus). A random sample of each answer took on every member named
# early, as the first answers name only the members that joined so far: in
# the model's 64 receivers the members that sat idle at 2 s were in 24 views
# on average, the busy ones in 39; ranked, every member is in 31-32 and the
# median receive ends 2% sooner (docs/sim.md, "Balanced views").
MAX_PEERS = 32
# Seconds between two questions to the source about the swarm's members.
MEMBERS_EVERY = 0.05
# While a receive has this many messages asked and not landed, it has work in
# hand, and its questions to peers are paced by its own progress rather than
# by the clock alone (:class:`QuestionBudget`): QUESTIONS_PER_MIB for each MiB
# that lands, QUESTION_FLOOR a second besides, at most QUESTION_BURST saved
# up. A question and its answer cost both sides' Python some 50-100 us; on a
# clock-driven schedule, a member short of CPU (a few dozen processes on two
# cores) lands less per second and asks as much, so its questions take a
# growing share of the CPU it lacks. Paced, a member that lands 6 MiB a second
# asks about 90 questions a second, not 160. Where the CPU keeps up, the
# budget hardly binds: 256 MiB at 400 Mbit/s lands 45-50 MiB a second, over
# 400 questions' worth, more than the clock asks. A receive with fewer
# messages in hand (its start, its tail, a peer lost) asks on the clock alone:
# that is when it needs to find its next messages. 4 per MiB and 20 a second
# cost the model's members that lie or sit behind slow links 3-10% (their
# answers came too seldom); 8 and 40 cost no row anything (docs/fast-links.md,
# "Questions paced by progress").
QUESTION_PIPELINE = 4
QUESTIONS_PER_MIB = 8.0
QUESTION_FLOOR = 40.0
QUESTION_BURST = 8.0
_MIB = 1 << 20
# Where a member starts its walk through the plan, as a fraction of the plan
# per member that joined before it (the golden ratio's: successive members
# start far apart, whatever their number).
SPREAD = 0.381966


@dataclass(frozen=True)
class NewPeer:
    """A member to connect to: its id in the span book, where it serves, its token."""

    peer: int
    at: str
    token: bytes


class QuestionBudget:
    """How many questions to peers a receive whose pipeline is full may send (see
    :data:`QUESTION_PIPELINE`): :data:`QUESTIONS_PER_MIB` for each MiB that lands, :data:`QUESTION_FLOOR`
    a second besides, at most :data:`QUESTION_BURST` saved up. Pure: time is passed in."""

    def __init__(
        self, per_mib: float = QUESTIONS_PER_MIB, floor: float = QUESTION_FLOOR, burst: float = QUESTION_BURST
    ) -> None:
        self.per_mib, self.floor, self.burst = per_mib, floor, burst
        self.questions = burst  # what may be asked now (a fraction saved towards the next)
        self._landed = 0
        self._at: float | None = None  # when the floor last added to it

    def landed(self, nbytes: int) -> None:
        """The receive has landed ``nbytes`` in all so far."""
        grown, self._landed = max(0, nbytes - self._landed), max(nbytes, self._landed)
        self.questions = min(self.burst, self.questions + self.per_mib * grown / _MIB)

    def allows(self, now: float) -> int:
        """How many questions may go out at ``now``."""
        if self._at is not None:
            self.questions = min(self.burst, self.questions + max(0.0, now - self._at) * self.floor)
        self._at = now
        return int(self.questions + 1e-9)

    def spend(self, count: int) -> None:
        self.questions -= count

    def ready_at(self) -> float:
        """When the floor alone allows the next question (-inf: one may go out now), as of the last
        :meth:`allows`."""
        if self._at is None or self.questions + 1e-9 >= 1:
            return -math.inf
        return self._at + (1 - self.questions) / self.floor


def start_offset(members_before: int, messages: int) -> int:
    """Where a member that joined after ``members_before`` others starts its walk through ``messages``."""
    if messages == 0:
        return 0
    return math.floor(members_before * SPREAD * messages) % messages


class Peers:
    """One receive's peers: their ids, tokens, and questions outstanding.

    ``own_token``: this receive's own token (it asks the source for members
    with it; None: it does not ask). ``known``: the members its relay order
    named. Its questions are kept in ``registry`` (the receive's; a fresh one
    by default).
    """

    def __init__(
        self, own_token: bytes | None, known: Sequence[wire.Peer] = (), registry: Registry | None = None
    ) -> None:
        self.own_token = own_token
        self.tokens: dict[int, bytes] = {}  # peer id -> its token
        self.at: dict[int, str] = {}  # peer id -> where it serves (its paths the source believes)
        self._ids: dict[bytes, int] = {}
        self.registry = registry if registry is not None else Registry()
        self._next_ask: dict[int, float] = {}
        self._dropped: set[int] = set()
        self._known = list(known)
        self._heard: set[bytes] = set()  # every member the source named to this receive
        # The source's numbers of the entries its last answer named (wire.NamedPeer), and whether an
        # answer named a number this receive did not know (one lost, or two that crossed).
        self._named: dict[int, wire.Peer] = {}
        self._unknown_number = False
        self._view: set[bytes] = set()  # the members this receive keeps, as of the last answer (_admit)
        self._ranks: dict[bytes, bytes] = {}  # by token: _rank, for every member heard of (one hash each)
        self.source_from = -math.inf  # the source is asked nothing before (it said ``busy``: fetch/backoff.py)
        self.budget = QuestionBudget()  # what a receive with work in hand may ask (``paced``)

    def learn(self, members: Sequence[wire.NamedPeer] = (), take_on: bool = True) -> list[NewPeer]:
        """Members the source named (and those of the relay order, the first time): the ones that are new,
        and known ones the source now names under more paths (their ``at`` has changed). ``take_on``
        False: no new one (the receive is nearly done)."""
        fresh = []
        offered = [*self._known, *self._resolve(members)]
        admit = self._admit([token for _, token in offered]) if take_on else set()
        for at, token in offered:
            if token == self.own_token:
                continue
            peer = self._ids.get(token)
            if peer is None:
                if token not in admit:
                    continue
                peer = len(self._ids) + 1  # SOURCE is 0
                self._ids[token] = peer
                self.tokens[peer] = token
                self._next_ask[peer] = -math.inf
            elif self.at[peer] == at or peer in self._dropped:
                continue
            self.at[peer] = at
            fresh.append(NewPeer(peer, at, token))
        self._known = []
        return fresh

    def names(self) -> int:
        """How this receive asks the source to name the members: what it named before by number alone,
        or, after a number this receive did not know, everything in full once."""
        return wire.NAMES_FULL if self._unknown_number else wire.NAMES_SHORT

    def _resolve(self, members: Sequence[wire.NamedPeer]) -> list[wire.Peer]:
        """The members an answer named, numbers looked up in the last answer's (one not found is skipped:
        it was named before, so learning it again would only give it another chance to be taken on)."""
        if not members:
            return []
        resolved, named, unknown = list[wire.Peer](), dict[int, wire.Peer](), False
        for entry in members:
            peer: wire.Peer | None
            if isinstance(entry, int):
                number, peer = entry, self._named.get(entry)
            elif len(entry) == 3:
                number, peer = entry[2], (entry[0], entry[1])
            else:  # an earlier release's source: no numbers
                resolved.append((entry[0], entry[1]))
                continue
            if peer is None:
                unknown = True
                continue
            named[number] = peer
            resolved.append(peer)
        self._named, self._unknown_number = named, unknown
        return resolved

    def _admit(self, tokens: Sequence[bytes]) -> set[bytes]:
        """Of ``tokens``, the new members this receive takes on: those in its view, the :data:`MAX_PEERS`
        members (or half those it has heard of, if more) of lowest :meth:`_rank` among those heard and not
        dropped. A dropped peer's place goes to the next in rank."""
        new = list(dict.fromkeys(t for t in tokens if t != self.own_token and t not in self._ids))
        self._heard.update(new)
        gone = {self.tokens[peer] for peer in self._dropped}
        size = max(MAX_PEERS, len(self._heard) // 2)
        self._view = set(sorted(self._heard - gone, key=self._rank)[:size])
        return self._view.intersection(new)

    def _rank(self, token: bytes) -> bytes:
        """Where member ``token`` stands in this receive's order of preference (:func:`.wire.rank`)."""
        rank = self._ranks.get(token)
        if rank is None:
            rank = self._ranks[token] = wire.rank(wire.KEPT, self.own_token or b"", token)
        return rank

    def surplus(self) -> list[int]:
        """Peers taken on (not dropped) that are no longer in the view: more members were heard of since."""
        return [peer for peer, token in self.tokens.items() if peer not in self._dropped and token not in self._view]

    def due(
        self,
        now: float,
        reachable: AbstractSet[int],
        busy: AbstractSet[int] = frozenset(),
        claim: bool = False,
        paced: bool = False,
    ) -> list[int]:
        """Who to ask now: peers (among ``reachable``) without a question outstanding whose turn it is,
        and the source (for members) when this receive has a token to show, at once if it has a ``claim``
        to make. A ``busy`` peer (this receive still has work for it) is asked only every
        :data:`HAVE_REFRESH`. ``paced`` (this receive has work in hand): of the peers due, only as many as
        :attr:`budget` allows, those whose turn came first; the source is not counted."""
        turns = self._turns(reachable, busy, claim)
        due = sorted(peer for peer, turn in turns.items() if peer != SOURCE and now >= turn)
        if paced:
            due = sorted(sorted(due, key=turns.__getitem__)[: self.budget.allows(now)])
            self.budget.spend(len(due))
        if SOURCE in turns and now >= turns[SOURCE]:
            due.append(SOURCE)
        return due

    def next_due(
        self,
        reachable: AbstractSet[int],
        busy: AbstractSet[int] = frozenset(),
        claim: bool = False,
        paced: bool = False,
    ) -> float:
        """When the next question falls due (inf: none can); arguments as for :meth:`due`, whose choice
        it must match: a turn counted here that :meth:`due` would not take makes the caller's loop spin."""
        turns = self._turns(reachable, busy, claim)
        members = min((turn for peer, turn in turns.items() if peer != SOURCE), default=math.inf)
        if paced and members < math.inf:
            members = max(members, self.budget.ready_at())
        return min(members, turns.get(SOURCE, math.inf))

    def _turns(self, reachable: AbstractSet[int], busy: AbstractSet[int], claim: bool) -> dict[int, float]:
        """When each peer that may be asked is next due: among ``reachable``, not dropped, with no question
        outstanding; the source only when this receive has a token to show (at once with a ``claim``).
        A peer that is not reachable (its connection down, or given up on) has no turn: it is asked
        again once it is back."""
        waiting = {question.peer for question in self.registry.of(Question)}
        turns: dict[int, float] = {}
        busy_after = self._busy_after()
        for peer in reachable:
            if peer in waiting or peer in self._dropped:
                continue
            if peer == SOURCE:
                if self.own_token is not None:
                    turns[SOURCE] = max(self.source_from, -math.inf if claim else self._next_ask.get(SOURCE, -math.inf))
                continue
            turns[peer] = self._next_ask.get(peer, -math.inf) + busy_after * (peer in busy)
        return turns

    def turn_of(self, peer: int, busy: bool) -> float:
        """When ``peer`` (not the source; ``busy``: this receive has work for it) is next due once it has
        no question outstanding, as :meth:`_turns` counts it."""
        return self._next_ask.get(peer, -math.inf) + self._busy_after() * busy

    def _busy_after(self) -> float:
        """How much later than an idle peer's a busy peer's turn comes."""
        return (HAVE_REFRESH - self._every()) * self.spread()

    def asking(self, peer: int, xfer: int, now: float, claim: bool = False) -> Question:
        """Question ``xfer`` goes to ``peer`` (to the source: with a ``claim``, or not)."""
        question = Question(xfer, peer, now, self._next_ask.get(peer, -math.inf), claim)
        self.registry.add(question)
        self._next_ask[peer] = now + (MEMBERS_EVERY if peer == SOURCE else self._every() * self.spread())
        return question

    def heard(self, peer: int, now: float) -> None:
        """``peer`` said what it holds unasked (a span's end): its next question comes an interval from
        ``now``, as if asked now (one already outstanding is answered as usual)."""
        if peer in self.tokens:
            self._next_ask[peer] = max(self._next_ask.get(peer, -math.inf), now + self._every() * self.spread())

    def _every(self) -> float:
        """How often an idle peer is asked, over :meth:`spread`: :data:`HAVE_EVERY` up to 16 peers; past
        that, :data:`HAVE_REFRESH`, as often as a busy one, so a member's questions a second stay what 16
        busy peers cost however many of its peers are idle."""
        return HAVE_EVERY if self.spread() <= 1.0 else HAVE_REFRESH

    def spread(self) -> float:
        """The peers not dropped over :data:`HAVE_PEERS`, at least 1: how many times less often than
        :data:`HAVE_EVERY` (and :data:`HAVE_REFRESH`) each peer is asked, and how many times longer than
        :data:`~.spans.QUIET_FIRST` a peer may be silent before it is dropped (each serves that many more)."""
        return max(1.0, (len(self.tokens) - len(self._dropped)) / HAVE_PEERS)

    def unasked(self, xfer: int) -> None:
        """Question ``xfer`` did not go out after all: its peer's turn is as it was."""
        question = self.question(xfer)
        if question is not None:
            self.registry.pop(xfer)
            self._next_ask[question.peer] = question.turn_before

    def question(self, xfer: int | None) -> Question | None:
        """The question ``xfer`` still unanswered (None: not a question of ours, or answered)."""
        return self.registry.get(xfer, Question)

    def answered(self, xfer: int | None) -> int | None:
        """The peer a reply to question ``xfer`` comes from (None: not a question of ours)."""
        question = self.question(xfer)
        if question is None:
            return None
        self.registry.pop(question.xfer)
        return question.peer

    def token_of(self, peer: int) -> bytes | None:
        """What a question to ``peer`` shows: the peer's token, or this receive's own to the source."""
        return self.own_token if peer == SOURCE else self.tokens.get(peer)

    def drop(self, peer: int) -> None:
        """Nothing more is asked of ``peer`` for this receive."""
        self._dropped.add(peer)
        for xfer in [q.xfer for q in self.registry.of(Question) if q.peer == peer]:
            self.registry.pop(xfer)

    def dropped(self, peer: int) -> bool:
        return peer in self._dropped

