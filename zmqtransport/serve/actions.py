"""What the scheduler tells its socket owner to do: one frozen record per action.

:class:`~zmqtransport.serve.scheduler.Scheduler` returns these;
:mod:`~zmqtransport.serve.outbox` carries them out on the ROUTER socket.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import wire
from ..relayed import Relayed
from .transfers import Key, Parked, Transfer


@dataclass(frozen=True)
class Refuse:
    """Answer a request with an error reply; report a failed send with ``Scheduler.undelivered``."""

    peer: bytes
    xfer: int
    code: str
    message: str
    parked: Parked | None = None  # the parked request this answers, if any

    @property
    def key(self) -> Key:
        return (self.peer, self.xfer)


@dataclass(frozen=True)
class Abort:
    """End a running transfer with an error reply (the transfer is already forgotten)."""

    transfer: Transfer
    code: str
    message: str


@dataclass(frozen=True)
class SendHeader:
    """Send the header of the staged step; report a failed send with ``Scheduler.undelivered``."""

    peer: bytes
    xfer: int
    header_body: bytes
    header_only: bool  # the receiver asked for the header alone: send ``end`` right after it
    parked: Parked | None  # the parked request this starts, if any
    stage_id: int | None = None  # the staging's id (announces that span fetches are served)
    relay: wire.RelayOrder | None = None  # for a receiver that offered to relay
    digest: str | None = None  # for a receiver that offered to verify: the algorithm of its digests

    @property
    def key(self) -> Key:
        return (self.peer, self.xfer)

    @property
    def digests_ahead(self) -> bool:
        """Said beside every ``digest``: each staging hashes any message on request, sent or not (device
        memory through the stager's ring, serve/digests.py), so a receiver may wait for a late read-ahead."""
        return self.digest is not None


@dataclass(frozen=True)
class Have:
    """Answer a ``have`` request: what this side holds (None: everything) and, as the source, the swarm."""

    peer: bytes
    xfer: int
    bits: int | None
    messages: int
    peers: tuple[wire.NamedPeer, ...] = ()
    coming: int = 0
    claimed: tuple[int, ...] | None = None  # to a member's claim: what the swarm reserved for it
    alone: bool = False  # to a member: this side's uplink outpaces the swarm, fetch the rest from it alone


@dataclass(frozen=True)
class Finish:
    """Every data message went out: send ``end`` and record the transfer."""

    transfer: Transfer
    seconds: float

    def envelope(self) -> bytes:
        """The ``end``: a relay's says what it holds and is fetching as the span ends (its downstream will
        ask it for more; read as it goes out: the receiving thread only adds bits, so a stale read says
        less than is true, never more)."""
        staged = self.transfer.staged
        if isinstance(staged, Relayed):
            return wire.end_reply(self.transfer.xfer, (staged.have, staged.coming, staged.messages))
        return wire.end_reply(self.transfer.xfer)

Action = Refuse | Abort | SendHeader | Finish | Have
