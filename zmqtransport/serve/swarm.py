"""The source's swarm (docs/protocol.md, "Swarm"): which receivers of a staging serve each other.

:class:`Swarm` holds the receivers of the staged step that offered to relay
(from another host), in the order their header requests came. Each newcomer is
told every member so far; members learn of later ones by asking the source
(a ``have`` request showing their own token). Every member fetches from the
source and from the members it knows, each peer as fast as it delivers, so a
slow receiver holds nobody back. A member is named under the paths of its
offer on the addresses its connections to the source come from: the one its
header request came from, and every other one it asks the source from (a
receiver with a NIC per network asks over each), so peers fetch from it over
all of them. Pure: the serving thread owns it. What a member serves is
:class:`zmqtransport.relayed.Relayed`.
"""

from __future__ import annotations

import bisect
import heapq
import ipaddress
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .. import digests, wire
from ..bitsets import lowest_from, run, run_length
from ..net import parse_metadata

if TYPE_CHECKING:
    from .staged import Served
    from .transfers import Transfer

# The metadata parameter of a CurveZMQ server key (zmqtransport.security.METADATA_KEY), and its z85 form.
CURVE_PARAM = "curve"
Z85_KEY_CHARS = 40
_Z85_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
_Z85_DIGITS = {char: value for value, char in enumerate(_Z85_ALPHABET)}

# Members one swarm remembers (the oldest go first); far above any realistic
# number of replicas recovering at once from one source.
MAX_MEMBERS = 1024
# Seconds between two looks at whether the uplink's measure within the step says the swarm no longer pays
# (Swarm.steps_aside): a member asks every 50 ms, and a look may count the hosts of every transfer.
ASIDE_EVERY = 0.05


@dataclass(frozen=True)
class Member:
    """A receiver that offered to relay: its header connection, where it serves, its token; ``number``:
    this entry's in have replies (a new one whenever ``at`` changes, so a number means one entry)."""

    peer: bytes
    at: str
    token: bytes
    number: int


