"""What the scheduler holds: running transfers and parked requests, pure records.

A :class:`Transfer` is one receiver's running fetch (or span fetch, or digest
request), with its credit and its progress; a :class:`Parked` request waits
for a step to be staged. Both are keyed by :data:`Key`. Whether a transfer is
stalled (:func:`stalled`) and whether it hashes what it sends
(:func:`transfer_hashing`) are read off the records alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import digests, wire

if TYPE_CHECKING:
    from .staged import Served, Staged

Key = tuple[bytes, int]  # (routing id of the receiver's socket, transfer id it chose)


@dataclass(frozen=True)
class Hashing:
    """A transfer hashes each message it sends (:mod:`.digests`); ``inline``: the digest goes in its envelope."""

    algorithm: digests.Algorithm
    inline: bool


@dataclass
class Transfer:
    """One receiver's running fetch of the staged step."""

    peer: bytes
    xfer: int
    staged: Served  # what it sends: the staged step, a withdrawn one's snapshot, or a step this side relays
    credit: int
    address: str
    started: float
    last_progress: float  # when credit last arrived, libzmq last released a frame, or it started
    next_seq: int = 0
    stop: int = -1  # one past the last data message to send; -1: the whole plan
    span: bool = False  # a span fetch (part of a striped receive): no header was sent
    # Its connection holds what a disallow should wait for at most (serve/frames.py):
    # it sends again once a frame of that connection is released.
    paused: bool = False
    hashing: Hashing | None = None
    # A digest request: answered with the span's digests (serve.digests.DigestWork), no data.
    digests_only: bool = False

    def __post_init__(self) -> None:
        self.first = self.next_seq
        if self.stop < 0:
            self.stop = self.staged.messages

    @property
    def key(self) -> Key:
        return (self.peer, self.xfer)

    def grant(self, credit: int, now: float) -> None:
        """The receiver granted ``credit`` more data messages (at most :data:`wire.MAX_CREDIT` held)."""
        self.credit = min(wire.MAX_CREDIT, self.credit + credit)
        self.last_progress = now

    @property
    def done(self) -> bool:
        return self.next_seq >= self.stop

    @property
    def sendable(self) -> bool:
        return (
            self.credit > 0
            and not self.paused
            and not self.done
            and not self.digests_only
            and self.staged.available(self.next_seq)
        )


@dataclass(frozen=True)
class Parked:
    """A fetch that arrived while nothing was staged; it waits until ``deadline``."""

    peer: bytes
    request: wire.Request
    deadline: float
    address: str

    @property
    def key(self) -> Key:
        return (self.peer, self.request.xfer)


def stalled(transfer: Transfer, now: float, stall: float) -> str | None:
    """Why ``transfer`` is stalled (None: it is not): it waited ``stall`` seconds without progress.

    A transfer waits for credit; a digest request, only for device memory
    hashed as the pump sends it; a paused transfer, for its connection to
    drain (serve/frames.py).
    """
    waiting = transfer.credit == 0 or transfer.digests_only or transfer.paused
    if not waiting or now - transfer.last_progress <= stall:
        return None
    if transfer.digests_only:
        return f"no digest of message {transfer.next_seq} came within {stall:.1f} s"
    return f"receiver granted no credit and took no data for {stall:.1f} s"


def transfer_hashing(request: wire.Request, staged: Staged, relays: bool) -> Hashing | None:
    """Whether a transfer of ``staged`` hashes what it sends (:class:`Hashing`).

    Inline digests when the receiver asked; and the messages sent to a relay
    of a staging in device memory, whose digests its downstream will ask for
    and which digest requests cannot read (serve.digests).
    """
    algorithm = digests.choose(request.verify)
    if algorithm is None:
        return None
    if request.inline:
        return Hashing(algorithm, inline=True)
    if relays and staged.device_plan is not None:
        return Hashing(algorithm, inline=False)
    return None
