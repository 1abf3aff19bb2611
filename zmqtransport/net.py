"""Addresses: which host to advertise, and the metadata string peers exchange.

The metadata string is ``tcp://HOST:PORT`` (IPv6 hosts in brackets), optionally
followed by ``?key=value&...`` parameters (``curve=<server public key>`` when
CurveZMQ is on). See docs/protocol.md.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode

ADVERTISE_ENV = "ZMQTRANSPORT_ADVERTISE_HOST"
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class PeerAddress:
    host: str
    port: int
    params: dict[str, str] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint to connect to."""
        return f"tcp://{format_host(self.host)}:{self.port}"

    def to_metadata(self) -> str:
        if not self.params:
            return self.endpoint
        return f"{self.endpoint}?{urlencode(sorted(self.params.items()))}"


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_metadata(metadata: str) -> PeerAddress:
    """Parse a metadata string from :meth:`ZMQTransport.metadata`; ``ValueError`` if malformed."""
    if not isinstance(metadata, str):
        raise ValueError(f"metadata must be a string, got {type(metadata).__name__}")
    text, _, query = metadata.strip().partition("?")
    if not text.startswith("tcp://"):
        raise ValueError(f"bad zmqtransport metadata {metadata!r}: expected tcp://HOST:PORT")
    hostport = text.removeprefix("tcp://")
    if hostport.startswith("["):
        host, sep, rest = hostport[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ValueError(f"bad zmqtransport metadata {metadata!r}: unterminated IPv6 host")
        port_text = rest[1:]
    else:
        host, sep, port_text = hostport.rpartition(":")
        if not sep or ":" in host:
            raise ValueError(f"bad zmqtransport metadata {metadata!r}: expected tcp://HOST:PORT")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"bad zmqtransport metadata {metadata!r}: invalid host or port")
    try:
        params = dict(parse_qsl(query, strict_parsing=True)) if query else {}
    except ValueError:
        raise ValueError(f"bad zmqtransport metadata {metadata!r}: malformed parameters") from None
    return PeerAddress(host, int(port_text), params)


def _interface_ipv4(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def _default_route_interface() -> str | None:
    """The interface of the IPv4 default route with the lowest metric (Linux)."""
    try:
        with open("/proc/net/route") as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return None
    defaults = [(int(row[6]), row[0]) for row in rows if len(row) > 7 and row[1] == "00000000"]
    return min(defaults)[1] if defaults else None


def _first_non_loopback_ipv4() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for name in names:
        address = _interface_ipv4(name)
        if address and not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def _hostname_address() -> str | None:
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def choose_advertise_host(bind_host: str, override: str | None = None) -> str:
    """The host other machines should use to reach a socket bound on ``bind_host``.

    In order: the explicit override, ``$ZMQTRANSPORT_ADVERTISE_HOST``, the bind
    host when it is a specific address, the IPv4 address of the default-route
    interface, the first non-loopback IPv4 address, the hostname's address, and
    finally 127.0.0.1. Hostnames are avoided on purpose: on multi-NIC clusters
    they often resolve to the management network rather than the training one.
    """
    for candidate in (override, os.environ.get(ADVERTISE_ENV)):
        if candidate:
            return candidate.strip("[]")
    if bind_host not in ("*", "0.0.0.0", "::", ""):  # noqa: S104 - recognising a wildcard, not binding one
        return bind_host.strip("[]")
    interface = _default_route_interface()
    address = _interface_ipv4(interface) if interface else None
    return address or _first_non_loopback_ipv4() or _hostname_address() or "127.0.0.1"
