"""The DEALER sockets of one receive, and which path each one uses.

A receive starts with one DEALER to the source's first path (or one per path,
racing: :mod:`zmqtransport.paths`); the one that wins carries the request and
the header. A striped receive keeps the others that may still connect, opens
more up to ``streams``, and, when the source names a relay, one per path of
that relay. All belong to the receiving thread and are closed by
:meth:`Connections.close`, whatever happened.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import zmq

from . import liveness, paths, striped, wire
from .errors import ProtocolError
from .net import Path, PeerAddress, parse_metadata

Configure = Callable[[zmq.Socket[Any]], None]


class Connections:
    """One receive's DEALERs: the one in use (:attr:`socket`), kept ones, and extra streams."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: PeerAddress,
        stall_timeout: float | None,
        peer_options: Configure | None,
        options_for: Callable[[PeerAddress], Configure | None] | None = None,
    ) -> None:
        self.context = context
        self.address = address
        self.stall_timeout = stall_timeout
        self.peer_options = peer_options  # the source's (CurveZMQ server key)
        self.options_for = options_for  # another peer's (a relay's key)
        self.spare: list[paths.Candidate] = []  # further paths' DEALERs kept for a striped receive
        self.extra: list[paths.Candidate] = []  # further connections opened for a striped receive
        # Closed again if configuring it fails (a bad key, say): a socket left
        # open would make the transport's shutdown wait forever in Context.term().
        # The watch is set up before connecting, so it sees the handshake.
        racing = bool(address.more_paths)
        self.first = paths.open_candidate(context, address.paths[0], self.configure, stall_timeout, racing)

    @property
    def socket(self) -> zmq.Socket[Any]:
        return self.first.socket

    @property
    def watch(self) -> liveness.SourceWatch:
        return self.first.watch

    @property
    def path(self) -> Path:
        return self.first.path

    def configure(self, sock: zmq.Socket[Any]) -> None:
        """Options of a DEALER to the source (its CurveZMQ key, if any)."""
        self.configure_for_peer(sock, self.peer_options)

    def configure_for_peer(self, sock: zmq.Socket[Any], peer_options: Configure | None) -> None:
        """Options of every DEALER of a receive; ``peer_options`` those of the peer it connects to."""
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
        # An explicit routing id survives a reconnect, so a sender that had to
        # rebuild its ROUTER (forced release of a stalled receiver) can still
        # answer a request it parked before. Ids must not start with a zero byte.
        sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))
        liveness.configure_heartbeats(sock, self.stall_timeout)
        if peer_options is not None:
            peer_options(sock)

    def connect(self, deadline: float, keep: bool) -> str | None:
        """Connect to the only path, or to the most preferred of several that connects.

        ``keep``: a striped receive keeps the other paths' DEALERs in :attr:`spare`.
        Returns what became of each path when none connected by ``deadline`` (else None).
        """
        if not self.address.more_paths:
            self.socket.connect(self.path.endpoint)
            return None
        candidates = [self.first]
        try:
            for path in self.address.more_paths:
                candidates.append(paths.open_candidate(self.context, path, self.configure, self.stall_timeout))
        except BaseException:
            for candidate in candidates[1:]:
                candidate.close()
            raise
        winner, self.spare, tried = paths.connect_first(candidates, deadline, keep=keep)
        if winner is None:
            # connect_first closed them all; a closed socket closes again harmlessly.
            return tried
        self.first = winner
        return None

    def drop_spare(self) -> None:
        for candidate in self.spare:
            candidate.close()
        self.spare = []

    def streams(self, count: int | None, relay: wire.RelayOrder | None) -> list[striped.Stream]:
        """A striped receive's connections: this one, the kept ones, more up to ``count``, a relay's."""
        candidates = [self.first, *self.spare]
        count = count if count is not None else len(candidates)
        for candidate in candidates[count:]:
            candidate.close()
        candidates = candidates[:count]
        now = time.monotonic()
        for candidate in candidates:
            candidate.watch.read_events(now)
        # More connections than paths: spread over the paths that are up, most preferred first.
        targets = [c.path for c in candidates if c.watch.state.established] or [self.path]
        for extra in range(count - len(candidates)):
            candidates.append(self._open(targets[extra % len(targets)], self.configure))
        self.spare = candidates[1:]
        streams = [striped.Stream(c.path, c.socket, c.watch) for c in candidates]
        if relay is not None and relay.upstream is not None:
            # Fetch from the relay the source named; the source's connections stand by.
            for stream in streams:
                stream.standby = True
            streams[:0] = self._relay_streams(relay)
        return streams

    def _relay_streams(self, order: wire.RelayOrder) -> list[striped.Stream]:
        """One connection per path of the upstream relay, showing the token the source gave for it."""
        assert order.upstream is not None
        try:
            upstream = parse_metadata(order.upstream)
        except ValueError as exc:
            raise ProtocolError(f"the source named a relay with malformed metadata: {exc}") from None
        relay_options = self.options_for(upstream) if self.options_for is not None else None

        def configure(sock: zmq.Socket[Any]) -> None:
            self.configure_for_peer(sock, relay_options)

        streams = []
        for path in upstream.paths:
            candidate = self._open(path, configure)
            streams.append(striped.Stream(path, candidate.socket, candidate.watch, token=order.upstream_token))
        return streams

    def _open(self, path: Path, configure: Configure) -> paths.Candidate:
        candidate = paths.open_candidate(self.context, path, configure, self.stall_timeout, False)
        self.extra.append(candidate)
        candidate.socket.connect(path.endpoint)
        return candidate

    def close(self) -> None:
        for candidate in (*self.spare, *self.extra, self.first):
            candidate.close()
