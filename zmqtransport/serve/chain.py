"""The source's relay chain (docs/protocol.md, "Relays"): who fetches a staging from whom.

:class:`Chain` holds the receivers of the staged step that offered to relay,
in the order their header requests came. Each newcomer is told to fetch from
the newest member still connected, and becomes the newest itself: a chain, so
every receiver's uplink carries the state once and the source's carries it
about once, pipelined message by message. Pure: the serving thread owns it.
What a relay serves is :class:`zmqtransport.relayed.Relayed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import wire

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

    def join(self, peer: bytes, at: str, token: bytes) -> wire.RelayOrder:
        """A receiver offered to relay: where it fetches from (the newest member), and its own token."""
        # A receiver asking again (a retry on the same connection) rejoins at the end, never after itself.
        self.left(peer)
        upstream = self.members[-1] if self.members else None
        self.members.append(Member(peer, at, token))
        del self.members[:-MAX_MEMBERS]
        if upstream is None:
            return wire.RelayOrder(token)
        return wire.RelayOrder(token, upstream.at, upstream.token)

    def left(self, peer: bytes) -> None:
        """The header connection of ``peer`` closed: it no longer relays (its receive ended)."""
        self.members = [member for member in self.members if member.peer != peer]

    def clear(self) -> None:
        self.members = []
