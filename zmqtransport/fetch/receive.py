"""One receive, from request to built object: :func:`fetch` and :func:`fetch_header`.

Threading: a receive runs entirely in the calling thread and owns the DEALERs
it creates; they are closed before it returns or raises. Several threads may
fetch at once (each has its own sockets).

Order of work: request, header, validation and allocation (so a hostile or
buggy peer is refused before any large allocation; :mod:`.landing` decides,
:mod:`.landed` allocates), then data messages copied straight into their
destination storage (:mod:`.inbox`), over one connection while credit is
returned in batches, or in spans over several (the pure :mod:`.planner`
decides, the :mod:`.owner` carries it out on the sockets), relaying what
lands when the source asks (:mod:`.relaying`), then the end marker. Only then
is the object built: nothing partial is ever returned.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from .. import buffers, digests, relayed, wire
from ..device import RecvUnstager
from ..errors import IntegrityError, ProtocolError
from ..gcpause import paused_gc
from ..net import PeerAddress, is_local_address
from ..stats import TransferStats
from . import landing, liveness
from .connection import Connections
from .inbox import Inbox
from .landed import Landed, build, land
from .options import FetchOptions
from .owner import Owner
from .peers import start_offset
from .planner import ReceivePlanner, Swarm, span_messages
from .relaying import RelayDuty
from .replies import refusal
from .requests import SpanTerms, step_request
from .streams import Configure, Context

logger = logging.getLogger("zmqtransport.fetch")


class Receive:
    """One receive's phases: request, header, data messages (one connection or striped), end marker."""

    def __init__(
        self,
        context: Context,
        address: PeerAddress,
        src_rank: int | None,
        step: int,
        timeout: float,
        options: FetchOptions,
        peer_options: Configure | None,
    ) -> None:
        self.address = address
        self.src_rank = src_rank  # None: the caller has no rank for the peer (fetch_header)
        self.step = step
        self.timeout = timeout
        self.options = options
        self.deadline = time.monotonic() + timeout
        self.xfer = random.getrandbits(63)
        self.stats = TransferStats(peer=address.endpoint, step=step)
        self.stage: int | None = None  # the staging's id, from a sender that serves span fetches
        self.order: wire.RelayOrder | None = None  # what the source said about relaying
        # The source's digest algorithm (None: it publishes no digests, so relays cannot be checked).
        self.algorithm: digests.Algorithm | None = None
        self.digests_ahead = False  # the source hashes any message on request (its header's 'ahead')
        self.duty: RelayDuty | None = None  # serving what lands to the downstream
        self.plan: list[list[wire.Piece]] = []  # the header's chunk plan: what each data message carries
        self.pending: wire.Reply | None = None  # a reply read ahead (the direct path's first data message)
        relay_options = options.relay.options_for if options.relay is not None else None
        self.conns = Connections(context, address, options.stall_timeout, peer_options, relay_options)

    # ----------------------------------------------------------------- naming the peer

    @property
    def endpoint(self) -> str:
        """The path in use (the first until several are tried)."""
        return self.conns.first.endpoint

    def describe(self, at: bool = True) -> str:
        """How messages name the source: by its rank where the caller gave one."""
        who = "the peer" if self.src_rank is None else f"rank {self.src_rank}"
        return f"{who} at {self.endpoint}" if at else who

    def _where(self) -> str:
        return f"{self.describe()} (step {self.step})"

    def _timed_out(self, waiting_for: str) -> TimeoutError:
        return TimeoutError(
            f"recv_checkpoint timed out after {self.timeout:.3g} s waiting for {waiting_for} from {self._where()}"
        )

    # ----------------------------------------------------------------- the connection in use

    def _next(self, waiting_for: str, in_transfer: bool = False) -> wire.Reply:
        """The next reply of this receive on the connection in use; an error reply raises."""
        if self.pending is not None:
            ahead, self.pending = self.pending, None
            return ahead
        stream = self.conns.first
        reply = stream.reply(self.describe())
        while reply is None:
            self._wait(waiting_for, in_transfer)
            reply = stream.reply(self.describe())
        if reply.op == wire.OP_ERROR:
            stream.discard()
            raise refusal(reply, self.describe(), self.step)
        if reply.xfer != self.xfer:
            stream.discard()
            raise ProtocolError(f"reply for another transfer: {reply.xfer!r}")
        return reply

    def _wait(self, waiting_for: str, in_transfer: bool) -> None:
        """Block until a message is ready; raise at the deadline, on a stall or a lost connection."""
        stream = self.conns.first
        outcome = stream.wait(self.deadline, in_transfer)
        if outcome is not liveness.Wait.READY:
            timed_out = str(self._timed_out(waiting_for))
            stall = stream.watch.stall_timeout
            raise liveness.silence(outcome, self._where(), waiting_for, stall, timed_out)

    # ----------------------------------------------------------------- phases

    def request(self, header_only: bool = False, keep_paths: bool = False, offer: str | None = None) -> None:
        """Connect (to the most preferred path that connects, when there are several) and ask for the step."""
        tried = self.conns.connect(self.deadline, keep_paths)
        if tried is not None:
            raise TimeoutError(
                f"recv_checkpoint timed out after {self.timeout:.3g} s waiting for a connection to "
                f"{self.describe(at=False)} (step {self.step}); paths tried: {tried}"
            )
        self.stats.peer = self.endpoint
        if self.address.more_paths:
            logger.debug("%s: using path %s", self.describe(at=False), self.endpoint)
        self.send_request(header_only, offer)

    def send_request(self, header_only: bool = False, offer: str | None = None) -> None:
        inline = self.options.verifies_all and not header_only
        options, now = self.options, time.monotonic()
        request = step_request(
            self.xfer, self.step, self.deadline, now, options.window, options.allow_pickle, header_only,
            offer, digests.offered(), inline,
        )  # fmt: skip
        self._send(request, "its request")

    def _send(self, frame: bytes, what: str) -> None:
        """Send on the connection in use, within the deadline.

        A DEALER with no pipe to its peer (a connection refused by CurveZMQ,
        torn down and not yet retried) blocks on send: never wait past the
        transfer's deadline for one.
        """
        if not self.conns.first.send_by(frame, self.deadline):
            raise self._timed_out(f"a connection to send {what} on")

    def receive_header(self) -> landing.ParsedHeader:
        reply = self._next("the checkpoint header")
        if reply.op != wire.OP_HEADER or not reply.more:
            raise ProtocolError(f"expected a header, got {reply.op!r}")
        self.stage = reply.stage
        self.order = reply.relay if self.options.relay is not None else None
        self.algorithm = digest_algorithm(reply.digest, self.options.verifies_all, self.describe())
        self.digests_ahead = reply.digests_ahead
        stream = self.conns.first
        body = stream.frame()
        stream.ended("the header")
        header = wire.decode_header(wire.unpack(body, wire.MAX_HEADER_BYTES))
        if header.step != self.step:
            raise ProtocolError(f"asked for step {self.step} but the peer sent step {header.step}")
        return landing.parse_header(header, self.options.allow_pickle)

    def receive_end(self) -> None:
        reply = self._next("the end of the transfer", in_transfer=True)
        if reply.op != wire.OP_END:
            raise ProtocolError(f"expected the end marker, got {reply.op!r}")
        self.conns.first.ended("the end marker")

    def header_phase(self) -> tuple[landing.ParsedHeader, bool]:
        """Ask for and read the header; returns it and whether the data comes striped (in spans)."""
        offer = relay_offer(self.options, self.address)
        # A striped receive asks for the header alone, then for spans on every
        # connection. One that only offers to relay asks for everything and the
        # source decides: where a swarm pays it makes the receive a member and
        # sends the header alone (then spans, from it and the other members);
        # where it does not (it feeds its receivers faster than they could
        # relay: serve/uplink.py), the data follows at once on this connection
        # (the direct path: no spans, no questions, no second round trip).
        header_only = self.options.striped(self.address)
        self.request(header_only=header_only, keep_paths=header_only or offer is not None, offer=offer)
        parsed = self.receive_header()
        if not header_only and offer is not None:
            reply = self._next("the data or the end of the header", in_transfer=True)
            if reply.op != wire.OP_END:
                self.pending = reply  # the first data message: the direct path
                return parsed, False
            self.conns.first.ended("the end marker")
        elif not header_only:
            return parsed, False
        else:
            self.receive_end()
        if self.stage is None:
            # A sender that serves no span fetches: one connection, as it expects, and no relaying either.
            self.conns.drop_spare()
            self.xfer = random.getrandbits(63)
            self.order = None
            self.send_request()
            parsed = self.receive_header()
        return parsed, self.stage is not None

    def plan_data(self, header: wire.Header) -> None:
        """The chunk plan (once the header's sizes were accepted), and relaying if the source asked.

        Registered as a relay before the memory is allocated: the downstream may ask at once.
        """
        self.plan = wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below)
        relay = self.options.relay
        if self.stage is not None and self.order is not None and relay is not None:
            self.duty = RelayDuty.start(relay.host, self.order.token, self.step, self.stage, self.plan)

    def receive_data(self, inbox: Inbox) -> None:
        """Receive every data message on the connection in use, returning credit in batches."""
        stream = self.conns.first
        source = self.describe()
        messages = len(inbox.plan)
        unacknowledged = 0
        batch = max(1, self.options.window // 2)
        for seq in range(messages):
            reply = self._next(f"data message {seq} of {messages}", in_transfer=True)
            if reply.op != wire.OP_DATA or reply.seq != seq or not reply.more:
                raise ProtocolError(f"expected data message {seq}, got {reply.op!r} {reply.seq!r}")
            inbox.land(stream, reply, source)
            unacknowledged += 1
            if unacknowledged >= batch and seq + 1 < messages:
                self._send(wire.credit_request(self.xfer, unacknowledged), "credit")
                unacknowledged = 0
        self.stats.messages = messages
        self.receive_end()

    def receive_striped(self, inbox: Inbox, chunk_bytes: int) -> None:
        """Receive every data message in spans over several connections (:mod:`.planner`, :mod:`.owner`),
        from the source and, when the source made this receive a swarm member, from the other members."""
        assert self.stage is not None  # only a sender that serves spans gets here
        options = self.options
        terms = SpanTerms(
            self.step,
            self.stage,
            options.allow_pickle,
            self.deadline,
            options.stall_timeout,
            self.algorithm,
            inline=options.verifies_all,
            digests_ahead=self.digests_ahead,
        )
        messages = len(inbox.plan)
        swarm, offset = None, 0
        known: tuple[wire.Peer, ...] = ()
        # Peers only where what they send can be checked against the source's digests.
        if self.order is not None and self.algorithm is not None:
            known = self.order.peers
            if not known and self.order.upstream is not None and self.order.upstream_token is not None:
                known = ((self.order.upstream, self.order.upstream_token),)  # a source that names one relay
            swarm = Swarm(self.order.token, known)
            offset = start_offset(len(known), messages)
        streams = self.conns.streams(options.stream_count(len(self.address.paths), swarm is not None))
        # In a swarm, spans small enough that every member gets several (a slow peer holds few back).
        span = span_messages(chunk_bytes, messages if swarm else 0, len(streams) + len(known) + 2)
        if swarm is not None:
            streams = [*streams, *self.conns.questions_to_source(streams)]
        relays = inbox.duty is not None
        self.stats.path = "swarm" if swarm is not None else "striped"
        plan = ReceivePlanner(inbox.offsets, terms, span, self.describe(False), swarm, offset, relays)
        try:
            Owner(streams, inbox, plan, self.conns.open_peer).run()
        finally:
            record(self.stats, plan)

    def data_phase(self, parsed: landing.ParsedHeader, stripe: bool, landed: Landed) -> None:
        """Every data message into ``landed``; then this receive's relaying winds down."""
        unstager = RecvUnstager.borrow(self.options.staging, landed.destinations)
        try:
            duty = self.duty
            if duty is not None:
                # Device memory is not relayed: the downstream is refused and fetches from the source.
                duty.attach(None if unstager is not None else [d.view for d in landed.destinations])
                duty = None if duty.stopped else duty
            inline = self.options.verifies_all
            inbox = Inbox(parsed, self.plan, landed, unstager, duty, self.options.progress, self.algorithm, inline)
            if stripe:
                self.receive_striped(inbox, parsed.header.chunk_bytes)
            else:
                self.receive_data(inbox)
        finally:
            if unstager is not None:
                # Every copy to the device has landed (or, on error, stopped) before this returns or raises.
                unstager.close()
        if self.duty is not None and not self.duty.stopped:
            self.conns.close()  # done with every source: an upstream relay's tail ends now
            if not self.serves_after_return(landed):
                self.duty.finish()

    def serves_after_return(self, landed: Landed) -> bool:
        """Whether this member goes on serving after the receive returns (:meth:`hand_over`): a fresh
        receive, where the transport asked for it (fetch/relaying.py, AfterReturn). One into device memory
        never gets here: its duty stopped when attached."""
        relay = self.options.relay
        if relay is None or relay.after_return is None:
            return False
        return all(d.in_place is None for d in landed.destinations)

    def hand_over(self, landed: Landed) -> None:
        """The object is built: a duty still serving goes to the transport, which stops it later."""
        relay, duty = self.options.relay, self.duty
        if duty is None or duty.stopped or relay is None or relay.after_return is None:
            return
        relay.after_return(duty, landed, self.deadline)
        self.duty = None  # close() leaves it serving

    def cancel(self) -> None:
        self.conns.first.cancel(wire.cancel_request(self.xfer))  # best effort: the peer may be gone

    def close(self) -> None:
        if self.duty is not None:
            self.duty.stop()  # before anything is handed to the caller, whatever happened
        self.conns.close()


def digest_algorithm(name: str | None, verifies_all: bool, source: str) -> digests.Algorithm | None:
    """The algorithm ``source`` chose from this side's offer (None: it publishes no digests); with
    ``verifies_all``, a source that publishes none is refused."""
    if name is None:
        if verifies_all:
            raise IntegrityError(
                f"verify='all': {source} publishes no digests to check the data against "
                "(a release before digests); receive from it with verify='relayed'"
            )
        return None
    if name not in digests.offered():
        raise ProtocolError(f"the peer chose digest algorithm {name!r}, which this side did not offer")
    return digests.algorithm(name)


def relay_offer(options: FetchOptions, source: PeerAddress) -> str | None:
    """Where a receive offers to serve others (its transport's metadata), or None.

    No offer to a source on this host: the source would not make it a swarm
    member (one host has one memory system, not several links).
    """
    if options.relay is None:
        return None
    if not relayed.RELAY_LOOPBACK and all(is_local_address(path.host) for path in source.paths):
        return None
    return options.relay.at


def record(stats: TransferStats, plan: ReceivePlanner) -> None:
    """What a striped receive's connections carried, into its statistics."""
    lanes = plan.lanes
    stats.streams = sum(1 for lane in lanes if not lane.questions)
    stats.messages = sum(lane.messages for lane in lanes)
    stats.duplicate_messages = plan.duplicates
    for lane in lanes:
        if lane.bytes:
            stats.paths[lane.endpoint] = stats.paths.get(lane.endpoint, 0) + lane.bytes


def fetch(
    context: Context,
    address: PeerAddress,
    src_rank: int,
    step: int,
    timeout: float,
    options: FetchOptions,
    peer_options: Configure | None = None,
    targets: Any = None,
) -> tuple[Any, TransferStats]:
    """Fetch ``step`` from the peer at ``address``; see :meth:`ZMQTransport.recv_checkpoint`.

    ``peer_options`` set up each DEALER to that peer (its CurveZMQ server key);
    ``targets`` is the structure to receive into, in place.
    """
    buffers.settle_malloc_thresholds()  # once per process; see there
    options = options.into(targets)
    with paused_gc():  # many acyclic objects per tensor: see gcpause
        receive = Receive(context, address, src_rank, step, timeout, options, peer_options)
        started = time.monotonic()
        landed: Landed | None = None
        try:
            parsed, stripe = receive.header_phase()
            receive.stats.header_seconds = time.monotonic() - started
            # Refused (absurd sizes) before anything is allocated, the chunk plan included.
            plan = landing.plan_landing(parsed, targets, options.landing())
            receive.plan_data(parsed.header)
            landed = land(plan, options.prefault_threads)
            receive.data_phase(parsed, stripe, landed)
            result = build(parsed, landed)
            receive.hand_over(landed)
        except BaseException:
            receive.cancel()
            raise
        finally:
            if landed is not None:
                landed.close()
            receive.close()
    return result, _finish_stats(receive, parsed, landed, time.monotonic() - started)


def _finish_stats(receive: Receive, parsed: landing.ParsedHeader, landed: Landed, seconds: float) -> TransferStats:
    stats = receive.stats
    stats.seconds = seconds
    stats.bytes = parsed.header.total_bytes
    if not stats.paths:
        stats.paths = {receive.endpoint: stats.bytes}
    stats.in_place_bytes = sum(
        n for n, d in zip(parsed.header.storages, landed.destinations, strict=True) if d.in_place is not None
    )
    stats.tensors = len(parsed.specs)
    logger.info(
        "received step %d from %s: %d bytes (%d in place) in %.3f s (%.2f GB/s)",
        receive.step,
        receive.describe(),
        stats.bytes,
        stats.in_place_bytes,
        stats.seconds,
        stats.gbps,
    )
    return stats


def fetch_header(
    context: Context,
    address: PeerAddress,
    step: int,
    timeout: float,
    options: FetchOptions,
    peer_options: Configure | None = None,
) -> wire.Header:
    """Ask the peer for the header of ``step`` only (no tensor data moves)."""
    receive = Receive(context, address, None, step, timeout, options, peer_options)
    try:
        receive.request(header_only=True)
        parsed = receive.receive_header()
        receive.receive_end()
        return parsed.header
    finally:
        receive.close()