class Swarm:
    """The members of the staged step's swarm."""

    def __init__(self, curve: bool = False) -> None:
        # Whether this side serves with CurveZMQ: an offer is believed only with the same
        # security (a member's metadata the next receivers could not use would fail them).
        self.curve = curve
        self._members: list[Member] = []
        # The members by token, kept beside the list: a member's every question to the source looks itself
        # up, and a dictionary built per question cost O(members) each, O(members^2) a round of questions.
        self._by_token: dict[bytes, Member] = {}
        # Bumped whenever a member joins, leaves or is renamed: an answer computed at one version is the
        # same at the next question while it holds (_repeats).
        self._version = 0
        # By asker's token: (version, the answer of numbers alone) that its next NAMES_SHORT question gets
        # while nothing changed: every member it is named was named to it in the answer before.
        self._repeats: dict[bytes, tuple[int, tuple[int, ...]]] = {}
        # By token: what a member offered, and the addresses its connections came from.
        self.offers: dict[bytes, tuple[str, frozenset[str]]] = {}
        # The digest algorithm the verifying members chose: what they will ask the source
        # for, of messages other members fetch (see Scheduler's span fetches of device memory).
        self.algorithm: digests.Algorithm | None = None
        # Messages reserved for some member (a bit set), and where the next reservation starts.
        self.claimed = 0
        self._cursor = 0
        # Messages of the staging sent to some receiver at least once: their first copies are out.
        self.sent = 0
        # By asker's token: the numbers of the entries the last answer to it named (wire.NamedPeer), each
        # named in full there or earlier: what the next may name by number alone; at most wire.MAX_PEERS.
        self.told: dict[bytes, frozenset[int]] = {}
        # By asker's token: (rank, token) of the members it is named (peers_for), lowest rank first; at
        # most wire.MAX_PEERS. Made when it first asks (a hash per member), kept as members join (a hash
        # per asker), made afresh after one of them leaves.
        self.named: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self._numbers = 0
        # Whether this staging's swarm stepped aside (steps_aside), and when that was last looked at.
        self.aside = False
        self._aside_at = float("-inf")

    @property
    def members(self) -> list[Member]:
        """The members, in the order they joined (a rejoin moves to the end). Assign, do not mutate."""
        return self._members

    @members.setter
    def members(self, members: list[Member]) -> None:
        self._members = members
        self._by_token = {member.token: member for member in members}
        self._version += 1

    def join(self, peer: bytes, at: str, token: bytes, follows: bool = True) -> wire.RelayOrder:
        """A receiver offered to relay: its token, and the members it may fetch from (the newest last).

        ``follows``: it may fetch from other members (it verifies what they
        send); one that does not fetches from the source, and the others may
        still fetch from it.
        """
        # A receiver asking again (a retry on the same connection) rejoins at the end, never beside itself.
        self.left(peer)
        known = self._peers(self.members) if follows else ()
        member = Member(peer, at, token, self._number())
        self._members.append(member)
        self._by_token[token] = member
        self._version += 1
        for asker, named in self.named.items():
            entry = (wire.rank(wire.NAMED, asker, token), token)
            if len(named) < wire.MAX_PEERS or entry < named[-1]:
                bisect.insort(named, entry)
                del named[wire.MAX_PEERS :]
        if len(self.members) > MAX_MEMBERS:
            self.members = self.members[-MAX_MEMBERS:]
            self._forget_non_members()
        if not known:
            return wire.RelayOrder(token)
        newest_at, newest_token = known[-1]
        return wire.RelayOrder(token, newest_at, newest_token, known)

    def offer(
        self, peer: bytes, offer: str, address: str, token: bytes, algorithm: digests.Algorithm | None
    ) -> wire.RelayOrder | None:
        """A receiver at ``address`` offered to relay at ``offer``: joined under the paths on its own host.

        ``algorithm``: the digest algorithm it verifies with (None: it does not
        verify, and is sent to no other member). None: no path of the offer is
        on that host (:func:`believable_offer`); it is served directly.
        """
        at = believable_offer(offer, [address], self.curve)
        if at is None:
            return None
        order = self.join(peer, at, token, follows=algorithm is not None)
        if algorithm is not None:
            self.algorithm = algorithm
        self.offers[token] = (offer, frozenset([address]))
        return order

    def seen(self, token: bytes, address: str) -> None:
        """The member serving under ``token`` asked from ``address``: its offer's paths there are believed too."""
        offer, addresses = self.offers.get(token, ("", frozenset()))
        if not offer or address in addresses:
            return
        addresses |= {address}
        self.offers[token] = (offer, addresses)
        at = believable_offer(offer, addresses, self.curve)
        if at is not None:
            self.members = [replace(m, at=at, number=self._number()) if m.token == token else m for m in self.members]

    def peers_for(self, token: bytes, names: int = wire.NAMES_PLAIN) -> tuple[wire.NamedPeer, ...] | None:
        """The members named to the one serving under ``token`` (None: no member has it), as it asked
        (``names``, wire.NamedPeer): with ``NAMES_SHORT``, an entry this side named to it in full in an
        earlier answer, and names again now, goes as its number alone.

        Every answer names the same members as before, the ones the asker
        did not take on too (it may take them on after a drop); only their
        bytes shrink, from about 40 to 1-5 each. Which members: the
        ``wire.MAX_PEERS`` others of lowest :func:`wire.rank` for the asker.
        The newest 64 (as before 2026-12-06) named the last 64 to join to
        every member, so at 256 receivers each of those was in about half the
        views and most others in a few: the model's slowest receive took
        1.90-1.93x the ideal, 1.69-1.70x ranked (docs/sim.md, "Balanced views").
        """
        by_token = self._by_token
        if token not in by_token:
            return None
        if names == wire.NAMES_SHORT:
            repeat = self._repeats.get(token)
            if repeat is not None and repeat[0] == self._version:
                return repeat[1]  # nothing changed since the last answer named them all: numbers alone
        named = self.named.get(token)
        if named is None:
            ranked = ((wire.rank(wire.NAMED, token, other), other) for other in by_token if other != token)
            named = self.named[token] = heapq.nsmallest(wire.MAX_PEERS, ranked)
        others = [by_token[other] for _, other in named]
        if names == wire.NAMES_PLAIN:
            return self._peers(others)
        told = self.told.get(token, frozenset()) if names == wire.NAMES_SHORT else frozenset()
        numbers = tuple(member.number for member in others)
        self.told[token] = frozenset(numbers)
        self._repeats[token] = (self._version, numbers)
        return tuple(m.number if m.number in told else (m.at, m.token, m.number) for m in others)

    def steps_aside(self, pays: Callable[[], bool | None], now: float) -> bool:
        """Whether the members should fetch the rest from the source alone (a have reply's ``alone``).

        ``pays``: whether a swarm pays for the step's receivers by the uplink's
        measure of this step (None: not measured enough yet, or the members
        were made on an earlier step's measure, which stands:
        :meth:`.uplink.Uplink.step_pays`). Members are made
        while it pays, and with nothing measured (a job's first step, every
        receiver asking at once) it is taken to pay. Where the step's own
        measure then shows an uplink that feeds every receiver faster than
        they relay (an unshaped NIC), the swarm costs each member 2-3x a
        direct receive's CPU and time for nothing: told ``alone``, members drop
        their peers and fetch the rest from the source in spans
        (docs/protocol.md, "Swarm", "Stepping aside"). Once aside, a step stays
        aside: its members have dropped their peers.
        """
        if not self.aside and self.members and now >= self._aside_at + ASIDE_EVERY:
            self._aside_at = now
            self.aside = pays() is False
        return self.aside

    def claim(self, token: bytes, count: int, messages: int) -> tuple[int, ...] | None:
        """Reserve up to ``count`` consecutive messages of ``messages`` that no member has been reserved, for
        the member serving under ``token``: ``(first, stop)``; ``()`` when every message is reserved; None
        when no member has that token (a claim is for members only).

        Members ask the source only for what it reserved for them, until every
        message is: the source sends each message to the swarm once, whatever
        the members know of each other (docs/protocol.md, "Swarm"). A member that
        leaves with reservations it did not fetch costs nothing more than today:
        once every message is reserved, members ask the source for whatever no
        peer holds.
        """
        if not self._member(token):
            return None
        free = run(0, messages) & ~self.claimed
        if not free:
            return ()
        first = lowest_from(free, self._cursor)
        stop = first + run_length(free, first, count)
        self.claimed |= run(first, stop)
        self._cursor = stop % messages
        return first, stop

    def first_copies(self, ready: list[Transfer], staged: Served | None) -> list[Transfer]:
        """Of the ``ready`` transfers, while there are members, those whose next message of ``staged`` no
        receiver has been sent yet (not in :attr:`sent`), if any; else all of them (Scheduler.next_round)."""
        if not self.members or self.aside:  # members that fetch alone each walk the whole state
            return ready
        first = [t for t in ready if t.staged is staged and not self.sent >> t.next_seq & 1]
        return first or ready

    def left(self, peer: bytes) -> None:
        """The header connection of ``peer`` closed: it no longer serves (its receive ended)."""
        self.members = [member for member in self.members if member.peer != peer]
        self._forget_non_members()

    def clear(self) -> None:
        self.members = []
        self.offers = {}
        self.algorithm = None
        self.claimed = 0
        self._cursor = 0
        self.sent = 0
        self.told = {}
        self._repeats = {}
        self.named = {}
        self.aside, self._aside_at = False, float("-inf")

    def _forget_non_members(self) -> None:
        # The members' tokens, as indexed: a check per entry against the list was O(members^2) at every leave.
        tokens = self._by_token
        self.offers = {token: offer for token, offer in self.offers.items() if token in tokens}
        self.told = {asker: told for asker, told in self.told.items() if asker in tokens}
        self._repeats = {asker: repeat for asker, repeat in self._repeats.items() if asker in tokens}
        # An asker that was named a leaver is ranked afresh when it next asks: filled by later joiners
        # alone, its list would miss members ranked just past its old last.
        self.named = {
            asker: named
            for asker, named in self.named.items()
            if asker in tokens and all(member in tokens for _, member in named)
        }

    def _number(self) -> int:
        self._numbers = (self._numbers + 1) % (wire.MAX_NAME_NUMBER + 1)
        return self._numbers

    def _member(self, token: bytes) -> bool:
        return token in self._by_token

    @staticmethod
    def _peers(members: list[Member]) -> tuple[wire.Peer, ...]:
        return tuple((member.at, member.token) for member in members[-wire.MAX_PEERS :])


