"""The glue: what the real planner and scheduler decide becomes simulated messages, and back.

A :class:`Server` wraps a real :class:`~zmqtransport.serve.scheduler.Scheduler`
(the source's, or a member's relaying side) and plays its socket owner
(serve/server.py, outbox.py, pump.py, digests.py): requests in, replies and
data messages out, one data message per transfer per round. A :class:`Member`
wraps a real :class:`~zmqtransport.fetch.planner.ReceivePlanner` and plays the
receive (fetch/receive.py) and its owner (fetch/owner.py): the header phase,
then the planner's actions carried out, replies fed back with the simulated
``now``. Every request and reply is the wire's own bytes (``zmqtransport.wire``),
so sizes are the wire's and the scheduler and planner parse what they would.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import digests, wire
from ..fetch import planner as plans
from ..fetch.peers import start_offset
from ..fetch.planner import ReceivePlanner, Swarm, span_messages
from ..fetch.relaying import RELAY_TAIL
from ..fetch.requests import SpanTerms, wait_ms
from ..fetch.spans import SOURCE
from ..relayed import Relayed
from ..serve.actions import Abort, Action, Finish, Have, Refuse, SendHeader
from ..serve.linkwatch import LINGER, READ_EVERY
from ..serve.scheduler import Scheduler
from ..serve.staged import Staged
from ..serve.transfers import Transfer
from ..serve.uplink import LinkReading
from . import model
from .loop import Loop

SHA = digests.algorithm(digests.SHA256)
STEP = 0  # torchft's job start heals at step 0
TIMEOUT = 600.0  # the receives' deadline, simulated seconds
STALL = 5.0  # the transport's default stall bound (transport.DEFAULT_STALL_TIMEOUT)
EXPIRE_EVERY = 0.25  # how often a server's scheduler is asked to expire what is late


def content(seq: int) -> bytes:
    """The true bytes of data message ``seq`` in the model (a stand-in: the size is carried apart)."""
    return b"message %d" % seq


@dataclass
class Conn:
    """One DEALER connection: the receive's stream ``index`` (-1: the header phase) to ``server``."""

    rid: bytes
    member: Member
    server: Server
    index: int
    questions: bool = False
    closed: bool = False


@dataclass
class Counters:
    data_messages: int = 0
    data_bytes: int = 0
    control_messages: int = 0
    control_bytes: int = 0
    source_data_bytes: int = 0
    source_control_bytes: int = 0  # what the source sent besides data (its answers, headers, ends)
    source_control: int = 0  # control messages into or out of the source
    duplicates: int = 0
    planner_passes: int = 0  # ReceivePlanner.tick calls (the owner's loop passes), all receivers
    # Control messages by kind: request or reply op, and whether the source or a member takes part.
    by_kind: dict[str, int] = field(default_factory=dict)

    def count(self, kind: str) -> None:
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1


