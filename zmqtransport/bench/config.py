"""What a benchmark run measures: scenarios, transport knobs, sizes, presets."""

from __future__ import annotations

import argparse
import contextlib
import math
from dataclasses import dataclass, replace
from typing import Any

from .layouts import TRANSFORMER, UNIFORM, Layout, layout_of

DEFAULT_SETTLE_S = 3.0
# Beyond the states: the processes themselves, HTTPTransport's buffers, the page cache others need.
MEMORY_HEADROOM = 2 << 30
DEFAULT_RATE_MBIT = 400.0


def settle_for(total_bytes: int) -> float:
    """The default idle seconds after a trial: none below 64 MiB, else DEFAULT_SETTLE_S per GiB (at least that).

    The guest hands memory freed by one trial back to its host over seconds, at
    a rate of its own (hundreds of MiB per second at best, here); a settle
    that does not grow with the state would leave the next trial of a 4 GiB
    run more of the previous trial's warm pages than a 1 GiB run, and the
    growth table would compare unlike memory.
    """
    if total_bytes < 64 << 20:
        return 0.0
    return DEFAULT_SETTLE_S * max(1.0, total_bytes / (1 << 30))


@dataclass(frozen=True)
class LabSpec:
    """Run a scenario in a network lab: one source host (0), one host per receiver (receiver rank r on host r).

    ``host_rates``: ``(host, Mbit/s)`` pairs for hosts whose NICs run at
    another rate than ``rate_mbit`` (mixed links: a slower port, another rack).
    ``shaped=False``: no link is rate-limited (issue 33: a NIC faster than the
    CPU; ``rate_mbit`` is then no limit and there is no ideal time); ``mtu``:
    every link's MTU (None: the kernel's 1500).
    """

    nics: int = 1
    rate_mbit: float = DEFAULT_RATE_MBIT
    host_rates: tuple[tuple[int, float], ...] = ()
    shaped: bool = True
    mtu: int | None = None

    def describe(self) -> str:
        """The links in words, for a table's title."""
        if not self.shaped:
            return f"unshaped veth, MTU {self.mtu or 1500}"
        text = f"{self.rate_mbit:g} Mbit/s"
        text += "".join(f", host {host} at {rate:g}" for host, rate in self.host_rates)
        return text + (f", MTU {self.mtu}" if self.mtu is not None else "")

    def rate_of(self, host: int) -> float:
        """Mbit/s of each of ``host``'s NICs, per direction."""
        return dict(self.host_rates).get(host, self.rate_mbit)

    def ideal_s(self, total_bytes: int, host: int) -> float:
        """The time ``total_bytes`` take into ``host`` at its NICs' nominal rate (its own link's ideal)."""
        return total_bytes / (self.nics * self.rate_of(host) * 1e6 / 8)

    @property
    def mixed(self) -> bool:
        return any(rate != self.rate_mbit for _, rate in self.host_rates)


@dataclass(frozen=True)
class Kill:
    """A receiver SIGKILLed mid-transfer (issue 13: a relay that dies).

    Receiver ``rank`` starts ``lead_s`` before the others, so that it is the
    first of the source's relay chain and the others depend on it, and kills
    itself once it has received ``at_fraction`` of the state (ZMQTransport's
    progress callback; other methods: that fraction of the one-link ideal
    time into its receive).
    """

    rank: int = 1
    at_fraction: float = 0.4
    lead_s: float = 0.2


@dataclass(frozen=True)
class Disallow:
    """The source calls ``disallow_checkpoint`` mid-transfer, then mutates its tensors (issue 23).

    ``at_s`` seconds after the receives start, the sender process calls it
    (timed: how long the trainer is held), then adds ``add`` to every tensor as
    an optimizer step would; every receiver then checks every element against
    the staged values (a receive that fails or gets other bytes is reported,
    not raised).
    """

    at_s: float = 0.3
    add: float = 1.0


@dataclass(frozen=True)
class Rogue:
    """Receiver 1's relaying is modified (issue 21: a rogue relay; modes in :mod:`.rogue`).

    With the scenario's ``lead_s`` it asks first, so it heads the source's
    relay chain; its own receive is not counted.
    """

    mode: str = "flip"


