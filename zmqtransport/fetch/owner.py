"""The one socket owner of a striped receive: polls its streams, drains them, carries out the plan.

The receiving thread owns every DEALER of the data phase (to the source over
each of its paths and, in a swarm, to each peer). :class:`Owner` waits on
them all with one poller, reads each connection's socket monitor, hands every
reply's envelope and every connection's change to the pure
:class:`~.planner.ReceivePlanner`, and carries out what it decides: requests
sent, cancels, streams closed, peers connected, data messages received into
their destination through the :class:`~.inbox.Inbox`. It decides nothing
itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from .. import wire
from ..errors import ProtocolError
from . import planner as plans
from .connection import Connection
from .inbox import Inbox
from .peers import NewPeer
from .planner import CHECK_EVERY, ReceivePlanner, Ticks

logger = logging.getLogger("zmqtransport.fetch")

# Messages taken from one stream before the others get a turn.
DRAIN_BATCH = 32

# Opens the connections to a new swarm peer (where it serves, its token, its id in the book).
OpenPeer = Callable[[str, bytes, int], list[Connection]]


class Owner:
    """Receives every data message of ``inbox``'s plan over ``streams`` as ``plan`` decides; the calling
    thread owns them all. In a swarm, ``open_peer`` connects to a peer the plan names."""

    def __init__(
        self, streams: Sequence[Connection], inbox: Inbox, plan: ReceivePlanner, open_peer: OpenPeer | None = None
    ) -> None:
        self.inbox = inbox
        self.plan = plan
        self.open_peer = open_peer
        self.streams: list[Connection] = []  # by the plan's stream index
        self.poller = zmq.Poller()
        self.ticks = Ticks()
        for stream in streams:
            self._add(stream)
        self._carry_out(plan.start())

    def run(self) -> None:
        """Until every message has landed."""
        ready: dict[Any, int] | None = None  # None: read every connection's monitor (the first pass)
        plan = self.plan
        try:
            while not plan.complete:
                now = time.monotonic()
                self._follow_connections(now, ready)
                if self.ticks.due(now):
                    self._carry_out(plan.tick(now))
                    self.ticks.ticked(max(plan.wake_at(now), now))
                ready = dict(self.poller.poll(self._wait_ms(now)))
                for index, stream in enumerate(self.streams):
                    if stream.socket in ready and not plan.lanes[index].gone:
                        self._drain(index, stream)
        finally:
            self._carry_out(plan.close())

    def _wait_ms(self, now: float) -> int:
        return max(0, math.ceil((max(self.ticks.at, now) - now) * 1000))

    # ------------------------------------------------------------------ streams

    def _add(self, stream: Connection) -> None:
        self.streams.append(stream)
        self.plan.add_stream(stream.peer, stream.token, stream.questions, stream.endpoint, time.monotonic())
        state = stream.watch.state  # read already where the receive looked at it (its first streams)
        self.plan.connection(len(self.streams) - 1, state.established, state.lost_at)
        self.poller.register(stream.socket, zmq.POLLIN)
        self.poller.register(stream.watch.monitor, zmq.POLLIN)

    def _connect(self, new: NewPeer) -> None:
        assert self.open_peer is not None  # a receive with peers can open them
        try:
            connections = self.open_peer(new.at, new.token, new.peer)
        except ProtocolError as exc:
            step = self.plan.terms.step
            logger.warning("striped receive of step %d: cannot fetch from a peer: %s", step, exc)
            return
        for connection in connections:
            self._add(connection)

    def _close(self, index: int) -> None:
        stream = self.streams[index]
        with contextlib.suppress(KeyError):
            self.poller.unregister(stream.socket)
            self.poller.unregister(stream.watch.monitor)
        stream.close()

    def _follow_connections(self, now: float, ready: dict[Any, int] | None) -> None:
        """Each connection's state, from its monitor's events (only monitors the last poll found ready have
        any: a receive with peers has a dozen connections or more, and passes its loop hundreds of times);
        what arrived on a connection that went down still counts."""
        plan = self.plan
        for index, stream in enumerate(self.streams):
            if plan.lanes[index].gone:
                continue
            if (ready is None or stream.watch.monitor in ready) and stream.watch.read_events(now):
                state = stream.watch.state
                plan.connection(index, state.established, state.lost_at)
                self.ticks.changed()
        for index in plan.settling(now):
            self.ticks.changed()
            self._drain(index, self.streams[index])

    # ------------------------------------------------------------------ replies

    def _drain(self, index: int, stream: Connection) -> None:
        plan = self.plan
        who, until = plan.describe(index), time.monotonic() + CHECK_EVERY  # then the loop's turn
        for _ in range(DRAIN_BATCH):
            try:
                reply = stream.reply(who)
                if reply is None:
                    return
                self.ticks.replied(reply)
                self._carry_out(plan.on_reply(index, reply, who, time.monotonic()), who)
            except ProtocolError as exc:
                self.ticks.changed()
                self._carry_out(plan.malformed(index, exc))  # the source's fails the receive
            if plan.complete or plan.lanes[index].gone or time.monotonic() >= until:
                return

    def _receive(self, action: plans.Receive, who: str) -> None:
        reply, plan = action.reply, self.plan
        try:
            _, digest = self.inbox.receive(self.streams[action.stream], reply, who, action.relayed)
        except ProtocolError:
            plan.unreceived(reply.seq)
            raise
        self._carry_out(plan.received(action.stream, reply.seq, reply.crc, digest))

    # ------------------------------------------------------------------ actions

    def _carry_out(self, actions: list[plans.Action], who: str = "") -> None:
        plan = self.plan
        for action in actions:
            self.ticks.carried(action)
            match action:
                case plans.Send(stream=index):
                    # A stream dropped since the request was made does not take it either.
                    if plan.lanes[index].gone or not self.streams[index].send(action.request):
                        self._carry_out(plan.undelivered(action))
                case plans.Cancel(stream=index, xfer=xfer):
                    if not plan.lanes[index].gone:
                        self.streams[index].cancel(wire.cancel_request(xfer))
                case plans.Receive():
                    self._receive(action, who)
                case plans.Land(seq=seq, crc=crc):
                    self.inbox.count(seq, crc)
                case plans.Discard(stream=index):
                    self.streams[index].discard()
                case plans.Close(stream=index):
                    self._close(index)
                case plans.Connect(peer=new):
                    self._connect(new)
                case plans.Fetching(asked=asked):
                    if self.inbox.duty is not None:
                        self.inbox.duty.fetching(asked)
                case plans.Wake():
                    pass  # self.ticks took it
                case plans.Fail(error=error):
                    raise error
