"""Socket life cycle helpers: nothing half-built is left behind when set-up fails.

A ZeroMQ context cannot be terminated while any of its sockets is open:
``Context.term()`` waits for them forever. So every place that creates a
socket and then configures, binds or connects it must close the socket (with
``linger=0``) before the error propagates; otherwise the caller's cleanup
hangs instead of reporting the error. The helpers here do that, and turn a
failed bind into an error that names the option and the value at fault.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from .errors import BindError
from .net import WILDCARD_HOSTS

logger = logging.getLogger(__name__)

MAX_PORT = 65535
TERM_TIMEOUT = 5.0  # seconds an error path waits for Context.term() before giving up on it


def check_port(port: int) -> int:
    """``port`` if it is a TCP port number or 0 (any free port); ``ValueError`` naming it if not."""
    if type(port) is not int or not 0 <= port <= MAX_PORT:
        # libzmq would silently bind some other port for 70000.
        raise ValueError(f"port={port!r}: must be an integer in [0, {MAX_PORT}] (0: any free port)")
    return port


def bind_endpoint(bind_host: str, port: int) -> str:
    """The ZeroMQ endpoint for listening on ``bind_host``:``port`` (``*`` for every wildcard form)."""
    host = "*" if bind_host in WILDCARD_HOSTS else bind_host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port or '*'}"


def new_socket(
    context: zmq.Context[Any], kind: int, configure: Callable[[zmq.Socket[Any]], None]
) -> zmq.Socket[Any]:
    """A socket of ``kind`` set up by ``configure``; closed again (linger 0) if ``configure`` raises."""
    sock: zmq.Socket[Any] = context.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        configure(sock)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bind(sock: zmq.Socket[Any], bind_host: str, port: int) -> int:
    """Bind ``sock`` to ``bind_host``:``port`` and return the port it got.

    On failure the socket is closed with ``linger=0`` (so the context can still
    be terminated) and :class:`BindError` names the option at fault.
    """
    endpoint = bind_endpoint(bind_host, check_port(port))
    try:
        sock.bind(endpoint)
        bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as exc:
        sock.close(linger=0)
        raise bind_error(exc, bind_host, port) from exc
    except BaseException:
        sock.close(linger=0)
        raise
    return int(bound.rsplit(":", 1)[1])


def bind_all(sock: zmq.Socket[Any], bind_hosts: Sequence[str], port: int) -> list[int]:
    """Bind ``sock`` on every host of ``bind_hosts`` (libzmq allows several binds); the port each got.

    With ``port`` given, every host must get that port. With ``port=0`` the
    first bind picks a free port and the later hosts try that same one, so
    all paths usually share a port; where it is taken on that address, the
    host gets a free port of its own (the metadata carries each path's port).
    On any failure the socket is closed, which releases the binds made
    before, and :class:`BindError` names the host at fault.
    """
    ports = [bind(sock, bind_hosts[0], port)]  # closes the socket if it fails
    for host in bind_hosts[1:]:
        if port or not _try_bind(sock, host, ports[0]):
            ports.append(bind(sock, host, port))
        else:
            ports.append(ports[0])
    return ports


def _try_bind(sock: zmq.Socket[Any], bind_host: str, port: int) -> bool:
    """Bind ``bind_host``:``port``; False if the port is taken there (the socket stays open)."""
    try:
        sock.bind(bind_endpoint(bind_host, port))
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            return False
        sock.close(linger=0)
        raise bind_error(exc, bind_host, 0) from exc
    except BaseException:
        sock.close(linger=0)
        raise
    return True


def bind_error(exc: zmq.ZMQError, bind_host: str, port: int) -> BindError:
    """What a failed bind means, in terms of the options the caller passed."""
    where = f"bind_host={bind_host!r}, port={port}"
    if exc.errno == errno.EADDRINUSE:
        message = f"port={port} is already in use on bind_host={bind_host!r} (pass port=0 for any free port)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        message = f"bind_host={bind_host!r}: not an address of this host"
    elif exc.errno == errno.ENODEV:
        # libzmq's answer for a name that is neither an interface nor resolvable.
        message = f"bind_host={bind_host!r}: not an address, interface name or resolvable host name of this host"
    elif exc.errno == errno.EACCES:
        message = f"port={port}: permission denied (ports below 1024 need privileges)"
    else:
        message = f"cannot listen on {where}: {exc.strerror}"
    error = BindError(message)
    error.errno = exc.errno
    return error


def terminate(context: zmq.Context[Any], timeout: float = TERM_TIMEOUT, *, level: int = logging.ERROR) -> bool:
    """``context.term()``, waiting at most ``timeout`` seconds; False if it did not finish.

    For error paths, which must never hang: ``term()`` blocks while a socket of
    the context is still open, which is a bug elsewhere. Rather than wait
    forever, that is logged at ``level``, naming the sockets still open, and
    the context is left to the process.
    """
    worker = threading.Thread(target=context.term, name="zmqtransport-term", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        logger.log(
            level,
            "zmqtransport: the ZeroMQ context did not terminate within %.1f s; left open (never closed by its"
            " owner): %s. The context is left to the process.",
            timeout,
            ", ".join(open_sockets(context)) or "a socket",
        )
        return False
    return True


def open_sockets(context: zmq.Context[Any]) -> list[str]:
    """The sockets of ``context`` not closed yet, as pyzmq names them (``<zmq.Socket(zmq.DEALER) at 0x...>``).

    Read from pyzmq's own bookkeeping, without a socket call: the sockets may
    belong to other threads, and a terminating context refuses every call.
    """
    tracked = getattr(context, "_sockets", None) or ()  # pyzmq's WeakSet of the context's sockets
    return [repr(sock) for sock in list(tracked) if not sock.closed]


__all__ = ["bind", "bind_all", "bind_endpoint", "bind_error", "check_port", "new_socket", "open_sockets", "terminate"]
