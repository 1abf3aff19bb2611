"""The server's ROUTER socket: its options, its port, and binding it again after a forced close.

Used only by the serving thread (:mod:`zmqtransport.serve.server`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from .. import sockets, wire
from .connections import ConnectionBook

logger = logging.getLogger("zmqtransport.serve")

# Small data frames are copied by pyzmq anyway; keep libzmq's per-peer queue far
# above what credit allows so a send never hits the high-water mark.
_SNDHWM = 8 * wire.MAX_CREDIT
READ_BATCH = 1000  # requests read per call, so a flood cannot starve the data pump
REBIND_RETRY = 0.02  # seconds between attempts to bind the port again after closing it
REBIND_DEADLINE = 10.0  # seconds: give up binding the port again after this long
# Send flags as plain ints: pyzmq's flags are enums (each | on them about half a microsecond here).
_MORE = int(zmq.SNDMORE | zmq.NOBLOCK)
_LAST = int(zmq.NOBLOCK)

Configure = Callable[[zmq.Socket[Any]], None]  # applies security options to a new socket


class Router:
    """One ROUTER socket bound to one or more addresses; :meth:`rebind` replaces it on the same ones.

    A socket monitor reports new and closed connections (a receiver killed, a
    connection reset) by file descriptor; each request's source descriptor
    (``ZMQ_SRCFD``) maps it to the routing ids that used that connection. New
    connections beyond the caps of :class:`~.connections.ConnectionBook` are
    closed at once (or an idle one in their place): :meth:`refusals` says which.
    """

    def __init__(
        self, context: zmq.Context[Any], bind_hosts: Sequence[str], port: int, configure: Configure | None
    ) -> None:
        """Bind every host of ``bind_hosts`` (see :func:`~zmqtransport.sockets.bind_all`).

        On failure nothing stays open (:class:`~zmqtransport.BindError`).
        """
        self._context = context
        self._configure = configure
        self.socket = self._make()
        ports = sockets.bind_all(self.socket, bind_hosts, port)  # closes the socket if it fails
        self.bound = list(zip(bind_hosts, ports, strict=True))  # (bind host, port) per path
        self.port = ports[0]
        self._endpoints = [sockets.bind_endpoint(host, bound_port) for host, bound_port in self.bound]
        try:
            self.monitor = self._monitor()
        except BaseException:
            self.socket.close(linger=0)
            raise
        self._peer_fds: dict[bytes, int] = {}  # routing id -> descriptor of its connection
        self._addresses: dict[bytes, str] = {}  # routing id -> the peer address its requests came from
        self.connections = ConnectionBook()
        self._refused: list[tuple[str, str]] = []  # (peer host, why) of connections closed for the caps
        self._gone: list[bytes] = []  # routing ids whose connection closed, not yet returned by disconnected()
        self._busy: Container[bytes] = ()  # the last busy set disconnected() was given

    def _make(self) -> zmq.Socket[Any]:
        return sockets.new_socket(self._context, zmq.ROUTER, self._configure_router)

    def _configure_router(self, router: zmq.Socket[Any]) -> None:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # raise instead of dropping frames
        router.setsockopt(zmq.SNDHWM, _SNDHWM)
        router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        router.setsockopt(zmq.IPV6, 1)
        if self._configure is not None:
            self._configure(router)

    def _monitor(self) -> zmq.Socket[Any]:
        events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        monitor: zmq.Socket[Any] = self.socket.get_monitor_socket(events)
        return monitor

    def _close_monitor(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self._peer_fds.clear()
        self._addresses.clear()
        self.connections.clear()

    def read(self) -> Iterator[tuple[bytes, str, list[zmq.Frame]]]:
        """Waiting requests as (routing id, peer address, frames after the routing id)."""
        for _ in range(READ_BATCH):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes
            with contextlib.suppress(zmq.ZMQError):  # ZMQ_SRCFD is deprecated: without it, stalls still catch the dead
                fd = int(frames[-1].get(zmq.SRCFD))
                if self._peer_fds.get(peer) != fd:
                    # A new connection may have the descriptor of one that just closed, whose end the
                    # monitor already holds (libzmq reports it before closing the descriptor): read that
                    # end first, or it would be charged to this peer as well.
                    self._read_monitor()
                self._peer_fds[peer] = fd
                self.connections.seen(fd, time.monotonic())
            address = self._addresses[peer] = _peer_address(frames[-1])
            yield peer, address, frames[1:]

    def descriptor(self, peer: bytes) -> int | None:
        """The descriptor of the connection ``peer``'s requests came on (libzmq's: never close it)."""
        return self._peer_fds.get(peer)

    def address_of(self, peer: bytes) -> str:
        """The address ``peer``'s requests came from (for logs)."""
        return self._addresses.get(peer, "unknown peer")

    def cut(self, peer: bytes) -> bool:
        """Close the connection ``peer`` came on; libzmq then frees what it queued for it. False if it cannot.

        ROUTER has no call to drop one peer: the connection's descriptor (from
        ``ZMQ_SRCFD``) is shut down, not closed, so libzmq's I/O thread sees the
        connection end, closes the descriptor itself and frees the peer's
        queue, as for a peer that went away; every other connection is
        untouched. The monitor is read first: a descriptor whose connection
        closed may since have been reused by another peer's (the check of the
        remote address guards against that as well, across hosts).
        """
        self._read_monitor()
        fd = self._peer_fds.get(peer)
        return fd is not None and _shut_down(fd, _host_of(self._addresses.get(peer, "")))

    def disconnected(self, busy: Container[bytes] = ()) -> list[bytes]:
        """Routing ids whose connection closed since the last call; new connections are checked against the caps.

        Call it before reading requests (the serving thread does). ``busy``:
        routing ids with something running (their connections are never
        closed to make room for a new one); :meth:`read` uses the last set
        given here, as a peer that became busy since then sent a request
        since then, so it is not idle either.
        """
        self._busy = busy
        self._read_monitor()
        gone, self._gone = self._gone, []
        return gone

    def _read_monitor(self) -> None:
        """Act on the monitor's events in their order: caps for new connections, ends noted for :meth:`disconnected`."""
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(int(event["value"]), self._busy)
                continue
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            self.connections.closed(event["value"])
            gone = [peer for peer, fd in self._peer_fds.items() if fd == event["value"]]
            for peer in gone:
                del self._peer_fds[peer]
                self._addresses.pop(peer, None)
            self._gone += gone

    def _accepted(self, fd: int, busy: Container[bytes]) -> None:
        """A new connection on ``fd``: within the caps it stays; beyond them it (or an idle one) is closed."""
        try:
            connection = socket.socket(fileno=fd)
        except OSError:
            return
        try:
            host = _host(connection.getpeername())
        except OSError:
            return  # already gone: the monitor reports its end
        finally:
            connection.detach()
        busy_fds = {held for peer, held in self._peer_fds.items() if peer in busy}
        closing, why = self.connections.accepted(fd, host, time.monotonic(), busy_fds)
        if closing is not None and _shut_down(closing, self.connections.host(closing) or host):
            self._refused.append((self.connections.host(closing) or host, why))

    def refusals(self) -> list[tuple[str, str]]:
        """(peer host, why) of each connection closed for the caps since the last call."""
        refused, self._refused = self._refused, []
        return refused

    def send(self, peer: bytes, frames: list[Any]) -> bool:
        """Send a small message; False if the peer is not connected (or not reading).

        Frame by frame with the flags as plain ints, as ``send_multipart`` does
        them less cheaply: every answer goes through here, and at a job start the
        source answers thousands of questions a second (``send_multipart`` and
        its flag arithmetic on pyzmq's enums were a sixth of a question's CPU).
        A ROUTER takes or refuses a message at its first frame, so a refusal
        leaves nothing half sent.
        """
        parts = [peer, *frames]
        try:
            for part in parts[:-1]:
                self.socket.send(part, _MORE)
            self.socket.send(parts[-1], _LAST)
        except zmq.ZMQError as exc:
            logger.debug("could not reply to peer: %s", exc)
            return False
        return True

    def send_data(self, peer: bytes, envelope: bytes, payload: Any, track: bool) -> zmq.MessageTracker | None:
        """Send one data message, the payload without a copy; raises ``zmq.ZMQError``."""
        self.socket.send(peer, _MORE)
        self.socket.send(envelope, _MORE)
        tracker: zmq.MessageTracker | None = self.socket.send(payload, _LAST, copy=False, track=track)
        return tracker

    def rebind(self) -> None:
        """Drop every queued frame by closing the socket, then listen again on the same addresses and ports."""
        self._close_monitor()
        self.socket.close(linger=0)
        deadline = time.monotonic() + REBIND_DEADLINE
        while True:
            router = self._make()
            try:
                for endpoint in self._endpoints:
                    router.bind(endpoint)
            except zmq.ZMQError:
                router.close(linger=0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(REBIND_RETRY)
                continue
            self.socket = router
            self.monitor = self._monitor()
            return

    def close(self) -> None:
        self._close_monitor()
        self.socket.close(linger=0)


def _shut_down(fd: int, host: str) -> bool:
    """Shut the connection on ``fd`` down if its remote host is ``host``; libzmq then closes it.

    Shut down, not closed: libzmq owns the descriptor, sees the connection end,
    closes it and frees what it queued, as for a peer that went away. The host
    check guards against a descriptor reused since it was reported.
    """
    try:
        connection = socket.socket(fileno=fd)
    except OSError:
        return False
    try:
        if _host(connection.getpeername()) != _host_of(host):
            return False
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    finally:
        connection.detach()  # libzmq owns the descriptor: never close it here
    return True


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError):
        return "unknown peer"


def _host(name: Any) -> str:
    """The host of a socket's remote address (an IPv4 address mapped into IPv6 as plain IPv4)."""
    host = str(name[0]) if isinstance(name, tuple) else str(name)
    return host.removeprefix("::ffff:")


def _host_of(address: str) -> str:
    return address.removeprefix("::ffff:").strip("[]")
