"""The source's relay chain (docs/protocol.md, "Relays"): who fetches a staging from whom.

:class:`Chain` holds the receivers of the staged step that offered to relay,
in the order their header requests came. Each newcomer is told to fetch from
the newest member still connected, and becomes the newest itself: a chain, so
every receiver's uplink carries the state once and the source's carries it
about once, pipelined message by message. Pure: the serving thread owns it.
What a relay serves is :class:`zmqtransport.relayed.Relayed`.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace

from .. import wire
from ..net import parse_metadata

# Members one chain remembers (the oldest go first); far above any realistic
# number of replicas recovering at once from one source.
MAX_MEMBERS = 1024


@dataclass(frozen=True)
class Member:
    """A receiver that offered to relay: its header connection, where it serves, its token."""

    peer: bytes
    at: str
    token: bytes


class Chain:
    """The source's relay chain for the staged step (pure; the serving thread owns it)."""

    def __init__(self) -> None:
        self.members: list[Member] = []

    def join(self, peer: bytes, at: str, token: bytes, follows: bool = True) -> wire.RelayOrder:
        """A receiver offered to relay: where it fetches from (the newest member), and its own token.

        ``follows``: it may be sent to a relay (it verifies what relays send);
        one that does not fetches from the source, and others may still fetch from it.
        """
        # A receiver asking again (a retry on the same connection) rejoins at the end, never after itself.
        self.left(peer)
        upstream = self.members[-1] if self.members and follows else None
        self.members.append(Member(peer, at, token))
        del self.members[:-MAX_MEMBERS]
        if upstream is None:
            return wire.RelayOrder(token)
        return wire.RelayOrder(token, upstream.at, upstream.token)

    def offer(self, peer: bytes, offer: str, address: str, token: bytes, follows: bool) -> wire.RelayOrder | None:
        """A receiver at ``address`` offered to relay at ``offer``: joined under the paths on its own host.

        None: no path of the offer is on that host (:func:`believable_offer`); it is served directly.
        """
        at = believable_offer(offer, address)
        return None if at is None else self.join(peer, at, token, follows)

    def left(self, peer: bytes) -> None:
        """The header connection of ``peer`` closed: it no longer relays (its receive ended)."""
        self.members = [member for member in self.members if member.peer != peer]

    def clear(self) -> None:
        self.members = []


def believable_offer(offer: str, address: str) -> str | None:
    """An offer to relay (a metadata string) kept to the paths on ``address``, the host its connection comes from.

    Anyone who reaches the source may offer: believed as it stands, an offer
    would send the next receivers wherever it names (another service, a host
    that answers nothing). Kept to the connection's own address, it can only
    send them back to the host that asked. Hosts are compared as IP addresses
    (an IPv4 peer on a dual-stack socket reads ``::ffff:10.0.0.7``); a path
    named by a hostname is not kept (the source resolves no names). None when
    no path is left or the offer does not parse.
    """
    peer = _ip(address)
    if peer is None:
        return None
    try:
        parsed = parse_metadata(offer)
    except ValueError:
        return None
    kept = [path for path in parsed.paths if _ip(path.host) == peer]
    if not kept:
        return None
    first, *more = kept
    return replace(parsed, host=first.host, port=first.port, more_paths=tuple(more)).to_metadata()


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return None
    mapped = getattr(ip, "ipv4_mapped", None)
    return mapped or ip
