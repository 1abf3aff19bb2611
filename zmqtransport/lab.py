"""A network lab: hosts as Linux network namespaces joined by rate-limited links.

``Lab(hosts=N, nics=K, rate_mbit=R)`` builds N "hosts", each a network
namespace with K NICs ``eth0``..``eth{K-1}`` (``host_rates={h: R'}``: host h's
NICs run at R' instead, a slower or faster port). NIC k of every host is one end of
a veth pair whose other end is a port of bridge ``br{k}`` in a separate
"switch" namespace, so each NIC index is one subnet, ``10.77.{k}.0/24``, and
host h has address ``10.77.{k}.{h+1}`` on it. Every NIC is rate-limited in both
directions with ``tc tbf``: on the host end (what the host uploads) and on the
switch port (what it downloads), as a switch with one rate per port would.

Processes run inside a host with :meth:`Lab.popen` (``ip netns exec``) or, for
a Python child that must keep its pipes to a parent, :func:`enter_namespace`
(``setns``) before it opens any socket. :meth:`Lab.tx_bytes` reads a host's
NIC counters, so a result can say how many bytes each host sent.

``Lab(..., shaped=False)`` leaves every link unshaped (no ``tbf``): the veth
pairs and the bridge then run as fast as the kernel moves bytes between
namespaces, a fast NIC whose limit is the CPU (issue 33). ``mtu=9000`` sets
every NIC, switch port and bridge to that MTU (jumbo frames); the default
leaves the kernel's 1500.

The lab removes everything it created on exit from its ``with`` block, on
error, at interpreter exit and on SIGTERM. Namespace names carry the creating
process id (``zlab{pid}x{n}...``), so parallel labs never collide and the
leftovers of a crashed run are recognised and removed by the next lab.
Building one needs root and iproute2 (``ip``, ``tc``): :func:`unavailable_reason`
says why a lab cannot be built here (tests skip with it).

This kernel offers tbf, htb and bridge but not netem or fq, so links have a
rate and a queue, and no added delay or loss.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import Any, Protocol

NAME_ROOT = "zlab"
SUBNET_PREFIX = "10.77"  # private; used only inside the lab's own namespaces
_NAME_PATTERN = re.compile(rf"^{NAME_ROOT}(\d+)x\d+(?:h\d+|sw)$")
_CLONE_NEWNET = 0x40000000
_COMMAND_TIMEOUT_S = 30.0
_STOP_GRACE_S = 3.0


class LabError(RuntimeError):
    """A lab command failed or the lab cannot be built here."""


def unavailable_reason() -> str | None:
    """Why a lab cannot be built on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "the network lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the network lab needs root (network namespaces, veth, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the network lab needs iproute2 ({', '.join(missing)} not found)"
    return None


