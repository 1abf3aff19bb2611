"""What peers say they hold and are fetching: hints with deadlines (docs/security.md, "Claims are hints").

A swarm member tells the others what it holds and what it is fetching now
(a ``have`` reply's ``bits`` and ``coming``; what the source reserved for it
is part of what it fetches). A receive believes what a peer holds only as far
as asking it for it (a peer that does not deliver what it was asked for is
dropped by the quiet rules of :mod:`.spans`), but what a peer is *fetching*
it believes more: the source is not asked for a message another member as
fast is about to serve. Believed without end, a member that answers "I hold
nothing but am fetching everything" and serves nothing kept another receiver
from asking the source for anything until its timeout (15 s for a 0.1 s
transfer); so did an honest member frozen (SIGSTOP) with messages reserved.

So a claim counts only while the peer backs it: what it holds grows, or it
delivers, at least once per :func:`claim_bound` (a multiple of the time a
message takes here, from the source or from that peer, and a floor). A peer
whose claims this receive still wants went that long without either loses
them (they lapse: the receive fetches those messages from the source and the
others at once), and if it goes :data:`DROP_AFTER` claim bounds so, still
claiming, the receive drops it (:meth:`.planner.ReceivePlanner`). A lapsed
peer that comes to hold more, or delivers, is believed again: an honest
member starved of CPU for a moment on a loaded host keeps its place (on the
unshaped lab rows, where the bound is the floor, dropping at the first bound
dropped such members), while one that claims and never delivers costs one
claim bound and is dropped.

Pure: bit sets as Python integers, an explicit ``now``.
"""

from __future__ import annotations

# A peer's claims lapse after this many times the time a message takes here
# (the slowest live path from the source, or that peer's own pace when it is
# slower): an honest member fetching lands a message every message time or
# so, from the source or from the others, and is asked what it holds every
# 50-100 ms (peers.HAVE_EVERY, HAVE_REFRESH). Twice the quiet rule's
# QUIET_GAPS: a member fetching waits on senders that serve others too.
CLAIM_GAPS = 8.0
# Seconds: never sooner (three of a busy peer's have refreshes, and scheduling
# noise on a busy host); well within the rogue rows' clean time (issue 34's
# target: a receive with a peer that claims and serves nothing within 1.5x of
# the clean time).
CLAIM_FLOOR = 0.3
# Claim bounds a peer's claims may go unbacked, still claiming, before it is
# dropped for the receive; they lapse after the first.
DROP_AFTER = 4


def claim_bound(source_time: float, pace: float | None) -> float:
    """Seconds a peer's claims are believed without its holdings growing or its delivering anything:
    ``source_time`` is what a message takes from the source here, ``pace`` the peer's own (None: unknown)."""
    return max(CLAIM_FLOOR, CLAIM_GAPS * max(source_time, pace or 0.0))


class Holdings:
    """What each peer holds and is fetching, as it reported (bit sets within ``everything``; ``source``
    holds all and says nothing), and since when each peer's claims have gone unbacked."""

    def __init__(self, everything: int, source: int) -> None:
        self.everything = everything
        self.source = source
        self.held: dict[int, int | None] = {source: None}  # None: everything
        self.coming: dict[int, int] = {}  # what each peer is believed to be fetching (0 once lapsed)
        self.backed: dict[int, float] = {}  # peer -> when its claims were last backed (or first made)
        self.lapsed: dict[int, int] = {}  # peer -> what it still claims, not believed until it backs a claim

    def report(self, peer: int, have: int, coming: int, now: float) -> bool:
        """``peer`` says it holds ``have`` and is fetching ``coming``: what it holds grew (its claims are
        backed, and believed again if they had lapsed), or it claims anew (their clock starts now), or
        neither (it keeps running). Whether the report is news (what it is believed to hold or fetch
        changed): one that is not changes no decision before the time the last one named."""
        if peer == self.source:
            return False
        was = (self.held.get(peer, -1), self.coming.get(peer), self.lapsed.get(peer))
        before = self.held.get(peer) or 0
        held = have & self.everything
        if held & ~before:
            self._backed(peer, now)
        elif not self.coming.get(peer) and peer not in self.lapsed:
            self.backed[peer] = now
        self.held[peer] = held
        claims = coming & self.everything & ~held
        if peer in self.lapsed:
            self.lapsed[peer], claims = claims, 0
        self.coming[peer] = claims
        return was != (self.held[peer], claims, self.lapsed.get(peer))

    def delivered(self, peer: int, now: float) -> None:
        """A message from ``peer`` arrived at ``now``: it is serving, its claims are backed."""
        if peer in self.backed and now > self.backed[peer]:
            self._backed(peer, now)

    def _backed(self, peer: int, now: float) -> None:
        self.backed[peer] = now
        self.lapsed.pop(peer, None)  # believed again from its next report

    def of(self, peer: int) -> int:
        held = self.held.get(peer, 0)
        return self.everything if held is None else held

    def unbacked(self, peer: int, wanted: int, now: float, bound: float) -> bool:
        """Whether to drop ``peer``: it claims to fetch some of ``wanted`` and has backed no claim for
        :data:`DROP_AFTER` times ``bound`` seconds. After one ``bound`` its claims lapse (here)."""
        since = now - self.backed.get(peer, now)
        if peer in self.lapsed:
            return bool(self.lapsed[peer] & wanted) and since >= DROP_AFTER * bound
        claims = self.coming.get(peer, 0)
        if claims & wanted and since >= bound:
            self.lapsed[peer], self.coming[peer] = claims, 0  # not waited on any more: fetched elsewhere
        return False

    def forget(self, peer: int) -> None:
        self.held[peer] = 0
        self.coming.pop(peer, None)
        self.backed.pop(peer, None)
        self.lapsed.pop(peer, None)
