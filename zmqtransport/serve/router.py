"""The server's ROUTER socket: its options, its port, and binding it again after a forced close.

Used only by the serving thread (:mod:`zmqtransport.serve.server`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from .. import wire

logger = logging.getLogger("zmqtransport.sender")

# Small data frames are copied by pyzmq anyway; keep libzmq's per-peer queue far
# above what credit allows so a send never hits the high-water mark.
_SNDHWM = 8 * wire.MAX_CREDIT
READ_BATCH = 1000  # requests read per call, so a flood cannot starve the data pump
REBIND_RETRY = 0.02  # seconds between attempts to bind the port again after closing it
REBIND_DEADLINE = 10.0  # seconds: give up binding the port again after this long

Configure = Callable[[zmq.Socket[Any]], None]  # applies security options to a new socket


def bind_host(host: str) -> str:
    """The host part of a ``tcp://`` bind endpoint: ``*`` for any wildcard, IPv6 in brackets."""
    host = "*" if host in ("", "*", "0.0.0.0", "::") else host  # noqa: S104 - normalising the wildcard
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return host


class Router:
    """One ROUTER socket bound to a fixed port; :meth:`rebind` replaces it on the same port."""

    def __init__(self, context: zmq.Context[Any], host: str, port: int, configure: Configure | None) -> None:
        self._context = context
        self._configure = configure
        self.socket = self._make()
        host = bind_host(host)
        self.socket.bind(f"tcp://{host}:{port or '*'}")
        endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(endpoint.rsplit(":", 1)[1])
        self._endpoint = f"tcp://{host}:{self.port}"

    def _make(self) -> zmq.Socket[Any]:
        router: zmq.Socket[Any] = self._context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # raise instead of dropping frames
        router.setsockopt(zmq.SNDHWM, _SNDHWM)
        router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        router.setsockopt(zmq.IPV6, 1)
        if self._configure is not None:
            self._configure(router)
        return router

    def read(self) -> Iterator[tuple[bytes, str, list[zmq.Frame]]]:
        """Waiting requests as (routing id, peer address, frames after the routing id)."""
        for _ in range(READ_BATCH):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            yield frames[0].bytes, _peer_address(frames[-1]), frames[1:]

    def send(self, peer: bytes, frames: list[Any]) -> bool:
        """Send a small message; False if the peer is not connected (or not reading)."""
        try:
            self.socket.send_multipart([peer, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("could not reply to peer: %s", exc)
            return False
        return True

    def send_data(self, peer: bytes, envelope: bytes, payload: Any, track: bool) -> zmq.MessageTracker | None:
        """Send one data message, the payload without a copy; raises ``zmq.ZMQError``."""
        self.socket.send(peer, zmq.SNDMORE | zmq.NOBLOCK)
        self.socket.send(envelope, zmq.SNDMORE | zmq.NOBLOCK)
        tracker: zmq.MessageTracker | None = self.socket.send(payload, zmq.NOBLOCK, copy=False, track=track)
        return tracker

    def rebind(self) -> None:
        """Drop every queued frame by closing the socket, then listen again on the same port."""
        self.socket.close(linger=0)
        deadline = time.monotonic() + REBIND_DEADLINE
        while True:
            router = self._make()
            try:
                router.bind(self._endpoint)
            except zmq.ZMQError:
                router.close(linger=0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(REBIND_RETRY)
                continue
            self.socket = router
            return

    def close(self) -> None:
        self.socket.close(linger=0)


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError):
        return "unknown peer"