class Net:
    """The hosts, their links and what crosses them."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.counters = Counters()
        self.in_flight: dict[tuple[str, str], int] = {}  # bytes sent, not yet received, by (from, to)
        self.messages_to: dict[str, int] = {}  # data messages sent, not yet received, by receiving host
        self.queued: dict[str, int] = {}  # bytes a host's serving thread picked, not yet through its uplink
        self.pumps: dict[str, Callable[[], None]] = {}  # who to wake when a host's uplink or a window drains
        # Data bytes the source's connections delivered, by (source, receiver): the kernel's tcpi_bytes_acked.
        self.acked: dict[tuple[str, str], int] = {}

    def window_open(self, src: model.Host, dst: model.Host) -> bool:
        if self.in_flight.get((src.name, dst.name), 0) >= model.WINDOW_BYTES:
            return False
        # A shaped downlink's queue holds what TCP keeps in it, TBF_QUEUE_MESSAGES from all senders together
        # (measured in the lab), so the senders of a slow host share that much in flight, not 8 MiB each.
        return not dst.down.burst or self.messages_to.get(dst.name, 0) < model.TBF_QUEUE_MESSAGES

    def uplink_open(self, src: model.Host) -> bool:
        return self.queued.get(src.name, 0) < model.UPLINK_QUEUE_BYTES

    def send(self, src: model.Host, dst: model.Host, ready: float, size: int, data: bool,
             arrive: Callable[[], None], source: bool = False) -> None:
        """A message of ``size`` bytes leaves ``src``'s process at ``ready`` for ``dst``; ``arrive`` when it is in."""
        c = self.counters
        if data:
            c.data_messages += 1
            c.data_bytes += size
            if source:
                c.source_data_bytes += size
        else:
            c.control_messages += 1
            c.control_bytes += size
            if source:
                c.source_control_bytes += size
        pair = (src.name, dst.name)
        self.in_flight[pair] = self.in_flight.get(pair, 0) + size
        self.messages_to[dst.name] = self.messages_to.get(dst.name, 0) + data
        self.queued[src.name] = self.queued.get(src.name, 0) + size

        def up() -> None:
            if src.dead:
                return
            through = src.up.carry(self.loop.now, size)
            self.loop.at(through, sent)

        def sent() -> None:
            self.queued[src.name] -= size
            self._wake(src.name)
            self.loop.at(self.loop.now + src.latency + dst.latency, down)

        def down() -> None:
            self.loop.at(dst.down.carry(self.loop.now, size), landed)

        def landed() -> None:
            self.in_flight[pair] -= size
            self.messages_to[dst.name] -= data
            if data and source:
                self.acked[pair] = self.acked.get(pair, 0) + size
            self._wake(src.name)
            if not dst.dead:
                arrive()

        self.loop.at(ready, up)

    def _wake(self, name: str) -> None:
        pump = self.pumps.get(name)
        if pump is not None:
            pump()


