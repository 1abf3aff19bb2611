"""Addresses: which host to advertise, and the metadata string peers exchange.

The metadata string is ``tcp://HOST:PORT`` (IPv6 hosts in brackets), optionally
followed by ``?key=value&...`` parameters (``curve=<server public key>`` when
CurveZMQ is on, ``paths=HOST:PORT,...`` when the source listens on more
addresses than the first). Parameters a parser does not know are kept and
ignored. See docs/protocol.md, "Metadata string".
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote_plus

ADVERTISE_ENV = "ZMQTRANSPORT_ADVERTISE_HOST"
PATHS_KEY = "paths"  # the metadata parameter listing the paths after the first
# Characters left readable in the paths parameter; a curve key stays fully
# quoted, as receivers without paths support parse it (its z85 alphabet holds '+', '&' and '=').
_PATHS_SAFE = ":,[]"
WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "")  # noqa: S104 - recognising a wildcard, not binding one
_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class Path:
    """One address a source listens on: a host (IPv6 without brackets) and a port."""

    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"tcp://{format_host(self.host)}:{self.port}"

    @property
    def hostport(self) -> str:
        return f"{format_host(self.host)}:{self.port}"


@dataclass(frozen=True)
class PeerAddress:
    """Where a source listens: its first (preferred) path ``host``:``port``, then ``more_paths``.

    ``params`` holds the metadata parameters other than the paths (``curve``,
    and any this version does not know).
    """

    host: str
    port: int
    params: dict[str, str] = field(default_factory=dict)
    more_paths: tuple[Path, ...] = ()

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint of the first path (the only one an older parser sees)."""
        return f"tcp://{format_host(self.host)}:{self.port}"

    @property
    def paths(self) -> tuple[Path, ...]:
        """Every advertised path, in the source's order of preference."""
        return (Path(self.host, self.port), *self.more_paths)

    def to_metadata(self) -> str:
        params = dict(self.params)
        if self.more_paths:
            params[PATHS_KEY] = ",".join(path.hostport for path in self.more_paths)
        if not params:
            return self.endpoint
        # The urlencode(sorted(...)) form that every receiver parses, with the paths readable.
        query = "&".join(
            f"{quote_plus(key)}={quote_plus(value, safe=_PATHS_SAFE if key == PATHS_KEY else '')}"
            for key, value in sorted(params.items())
        )
        return f"{self.endpoint}?{query}"


def format_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def parse_metadata(metadata: str) -> PeerAddress:
    """Parse a metadata string from :meth:`ZMQTransport.metadata`; ``ValueError`` if malformed."""
    if not isinstance(metadata, str):
        raise ValueError(f"metadata must be a string, got {type(metadata).__name__}")
    text, _, query = metadata.strip().partition("?")
    if not text.startswith("tcp://"):
        raise ValueError(f"bad zmqtransport metadata {metadata!r}: expected tcp://HOST:PORT")
    first = _parse_hostport(text.removeprefix("tcp://"), metadata)
    try:
        params = dict(parse_qsl(query, strict_parsing=True)) if query else {}
    except ValueError:
        raise ValueError(f"bad zmqtransport metadata {metadata!r}: malformed parameters") from None
    listed = params.pop(PATHS_KEY, None)
    more = tuple(_parse_hostport(entry, metadata) for entry in listed.split(",")) if listed is not None else ()
    return PeerAddress(first.host, first.port, params, more)


def _parse_hostport(hostport: str, metadata: str) -> Path:
    """``HOST:PORT`` or ``[IPV6]:PORT``; ``ValueError`` quoting the whole ``metadata`` if malformed."""
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
    return Path(host, int(port_text))


def is_local_address(address: str) -> bool:
    """Whether ``address`` (an IP address as a socket reports it; IPv4-mapped IPv6 too) belongs to this host.

    Loopback, or an address of one of this host's interfaces (in its network
    namespace): a socket can bind to it. A hostname or anything else that is
    not an IP address is not recognised (False).
    """
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0].strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    ip = mapped or ip
    if ip.is_loopback:
        return True
    if ip.is_unspecified or ip.is_multicast:
        return False
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((str(ip), 0))
        except OSError:
            return False
    return True


def split_hosts(value: str | Sequence[str], option: str) -> list[str]:
    """A host list from a sequence or a comma-separated string; ``ValueError`` naming ``option`` if empty."""
    if isinstance(value, str):
        hosts = [part.strip() for part in value.split(",")] if "," in value else [value.strip()]
    elif isinstance(value, Sequence) and all(isinstance(part, str) for part in value):
        hosts = [part.strip() for part in value]
    else:
        raise ValueError(f"{option}={value!r}: expected a host, a comma-separated string or a list of hosts")
    if not hosts or (len(hosts) > 1 and not all(hosts)):
        raise ValueError(f"{option}={value!r}: expected at least one host and no empty entry")
    return hosts


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
    if bind_host not in WILDCARD_HOSTS:
        return bind_host.strip("[]")
    interface = _default_route_interface()
    address = _interface_ipv4(interface) if interface else None
    return address or _first_non_loopback_ipv4() or _hostname_address() or "127.0.0.1"


def advertised_hosts(bind_hosts: Sequence[str], override: str | Sequence[str] | None = None) -> list[str]:
    """The hosts to advertise for a socket bound on ``bind_hosts``, in order of preference.

    In order of precedence: ``override`` (a list or a comma-separated string),
    ``$ZMQTRANSPORT_ADVERTISE_HOST`` (comma-separated), or each bind host
    itself, a wildcard replaced as :func:`choose_advertise_host` says. Needs
    no port, so a transport decides (and refuses a malformed list, naming the
    option or the variable) before it acquires anything.
    """
    if override:
        return [host.strip("[]") for host in split_hosts(override, "advertise_host")]
    variable = os.environ.get(ADVERTISE_ENV)
    if variable:
        return [host.strip("[]") for host in split_hosts(variable, ADVERTISE_ENV)]
    return [choose_advertise_host(host) for host in bind_hosts]


def paths_with_ports(hosts: Sequence[str], ports: Sequence[int]) -> tuple[Path, ...]:
    """One path per advertised host, duplicates dropped, with the port of its bind.

    When there are as many advertised hosts as bound ports, the i-th host gets
    the i-th port; otherwise every one gets the first (the ports differ only
    when a later bind could not get the first one).
    """
    matched = list(ports) if len(hosts) == len(ports) else [ports[0]] * len(hosts)
    paths: list[Path] = []
    for host, port in zip(hosts, matched, strict=True):
        if Path(host, port) not in paths:
            paths.append(Path(host, port))
    return tuple(paths)


def advertised_paths(bound: Sequence[tuple[str, int]], override: str | Sequence[str] | None = None) -> tuple[Path, ...]:
    """The paths to advertise for a socket bound at ``bound`` (``(bind host, port)`` each, in order).

    :func:`advertised_hosts` with the ports of :func:`paths_with_ports`.
    """
    hosts = advertised_hosts([host for host, _ in bound], override)
    return paths_with_ports(hosts, [port for _, port in bound])