def enter_namespace(name: str) -> None:
    """Move the calling process into network namespace ``name`` (``setns``).

    Only the calling thread moves, and threads it starts later follow it: call
    this first thing in a child process, before any socket or thread exists.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{name}", "rb") as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")


@dataclass(frozen=True)
class Shaping:
    """tbf parameters for one direction of one NIC.

    ``burst`` is the bucket (bytes sent back to back at line speed). It must
    hold a whole GSO packet (64 KiB), or tbf splits every one. ``limit`` is the
    queue (bytes waiting for tokens); a queue shorter than TCP's window makes
    drops and a rate below nominal. Measured on this kernel with one TCP stream
    through 400 Mbit/s (docs/performance.md): these give 95-98% of nominal.
    """

    rate_mbit: float
    burst_bytes: int = 256 << 10
    limit_bytes: int = 4 << 20

    def tc_args(self) -> str:
        rate = f"{self.rate_mbit * 1000:.0f}kbit"
        return f"tbf rate {rate} burst {self.burst_bytes} limit {self.limit_bytes}"


def host_interface(nic: int) -> str:
    return f"eth{nic}"


def switch_port(host: int, nic: int) -> str:
    return f"h{host}n{nic}"


def address_of(host: int, nic: int) -> str:
    return f"{SUBNET_PREFIX}.{nic}.{host + 1}"


def build_plan(
    namespaces: Sequence[str],
    switch: str,
    nics: int,
    shaping: Shaping | Sequence[Shaping] | None,
    mtu: int | None = None,
) -> dict[str, list[list[str]]]:
    """Batches of ``ip`` and ``tc`` lines per namespace that build the lab (pure).

    ``shaping``: one for every host, or one per host (a host's NICs share it,
    in both directions: a slower NIC is slower both ways); None: no link is
    shaped. ``mtu``: every NIC, switch port and bridge gets it (None: the
    kernel's default).
    """
    if shaping is None:
        per_host: list[Shaping | None] = [None] * len(namespaces)
    else:
        per_host = [shaping] * len(namespaces) if isinstance(shaping, Shaping) else list(shaping)
    if len(per_host) != len(namespaces):
        raise ValueError(f"{len(per_host)} shapings for {len(namespaces)} hosts")
    sized = ["mtu", str(mtu)] if mtu is not None else []
    ip_switch = [["link", "add", f"br{k}", *sized, "type", "bridge"] for k in range(nics)]
    ip_switch += [f"link set br{k} up".split() for k in range(nics)]
    tc_switch: list[list[str]] = []
    plan: dict[str, list[list[str]]] = {}
    for host, namespace in enumerate(namespaces):
        ip_host = [["link", "set", "lo", "up"]]
        tc_host: list[list[str]] = []
        shaping_here = per_host[host]
        tbf = shaping_here.tc_args().split() if shaping_here is not None else []
        for nic in range(nics):
            port, nic_name = switch_port(host, nic), host_interface(nic)
            ip_switch.append(
                ["link", "add", port, *sized, "type", "veth", "peer", "name", nic_name, *sized, "netns", namespace]
            )
            ip_switch.append(["link", "set", port, "master", f"br{nic}", "up"])
            ip_host.append(["addr", "add", f"{address_of(host, nic)}/24", "dev", nic_name])
            ip_host.append(["link", "set", nic_name, "up"])
            if tbf:
                tc_host.append(["qdisc", "add", "dev", nic_name, "root", *tbf])
                tc_switch.append(["qdisc", "add", "dev", port, "root", *tbf])
        plan[f"ip:{namespace}"] = ip_host
        plan[f"tc:{namespace}"] = tc_host
    # The switch side first: the veth pairs must exist before the hosts configure them.
    return {f"ip:{switch}": ip_switch, f"tc:{switch}": tc_switch, **plan}


def _run(argv: Sequence[str], stdin: str | None = None) -> str:
    done = subprocess.run(
        list(argv), input=stdin, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        raise LabError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _lab_namespaces() -> list[str]:
    listing = _run(["ip", "netns", "list"])
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    return [name for name in names if _NAME_PATTERN.match(name)]


def switch_namespaces() -> list[str]:
    """The switch namespace of every lab on this machine: its port toward host N (``hNn0``) queues what
    waits for N's downlink (scripts/tbf_backlog.py reads it)."""
    return [name for name in _lab_namespaces() if name.endswith("sw")]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(name: str) -> None:
    """Kill what still runs inside ``name`` (only lab processes live there), then delete it."""
    with contextlib.suppress(LabError, subprocess.TimeoutExpired):
        for pid in _run(["ip", "netns", "pids", name]).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
    with contextlib.suppress(LabError, subprocess.TimeoutExpired):
        _run(["ip", "netns", "delete", name])


def remove_leftovers() -> list[str]:
    """Delete lab namespaces whose creating process is gone; returns their names."""
    removed = []
    for name in _lab_namespaces():
        match = _NAME_PATTERN.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_namespace(name)
            removed.append(name)
    return removed


class Process(Protocol):
    """What :meth:`Lab.close` needs of a process it stops: ``subprocess.Popen``'s calls."""

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...


# Labs of this process that are still up, for atexit and SIGTERM.
_LIVE: dict[str, Lab] = {}
_LIVE_LOCK = threading.Lock()
_COUNTER = itertools.count()


class _Hooks:
    """Whether the atexit and SIGTERM hooks are in place, and the SIGTERM handler they replaced."""

    installed = False
    previous_sigterm: Any = None


def _close_all() -> None:
    with _LIVE_LOCK:
        labs = list(_LIVE.values())
    for lab in labs:
        lab.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _close_all()
    previous = _Hooks.previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    # Default action: die of SIGTERM as if no handler had been there.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    if _Hooks.installed:
        return
    atexit.register(_close_all)
    # Signal handlers can only be set from the main thread; a process that ignores SIGTERM keeps ignoring it.
    main = threading.current_thread() is threading.main_thread()
    if main and signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN:
        _Hooks.previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
    _Hooks.installed = True


class Lab:
    """N hosts with K rate-limited NICs each; see the module docstring.

    >>> with Lab(hosts=2, nics=1, rate_mbit=400) as lab:       # doctest: +SKIP
    ...     server = lab.popen(0, ["python", "server.py", lab.address(0)])
    ...     lab.run(1, ["python", "client.py", lab.address(0)])
    ...     sent = lab.tx_bytes(0)
    """

    def __init__(
        self,
        hosts: int,
        nics: int = 1,
        rate_mbit: float = 400.0,
        *,
        burst_bytes: int | None = None,
        limit_bytes: int | None = None,
        host_rates: Mapping[int, float] | None = None,
        shaped: bool = True,
        mtu: int | None = None,
    ) -> None:
        """``host_rates``: hosts whose NICs run at another rate than ``rate_mbit`` (Mbit/s, both directions).

        ``shaped=False``: no link is rate-limited (``rate_mbit`` and ``host_rates``
        are then only names, not limits); ``mtu``: every link's MTU (68..65535).
        """
        rates = dict(host_rates or {})
        if hosts < 1 or nics < 1 or nics > 250 or hosts > 250 or rate_mbit <= 0 or min(rates.values(), default=1) <= 0:
            raise ValueError("a lab needs 1..250 hosts, 1..250 NICs and a positive rate")
        if not all(0 <= host < hosts for host in rates):
            raise ValueError(f"host_rates names hosts outside 0..{hosts - 1}: {sorted(rates)}")
        if mtu is not None and not 68 <= mtu <= 65535:
            raise ValueError(f"an MTU must be within 68..65535, not {mtu}")
        if not shaped and rates:
            raise ValueError("host_rates needs shaped links")
        self.shaped = shaped
        self.mtu = mtu
        self.hosts = hosts
        self.nics = nics
        self.rate_mbit = rate_mbit
        defaults = Shaping(rate_mbit)
        self.shaping = Shaping(
            rate_mbit,
            burst_bytes if burst_bytes is not None else defaults.burst_bytes,
            limit_bytes if limit_bytes is not None else defaults.limit_bytes,
        )
        self.host_rates = rates
        self.prefix = f"{NAME_ROOT}{os.getpid()}x{next(_COUNTER)}"
        self.switch = f"{self.prefix}sw"
        self._owner_pid = os.getpid()
        self._created: list[str] = []
        self._processes: list[Process] = []
        self._closed = False

    # -- names and addresses
    def namespace(self, host: int) -> str:
        self._check(host, 0)
        return f"{self.prefix}h{host}"

    def address(self, host: int, nic: int = 0) -> str:
        """The IPv4 address of ``host``'s NIC ``nic`` (its subnet is per NIC)."""
        self._check(host, nic)
        return address_of(host, nic)

    def interface(self, nic: int) -> str:
        self._check(0, nic)
        return host_interface(nic)

    @property
    def link_bytes_per_s(self) -> float:
        """The default rate of one NIC in one direction, bytes per second."""
        return self.rate_mbit * 1e6 / 8

    def host_rate_mbit(self, host: int) -> float:
        """The rate of each of ``host``'s NICs, Mbit/s per direction."""
        self._check(host, 0)
        return self.host_rates.get(host, self.rate_mbit)

    def host_shaping(self, host: int) -> Shaping:
        rate = self.host_rate_mbit(host)
        return self.shaping if rate == self.rate_mbit else replace(self.shaping, rate_mbit=rate)

    # -- lifecycle
    def __enter__(self) -> Lab:
        reason = unavailable_reason()
        if reason is not None:
            raise LabError(reason)
        _install_hooks()
        remove_leftovers()
        with _LIVE_LOCK:
            _LIVE[self.prefix] = self
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        namespaces = [f"{self.prefix}h{host}" for host in range(self.hosts)]
        for name in [self.switch, *namespaces]:
            _run(["ip", "netns", "add", name])
            self._created.append(name)
        shapings = [self.host_shaping(host) for host in range(self.hosts)] if self.shaped else None
        for key, lines in build_plan(namespaces, self.switch, self.nics, shapings, self.mtu).items():
            tool, namespace = key.split(":", 1)
            if lines:
                _run([tool, "-n", namespace, "-batch", "-"], stdin="".join(" ".join(line) + "\n" for line in lines))

    def close(self) -> None:
        """Stop the lab's processes and delete its namespaces (idempotent)."""
        if self._closed or os.getpid() != self._owner_pid:
            return  # a forked child must not tear down its parent's lab
        self._closed = True
        for process in self._processes:
            if process.poll() is None:
                process.terminate()
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(_STOP_GRACE_S)
            if process.poll() is None:
                process.kill()
                process.wait(_STOP_GRACE_S)
        for name in reversed(self._created):
            _delete_namespace(name)
        with _LIVE_LOCK:
            _LIVE.pop(self.prefix, None)

    # -- processes
    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host`` (``ip netns exec``); stopped at close() if still running."""
        process: subprocess.Popen[Any] = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(host), *argv], **kwargs
        )
        self._processes.append(process)
        return process

    def adopt(self, process: Process) -> None:
        """Stop ``process`` at close() too, like those of :meth:`popen` (one started on a host otherwise)."""
        self._processes.append(process)

    def run(
        self, host: int, argv: Sequence[str], timeout: float = 60.0, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` inside ``host`` to completion (bounded by ``timeout``)."""
        command = ["ip", "netns", "exec", self.namespace(host), *argv]
        return subprocess.run(command, timeout=timeout, check=False, **kwargs)

    # -- counters and links
    def counters(self, host: int) -> dict[int, tuple[int, int]]:
        """``{nic: (tx_bytes, rx_bytes)}`` of ``host``'s NICs, as the kernel counts them (Ethernet frames)."""
        links = json.loads(_run(["ip", "-n", self.namespace(host), "-s", "-j", "link", "show"]))
        by_name = {link["ifname"]: link["stats64"] for link in links}
        result = {}
        for nic in range(self.nics):
            stats = by_name[host_interface(nic)]
            result[nic] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return result

    def tx_bytes(self, host: int, nic: int | None = None) -> int:
        """Bytes ``host`` sent on NIC ``nic``, or on all its NICs."""
        counts = self.counters(host)
        return counts[nic][0] if nic is not None else sum(tx for tx, _ in counts.values())

    def rx_bytes(self, host: int, nic: int | None = None) -> int:
        counts = self.counters(host)
        return counts[nic][1] if nic is not None else sum(rx for _, rx in counts.values())

    def link_down(self, host: int, nic: int) -> None:
        """Cut ``host``'s NIC ``nic`` at the switch (the host sees its carrier go)."""
        self._check(host, nic)
        _run(["ip", "-n", self.switch, "link", "set", switch_port(host, nic), "down"])

    def link_up(self, host: int, nic: int) -> None:
        self._check(host, nic)
        _run(["ip", "-n", self.switch, "link", "set", switch_port(host, nic), "up"])

    def _check(self, host: int, nic: int) -> None:
        if not 0 <= host < self.hosts or not 0 <= nic < self.nics:
            raise ValueError(f"no host {host} NIC {nic} in a lab of {self.hosts} host(s) x {self.nics} NIC(s)")


# A plain TCP transfer between two hosts, with no dependency beyond Python: the
# lab's own check that a link carries about its nominal rate and no more.
_TCP_SINK = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
server.settimeout(float(sys.argv[2]))
conn, _ = server.accept()
conn.settimeout(float(sys.argv[2]))
started = time.perf_counter()
total = 0
buffer = bytearray(1 << 20)
while True:
    got = conn.recv_into(buffer)
    if not got:
        break
    total += got
print(total, time.perf_counter() - started, flush=True)
"""
_TCP_SOURCE = """
import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
left = int(sys.argv[3])
block = bytes(1 << 20)
while left > 0:
    n = min(left, len(block))
    conn.sendall(block[:n])
    left -= n
conn.shutdown(socket.SHUT_WR)
conn.recv(1)
"""


@dataclass(frozen=True)
class TcpResult:
    received: int
    seconds: float  # at the sink, from accept to the sender's end of stream


def tcp_transfer(lab: Lab, source: int, sink: int, nbytes: int, nic: int = 0, timeout: float = 60.0) -> TcpResult:
    """Send ``nbytes`` from ``source`` to ``sink`` over NIC ``nic`` with one TCP stream."""
    python = sys.executable
    sink_process = lab.popen(
        sink,
        [python, "-c", _TCP_SINK, lab.address(sink, nic), str(timeout)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink_process.stdout is not None
        port = sink_process.stdout.readline().strip()
        if not port:
            raise LabError("the TCP sink did not start")
        argv = [python, "-c", _TCP_SOURCE, lab.address(sink, nic), port, str(nbytes), str(timeout)]
        # ``timeout`` bounds each socket wait; the processes get time to start on top.
        source_run = lab.run(source, argv, timeout + _COMMAND_TIMEOUT_S, capture_output=True, text=True)
        if source_run.returncode != 0:
            raise LabError(f"the TCP source failed: {source_run.stderr.strip().splitlines()[-1:]}")
        out, _ = sink_process.communicate(timeout=timeout + _COMMAND_TIMEOUT_S)
    finally:
        if sink_process.poll() is None:
            sink_process.kill()
            sink_process.wait(_STOP_GRACE_S)
    fields = out.split()
    if len(fields) != 2:
        raise LabError(f"the TCP sink did not finish: {out!r}")
    return TcpResult(int(fields[0]), float(fields[1]))
