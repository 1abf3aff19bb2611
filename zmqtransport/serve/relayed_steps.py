"""The relay registry: the steps this side relays as a swarm member, by token.

The source's view of its swarm (whose offer is believed, who relays for whom)
is :mod:`.swarm`'s; what a relayed step holds, the shared
:class:`~zmqtransport.relayed.Relayed`.
"""
from __future__ import annotations

from collections.abc import Iterable

from .. import wire
from ..relayed import Relayed
from .actions import Have, Refuse
from .transfers import Parked, Transfer


class RelayedSteps:
    """The steps this side relays (its receives, served onward: :class:`Relayed`), by token.

    Also the span fetches that came for a token not registered yet: they wait
    (``scheduler.RELAY_REGISTER_GRACE``) for it; and the tokens this side
    stopped serving, whose span fetches are refused at once. Pure; the
    scheduler owns it.
    """

    def __init__(self, limit: int) -> None:
        self.steps: dict[bytes, Relayed] = {}
        self.waiting: list[Parked] = []
        self.limit = limit
        # Tokens relayed no more (insertion-ordered, the newest `limit`): a member
        # still asking under one is told at once instead of waiting out the
        # registration grace, which a finished member's peers paid at every tail.
        self.stopped: dict[bytes, None] = {}

    def register(self, relayed: Relayed) -> list[Parked]:
        """Serve ``relayed``; returns the span fetches that waited for its token (forgotten here)."""
        self.steps[relayed.token] = relayed
        early = [p for p in self.waiting if p.request.token == relayed.token]
        self.waiting = [p for p in self.waiting if p.request.token != relayed.token]
        return early

    def admit(self, fetch: Parked, busy: str | None) -> Relayed | Refuse | None:
        """A span fetch showing a token: the step to serve it from, its refusal, or None while it waits.

        ``busy``: why the limits refuse it. A fetch for a token not registered
        yet waits until ``fetch.deadline``: the source may have sent a downstream
        here before this receiver, busy parsing the same header, registered it.
        """
        peer, request = fetch.peer, fetch.request
        assert request.token is not None and request.span is not None  # wire.decode_request
        relayed = self.steps.get(request.token)
        if relayed is None and request.token in self.stopped:
            return Refuse(peer, request.xfer, wire.ERR_NOT_RELAYING, "this relay has stopped relaying")
        if relayed is None:
            if len(self.waiting) >= self.limit:
                return Refuse(peer, request.xfer, wire.ERR_BUSY, "too many waiting requests")
            self.waiting.append(fetch)
            return None
        if request.step != relayed.step or request.stage != relayed.stage_id:
            return Refuse(peer, request.xfer, wire.ERR_WRONG_STEP, f"this receiver relays step {relayed.step}")
        if request.span[1] > relayed.messages:
            return Refuse(peer, request.xfer, wire.ERR_BAD_REQUEST, f"span {list(request.span)} beyond the plan")
        if busy is not None:
            return Refuse(peer, request.xfer, wire.ERR_BUSY, busy)
        relayed.served = True
        relayed.peers.add(peer)
        return relayed

    def have(self, peer: bytes, request: wire.Request) -> Have | None:
        """What this side holds of the step it relays under ``request.token`` (None: it relays no such step)."""
        relayed = self.steps.get(request.token) if request.token is not None else None
        if relayed is None or relayed.stage_id != request.stage:
            return None
        return Have(peer, request.xfer, relayed.have, relayed.messages, coming=relayed.coming)

    def mark_awaited(self, transfers: Iterable[Transfer]) -> None:
        """Publish to each relayed step the messages its ``transfers`` wait for (:attr:`Relayed.awaited`):
        a transfer with credit whose next message has not landed. The receiving thread wakes the serving
        thread for those landings alone, so call this before looking at what may send (then wait)."""
        waits = dict.fromkeys(self.steps, 0)
        for transfer in transfers:
            staged = transfer.staged
            if not isinstance(staged, Relayed) or staged.token not in waits or transfer.paused:
                continue
            if transfer.credit > 0 and not transfer.done and not staged.available(transfer.next_seq):
                waits[staged.token] |= 1 << transfer.next_seq
        for token, bits in waits.items():
            self.steps[token].awaited = bits

    def stop(self, token: bytes, transfers: Iterable[Transfer]) -> list[Transfer]:
        """Relay ``token``'s step no more; returns the transfers serving it (to end)."""
        relayed = self.steps.pop(token, None)
        self.stopped[token] = None
        while len(self.stopped) > self.limit:
            del self.stopped[next(iter(self.stopped))]
        return [t for t in transfers if t.staged is relayed]

    def late(self, now: float) -> list[Refuse]:
        """Refusals of the span fetches whose wait has ended (forgotten here)."""
        late = [p for p in self.waiting if p.deadline <= now]
        self.waiting = [p for p in self.waiting if p.deadline > now]
        message = "this receiver relays nothing under that token"
        return [Refuse(p.peer, p.request.xfer, wire.ERR_NOT_RELAYING, message) for p in late]

    def left(self, peer: bytes) -> None:
        """The connection of ``peer`` closed: that downstream's receive has ended."""
        for relayed in self.steps.values():
            relayed.peers.discard(peer)

    def clear(self) -> list[Parked]:
        """Relay nothing any more; returns the span fetches that were waiting."""
        waiting, self.waiting = self.waiting, []
        self.steps.clear()
        return waiting