def believable_offer(offer: str, addresses: str | Iterable[str], curve: bool = False) -> str | None:
    """An offer to relay (a metadata string) kept to the paths on ``addresses``, those its connections come from.

    Anyone who reaches the source may offer: believed as it stands, an offer
    would send the next receivers wherever it names (another service, a host
    that answers nothing). Kept to the connections' own addresses, it can only
    send them back to the host that asked. Hosts are compared as IP addresses
    (an IPv4 peer on a dual-stack socket reads ``::ffff:10.0.0.7``); a path
    named by a hostname is not kept (the source resolves no names). None when
    no path is left or the offer does not parse, or when its parameters are not
    what the source's own receivers can use (:func:`usable_params`).
    """
    seen = {_ip(address) for address in ([addresses] if isinstance(addresses, str) else addresses)} - {None}
    if not seen:
        return None
    try:
        parsed = parse_metadata(offer)
    except ValueError:
        return None
    if not usable_params(parsed.params, curve):
        return None
    kept = [path for path in parsed.paths if _ip(path.host) in seen]
    if not kept:
        return None
    first, *more = kept
    return replace(parsed, host=first.host, port=first.port, more_paths=tuple(more)).to_metadata()


def usable_params(params: Mapping[str, str], curve: bool) -> bool:
    """Whether an offer's metadata parameters are the source's own security: the next receivers can use it.

    The receivers of one source are configured like it (a job secret, or none):
    an offer asking for CurveZMQ of a source without it (or one without a key
    from a source with it) would make every receiver sent there fail, so it is
    not believed. With CurveZMQ the key must be well-formed; no other
    parameter is known.
    """
    if set(params) - {CURVE_PARAM}:
        return False
    key = params.get(CURVE_PARAM)
    if key is None:
        return not curve
    return curve and _is_z85_key(key)


def _is_z85_key(text: str) -> bool:
    """Whether ``text`` is a CurveZMQ public key in z85 (40 characters, each group of five under 2**32),
    as :func:`zmqtransport.security.check_public_key` accepts; here without zmq, which this module needs not."""
    if len(text) != Z85_KEY_CHARS or any(char not in _Z85_DIGITS for char in text):
        return False
    for at in range(0, Z85_KEY_CHARS, 5):
        value = 0
        for char in text[at : at + 5]:
            value = value * 85 + _Z85_DIGITS[char]
        if value >= 1 << 32:
            return False
    return True


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip
