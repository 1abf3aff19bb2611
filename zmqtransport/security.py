"""Optional CurveZMQ encryption and authentication (docs/security.md).

Without CURVE, anyone who can open a TCP connection to a transport's port can
fetch the staged checkpoint. With it:

* every connection is encrypted and the receiver authenticates the sender: the
  sender's CURVE public key travels in the metadata string
  (``tcp://HOST:PORT?curve=<z85 public key>``) and only the holder of the
  matching secret key can complete the handshake;
* the sender authenticates receivers: a ZAP handler (RFC 27) running in the
  transport's own ZeroMQ context accepts only client public keys in an allowed
  set, and libzmq drops every other connection during the handshake, before a
  single request is read.

Keys: each transport makes a fresh server key pair at construction (or takes
one given to it). Client keys are normally *derived* from a job secret shared
by every rank (``curve_secret=`` or ``$ZMQTRANSPORT_CURVE_SECRET``): all ranks
derive the same client key pair, and every server allows its public key. For
finer control, pass an explicit client key pair and an allow-list of client
public keys instead (or as well).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

logger = logging.getLogger(__name__)

CURVE_SECRET_ENV = "ZMQTRANSPORT_CURVE_SECRET"  # noqa: S105 - a variable name, not a secret
METADATA_KEY = "curve"  # metadata parameter carrying the server's z85 public key
ZAP_DOMAIN = "zmqtransport"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27; one handler per context
MIN_SECRET_BYTES = 16
_KEY_BYTES = 32
_Z85_KEY_CHARS = 40
_REJECT_LOG_INTERVAL = 10.0  # seconds between warnings about refused clients
_START_TIMEOUT = 10.0  # seconds the ZAP handler thread gets to start, and to stop

SocketConfigurator = Callable[[zmq.Socket[Any]], None]


@dataclass(frozen=True)
class KeyPair:
    """A CURVE key pair, both halves z85-encoded (40 ASCII bytes each)."""

    public: bytes
    secret: bytes

    def __repr__(self) -> str:  # never print the secret half
        return f"KeyPair(public={self.public.decode('ascii')!r}, secret=<hidden>)"


def generate_keypair() -> KeyPair:
    """A fresh random key pair (``zmq.curve_keypair``)."""
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def keypair_from_seed(seed: bytes) -> KeyPair:
    """The key pair whose secret key is the 32 bytes ``seed``."""
    if len(seed) != _KEY_BYTES:
        raise ValueError(f"a CURVE secret key has {_KEY_BYTES} bytes, got {len(seed)}")
    secret = z85.encode(seed)
    return KeyPair(zmq.curve_public(secret), secret)


def client_keypair_from_secret(job_secret: str | bytes) -> KeyPair:
    """The client key pair every rank holding ``job_secret`` derives.

    BLAKE2b with a purpose-specific personalisation: the secret itself never
    leaves the process, and a key derived here is useless for anything else.
    """
    material = _secret_bytes(job_secret)
    seed = hashlib.blake2b(material, digest_size=_KEY_BYTES, person=b"zmqtransport-cli").digest()
    return keypair_from_seed(seed)


def new_job_secret() -> str:
    """A fresh job secret (256 random bits, URL-safe text) to hand to every rank."""
    return secrets.token_urlsafe(32)


def check_public_key(key: str | bytes, what: str = "CURVE public key") -> bytes:
    """``key`` as z85 bytes if it is a well-formed CURVE public key; ``ValueError`` if not."""
    try:
        raw = key.encode("ascii") if isinstance(key, str) else bytes(key)
    except UnicodeEncodeError:
        raise ValueError(f"{what} must be z85 text (ASCII)") from None
    if len(raw) != _Z85_KEY_CHARS:
        raise ValueError(f"{what} must be {_Z85_KEY_CHARS} z85 characters, got {len(raw)}")
    try:
        decoded = z85.decode(raw)
    # pyzmq's decoder raises all of these; struct.error for a group of five over 2**32 ("#####").
    except (ValueError, KeyError, IndexError, TypeError, struct.error):
        raise ValueError(f"{what} is not valid z85") from None
    if len(decoded) != _KEY_BYTES:
        raise ValueError(f"{what} does not decode to {_KEY_BYTES} bytes")
    return raw


def _secret_bytes(job_secret: str | bytes) -> bytes:
    material = job_secret.encode() if isinstance(job_secret, str) else bytes(job_secret)
    if len(material) < MIN_SECRET_BYTES:
        raise ValueError(
            f"the CURVE job secret must have at least {MIN_SECRET_BYTES} bytes "
            f"(zmqtransport.security.new_job_secret() makes a good one)"
        )
    return material


@dataclass(frozen=True)
class CurveSettings:
    """What one transport uses: its server key pair, its client key pair, whom it serves."""

    server: KeyPair
    client: KeyPair | None
    allowed_clients: frozenset[bytes]

    @classmethod
    def resolve(
        cls,
        secret: str | bytes | None = None,
        allowed_clients: Iterable[str | bytes] | None = None,
        client_keypair: KeyPair | tuple[bytes, bytes] | None = None,
        server_keypair: KeyPair | tuple[bytes, bytes] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> CurveSettings | None:
        """Combine constructor options and the environment; ``None`` means CURVE is off.

        ``secret`` falls back to ``$ZMQTRANSPORT_CURVE_SECRET``. CURVE is on as
        soon as any option is given; then the server must allow at least one
        client key, or nobody could ever fetch from it.
        """
        environ = os.environ if environ is None else environ
        if secret is None:
            secret = environ.get(CURVE_SECRET_ENV) or None
        given = (secret, allowed_clients, client_keypair, server_keypair)
        if all(option is None for option in given):
            return None
        allowed = {check_public_key(key, "an allowed client key") for key in allowed_clients or ()}
        client = _as_keypair(client_keypair, "curve_client_keypair")
        if secret is not None:
            derived = client_keypair_from_secret(secret)
            allowed.add(derived.public)
            client = client or derived
        if not allowed:
            raise ValueError(
                "CurveZMQ is on but no client may fetch from this transport: pass curve_secret= "
                f"(or set {CURVE_SECRET_ENV}) or curve_allowed_clients="
            )
        server = _as_keypair(server_keypair, "curve_server_keypair") or generate_keypair()
        return cls(server, client, frozenset(allowed))

    def configure_server(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (the ROUTER) a CURVE server that asks the ZAP handler about clients.

        ZAP_ENFORCE_DOMAIN makes libzmq refuse connections when no handler answers,
        instead of letting every client in: the configuration fails closed.
        """
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server.public)
        sock.setsockopt(zmq.CURVE_SERVER, 1)

    def client_configurator(self, peer: str, server_key: str | None) -> SocketConfigurator:
        """Socket options for a DEALER fetching from ``peer``, whose metadata gave ``server_key``."""
        if server_key is None:
            raise ValueError(
                f"the peer at {peer} does not use CurveZMQ, but this transport requires it: "
                "refusing to fetch a checkpoint in the clear"
            )
        if self.client is None:
            raise ValueError(
                f"the peer at {peer} requires CurveZMQ and this transport has no client key: "
                f"pass curve_secret= (or set {CURVE_SECRET_ENV}) or curve_client_keypair="
            )
        return _client_configurator(self.client, check_public_key(server_key, f"{peer}'s key"))


def client_configurator_without_settings(peer: str, server_key: str | None) -> SocketConfigurator | None:
    """For a transport with CURVE off: plain peers are fine, CURVE peers are an error."""
    if server_key is None:
        return None
    raise ValueError(
        f"the peer at {peer} requires CurveZMQ: pass curve_secret= (or set {CURVE_SECRET_ENV}) to fetch from it"
    )


def _client_configurator(client: KeyPair, server_key: bytes) -> SocketConfigurator:
    def configure(sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, client.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)

    return configure


def _as_keypair(value: KeyPair | tuple[bytes, bytes] | None, what: str) -> KeyPair | None:
    if value is None or isinstance(value, KeyPair):
        return value
    try:
        public, secret = value
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a KeyPair or a (public, secret) pair") from None
    public = check_public_key(public, f"{what} public key")
    secret = check_public_key(secret, f"{what} secret key")  # same encoding rules
    if zmq.curve_public(secret) != public:
        raise ValueError(f"{what}: the public key does not belong to the secret key")
    return KeyPair(public, secret)


class ZapHandler:
    """Answers libzmq's ZAP requests for one context: allowed CURVE client keys only.

    Runs in its own thread, which alone owns the ZAP socket; :meth:`close`
    stops it through an inproc pair. Start it before any CURVE server socket
    of the context accepts connections.
    """

    def __init__(self, context: zmq.Context[Any], allowed_clients: frozenset[bytes]) -> None:
        self._context = context
        self._allowed = allowed_clients
        self._control_endpoint = f"inproc://zmqtransport-zap-control-{id(self):x}"
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._last_warning = float("-inf")
        self.refused = 0  # connections refused so far (read by tests and operators)
        self._thread = threading.Thread(target=self._run, name="zmqtransport-zap", daemon=True)
        # The stopper exists before the thread, so every failure below can stop
        # the thread (an open socket of it would make Context.term() hang).
        self._stopper = context.socket(zmq.PAIR)
        try:
            self._stopper.setsockopt(zmq.LINGER, 0)
            self._stopper.connect(self._control_endpoint)  # inproc: connecting before the bind is fine
            self._thread.start()
            if not self._ready.wait(_START_TIMEOUT):
                raise RuntimeError(f"the ZAP handler thread did not start within {_START_TIMEOUT:g} s")
            if self._failure is not None:
                raise RuntimeError(f"cannot start the ZAP handler: {self._failure}") from self._failure
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the handler thread and close its sockets; idempotent, each wait bounded."""
        if self._stopper.closed:
            return
        if self._thread.is_alive():
            # NOBLOCK: a thread that already left has no peer socket to take it.
            with contextlib.suppress(zmq.Again):
                self._stopper.send(b"stop", zmq.NOBLOCK)
            self._thread.join(_START_TIMEOUT)
            if self._thread.is_alive():
                logger.error("the ZAP handler thread did not stop within %g s", _START_TIMEOUT)
        self._stopper.close(linger=0)

    def _run(self) -> None:
        handler = self._context.socket(zmq.REP)
        handler.setsockopt(zmq.LINGER, 0)
        control = self._context.socket(zmq.PAIR)
        control.setsockopt(zmq.LINGER, 0)
        try:
            try:
                handler.bind(ZAP_ENDPOINT)
                control.bind(self._control_endpoint)
            except zmq.ZMQError as exc:  # e.g. a handler already bound in this context
                self._failure = exc
                return
            finally:
                self._ready.set()
            poller = zmq.Poller()
            poller.register(handler, zmq.POLLIN)
            poller.register(control, zmq.POLLIN)
            while True:
                events = dict(poller.poll())
                if control in events:
                    return
                if handler in events:
                    handler.send_multipart(self._answer(handler.recv_multipart()))
        except zmq.ContextTerminated:
            return
        finally:
            handler.close(linger=0)
            control.close(linger=0)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request; anything unexpected is refused."""
        request_id = frames[1] if len(frames) > 1 else b""
        if len(frames) < 6 or frames[0] != b"1.0":
            return [b"1.0", request_id, b"400", b"malformed ZAP request", b"", b""]
        domain, address, _identity, mechanism, credentials = (
            frames[2],
            frames[3],
            frames[4],
            frames[5],
            frames[6:],
        )
        key = credentials[0] if len(credentials) == 1 else b""
        if (
            domain == ZAP_DOMAIN.encode()
            and mechanism == b"CURVE"
            and len(key) == _KEY_BYTES
            and z85.encode(key) in self._allowed
        ):
            return [b"1.0", request_id, b"200", b"OK", z85.encode(key), b""]
        self.refused += 1
        now = time.monotonic()
        if now - self._last_warning >= _REJECT_LOG_INTERVAL:
            self._last_warning = now
            logger.warning(
                "refused a %s connection from %s: client key not allowed (%d refused so far)",
                mechanism.decode("ascii", "replace"),
                address.decode("ascii", "replace"),
                self.refused,
            )
        return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""]


__all__ = [
    "CURVE_SECRET_ENV",
    "METADATA_KEY",
    "CurveSettings",
    "KeyPair",
    "ZapHandler",
    "check_public_key",
    "client_keypair_from_secret",
    "generate_keypair",
    "keypair_from_seed",
    "new_job_secret",
]
