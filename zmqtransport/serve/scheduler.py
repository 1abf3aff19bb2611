"""Which transfer sends what, and when to give up: the sending side without sockets.

The :class:`Scheduler` is pure: no zmq, no threads, no clock of its own. The
socket owner (:mod:`zmqtransport.serve.server`) feeds it events (a request, a
staged step, a disallow, a delivered data message, the passing of time, each
with an explicit ``now``) and carries out the actions it returns: error
replies, headers, ends of transfers. Tests drive it with a fake clock.

Flow control (docs/protocol.md, "Flow control"): a transfer may send while it
has credit; :meth:`Scheduler.next_round` offers one data message per transfer
per round, so concurrent receivers share the link.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import digests, wire
from .. import relayed as shared_relaying
from ..net import is_local_address
from ..relayed import Relayed
from .snapshot import Snapshot
from .staged import Served, Staged
from .swarm import Swarm
from .withdrawn import Withdrawals

Key = tuple[bytes, int]  # (routing id of the receiver's socket, transfer id it chose)


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


# Seconds the socket owner may sleep when nothing is due, and between retries of
# requests re-parked after a rebind.
IDLE_WAKEUP = 1.0

# How long a span fetch for a relay token this side has not registered waits
# for it (the receive registers it as soon as it has parsed the header).
RELAY_REGISTER_GRACE = 2.0
REPARKED_RETRY = 0.02


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


@dataclass(frozen=True)
class Refuse:
    """Answer a request with an error reply; report a failed send with :meth:`Scheduler.undelivered`."""

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
    """Send the header of the staged step; report a failed send with :meth:`Scheduler.undelivered`."""

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


@dataclass(frozen=True)
class Have:
    """Answer a ``have`` request: what this side holds (None: everything) and, as the source, the swarm."""

    peer: bytes
    xfer: int
    bits: int | None
    messages: int
    peers: tuple[wire.Peer, ...] = ()
    coming: int = 0
    claimed: tuple[int, ...] | None = None  # to a member's claim: what the swarm reserved for it


@dataclass(frozen=True)
class Finish:
    """Every data message went out: send ``end`` and record the transfer."""

    transfer: Transfer
    seconds: float


Action = Refuse | Abort | SendHeader | Finish | Have


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
        self._rebound_at = float("-inf")

    # ------------------------------------------------------------------ events

    def stage(self, staged: Staged, now: float) -> list[Action]:
        """Serve ``staged`` from now on; requests parked until now start (or are refused)."""
        self.staged = staged
        self.withdrawals.readers.clear()
        self.swarm.clear()
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
                self.transfers[key].grant(request.credit, now)
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
        """The receivers of these transfers took data (libzmq released frames queued for them)."""
        peers = {peer for peer, _ in keys}
        for transfer in self.transfers.values():
            if transfer.key in keys:
                transfer.last_progress = now
            if transfer.peer in peers:
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
        """Transfers that may send their next data message now, one message each."""
        return [t for t in self.transfers.values() if t.sendable]

    def sent(self, transfer: Transfer, now: float) -> list[Action]:
        """Data message ``transfer.next_seq`` went out."""
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
        if request.relay is not None and (self.relay_loopback or not self.is_local(address)):
            order = self.swarm.offer(peer, request.relay, address, self.make_token(), algorithm)
        # A receiver sent to a relay gets the header alone: it asks the relay for the data.
        header_only = request.header_only or (order is not None and order.upstream is not None)
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
        everything, and the swarm's other members (``request.token`` is the asker's own: asked from
        ``address``, that member's paths there are believed too)."""
        token = request.token
        relayed = self.relaying.have(peer, request)
        if relayed is not None:
            return relayed
        staged = self.staged
        if staged is not None and staged.stage_id == request.stage:
            if token is not None:
                self.swarm.seen(token, address)
            peers = self.swarm.peers_for(token) if token is not None else None
            claimed = self.swarm.claim(token, request.claim, staged.messages) if token and request.claim else None
            return Have(peer, request.xfer, None, staged.messages, peers or (), claimed=claimed)
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


class RelayedSteps:
    """The steps this side relays (its receives, served onward: :class:`Relayed`), by token.

    Also the span fetches that came for a token not registered yet: they wait
    (:data:`RELAY_REGISTER_GRACE`) for it; and the tokens this side stopped
    serving, whose span fetches are refused at once. Pure; the scheduler owns it.
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