@dataclass(frozen=True)
class Profiling:
    """``--profile``: where each process of a trial spends its CPU (:mod:`.profiling`).

    ``perf_dir``: also ``perf record -g`` the source and receiver 1 over each
    trial's receives, one file per process and trial there ("": no perf).
    ``functions``: a cProfile of the receiving thread too (it slows Python-heavy
    code, so the per-thread CPU is the code's own only without it).
    """

    perf_dir: str = ""
    functions: bool = True


@dataclass(frozen=True)
class Scenario:
    """One benchmark configuration: what moves, to how many receivers, and how."""

    name: str
    total_bytes: int
    tensor_bytes: int
    receivers: int = 1
    methods: tuple[str, ...] = ()
    reps: int = 5
    # Whole unmeasured trials first (each still with fresh receiver processes).
    warmup: int = 0
    # Idle seconds after each receive. This VM's balloon reports freed memory
    # back to the host about 2 s after it is freed, and touching it again then
    # costs several times more than touching recycled pages: without a pause a
    # method that runs right after a fresh receive inherits its warm pages.
    settle_s: float = 0.0
    # Also time a second receive in the same receiver process (the warm column).
    warm: bool = False
    lab: LabSpec | None = None
    kill: Kill | None = None
    rogue: Rogue | None = None
    # Receiver 1 asks this many seconds before the others (first in the source's relay chain).
    lead_s: float = 0.0
    # What the state dict looks like (layouts.LAYOUTS); a transformer's size is
    # its weights and Adam moments together, about total_bytes (tensor_bytes unused).
    layout: str = UNIFORM

    @property
    def payload(self) -> Layout:
        return layout_of(self.layout, self.total_bytes, self.tensor_bytes)
    disallow: Disallow | None = None
    # Record where each process spends its CPU in every trial (per thread, the receive's phases, and a
    # cProfile of the receiving thread): :mod:`.profiling`. Costs some CPU itself; off for timing runs.
    profiling: Profiling | None = None

    @property
    def tensor_sizes(self) -> list[int]:
        return self.payload.sizes

    @property
    def memory_needed(self) -> int:
        """Memory a run needs: the sender and every receiver each hold the state, plus room for the rest."""
        return (self.receivers + 1) * self.total_bytes + MEMORY_HEADROOM