class Server:
    """A serving side: the real scheduler and a stand-in for its socket owner."""

    def __init__(self, net: Net, host: model.Host, scheduler: Scheduler, staged: Staged | None,
                 liar: bool = False) -> None:
        self.net, self.host, self.scheduler, self.liar = net, host, scheduler, liar
        self.lie_messages = 0  # a liar's: the messages of the step it claims to hold (once it knows them)
        self.staged = staged
        self.conns: dict[bytes, Conn] = {}
        self.hashed: set[int] = set()  # messages the source hashed (once per staging)
        self._turn = 0
        self._last_turn: dict[tuple[bytes, int], int] = {}  # transfer -> the turn it last sent on
        self._pumping = False
        self._expiring = False
        self._watching_until = -1.0  # the kernel's readings go on until then (serve/linkwatch.py's LINGER)
        self._read: dict[str, int] = {}  # acked bytes per receiver at the reading before
        self._keys: dict[str, int] = {}  # the readings' key (the kernel's descriptor) per receiver
        net.pumps[host.name] = self.pump
        if staged is not None:
            scheduler.stage(staged, net.loop.now)

    @property
    def is_source(self) -> bool:
        return self.staged is not None

    def request(self, conn: Conn, frame: bytes) -> None:
        """A request arrived on ``conn`` (its CPU already charged)."""
        if self.host.dead:
            return
        now = self.net.loop.now
        self.conns[conn.rid] = conn
        request = wire.decode_request(frame)
        relaying = list(self.scheduler.relaying.steps.values())
        if self.liar and relaying:
            self.lie_messages = len(relaying[0].plan)
        # A liar is modified code: it lies on after its own receive has ended, whatever the honest ones do then.
        if self.liar and request.token is not None and self.lie_messages:
            if request.op == wire.OP_HAVE:  # claims everything, delivers nothing (a span fetch is never served)
                messages = self.lie_messages
                self.reply(conn, wire.have_reply(request.xfer, (1 << messages) - 1, messages), 0)
            return
        self.execute(self.scheduler.on_request(conn.rid, request, conn.member.host.name, now))
        self._answer_digests()
        self.pump()
        self._expire_soon()

    def disconnected(self, conn: Conn) -> None:
        if self.host.dead:
            return
        self.conns.pop(conn.rid, None)
        self.scheduler.disconnected(conn.rid)
        self.pump()

    def disconnected_by_death(self, conn: Conn) -> None:
        """``conn``'s receiver died: the same as a close, seen here a latency later."""
        self.disconnected(conn)

    def reply(self, conn: Conn, envelope: bytes, payload: int, cost: float = model.CONTROL_PER_MESSAGE,
              data: bool = False, body: bytes = b"") -> None:
        """Send a reply (``payload``: the bytes of the frames after the envelope) on ``conn``."""
        if conn.closed or conn.member.host.dead:
            return
        if not data:
            if self.is_source:
                self.net.counters.source_control += 1
            op = wire.unpack(envelope, wire.MAX_REQUEST_BYTES).get("op")
            self.net.counters.count(f"{op} reply {'from the source' if self.is_source else 'from a member'}")
        ready = self.host.serving.run(self.net.loop.now, cost)
        size = len(envelope) + payload + model.FRAME_OVERHEAD
        member, more = conn.member, payload > 0 or bool(body)
        self.net.send(self.host, member.host, ready, size, data,
                      lambda: member.reply(conn, envelope, more, payload, body), source=self.is_source)

    def execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, SendHeader):
                conn = self.conns.get(action.peer)
                if conn is None:
                    self.scheduler.undelivered(action, self.net.loop.now)
                    continue
                envelope = wire.header_envelope(
                    action.xfer, action.stage_id, action.relay, action.digest, action.digests_ahead
                )
                self.reply(conn, envelope, len(action.header_body), body=action.header_body)
                if action.header_only:
                    self.reply(conn, wire.end_reply(action.xfer), 0)
            elif isinstance(action, Have):
                conn = self.conns[action.peer]
                envelope = wire.have_reply(action.xfer, action.bits, action.messages, action.peers, action.coming,
                                           action.claimed, action.alone)
                self.reply(conn, envelope, 0)
            elif isinstance(action, Refuse):
                if action.peer in self.conns:
                    self.reply(self.conns[action.peer], wire.error_reply(action.xfer, action.code, action.message), 0)
            elif isinstance(action, Abort):
                conn = self.conns.get(action.transfer.peer)
                if conn is not None:
                    self.reply(conn, wire.error_reply(action.transfer.xfer, action.code, action.message), 0)
            elif isinstance(action, Finish):
                conn = self.conns.get(action.transfer.peer)
                if conn is not None:
                    self.reply(conn, action.envelope(), 0)

    def _answer_digests(self) -> None:
        """What serve.digests.DigestWork does: hash each message once, answer each digest request."""
        for transfer in [t for t in self.scheduler.transfers.values() if t.digests_only]:
            del self.scheduler.transfers[transfer.key]
            conn = self.conns.get(transfer.peer)
            fresh = [seq for seq in range(transfer.first, transfer.stop) if seq not in self.hashed]
            self.hashed.update(fresh)
            plan = transfer.staged
            assert isinstance(plan, Staged)
            cost = model.CONTROL_PER_MESSAGE + model.SOURCE_HASH_PER_BYTE * sum(
                wire.chunk_length(plan.plan[seq]) for seq in fresh)
            blob = b"".join(digests.digest_of(SHA, content(seq)) for seq in range(transfer.first, transfer.stop))
            if conn is not None:
                self.reply(conn, wire.digests_reply(transfer.xfer, transfer.first, blob), 0, cost=cost)

    def pump(self) -> None:
        """What serve/pump.py does: one data message per sendable transfer per round, while the uplink takes them."""
        if self._pumping or self.host.dead:
            return
        self._pumping = True
        try:
            while self.net.uplink_open(self.host):
                ready = [t for t in self.scheduler.next_round() if self._open(t)]
                if not ready:
                    return
                # serve/pump.py sends one message per ready transfer per round: the one
                # that sent longest ago goes next (an index into a list whose length
                # changes as transfers come and go starved some past the stall bound).
                self._turn += 1
                chosen = min(ready, key=lambda t: self._last_turn.get(t.key, -1))
                self._last_turn[chosen.key] = self._turn
                self._send(chosen)
        finally:
            self._pumping = False

    def _open(self, transfer: Transfer) -> bool:
        conn = self.conns.get(transfer.peer)
        return conn is not None and self.net.window_open(self.host, conn.member.host)

    def _send(self, transfer: Transfer) -> None:
        conn = self.conns[transfer.peer]
        seq = transfer.next_seq
        size = wire.chunk_length(transfer.staged.plan[seq]) if hasattr(transfer.staged, "plan") else 0
        if self.is_source:
            cost = model.SOURCE_PER_MESSAGE + size * model.SOURCE_PER_BYTE
        else:
            cost = model.RELAY_PER_MESSAGE + size * model.RELAY_PER_BYTE
        self.reply(conn, wire.data_envelope(transfer.xfer, seq, None), size, cost=cost, data=True)
        self.execute(self.scheduler.sent(transfer, self.net.loop.now))
        if self.is_source:
            self._watch()

    def _watch(self) -> None:
        """What serve/linkwatch.py does for the source's own step: the kernel's counters of its data
        connections, every READ_EVERY while data goes out and for LINGER after, to its uplink's measure.

        The model's kernel: a connection's bytes acknowledged are its data bytes delivered; a flight (a data
        message, at least MOVED_BYTES of one in a reading) crosses at its path's rate, the slower of the
        source's uplink and the receiver's downlink, and connections moving at once share the uplink. No
        flight is application-limited: the socket owner hands libzmq whole messages, which fill a flight
        (in the lab most readings of a swarm were application-limited; here the measure is believed after
        its three readings and 32 MiB acknowledged, which the lab reached 0.22 s into a step of three).
        """
        idle = self._watching_until < self.net.loop.now
        self._watching_until = self.net.loop.now + LINGER
        if idle:
            self.net.loop.at(self.net.loop.now + READ_EVERY, self._reading)

    def _reading(self) -> None:
        if self.host.dead:
            return
        now, me = self.net.loop.now, self.host.name
        moving = {dst: acked for (src, dst), acked in self.net.acked.items()
                  if src == me and acked - self._read.get(dst, 0) > 0}
        uplink = self.host.up.bps / 8 / model.WIRE_OVERHEAD
        hosts = {conn.member.host.name: conn.member.host for conn in self.conns.values()}
        readings: dict[int, LinkReading] = {}
        for dst, acked in moving.items():
            if dst not in hosts:
                continue
            path = min(uplink, hosts[dst].down.bps / 8 / model.WIRE_OVERHEAD)
            # A connection's key, as the kernel's descriptor is: one per receiver, the same at every reading.
            key = self._keys.setdefault(dst, len(self._keys))
            readings[key] = LinkReading(acked, min(path, uplink / len(moving)))
        self._read.update(moving)
        self.scheduler.uplink.links(readings)
        if now < self._watching_until:
            self.net.loop.at(now + READ_EVERY, self._reading)

    def _expire_soon(self) -> None:
        if self._expiring:
            return
        self._expiring = True

        def expire() -> None:
            self._expiring = False
            if self.host.dead:
                return
            self.execute(self.scheduler.expire(self.net.loop.now))
            self.pump()
            if self.scheduler.transfers or self.scheduler.relaying.waiting:
                self._expire_soon()

        self.net.loop.at(self.net.loop.now + EXPIRE_EVERY, expire)


