"""Whether a request is let in: the server's limits and every refusal of a request as it arrives.

Pure functions of the request, what it asks of (the staged step, a withdrawn
staging's snapshot) and the transfers running; the scheduler calls them and
returns their refusals as :class:`~zmqtransport.serve.actions.Refuse` actions.
Fetches and span fetches (:func:`start_refusal`, :func:`span_refusal`) count
against :attr:`Limits.transfers_per_peer` and :attr:`Limits.transfers`;
digest requests (:func:`digest_transfer`) have bounds of their own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .. import digests, wire
from .actions import Refuse
from .transfers import Hashing, Key, Transfer

if TYPE_CHECKING:
    from .snapshot import Snapshot
    from .staged import Staged


@dataclass(frozen=True)
class Limits:
    """Bounds on what one server holds at once (docs/protocol.md, error code ``busy``)."""

    transfers_per_peer: int = 4
    transfers: int = 64
    parked: int = 256
    # Digest requests (small, answered within a few rounds) have bounds of their own.
    digests_per_peer: int = 16
    digests: int = 256
    # After a forced rebind, how long a parked request whose receiver has not
    # reconnected yet is kept for another try (DEALERs reconnect every 100 ms),
    # and the least a withdrawn staging's readers are kept to ask again.
    rebind_grace: float = 5.0


def start_refusal(request: wire.Request, staged: Staged, busy: str | None) -> tuple[str | None, str]:
    """Why a fetch of the staged step is refused, if it is; ``busy``: why the limits refuse it."""
    code, message = span_refusal(request, staged)
    if code is not None:
        return code, message
    if staged.tree.has_pickle and not request.accept_pickle:
        return wire.ERR_PICKLE, f"step {staged.step} holds pickled objects and the receiver does not accept pickle"
    return (None, "") if busy is None else (wire.ERR_BUSY, busy)


def busy_reason(transfers: Iterable[Transfer], peer: bytes, limits: Limits) -> str | None:
    """Why one more data transfer from ``peer`` would exceed the limits (None: it would not).

    Digest requests do not count: they have bounds of their own.
    """
    data = [t for t in transfers if not t.digests_only]
    if sum(1 for t in data if t.peer == peer) >= limits.transfers_per_peer:
        return "too many transfers from this peer"
    if len(data) >= limits.transfers:
        return "too many concurrent transfers"
    return None


def span_refusal(request: wire.Request, staged: Staged | Snapshot) -> tuple[str | None, str]:
    """Why a fetch of ``staged`` (a span fetch: its staging and its span too) is refused, if it is."""
    if request.step != staged.step:
        return wire.ERR_WRONG_STEP, f"requested step {request.step} but this peer serves step {staged.step}"
    if request.span is not None:
        if request.stage != staged.stage_id:
            return wire.ERR_WRONG_STEP, f"step {staged.step} was staged again since the header was sent"
        if request.span[1] > staged.messages:
            return wire.ERR_BAD_REQUEST, f"span {list(request.span)} beyond the {staged.messages} data messages"
    return None, ""


def digest_transfer(
    peer: bytes,
    request: wire.Request,
    address: str,
    now: float,
    staged: Staged | Snapshot | None,
    transfers: dict[Key, Transfer],
    limits: Limits,
) -> Transfer | Refuse:
    """A digest request (``digests_only``) of ``staged``: the transfer that answers it, or its refusal."""
    algorithm = digests.choose(request.verify)
    code, message = _digest_refusal(peer, request, staged, transfers, limits)
    if code is not None or staged is None or algorithm is None or request.span is None:
        return Refuse(peer, request.xfer, code or wire.ERR_BAD_REQUEST, message)
    first, stop = request.span
    transfer = Transfer(peer, request.xfer, staged, 1, address, now, now, first, stop, span=True)
    transfer.hashing, transfer.digests_only = Hashing(algorithm, inline=False), True
    return transfer


def _digest_refusal(
    peer: bytes,
    request: wire.Request,
    staged: Staged | Snapshot | None,
    transfers: dict[Key, Transfer],
    limits: Limits,
) -> tuple[str | None, str]:
    if staged is None:
        return wire.ERR_DISALLOWED, f"step {request.step} is no longer served"
    code, message = span_refusal(request, staged)
    if code is not None:
        return code, message
    if request.span is not None and not all(staged.available(seq) for seq in range(*request.span)):
        return wire.ERR_DISALLOWED, f"step {request.step} is no longer served"  # a copy without those messages
    if digests.choose(request.verify) is None:
        return wire.ERR_BAD_REQUEST, f"no digest algorithm in common (this side has {digests.offered()})"
    running = [t for t in transfers.values() if t.digests_only]
    if sum(1 for t in running if t.peer == peer) >= limits.digests_per_peer:
        return wire.ERR_BUSY, "too many digest requests from this peer"
    if len(running) >= limits.digests:
        return wire.ERR_BUSY, "too many digest requests"
    return None, ""
