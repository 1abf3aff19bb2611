"""The source's swarm (docs/protocol.md, "Swarm"): which receivers of a staging serve each other.

:class:`Swarm` holds the receivers of the staged step that offered to relay
(from another host), in the order their header requests came. Each newcomer is
told every member so far; members learn of later ones by asking the source
(a ``have`` request showing their own token). Every member fetches from the
source and from the members it knows, each peer as fast as it delivers, so a
slow receiver holds nobody back. Pure: the serving thread owns it. What a
member serves is :class:`zmqtransport.relayed.Relayed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import wire

# Members one swarm remembers (the oldest go first); far above any realistic
# number of replicas recovering at once from one source.
MAX_MEMBERS = 1024


@dataclass(frozen=True)
class Member:
    """A receiver that offered to relay: its header connection, where it serves, its token."""

    peer: bytes
    at: str
    token: bytes


class Swarm:
    """The members of the staged step's swarm."""

    def __init__(self) -> None:
        self.members: list[Member] = []

    def join(self, peer: bytes, at: str, token: bytes) -> wire.RelayOrder:
        """A receiver offered to relay: its token, and the members it may fetch from (the newest last)."""
        # A receiver asking again (a retry on the same connection) rejoins at the end, never beside itself.
        self.left(peer)
        known = self._peers(self.members)
        self.members.append(Member(peer, at, token))
        del self.members[:-MAX_MEMBERS]
        if not known:
            return wire.RelayOrder(token)
        newest_at, newest_token = known[-1]
        return wire.RelayOrder(token, newest_at, newest_token, known)

    def peers_for(self, token: bytes) -> tuple[wire.Peer, ...] | None:
        """The members other than the one serving under ``token`` (None: no member has it)."""
        if not any(member.token == token for member in self.members):
            return None
        return self._peers([member for member in self.members if member.token != token])

    def left(self, peer: bytes) -> None:
        """The header connection of ``peer`` closed: it no longer serves (its receive ended)."""
        self.members = [member for member in self.members if member.peer != peer]

    def clear(self) -> None:
        self.members = []

    @staticmethod
    def _peers(members: list[Member]) -> tuple[wire.Peer, ...]:
        return tuple((member.at, member.token) for member in members[-wire.MAX_PEERS :])