@dataclass
class Outcome:
    """How one receive ended in the model."""

    done_at: float | None = None
    failed: str = ""
    landed: dict[int, bytes] = field(default_factory=dict)  # what landed where, as the model tracks it
    sources: dict[int, str] = field(default_factory=dict)  # from whom each message came
    killed: bool = False
    member: bool = False  # the source made it a swarm member (else it served it directly)


class Member:
    """A receiver: the header phase, then the real planner's striped receive; relays what lands."""

    def __init__(self, net: Net, host: model.Host, source: Server, directory: dict[str, Server],
                 relay: Server | None, kill_at: float | None = None, after_return: bool = True) -> None:
        self.net, self.host, self.source, self.directory, self.relay = net, host, source, directory, relay
        self.kill_at = kill_at  # the fraction of its messages after which it dies (None: never)
        # The transport's relay_after_return (a fresh receive, as every modelled one): once complete it serves
        # on until the run's end, as until torchft's disallow_checkpoint, which follows every healing replica.
        self.after_return = after_return
        self.outcome = Outcome()
        # Transfer ids as the real receive makes them (random 63-bit, planner.ReceivePlanner), from a draw
        # of this host's own: their wire size is the real one, and does not grow with how many were made.
        draw = random.Random(host.name)  # noqa: S311 (ids, not secrets; reproducible per host)
        self.xfers = iter(lambda: draw.getrandbits(63), None)
        self.conns: list[Conn] = []  # by the planner's stream index
        self.plan: ReceivePlanner | None = None
        self.relayed: Relayed | None = None
        self.header_conn: Conn | None = None
        self._header_xfer = 0
        self._tick_at = float("inf")
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.peer_names: dict[int, str] = {}  # the planner's peer id -> host name
        self.others: list[Member] = []  # told when this one dies
        self._pending: tuple[int, bytes, str] | None = None

    @property
    def finished(self) -> bool:
        return self.outcome.done_at is not None or bool(self.outcome.failed) or self.outcome.killed

    # ------------------------------------------------------------------ the header phase

    def start(self) -> None:
        conn = Conn(f"{self.host.name}/h".encode(), self, self.source, -1)
        self.header_conn = conn
        self._header_xfer = next(self.xfers)
        offer = f"tcp://{self.host.name}:7000" if self.relay is not None else None
        deadline = TIMEOUT
        request = wire.fetch_request(self._header_xfer, STEP, wait_ms(deadline, self.net.loop.now), 16, False,
                                     header_only=True, relay=offer, verify=[SHA.name])
        self._request(conn, request)

    def _on_header(self, conn: Conn, reply: wire.Reply) -> None:
        now = self.net.loop.now
        staged = self.source.staged
        assert staged is not None and reply.stage is not None
        plan = staged.plan
        self.sizes = [wire.chunk_length(pieces) for pieces in plan]
        self.offsets = list(itertools.accumulate(self.sizes, initial=0))
        order = reply.relay
        algorithm = digests.algorithm(reply.digest) if reply.digest is not None else None
        terms = SpanTerms(STEP, reply.stage, False, TIMEOUT, STALL, algorithm, digests_ahead=reply.digests_ahead)
        swarm, offset = None, 0
        known: tuple[wire.Peer, ...] = ()
        self.outcome.member = order is not None
        if order is not None and algorithm is not None:
            known = order.peers
            swarm = Swarm(order.token, known)
            offset = start_offset(len(known), len(plan))
        chunk = max(self.sizes)
        span = span_messages(chunk, len(plan) if swarm else 0, 1 + len(known) + 2)
        relays = order is not None and self.relay is not None
        self.plan = ReceivePlanner(self.offsets, terms, span, "the source", swarm, offset, relays,
                                   xfers=lambda: next(self.xfers))
        if relays:
            assert order is not None and self.relay is not None
            self.relayed = Relayed(STEP, reply.stage, order.token, plan, views=[])
            self.relay.execute(self.relay.scheduler.relay(self.relayed, now))
        # The header's connection carries data; one more carries questions to the source only.
        conn.index = self._add(self.source, SOURCE, None, False, up=True)
        if swarm is not None:
            self._add(self.source, SOURCE, None, True)
        self._carry_out(self.plan.start())
        self._tick(now)

    def _add(self, server: Server, peer: int, token: bytes | None, questions: bool, up: bool = False) -> int:
        assert self.plan is not None
        now = self.net.loop.now
        index = len(self.conns)
        conn = self.header_conn if up else Conn(f"{self.host.name}/{index}".encode(), self, server, index, questions)
        assert conn is not None
        self.conns.append(conn)
        self.plan.add_stream(peer, token, questions, f"tcp://{server.host.name}:7000", now)
        if up:
            self.plan.connection(index, True, None)
        else:
            def established() -> None:
                if self.plan is not None and not server.host.dead and not self.finished and not conn.closed:
                    self.plan.connection(index, True, None)
                    self._tick(self.net.loop.now)
            self.net.loop.at(now + 2 * (self.host.latency + server.host.latency), established)
        return index

    # ------------------------------------------------------------------ messages

    def _request(self, conn: Conn, frame: bytes) -> None:
        if conn.closed or self.host.dead:
            return
        ready = self.host.receiving.run(self.net.loop.now, model.CONTROL_PER_MESSAGE)
        server = conn.server
        if server.is_source:
            self.net.counters.source_control += 1
        message = wire.unpack(frame, wire.MAX_REQUEST_BYTES)
        op = "digests" if message.get("digests_only") else "span" if "span" in message else message.get("op")
        self.net.counters.count(f"{op} to {'the source' if server.is_source else 'a member'}")

        def arrive() -> None:
            if not conn.closed:
                serving, now = server.host.serving, self.net.loop.now
                # A request that finds the serving thread busy is read in a turn already paid for.
                cost = model.CONTROL_PER_MESSAGE if serving.free_at <= now else model.QUEUED_REQUEST
                done = serving.run(now, cost)
                self.net.loop.at(done, lambda: server.request(conn, frame))

        self.net.send(self.host, server.host, ready, len(frame) + model.FRAME_OVERHEAD, False, arrive)

    def reply(self, conn: Conn, envelope: bytes, more: bool, payload: int, body: bytes) -> None:
        """A reply arrived on ``conn``: its CPU, then the planner (or the header phase)."""
        if self.finished or conn.closed:
            return
        data = payload > 0 and not body
        relayed = data and not conn.server.is_source
        cost = model.CONTROL_PER_MESSAGE
        if data:
            cost = model.RECV_PER_MESSAGE + payload * (model.RECV_PER_BYTE + (model.HASH_PER_BYTE if relayed else 0))
        done = self.host.receiving.run(self.net.loop.now, cost)
        self.net.loop.at(done, lambda: self._handle(conn, envelope, more))

    def _handle(self, conn: Conn, envelope: bytes, more: bool) -> None:
        if self.finished or conn.closed:
            return
        now = self.net.loop.now
        reply = wire.decode_reply(envelope, more, conn.server.host.name)
        if self.plan is None:
            if reply.op == wire.OP_HEADER:
                self._on_header(conn, reply)
            elif reply.op == wire.OP_ERROR:
                self._fail(f"the source refused the header: [{reply.code}] {reply.text}")
            return
        if reply.xfer == self._header_xfer and reply.op == wire.OP_END:
            return  # the header's end marker (receive.receive_end)
        if self.plan.lanes[conn.index].gone:
            return  # the owner reads no stream it closed
        actions = self.plan.on_reply(conn.index, reply, conn.server.host.name, now)
        self._carry_out(actions, conn)
        # An answer says when it calls for a pass (plans.Wake); anything else, or an answer that broke
        # the protocol, at once.
        if reply.op != wire.OP_HAVE or not any(isinstance(action, plans.Wake) for action in actions):
            self._tick(now)

    def _carry_out(self, actions: list[plans.Action], conn: Conn | None = None) -> None:
        plan = self.plan
        assert plan is not None
        for action in actions:
            if self.finished:
                return
            match action:
                case plans.Send(stream=index):
                    if plan.lanes[index].gone or self.conns[index].closed:
                        self._carry_out(plan.undelivered(action))
                    else:
                        self._request(self.conns[index], action.request)
                case plans.Cancel(stream=index, xfer=xfer):
                    if not plan.lanes[index].gone:
                        self._request(self.conns[index], wire.cancel_request(xfer))
                case plans.Receive(stream=index, reply=reply, relayed=relayed):
                    self._receive(index, reply, relayed)
                case plans.Land(seq=seq):
                    self._land(seq)
                case plans.Discard():
                    pass
                case plans.Close(stream=index):
                    self._close(self.conns[index])
                case plans.Connect(peer=new):
                    server = self.directory.get(new.at.removeprefix("tcp://").split(":")[0])
                    if server is not None:
                        self.peer_names[new.peer] = server.host.name
                        self._add(server, new.peer, new.token, False)
                        self._add(server, new.peer, new.token, True)
                case plans.Fetching(asked=asked):
                    if self.relayed is not None:
                        self.relayed.coming = asked
                case plans.Wake(at=at):
                    self._tick(at)
                case plans.Fail(error=error):
                    self._fail(f"{type(error).__name__}: {error}")

    def _receive(self, index: int, reply: wire.Reply, relayed: bool) -> None:
        """The payload is in place: what the sender had of it (a member: what landed there, checked)."""
        assert self.plan is not None
        sender = self.conns[index].server.host.name
        data = content(reply.seq)
        digest = digests.digest_of(SHA, data) if relayed else None
        self._pending = (reply.seq, data, sender)
        self._carry_out(self.plan.received(index, reply.seq, reply.crc, digest))

    def _land(self, seq: int) -> None:
        pending = self._pending
        if pending is not None and pending[0] == seq:
            self.outcome.landed[seq], self.outcome.sources[seq] = pending[1], pending[2]
        else:  # a relayed message released by its digest's arrival: it landed earlier, from its peer
            self.outcome.landed[seq] = content(seq)
            self.outcome.sources.setdefault(seq, "peer")
        if self.relayed is not None:
            self.relayed.landed_one(seq, None)
            if self.relay is not None:
                self.relay.pump()
        assert self.plan is not None
        if self.kill_at is not None and len(self.outcome.landed) >= self.kill_at * len(self.sizes):
            self._kill()
        elif self.plan.complete:
            self._complete()

    # ------------------------------------------------------------------ time

    def _tick(self, when: float) -> None:
        # The owner (fetch/owner.py) drains every reply that is ready before its loop ticks: replies already
        # queued on the receiving thread come first, and one pass follows them all.
        when = max(when, self.host.receiving.free_at)
        if self.finished or when >= self._tick_at:
            return
        self._tick_at = when

        def tick() -> None:
            if self.finished or self._tick_at != when or self.plan is None:
                return
            self._tick_at = float("inf")
            now = self.net.loop.now
            self.net.counters.planner_passes += 1
            # The pass's own CPU, on the receiving thread: what it sends queues behind it.
            self.host.receiving.run(now, model.pass_cost(len(self.plan.lanes)))
            self._carry_out(self.plan.tick(now))
            if not self.finished:
                self._tick(self.plan.wake_at(now))

        self.net.loop.at(when, tick)

    # ------------------------------------------------------------------ endings

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        server = conn.server
        self.net.loop.at(self.net.loop.now + self.host.latency + server.host.latency,
                         lambda: server.disconnected(conn))

    def _complete(self) -> None:
        assert self.plan is not None
        now = self.net.loop.now
        self.outcome.done_at = now
        self.net.counters.duplicates += self.plan.duplicates
        self.outcome.done_at = None  # the cancels below still go out
        self._carry_out(self.plan.close())
        self.outcome.done_at = now
        for conn in self.conns:
            self._close(conn)
        if self.relay is not None and self.relayed is not None and not self.after_return:
            relay, relayed = self.relay, self.relayed

            def stop() -> None:  # fetch/relaying.RelayDuty.finish: a bounded tail, then stop
                relayed.stop()
                relay.execute(relay.scheduler.stop_relay(relayed.token))

            self.net.loop.at(now + RELAY_TAIL, stop)

    def _fail(self, why: str) -> None:
        self.outcome.failed = why
        for conn in self.conns:
            self._close(conn)
        if self.relayed is not None:
            self.relayed.stop()
            if self.relay is not None:
                self.relay.execute(self.relay.scheduler.stop_relay(self.relayed.token))

    def _kill(self) -> None:
        """The process dies: nothing more goes out; every connection to or from it goes down."""
        self.outcome.killed = True
        self.host.dead = True
        now = self.net.loop.now
        for conn in self.conns:
            conn.closed = True
            self.net.loop.at(now + self.host.latency + conn.server.host.latency, self._gone_from(conn))
        for other in self.others:
            if other is not self:
                self.net.loop.at(now + self.host.latency + other.host.latency, self._gone_to(other))

    def _gone_from(self, conn: Conn) -> Callable[[], None]:
        return lambda: conn.server.disconnected_by_death(conn)

    def _gone_to(self, other: Member) -> Callable[[], None]:
        return lambda: other.lost(self.host.name)

    def lost(self, server_name: str) -> None:
        """Every connection of this receive to ``server_name`` went down (its process died)."""
        if self.plan is None or self.finished:
            return
        now = self.net.loop.now
        for conn in self.conns:
            if conn.server.host.name == server_name and not self.plan.lanes[conn.index].gone:
                self.plan.connection(conn.index, True, now)
        self._tick(now)