@dataclass(frozen=True)
class Knobs:
    """Transport options shared by every process of a run."""

    chunk_bytes: int | None = None
    window: int | None = None
    pack_below: int | None = None
    io_threads: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    timeout_s: float = 600.0
    verify: bool = True

    def zmq_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for name in ("chunk_bytes", "window", "pack_below", "io_threads"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        kwargs.update(dict(self.extra))
        return kwargs


def _presets() -> dict[str, Scenario]:
    gib, mib, kib = 1 << 30, 1 << 20, 1 << 10
    big = ("tcp-reused", "tcp-fresh", "zmq-bare", "http", "http-4")
    settle = DEFAULT_SETTLE_S
    lab_methods = ("tcp-reused", "zmq-inplace", "zmq-fresh", "http", "http-4", "pg-inplace")
    return {
        "inplace": Scenario("inplace", gib, 4 * mib, methods=(*big, "zmq-inplace", "pg-inplace"), settle_s=settle),
        "fresh": Scenario("fresh", gib, 4 * mib, methods=(*big, "zmq-fresh", "pg-fresh"), settle_s=settle),
        "small": Scenario(
            "small",
            80 * mib,
            4 * kib,
            methods=(*big, "zmq-fresh", "zmq-inplace", "pg-fresh"),
            settle_s=settle,
        ),
        "fanout": Scenario(
            "fanout",
            gib,
            4 * mib,
            receivers=3,
            methods=(*big, "zmq-fresh", "zmq-inplace"),
            reps=3,
            settle_s=settle,
        ),
        "tiny": Scenario(
            "tiny",
            kib,
            kib,
            methods=("tcp-reused", "tcp-fresh", "zmq-bare", "http", "zmq-fresh", "zmq-inplace", "pg-fresh"),
            reps=30,
        ),
        "lab-1to1": Scenario("lab-1to1", 64 * mib, 4 * mib, methods=lab_methods, reps=3, lab=LabSpec()),
        "lab-1to3": Scenario("lab-1to3", 64 * mib, 4 * mib, receivers=3, methods=lab_methods, reps=3, lab=LabSpec()),
        "lab-2nic": Scenario("lab-2nic", 64 * mib, 4 * mib, methods=lab_methods, reps=3, lab=LabSpec(nics=2)),
        # Issue 12: both paths vs one stream on one NIC, and a path cut mid-transfer (2 NICs) ...
        "lab-paths": Scenario(
            "lab-paths",
            128 * mib,
            4 * mib,
            methods=("tcp-reused", "zmq-inplace-1s", "zmq-inplace", "zmq-inplace-cut", "http-4"),
            reps=3,
            lab=LabSpec(nics=2),
        ),
        # ... and four connections vs one on one NIC.
        "lab-streams": Scenario(
            "lab-streams",
            128 * mib,
            4 * mib,
            methods=("tcp-reused", "zmq-inplace-1s", "zmq-inplace-4s", "http-4"),
            reps=5,
            lab=LabSpec(),
        ),
    }


def _with_relay_rows(presets: dict[str, Scenario]) -> dict[str, Scenario]:
    """Issue 13 (relays): ZMQTransport(relay=False) beside the three-receiver row; seven receivers; a relay killed."""
    mib = 1 << 20
    relay_methods = ("zmq-fresh", "zmq-norelay", "http-4")
    rows = dict(presets)
    three = rows["lab-1to3"]
    rows["lab-1to3"] = replace(three, methods=(*three.methods, "zmq-norelay"))
    seven = Scenario("lab-1to7", 64 * mib, 4 * mib, receivers=7, methods=relay_methods, reps=3, lab=LabSpec())
    rows["lab-1to7"] = seven
    rows["lab-kill"] = Scenario(
        "lab-kill", 64 * mib, 4 * mib, receivers=3, methods=relay_methods, reps=3, lab=LabSpec(), kill=Kill()
    )
    # Issue 22 (mixed links): the first receiver to ask on a link 4x slower than the others'.
    mixed = LabSpec(host_rates=((1, DEFAULT_RATE_MBIT / 4),))
    rows["lab-mixed"] = Scenario(
        "lab-mixed", 32 * mib, 4 * mib, receivers=3, methods=relay_methods, reps=3, lab=mixed, lead_s=0.2
    )
    # Issue 22: several paths and the swarm together (2 NICs per host, 3 receivers).
    rows["lab-2nic-1to3"] = Scenario(
        "lab-2nic-1to3", 64 * mib, 4 * mib, receivers=3, methods=relay_methods, reps=3, lab=LabSpec(nics=2)
    )
    # Issue 21: a rogue relay at the head of the chain, and an honest one that shuts down mid-transfer;
    # issue 22: one that makes the source reserve it every message and fetches none of them;
    # issue 34: one that also claims to be fetching everything and serves nothing.
    for mode in ("flip", "error", "silent", "shutdown", "hoard", "liar"):
        rows[f"lab-rogue-{mode}"] = Scenario(
            f"lab-rogue-{mode}", 64 * mib, 4 * mib, receivers=3, methods=("zmq-fresh",), reps=3, lab=LabSpec(),
            rogue=Rogue(mode), lead_s=0.2,
        )  # fmt: skip
    return rows


def _with_disallow_rows(presets: dict[str, Scenario]) -> dict[str, Scenario]:
    """Issue 23: disallow_checkpoint mid-transfer, then a mutation; in the lab and on loopback (1 GiB)."""
    mib = 1 << 20
    methods = ("zmq-inplace", "zmq-fresh", "http-4")
    rows = dict(presets)
    rows["lab-disallow"] = Scenario(
        "lab-disallow", 64 * mib, 4 * mib, methods=methods, reps=3, lab=LabSpec(), disallow=Disallow(0.3)
    )
    rows["disallow"] = Scenario(
        "disallow", 1 << 30, 4 * mib, methods=methods, reps=3, settle_s=DEFAULT_SETTLE_S, disallow=Disallow(0.1)
    )
    return rows


def _with_fast_rows(presets: dict[str, Scenario]) -> dict[str, Scenario]:
    """Issue 33: unshaped links (a NIC faster than the CPU), MTU 1500 and 9000; one and three receivers."""
    mib = 1 << 20
    anchors = ("tcp-reused", "tcp-reused-4")
    zmq = ("zmq-inplace", "zmq-fresh", "zmq-norelay")
    rows = dict(presets)
    for mtu in (None, 9000):
        suffix = "" if mtu is None else f"-mtu{mtu}"
        spec = LabSpec(shaped=False, mtu=mtu)
        one = (*anchors, "zmq-bare", *zmq, "http-4")
        rows[f"fast-1to1{suffix}"] = Scenario(f"fast-1to1{suffix}", 256 * mib, 4 * mib, methods=one, reps=3, lab=spec)
        three = (*anchors, *zmq, "http-4")
        rows[f"fast-1to3{suffix}"] = Scenario(
            f"fast-1to3{suffix}", 256 * mib, 4 * mib, receivers=3, methods=three, reps=3, lab=spec
        )
    return rows


def exact_size(scenario: Scenario) -> Scenario:
    """``scenario`` with ``total_bytes`` what its layout really holds (a transformer's is only about the request)."""
    return replace(scenario, total_bytes=sum(scenario.tensor_sizes))


def _large_presets() -> dict[str, Scenario]:
    """Issue 24: how time grows with the state (1, 2, 4, 8 GiB uniform) and a transformer's state with Adam's."""
    gib, mib = 1 << 30, 1 << 20
    methods = ("tcp-reused", "tcp-fresh", "http-4", "zmq-fresh", "zmq-inplace")
    rows = {}
    for size in (1, 2, 4, 8):
        name = f"uniform-{size}g"
        rows[name] = Scenario(name, size * gib, 4 * mib, methods=methods, reps=3, settle_s=settle_for(size * gib))
    transformer = Scenario(
        "transformer",
        int(3.5 * gib),
        4 * mib,
        methods=methods,
        reps=3,
        settle_s=settle_for(int(3.5 * gib)),
        layout=TRANSFORMER,
    )
    rows["transformer"] = exact_size(transformer)
    return rows


LARGE = _large_presets()
PRESETS = {**_with_fast_rows(_with_disallow_rows(_with_relay_rows(_presets()))), **LARGE}
# The fan-out rows (issues 13 and 22) and the one-receiver time they are compared with: ``--scenario relay``.
RELAY_PRESETS = ("lab-1to1", "lab-1to3", "lab-1to7", "lab-kill", "lab-mixed", "lab-2nic-1to3")
# Issue 21's rows and the clean fan-out they are compared with: ``--scenario rogue``.
ROGUE_PRESETS = (
    "lab-1to1", "lab-1to3", *(f"lab-rogue-{mode}" for mode in ("flip", "error", "silent", "shutdown", "hoard", "liar"))
)
# Issue 33's unshaped-link rows: ``--scenario fast`` (also part of ``--lab``).
FAST_PRESETS = tuple(n for n in PRESETS if n.startswith("fast-"))
# Issue 23's rows (run only where named): ``--scenario disallow --scenario lab-disallow``.
DISALLOW_PRESETS = ("lab-disallow", "disallow")
LAB_PRESETS = tuple(n for n, s in PRESETS.items() if s.lab is not None and n not in DISALLOW_PRESETS)
# ``--scenario all``: every loopback preset but the large ones (minutes each, GiBs of memory on both sides).
LOOPBACK_PRESETS = tuple(
    n for n, s in PRESETS.items() if s.lab is None and n not in LARGE and n not in DISALLOW_PRESETS
)
# Issue 24: ``--scenario growth`` (docs/performance.md, "Large states") and ``--scenario large``.
GROWTH_PRESETS = ("uniform-1g", "uniform-2g", "uniform-4g")
LARGE_PRESETS = ("transformer", "uniform-4g", "uniform-8g")


def parse_size(text: str) -> int:
    """``"1G"``, ``"4MiB"``, ``"4k"`` or plain bytes; binary multiples."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    for suffix, factor in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40)):
        if value.endswith(suffix):
            value, scale = value[:-1], factor
            break
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if number <= 0 or not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return int(number * scale)


def parse_option(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    value: Any = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        with contextlib.suppress(ValueError):
            value = int(raw)
    return name, value


def torchft_available() -> bool:
    try:
        # Optional: the benchmark runs without torchft, minus its methods.
        import torchft.checkpointing  # noqa: F401
    except Exception:  # noqa: BLE001 - torchft's import fails in many ways on odd installs
        return False
    return True


def numpy_available() -> bool:
    """PGTransport's receive decodes its metadata through numpy."""
    try:
        import numpy  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True
