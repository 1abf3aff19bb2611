"""Which transfer sends what, and when to give up: the sending side without sockets.

The :class:`Scheduler` is pure: no zmq, no threads, no clock of its own. The
socket owner (:mod:`zmqtransport.serve.server`) feeds it events (a request, a
staged step, a disallow, a delivered data message, the passing of time, each
with an explicit ``now``) and carries out the actions it returns
(:mod:`.actions`): error replies, headers, ends of transfers. Tests drive it
with a fake clock. What it holds are :mod:`.transfers`; whether a request is
let in, :mod:`.admission`; the steps this side relays, :mod:`.relayed_steps`.

Flow control (docs/protocol.md, "Flow control"): a transfer may send while it
has credit; :meth:`Scheduler.next_round` offers one data message per transfer
per round, so concurrent receivers share the link (with swarm members, the
messages no receiver has yet first).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

from .. import digests, wire
from .. import relayed as shared_relaying
from ..net import is_local_address
from ..relayed import Relayed
from .actions import Abort, Action, Finish, Have, Refuse, SendHeader
from .admission import Limits, busy_reason, digest_transfer, start_refusal
from .relayed_steps import RelayedSteps
from .staged import Served, Staged
from .swarm import Swarm
from .transfers import Hashing, Key, Parked, Transfer, stalled, transfer_hashing
from .uplink import Uplink
from .withdrawn import Withdrawals

# Seconds the socket owner may sleep when nothing is due, and between retries of
# requests re-parked after a rebind.
IDLE_WAKEUP = 1.0

# How long a span fetch for a relay token this side has not registered waits
# for it (the receive registers it as soon as it has parsed the header).
RELAY_REGISTER_GRACE = 2.0
REPARKED_RETRY = 0.02


def receivers(address: str, staged: Staged, transfers: Iterable[Transfer], swarm: Swarm) -> int:
    """How many receive ``staged``: as many as its sender said, or if more, the hosts that have asked for it so
    far (``address``, the asker's, among them; a receive striped over several connections is one)."""
    hosts = {address}
    hosts.update(t.address for t in transfers if t.staged is staged)
    for _, addresses in swarm.offers.values():
        hosts.update(addresses)
    return max(staged.receivers, len(hosts))


def swarm_pays(uplink: Uplink, address: str, staged: Staged, transfers: Iterable[Transfer], swarm: Swarm) -> bool:
    """Whether the receiver at ``address`` that offers to relay is made a member (:mod:`.uplink`).

    Not where its sender said one receiver would fetch the step (torchft's
    ``dst_ranks``: the one replica group healing) and no other host has
    asked: a swarm of one relays to nobody, and its member fetched what it
    claimed, four messages a claim, taking 1.5x the direct credit loop's time
    over a fast link (fast-1to1 in place: 0.19-0.20 s against 0.12-0.13 s;
    docs/fast-links.md, "The first step steps aside"). A host beyond the one
    told makes it a swarm again.
    """
    count = receivers(address, staged, transfers, swarm)
    return not (staged.receivers == 1 and count == 1) and uplink.swarm_pays(count)


def swarm_have(
    swarm: Swarm, peer: bytes, request: wire.Request, address: str, staged: Staged,
    pays: Callable[[], bool | None], now: float,
) -> Have:
    """The source's answer to ``have`` about its staged step: everything; to a member (``request.token``
    its own, asked from ``address``: its paths there are believed too), the other members and what it
    claimed, or ``alone`` once the step's measure says the swarm no longer pays (``pays``, Swarm.steps_aside)."""
    token = request.token
    if token is None:
        return Have(peer, request.xfer, None, staged.messages)
    swarm.seen(token, address)
    if swarm.steps_aside(pays, now):
        return Have(peer, request.xfer, None, staged.messages, alone=True)
    peers = swarm.peers_for(token, request.names)
    claimed = swarm.claim(token, request.claim, staged.messages) if request.claim else None
    return Have(peer, request.xfer, None, staged.messages, peers or (), claimed=claimed)


class Scheduler:
    """Transfers, parked requests, credit and stall deadlines of one server."""

    def __init__(
        self,
        timeout: float,
        stall: float | None = None,
        limits: Limits | None = None,
        make_token: Callable[[], bytes] | None = None,
        is_local: Callable[[str], bool] = is_local_address,
        curve: bool = False,
    ) -> None:
        self.relay_loopback = shared_relaying.RELAY_LOOPBACK  # read here: tests patch the module
        self.is_local = is_local  # whether a peer address belongs to this host
        # Relay tokens: unguessable, handed out only to the staged step's receivers.
        self.make_token = make_token if make_token is not None else lambda: os.urandom(wire.RELAY_TOKEN_BYTES)
        # A transfer whose receiver grants no credit and takes no data for this
        # long is stalled and dropped: the stall bound, at most the transfer timeout.
        self.stall = timeout if stall is None else min(stall, timeout)
        self.limits = limits if limits is not None else Limits()
        self.staged: Staged | None = None
        self.withdrawals = Withdrawals(self.stall, timeout)  # also the staged step's readers
        self.transfers: dict[Key, Transfer] = {}
        self.parked: list[Parked] = []
        self.swarm = Swarm(curve)  # receivers of the staged step that offered to relay (curve: this side's own)
        self.relaying = RelayedSteps(self.limits.parked)  # steps this side relays (as a receiver)
        self.uplink = Uplink()  # what this side delivers per receiver of its own steps: whether a swarm pays
        self._rebound_at = float("-inf")

    # ------------------------------------------------------------------ events

    def stage(self, staged: Staged, now: float) -> list[Action]:
        """Serve ``staged`` from now on; requests parked until now start (or are refused)."""
        self.staged = staged
        self.withdrawals.readers.clear()
        self.swarm.clear()
        self.uplink.new_step()
        return self._retry_parked(now)

    def disallow(self, now: float, cap: int) -> tuple[int, int]:
        """Serve the staged step to no new receive; the running ones finish (:mod:`.withdrawn`).

        ``cap``: the most bytes its snapshot may take, with those still alive;
        until the snapshot is taken (:attr:`withdrawals`, which the socket owner
        asks what to copy), they read the caller's tensors. Returns how many
        receives of it were running, and the bytes they may still ask for.
        """
        running = (0, 0)
        if self.staged is not None:
            running = self.withdrawals.withdraw(self.staged, self.transfers.values(), now, cap)
        self.staged = None
        self.swarm.clear()
        return running

    def on_request(self, peer: bytes, request: wire.Request, address: str, now: float) -> list[Action]:
        key = (peer, request.xfer)
        if request.op == wire.OP_CREDIT:
            if key in self.transfers:
                transfer = self.transfers[key]
                transfer.grant(request.credit, now)
                if isinstance(transfer.staged, Staged):
                    self.uplink.requested(now)  # what it asked for before has landed
            return []
        if request.op == wire.OP_CANCEL:
            self.transfers.pop(key, None)
            self.parked = [p for p in self.parked if p.key != key]
            return []
        if request.op == wire.OP_HAVE:
            return [self._have(peer, request, address, now)]
        if key in self.transfers:
            return [Refuse(peer, request.xfer, wire.ERR_BUSY, "this transfer id is already running")]
        withdrawn = self.withdrawals.find(request.stage)
        if request.digests_only:  # computed by serve.digests.DigestWork
            # A relay-fed receive running at a disallow still asks the source for its digests.
            source = self.staged if withdrawn is None else self.withdrawals.digests_of(withdrawn, now)
            started = digest_transfer(peer, request, address, now, source, self.transfers, self.limits)
            if isinstance(started, Refuse):
                return [started]
            self.transfers[key] = started
            return []
        if request.token is not None:
            return self._start_relayed(peer, request, address, now)
        if withdrawn is not None:  # a span fetch of a receive that was running at the disallow
            refusal = self.withdrawals.refusal(withdrawn, request, now, busy=self._busy(peer))
            if refusal is not None:
                return [Refuse(peer, request.xfer, *refusal)]
            return self._start_span(peer, request, address, now, withdrawn.source)
        if self.staged is None and request.span is not None:
            # A span fetch names a staging whose header its receiver has seen:
            # with nothing staged now, that staging was disallowed. Say so at once.
            return [Refuse(peer, request.xfer, wire.ERR_DISALLOWED, f"step {request.step} is no longer served")]
        if self.staged is None:
            if len(self.parked) >= self.limits.parked:
                return [Refuse(peer, request.xfer, wire.ERR_BUSY, "too many waiting requests")]
            self.parked.append(Parked(peer, request, now + request.wait_ms / 1000, address))
            return []
        if request.span is not None or not request.header_only:
            self.uplink.requested(now)
        return self._start(peer, request, address, now, parked=None)

    def undelivered(self, action: SendHeader | Refuse, now: float) -> None:
        """A header or refusal could not be sent (the receiver is not connected).

        The transfer is forgotten. A request parked before a forced rebind is
        kept for another try while its receiver (whose DEALER keeps its routing
        id) may still be reconnecting.
        """
        if isinstance(action, SendHeader):
            self.transfers.pop(action.key, None)
        if action.parked is not None and now - self._rebound_at < self.limits.rebind_grace:
            self.parked.append(action.parked)

    def progress(self, keys: set[Key], now: float) -> None:
        """The receivers of these transfers took data (libzmq released frames queued for them).

        A receiver that takes data on its connection is taking it for every transfer it runs there: a
        transfer behind another on one connection waits for that one's frames, not for its receiver
        (a swarm member whose flow has a share of a busy uplink reads each span in turn, slowly)."""
        peers = {peer for peer, _ in keys}
        for transfer in self.transfers.values():
            if transfer.peer in peers:
                transfer.last_progress = now
                transfer.paused = False  # its connection drains

    def resume(self) -> None:
        """Transfers paused at this side's copy bound may try again (the pump pauses them anew if need be)."""
        for transfer in self.transfers.values():
            transfer.paused = False

    def disconnected(self, peer: bytes) -> list[Transfer]:
        """The connection of ``peer`` closed: its transfers cannot complete. Returns them, forgotten.

        Its parked requests stay: a DEALER that reconnects keeps its routing id.
        """
        gone = [t for t in self.transfers.values() if t.peer == peer]
        for transfer in gone:
            del self.transfers[transfer.key]
        self.swarm.left(peer)
        self.withdrawals.left(peer)
        self.relaying.left(peer)
        return gone

    def rebound(self, now: float) -> None:
        """The socket was closed and bound again: every receiver is reconnecting."""
        self._rebound_at = now
        self.withdrawals.rebound(now, self.limits.rebind_grace)

    def relay(self, relayed: Relayed, now: float) -> list[Action]:
        """Serve ``relayed`` (a step this side is receiving) to span fetches showing its token.

        Span fetches that came for that token before it was registered start now.
        """
        actions: list[Action] = []
        for parked in self.relaying.register(relayed):
            actions += self._start_relayed(parked.peer, parked.request, parked.address, now)
        return actions

    def stop_relay(self, token: bytes) -> list[Action]:
        """Stop relaying: its running transfers end ``not_relaying`` (their receivers fetch elsewhere)."""
        stopped = self.relaying.stop(token, self.transfers.values())
        return [self._abort(t, wire.ERR_NOT_RELAYING, "this relay has stopped relaying") for t in stopped]

    def next_round(self) -> list[Transfer]:
        """Transfers that may send their next data message now, one message each.

        While the staged step has swarm members, those whose next message no
        receiver has been sent yet go first: a second copy waits for the
        first copies ready to go (at most the rest of one state). Past 64
        members, second copies that members asked for what nobody in their
        view held took half the uplink, and the last first copy left at
        twice the ideal (docs/sim.md, "First copies first at the source").
        """
        return self.swarm.first_copies([t for t in self.transfers.values() if t.sendable], self.staged)

    def sent(self, transfer: Transfer, now: float) -> list[Action]:
        """Data message ``transfer.next_seq`` went out."""
        self.swarm.sent |= int(transfer.staged is self.staged) << transfer.next_seq  # first copies (next_round)
        if isinstance(transfer.staged, Staged):
            self.uplink.sent(transfer.staged.span_bytes(transfer.next_seq, transfer.next_seq + 1))
        transfer.next_seq += 1
        transfer.credit -= 1
        if not transfer.done:
            return []
        self.transfers.pop(transfer.key, None)
        return [Finish(transfer, now - transfer.started)]

    def drop(self, transfer: Transfer) -> None:
        """A data message could not be sent: the receiver is gone or ignored flow control."""
        self.transfers.pop(transfer.key, None)

    def expire(self, now: float) -> list[Action]:
        """Retry re-parked requests, refuse parked ones past their wait, drop stalled transfers."""
        actions: list[Action] = []
        if self.staged is not None and self.parked:
            # Only requests re-parked by undelivered after a forced rebind wait
            # while a step is staged: retry them now that their peer may be back.
            actions += self._retry_parked(now)
        actions += self.relaying.late(now)
        late = [p for p in self.parked if p.deadline <= now]
        self.parked = [p for p in self.parked if p.deadline > now]
        for p in late:
            message = f"no checkpoint was staged for step {p.request.step} in time"
            actions.append(Refuse(p.peer, p.request.xfer, wire.ERR_NOT_STAGED, message))
        for transfer in list(self.transfers.values()):
            why = stalled(transfer, now, self.stall)
            if why is not None:
                actions.append(self._abort(transfer, wire.ERR_STALLED, why))
        overdue = self.withdrawals.expire(self.transfers.values(), now)
        actions += [self._abort(t, wire.ERR_DISALLOWED, "disallowed a transport timeout ago") for t in overdue]
        return actions

    def shutdown(self) -> list[Action]:
        """The server is stopping: every transfer and parked request ends ``shutdown``."""
        actions: list[Action] = []
        for transfer in list(self.transfers.values()):
            actions.append(self._abort(transfer, wire.ERR_SHUTDOWN, "the serving transport is shutting down"))
        for parked in (*self.parked, *self.relaying.clear()):
            actions.append(Refuse(parked.peer, parked.request.xfer, wire.ERR_SHUTDOWN, "shutting down"))
        self.parked = []
        self.staged = None
        self.withdrawals.clear()
        return actions

    def wakeup_in(self, now: float) -> float:
        """Seconds until something is due (0: data can go out now)."""
        if any(t.sendable for t in self.transfers.values()):
            return 0.0
        if self.staged is not None and self.parked:
            return REPARKED_RETRY
        deadlines = [p.deadline for p in (*self.parked, *self.relaying.waiting)]
        deadlines += [t.last_progress + self.stall for t in self.transfers.values()]
        deadlines += self.withdrawals.deadlines(self.transfers.values())
        if not deadlines:
            return IDLE_WAKEUP
        return max(0.0, min(IDLE_WAKEUP, min(deadlines) - now))

    # ------------------------------------------------------------------ internals

    def _retry_parked(self, now: float) -> list[Action]:
        waiting, self.parked = self.parked, []
        actions: list[Action] = []
        for parked in waiting:
            actions += self._start(parked.peer, parked.request, parked.address, now, parked=parked)
        return actions

    def _start(
        self, peer: bytes, request: wire.Request, address: str, now: float, parked: Parked | None
    ) -> list[Action]:
        staged = self.staged
        assert staged is not None
        # The limits are checked here, not when a request is parked: requests
        # parked while nothing was staged all start at once when a step is staged.
        code, message = start_refusal(request, staged, self._busy(peer))
        if code is not None:
            return [Refuse(peer, request.xfer, code, message, parked)]
        if request.span is not None:
            return self._start_span(peer, request, address, now, staged)
        algorithm = digests.choose(request.verify)
        order = None
        # A swarm only where this side's uplink is what bounds its receivers (uplink.py); where it feeds
        # them faster than they could relay, every receiver is served directly.
        if (
            request.relay is not None
            and (self.relay_loopback or not self.is_local(address))
            and swarm_pays(self.uplink, address, staged, self.transfers.values(), self.swarm)
        ):
            order = self.swarm.offer(peer, request.relay, address, self.make_token(), algorithm)
        # A member that verifies fetches in spans (from this side and the members, as they come): it
        # gets the header alone. So does one sent to a relay (an earlier release, which follows a chain).
        header_only = request.header_only or (
            order is not None and (order.upstream is not None or algorithm is not None)
        )
        digest = algorithm.name if algorithm is not None else None
        header = SendHeader(peer, request.xfer, staged.header_body, header_only, parked, staged.stage_id, order, digest)
        if header_only:
            self.withdrawals.reader(peer)  # it fetches spans as it goes
            return [header]
        hashing = transfer_hashing(request, staged, relays=order is not None)
        transfer = Transfer(peer, request.xfer, staged, request.credit, address, now, now, hashing=hashing)
        if transfer.done:  # nothing to send: only the header and the end
            return [header, Finish(transfer, 0.0)]
        self.transfers[transfer.key] = transfer
        return [header]

    def _have(self, peer: bytes, request: wire.Request, address: str, now: float) -> Have | Refuse:
        """What this side holds of ``request.stage``: as a swarm peer, what has landed; as the source,
        everything, and to a member the swarm (:func:`swarm_have`)."""
        relayed = self.relaying.have(peer, request)
        if relayed is not None:
            return relayed
        staged = self.staged
        if staged is not None and staged.stage_id == request.stage:
            hosts = functools.partial(receivers, address, staged, self.transfers.values(), self.swarm)
            return swarm_have(self.swarm, peer, request, address, staged, lambda: self.uplink.step_pays(hosts), now)
        withdrawn = self.withdrawals.find(request.stage)
        if withdrawn is not None:  # a member whose receive ran at a disallow: what it may still ask for is kept
            return Have(peer, request.xfer, self.withdrawals.held(withdrawn, now), withdrawn.staged.messages)
        return Refuse(peer, request.xfer, wire.ERR_NOT_RELAYING, "this side serves nothing of that staging")

    def _start_relayed(self, peer: bytes, request: wire.Request, address: str, now: float) -> list[Action]:
        """A span fetch to this side as a relay: served from the step it is receiving, as it lands."""
        admitted = self.relaying.admit(Parked(peer, request, now + RELAY_REGISTER_GRACE, address), self._busy(peer))
        if isinstance(admitted, Relayed):
            return self._start_span(peer, request, address, now, admitted)
        return [] if admitted is None else [admitted]

    def _start_span(
        self, peer: bytes, request: wire.Request, address: str, now: float, staged: Served
    ) -> list[Action]:
        """A span fetch: its data messages, then ``end``; no header (the receiver has it)."""
        assert request.span is not None
        first, stop = request.span
        transfer = Transfer(peer, request.xfer, staged, request.credit, address, now, now, first, stop, span=True)
        if isinstance(staged, Staged):
            transfer.hashing = transfer_hashing(request, staged, relays=False)
            swarm = self.swarm.algorithm
            if transfer.hashing is None and swarm is not None and staged.device_plan is not None:
                # Device memory: digest requests cannot read it, so what goes out to a swarm
                # (whose members ask for digests of what they fetch from each other) is hashed here.
                transfer.hashing = Hashing(swarm, inline=False)
        self.transfers[transfer.key] = transfer
        return []

    def _busy(self, peer: bytes) -> str | None:
        return busy_reason(self.transfers.values(), peer, self.limits)

    def _abort(self, transfer: Transfer, code: str, message: str) -> Abort:
        self.transfers.pop(transfer.key, None)
        return Abort(transfer, code, message)
