"""The DEALER sockets of one receive: one :class:`Connection` type, and the set a receive opens.

A receive starts with one DEALER to the source's first path (or one per path,
racing: :mod:`.racing`); the one that wins carries the request and the
header. A striped receive keeps the others that may still connect, opens more
up to ``streams``, and, in a swarm, one per path of each peer. All belong to
the receiving thread and are closed by :meth:`Connections.close`, whatever
happened.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from .. import sockets, wire
from ..errors import ProtocolError
from ..net import Path, PeerAddress, parse_metadata
from . import racing
from .streams import REFUSAL_EVENTS, Configure, Context, DealerStream, SourceWatch, configure_heartbeats


class Connection(DealerStream):
    """One DEALER of a receive (a :class:`~.streams.Stream`): the path it connects to, the socket, the watch.

    ``peer`` and ``token`` name a swarm peer (``token`` shown in every span
    fetch, docs/protocol.md, "Swarm"); 0 and None for the source.
    ``questions``: it carries questions only (have, members, digests, signs of
    life), never a span fetch, so their answers never queue behind data
    (docs/protocol.md, "Swarm").
    """

    def __init__(
        self,
        path: Path,
        socket: zmq.Socket[Any],
        watch: SourceWatch,
        peer: int = 0,
        token: bytes | None = None,
        questions: bool = False,
    ) -> None:
        super().__init__(socket, watch, path.endpoint)
        self.path = path
        self.peer = peer
        self.token = token
        self.questions = questions


def open_connection(
    context: Context, path: Path, configure: Configure, stall_timeout: float | None, racing: bool = False
) -> Connection:
    """A DEALER set up by ``configure`` and watched, not yet connected; nothing stays open if that fails.

    ``racing``: it takes part in :func:`.racing.connect_first`, so its watch
    also reports failed connection attempts (a lone DEALER does without them).
    The watch is set up before connecting, so it sees the handshake.
    """
    socket = sockets.new_socket(context, zmq.DEALER, configure)
    try:
        watch = SourceWatch(socket, stall_timeout, REFUSAL_EVENTS if racing else 0)
    except BaseException:
        socket.close(linger=0)
        raise
    return Connection(path, socket, watch)


def dealer_options(stall_timeout: float | None, peer_options: Configure | None) -> Configure:
    """Options of every DEALER of a receive; ``peer_options`` those of the peer it connects to (its CurveZMQ key)."""

    def configure(sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
        # An explicit routing id survives a reconnect, so a sender that had to
        # rebuild its ROUTER (forced release of a stalled receiver) can still
        # answer a request it parked before. Ids must not start with a zero byte.
        sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))
        configure_heartbeats(sock, stall_timeout)
        if peer_options is not None:
            peer_options(sock)

    return configure


class Connections:
    """One receive's DEALERs: the one in use (:attr:`first`), kept ones, extra streams and a relay's."""

    def __init__(
        self,
        context: Context,
        address: PeerAddress,
        stall_timeout: float | None,
        source_options: Configure | None,
        relay_options: Callable[[PeerAddress], Configure | None] | None,
    ) -> None:
        self.context = context
        self.address = address
        self.stall_timeout = stall_timeout
        self.to_source = dealer_options(stall_timeout, source_options)
        self.relay_options = relay_options  # a relay's DEALER options, from its metadata
        self.spare: list[Connection] = []  # further paths' DEALERs kept for a striped receive
        self.extra: list[Connection] = []  # further connections opened for a striped receive
        # Closed again if configuring it fails (a bad key, say): a socket left
        # open would make the transport's shutdown wait forever in Context.term().
        self.first = self._new(address.paths[0], self.to_source, racing=bool(address.more_paths))

    def connect(self, deadline: float, keep: bool) -> str | None:
        """Connect to the only path, or to the most preferred of several that connects.

        ``keep``: a striped receive keeps the other paths' DEALERs in :attr:`spare`.
        Returns what became of each path when none connected by ``deadline`` (else None).
        """
        if not self.address.more_paths:
            self.first.socket.connect(self.first.endpoint)
            return None
        racers = [self.first]
        try:
            for path in self.address.more_paths:
                racers.append(self._new(path, self.to_source, racing=True))
        except BaseException:
            for racer in racers[1:]:
                racer.close()
            raise
        winner, self.spare, tried = racing.connect_first(racers, deadline, keep=keep)
        if winner is None:
            # connect_first closed them all; a closed socket closes again harmlessly.
            return tried
        self.first = winner
        return None

    def drop_spare(self) -> None:
        for connection in self.spare:
            connection.close()
        self.spare = []

    def streams(self, count: int | None) -> list[Connection]:
        """A striped receive's connections to the source: this one, the kept ones, more up to ``count``."""
        connections = [self.first, *self.spare]
        count = count if count is not None else len(connections)
        for connection in connections[count:]:
            connection.close()
        connections = connections[:count]
        now = time.monotonic()
        for connection in connections:
            connection.watch.read_events(now)
        # More connections than paths: spread over the paths that are up, most preferred first.
        targets = [c.path for c in connections if c.watch.state.established] or [self.first.path]
        for extra in range(count - len(connections)):
            connections.append(self._open(targets[extra % len(targets)], self.to_source))
        self.spare = connections[1:]
        return connections

    def open_peer(self, at: str, token: bytes, peer: int) -> list[Connection]:
        """One connection per path of the swarm peer serving at ``at`` (its metadata), showing its ``token``:
        its paths this receive has no connection to yet.

        Raises ``ProtocolError`` for metadata this receive cannot use: malformed, or asking for
        connection parameters it does not have (CurveZMQ where it has none, a key that is no key).
        The offer is the peer's, named by the source: it costs that peer only, never the receive.
        """
        try:
            address = parse_metadata(at)
            peer_options = self.relay_options(address) if self.relay_options is not None else None
        except ValueError as exc:
            raise ProtocolError(f"the source named a peer whose metadata this receiver cannot use: {exc}") from None
        configure = dealer_options(self.stall_timeout, peer_options)
        opened = {c.path for c in self.extra if c.peer == peer and not c.questions}
        connections = [self._open(path, configure) for path in address.paths if path not in opened]
        if not any(c.peer == peer and c.questions for c in self.extra):
            connections.append(self._open(address.paths[0], configure, questions=True))
        for connection in connections:
            connection.peer, connection.token = peer, token
        return connections

    def questions_to_source(self, streams: list[Connection]) -> list[Connection]:
        """One connection for questions per path of the source that ``streams`` use: the source
        believes a member's paths on the addresses its questions come from."""
        paths = list(dict.fromkeys(stream.path for stream in streams))
        return [self._open(path, self.to_source, questions=True) for path in paths]

    def _new(self, path: Path, configure: Configure, racing: bool = False) -> Connection:
        return open_connection(self.context, path, configure, self.stall_timeout, racing)

    def _open(self, path: Path, configure: Configure, questions: bool = False) -> Connection:
        connection = self._new(path, configure)
        connection.questions = questions
        self.extra.append(connection)
        connection.socket.connect(path.endpoint)
        return connection

    def close(self) -> None:
        for connection in (*self.spare, *self.extra, self.first):
            connection.close()
