"""How many connections one serving socket keeps open, and which one goes when there are too many.

Every connection is memory of this process (libzmq's pipes and buffers, the
kernel's socket buffers) and a file descriptor, shared with everything else the
training process opens; a peer decides how many it opens. So each serving
socket (a source's, and a relaying receiver's) keeps at most
:data:`MAX_CONNECTIONS` open, at most :data:`MAX_PER_HOST` from one host
(docs/security.md, "Connections"). A connection beyond either is let in only
in place of an idle one of that scope: one on which nothing runs (no transfer,
no parked request) and no request came for :data:`IDLE_CONNECTION` seconds,
the longest idle first; otherwise the newcomer is refused (its connection is
closed at once; a DEALER tries again on its own). An honest receiver sends its
first request as it connects and keeps asking while it receives, so it is
never the idle one; a connection that never sends is.

Pure bookkeeping (no zmq, no sockets): connections are named by their file
descriptor as the socket monitor reports them; the socket owner
(:mod:`.router`) feeds events and closes what this says to close.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

# Connections one serving socket keeps open at once. A source may serve every
# other replica group of a job at once (job start heals N-1 of them, 256 and
# more), each over one connection per path, and a relay its swarm's members
# (wire.MAX_PEERS); this leaves room for that while bounding what a peer can
# open.
MAX_CONNECTIONS = 1024
# Connections from one host: its ranks' receivers, each over its paths, and
# the members relaying through it.
MAX_PER_HOST = 64
# Seconds without a request on a connection, with nothing running on it,
# after which it may be closed to make room for a new one.
IDLE_CONNECTION = 10.0


@dataclass
class _Open:
    host: str
    last_seen: float  # when it was accepted or last sent a request


class ConnectionBook:
    """The connections one serving socket has open (by descriptor), and the decisions of the caps."""

    def __init__(self, limit: int | None = None, per_host: int | None = None, idle: float | None = None) -> None:
        # The module's values, read here (not bound at import): tests patch them.
        self.limit = MAX_CONNECTIONS if limit is None else limit
        self.per_host = MAX_PER_HOST if per_host is None else per_host
        self.idle = IDLE_CONNECTION if idle is None else idle
        self._open: dict[int, _Open] = {}

    def __len__(self) -> int:
        return len(self._open)

    def accepted(self, fd: int, host: str, now: float, busy: Container[int]) -> tuple[int | None, str]:
        """A new connection on ``fd`` from ``host``: the descriptor to close (it or an idle one) and why.

        (None, "") when it fits. ``busy``: descriptors with something running
        on them (a transfer, a parked request), never closed for room.
        """
        self._open[fd] = _Open(host, now)
        from_host = [other for other, seen in self._open.items() if seen.host == host and other != fd]
        if len(from_host) >= self.per_host:
            return self._make_room(fd, from_host, now, busy, f"{len(from_host) + 1} connections from {host}")
        if len(self._open) > self.limit:
            others = [other for other in self._open if other != fd]
            return self._make_room(fd, others, now, busy, f"{len(self._open)} connections open")
        return None, ""

    def _make_room(self, fd: int, among: list[int], now: float, busy: Container[int], why: str) -> tuple[int, str]:
        idle = [other for other in among if other not in busy and now - self._open[other].last_seen >= self.idle]
        if idle:
            oldest = min(idle, key=lambda other: self._open[other].last_seen)
            return oldest, f"{why}: closed the one idle longest ({now - self._open[oldest].last_seen:.0f} s)"
        return fd, f"{why}: refused"

    def seen(self, fd: int, now: float) -> None:
        """A request came on ``fd``."""
        connection = self._open.get(fd)
        if connection is not None:
            connection.last_seen = now

    def host(self, fd: int) -> str | None:
        connection = self._open.get(fd)
        return None if connection is None else connection.host

    def closed(self, fd: int) -> None:
        """The connection on ``fd`` closed (the monitor said so): its descriptor may be reused."""
        self._open.pop(fd, None)

    def clear(self) -> None:
        """The socket was closed: every connection with it."""
        self._open.clear()
