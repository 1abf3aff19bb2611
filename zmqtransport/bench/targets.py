"""The performance targets of issues 4, 12, 13, 16, 21 to 24 and 33, checked wherever a run measured what they need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .growth import growth_series, seconds_per_gib
from .layouts import UNIFORM
from .relayreport import RELAYING, link_rows, relay_rows
from .runner import ScenarioResult


@dataclass
class Target:
    scenario: str
    text: str
    measured: float
    limit: float
    higher_is_better: bool
    issue: int = 4

    @property
    def holds(self) -> bool:
        return self.measured >= self.limit if self.higher_is_better else self.measured <= self.limit


def evaluate_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """The performance targets of issues 4, 12, 13, 16, 21 to 24 and 33, wherever the run measured what they need."""
    targets = (
        _issue4_targets(results)
        + _issue12_targets(results)
        + _issue13_targets(results)
        + _issue16_targets(results)
        + _issue21_targets(results)
        + _issue22_targets(results)
        + _issue23_targets(results)
        + _issue24_targets(results)
        + _issue33_targets(results)
    )
    return sorted(targets, key=lambda target: target.issue)  # one block per issue, in the order found


# Issue 23 (disallow keeps the contract): the most seconds the source may be held in the lab, and on
# loopback beyond one memcpy of what it copied.
_LAB_DISALLOW_S = 0.15
_BEYOND_MEMCPY_S = 0.05
_DISALLOWING = ("zmq-inplace", "zmq-fresh")


def _issue23_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    targets: list[Target] = []
    for result in results:
        scenario = result.scenario
        if scenario.disallow is None:
            continue
        for method in _DISALLOWING:
            entry = result.summary.get(method)
            if entry is None or entry.disallow_max_s is None:
                continue
            text = f"{method}: trials in which the receiver got the staged bytes"
            targets.append(Target(scenario.name, text, entry.exact_trials, scenario.reps, True, 23))
            if scenario.lab is not None:
                text = f"{method}: slowest disallow_checkpoint, seconds"
                targets.append(Target(scenario.name, text, entry.disallow_max_s, _LAB_DISALLOW_S, False, 23))
            elif entry.disallow_s is not None and entry.memcpy_s is not None:
                text = f"{method}: disallow_checkpoint seconds beyond a memcpy of what the receive still needed"
                measured = entry.disallow_s - entry.memcpy_s
                targets.append(Target(scenario.name, text, measured, _BEYOND_MEMCPY_S, False, 23))
    return targets


# Issue 12 (several paths and streams, in the lab): (method, NICs per host, most seconds / one stream's seconds).
# One stream (zmq-inplace-1s) uses one connection on the first NIC: the one-NIC time of the same run.
ONE_STREAM = "zmq-inplace-1s"
_PATH_CHECKS = (
    ("zmq-inplace", 2, 0.6, "both paths (default streams)"),
    ("zmq-inplace-cut", 2, 1.3, "a path cut mid-transfer, bit-exact"),
    ("zmq-inplace-4s", 1, 1.05, "streams=4 on one NIC"),
)


def _issue12_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Ratios of receive times to one stream's in the same lab scenario (lower is better)."""
    targets: list[Target] = []
    for result in results:
        lab, one = result.scenario.lab, result.summary.get(ONE_STREAM)
        if lab is None or one is None:
            continue
        for method, nics, limit, what in _PATH_CHECKS:
            entry = result.summary.get(method)
            if entry is None or lab.nics != nics:
                continue
            text = f"{method} seconds / {ONE_STREAM} (one NIC) seconds: {what}"
            targets.append(Target(result.scenario.name, text, entry.slowest_s / one.slowest_s, limit, False, 12))
    return targets


# Equal links in the lab: most slowest-receiver seconds / one-receiver seconds, by scenario shape.
# Issue 13 set them for the relay chain; issue 22 kept the swarm to tighter ones (the same upload).
_SLOWEST_OVER_ONE = {"three": 1.3, "seven": 1.5, "killed": 2.0}
_SWARM_SLOWEST_OVER_ONE = {"three": 1.15, "seven": 1.3, "killed": 1.5}
_UPLOAD_OVER_STATE = 1.3  # three receivers: the source host's NIC bytes / state bytes


def _issue13_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Several receivers in the lab against one receiver of the same run (relayreport.relay_rows)."""
    targets: list[Target] = []
    swarm: list[Target] = []  # issue 22's tighter bounds for the swarm
    for row in relay_rows(results):
        if row.method not in RELAYING or not row.shaped:  # set for links slower than the CPU
            continue
        shape = "killed" if row.killed else "three" if row.receivers == 3 else "seven" if row.receivers == 7 else ""
        if not shape or row.rogue:
            continue
        what = f"{row.receivers} receivers" + (f", {row.killed} relay SIGKILLed mid-transfer" if row.killed else "")
        text = f"{row.method} slowest / one-receiver seconds ({what})"
        targets.append(Target(row.scenario, text, row.times_one, _SLOWEST_OVER_ONE[shape], False, 13))
        swarm.append(Target(row.scenario, text, row.times_one, _SWARM_SLOWEST_OVER_ONE[shape], False, 22))
        if shape == "three":
            text = f"{row.method} source upload / state ({what})"
            targets.append(Target(row.scenario, text, row.sent_over_state, _UPLOAD_OVER_STATE, False, 13))
    return targets + swarm


# Issue 21 (a rogue relay, in the lab): most slowest-honest-receiver seconds / the clean fan-out's.
_ROGUE_OVER_CLEAN = 2.0


def _issue21_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Honest receivers behind a rogue relay against the same fan-out without one, in the same run."""
    targets: list[Target] = []
    for result in results:
        scenario = result.scenario
        if scenario.rogue is None or scenario.lab is None:
            continue
        clean = next(
            (
                other
                for other in results
                if other.scenario.rogue is None
                and other.scenario.kill is None
                and other.scenario.lab == scenario.lab
                and other.scenario.receivers == scenario.receivers
                and other.scenario.total_bytes == scenario.total_bytes
            ),
            None,
        )
        if clean is None:
            continue
        for method, entry in result.summary.items():
            reference = clean.summary.get(method)
            if method not in RELAYING or reference is None:
                continue
            text = f"{method} slowest honest / clean fan-out slowest (rogue relay: {scenario.rogue.mode})"
            measured = entry.slowest_s / reference.slowest_s
            targets.append(Target(scenario.name, text, measured, _ROGUE_OVER_CLEAN, False, 21))
    return targets


# Issue 22 (mixed links): most seconds over a receiver's own link's ideal; most source upload over the state.
_OWN_IDEAL_LIMIT = 1.3
_MIXED_UPLOAD_LIMIT = 2.0


def _issue22_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Every relaying receiver on unequal links against its own link's ideal (relayreport.link_rows)."""
    targets: list[Target] = []
    uploads: dict[tuple[str, str], float] = {}
    for row in link_rows(results):
        if row.method not in RELAYING:
            continue
        text = f"{row.method} r{row.rank} ({row.rate_mbit:g} Mbit/s) seconds / its own link's ideal"
        targets.append(Target(row.scenario, text, row.times_ideal, _OWN_IDEAL_LIMIT, False, 22))
        uploads[(row.scenario, row.method)] = row.sent_over_state
    for (scenario, method), sent in uploads.items():
        targets.append(Target(scenario, f"{method} source upload / state", sent, _MIXED_UPLOAD_LIMIT, False, 22))
    return targets + _two_nic_targets(results)


_TWO_NIC_LIMIT = 0.6  # slowest of 3 receivers with 2 NICs each / one receiver's time over one NIC


def _two_nic_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Several paths and the swarm together: 3 receivers on 2 NICs against one receiver on one NIC."""
    targets: list[Target] = []
    for result in results:
        scenario, lab = result.scenario, result.scenario.lab
        if lab is None or lab.nics != 2 or scenario.receivers < 2 or lab.mixed or scenario.kill is not None:
            continue
        for reference in results:
            one, ref_lab = reference.scenario, reference.scenario.lab
            comparable = (
                ref_lab is not None and ref_lab.nics == 1 and one.receivers == 1 and not ref_lab.mixed
                and ref_lab.rate_mbit == lab.rate_mbit and one.total_bytes == scenario.total_bytes
                and ref_lab.shaped == lab.shaped
            )
            if not comparable:
                continue
            for method in RELAYING:
                entry, base = result.summary.get(method), reference.summary.get(method)
                if entry is None or base is None:
                    continue
                text = f"{method} slowest of {scenario.receivers} (2 NICs each) / one receiver over one NIC"
                targets.append(Target(scenario.name, text, entry.slowest_s / base.slowest_s, _TWO_NIC_LIMIT, False, 22))
    return targets


# Issue 16 (cold-process speed): (method, anchor, minimum ratio of anchor seconds / method seconds).
_ONE_RECEIVER_LARGE = (
    ("zmq-inplace", "zmq-bare", 0.9),
    ("zmq-inplace", "http-4", 1.2),
    ("zmq-fresh", "http-4", 1.0),
    ("zmq-fresh", "http", 1.5),
)
_ONE_RECEIVER_SMALL = (("zmq-fresh", "http", 10.0),)
_SEVERAL_RECEIVERS = (("zmq-fresh", "http", 1.0),)  # slowest receiver against http's slowest
_SMALL_TENSOR_BYTES = 64 << 10  # below pack_below: tensors travel packed


def _issue16_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Cold ratios on loopback: large tensors, many small tensors, several fresh receivers."""
    targets: list[Target] = []
    for result in results:
        scenario = result.scenario
        if scenario.lab is not None or scenario.total_bytes < 64 << 20 or scenario.layout != UNIFORM:
            continue
        if scenario.disallow is not None:
            continue  # a disallow mid-transfer is not a speed run
        several = scenario.receivers > 1
        checks: tuple[tuple[str, str, float], ...]
        if several:
            checks = _SEVERAL_RECEIVERS
        elif scenario.tensor_bytes < _SMALL_TENSOR_BYTES:
            checks = _ONE_RECEIVER_SMALL
        else:
            checks = _ONE_RECEIVER_LARGE
        for method, anchor, limit in checks:
            entry = result.summary.get(method)
            if entry is None or anchor not in entry.ratios:
                continue
            text = f"{method} slowest / {anchor} slowest speed" if several else f"{method} speed / {anchor}"
            targets.append(Target(scenario.name, text, entry.ratios[anchor], limit, True, 16))
    return targets


def _issue4_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    targets: list[Target] = []
    mib = float(1 << 20)

    def add(scenario: str, text: str, measured: float, limit: float, higher: bool = True) -> None:
        targets.append(Target(scenario, text, measured, limit, higher))

    for result in results:
        name, s = result.scenario.name, result.summary
        zi, zf = s.get("zmq-inplace"), s.get("zmq-fresh")
        if name == "inplace" and zi is not None:
            if "tcp-reused" in zi.ratios:
                add(name, "zmq-inplace speed / tcp-reused ceiling", zi.ratios["tcp-reused"], 0.75)
            add(name, "sender peak RSS growth, MiB", zi.send_rss_max / mib, 64, higher=False)
            add(
                name,
                "in-place receiver peak RSS growth, MiB",
                zi.recv_rss_max / mib,
                128,
                higher=False,
            )
        if name == "fresh" and zf is not None:
            if "http" in zf.ratios:
                add(name, "zmq-fresh speed / http (num_chunks=0)", zf.ratios["http"], 2.0)
            if "http-4" in zf.ratios:
                add(name, "zmq-fresh speed / http-4 (num_chunks=4)", zf.ratios["http-4"], 1.3)
            add(name, "sender peak RSS growth, MiB", zf.send_rss_max / mib, 64, higher=False)
        if name == "small" and zf is not None and "http" in zf.ratios:
            add(name, "zmq-fresh speed / http (num_chunks=0)", zf.ratios["http"], 6.0)
        if name == "fanout":
            for method in ("zmq-fresh", "zmq-inplace"):
                entry = s.get(method)
                if entry is None:
                    continue
                if "http" in entry.ratios:
                    add(
                        name,
                        f"{method} slowest receiver speed / http slowest",
                        entry.ratios["http"],
                        2.0,
                    )
                add(name, f"{method} slowest / fastest receiver", entry.spread, 1.5, higher=False)
        if name == "tiny":
            for method in ("zmq-fresh", "zmq-inplace"):
                entry = s.get(method)
                if entry is not None:
                    add(name, f"{method} median recv, ms", entry.slowest_s * 1000, 5.0, higher=False)
    return targets


# Issue 24 (large states), one receiver on loopback: (method, anchor, minimum speed ratio) by kind of state.
_LARGE_UNIFORM = (("zmq-fresh", "http-4", 1.1), ("zmq-inplace", "http-4", 1.5))
_LARGE_SHAPED = (("zmq-fresh", "http-4", 1.2), ("zmq-inplace", "http-4", 1.5))
LARGE_BYTES = 3 << 30  # "large": from 3 GiB on
_GROWTH_LIMIT = 1.25  # seconds per GiB at the largest size / at the smallest, where plain TCP grows less
_OVER_STATE_MIB = 64  # a fresh receiver's peak RSS growth beyond the state it receives
_SENDER_MIB = 64  # the sender's peak RSS growth (zero copy: nothing)


def _issue24_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Large states: speed against HTTPTransport(num_chunks=4), memory, and growth with size."""
    targets: list[Target] = []
    mib = float(1 << 20)
    for result in results:
        scenario = result.scenario
        if scenario.lab is not None or scenario.receivers != 1 or scenario.total_bytes < LARGE_BYTES:
            continue
        checks = _LARGE_UNIFORM if scenario.layout == UNIFORM else _LARGE_SHAPED
        for method, anchor, limit in checks:
            entry = result.summary.get(method)
            if entry is not None and anchor in entry.ratios:
                targets.append(
                    Target(scenario.name, f"{method} speed / {anchor}", entry.ratios[anchor], limit, True, 24)
                )
        fresh = result.summary.get("zmq-fresh")
        if fresh is not None:
            over = (fresh.recv_rss_max - scenario.total_bytes) / mib
            text = "zmq-fresh receiver peak RSS growth beyond the state, MiB"
            targets.append(Target(scenario.name, text, over, _OVER_STATE_MIB, False, 24))
        for method in ("zmq-fresh", "zmq-inplace"):
            entry = result.summary.get(method)
            if entry is not None:
                text = f"{method} sender peak RSS growth, MiB"
                targets.append(Target(scenario.name, text, entry.send_rss_max / mib, _SENDER_MIB, False, 24))
    return targets + _growth_targets(results)


def _growth_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """zmq-fresh's seconds per GiB at the largest size over the smallest: within 1.25, or no worse than plain TCP's."""
    series = growth_series(results)
    if not series or not all("zmq-fresh" in r.summary for r in series):
        return []
    first, last = series[0], series[-1]

    def growth(method: str) -> float:
        return seconds_per_gib(last, method) / seconds_per_gib(first, method)

    limit = _GROWTH_LIMIT
    text = f"zmq-fresh seconds per GiB, {last.scenario.name} / {first.scenario.name}"
    if all("tcp-fresh" in r.summary for r in series) and growth("tcp-fresh") > limit:
        limit = growth("tcp-fresh")
        text += " (limit: tcp-fresh's growth, above 1.25)"
    return [Target(last.scenario.name, text, growth("zmq-fresh"), limit, False, 24)]


# Issue 33 (links faster than the CPU). Unshaped lab, one receiver: (method, anchor, least speed ratio).
_FAST_ONE = (("zmq-inplace", "http-4", 1.2), ("zmq-fresh", "http-4", 1.0), ("zmq-inplace", "tcp-reused-4", 1 / 1.5))
_FAST_MANY = (("zmq-fresh", "http-4", 1.0), ("zmq-inplace", "http-4", 1.0))  # several receivers: slowest's
_RELAY_CPU_OVER_DIRECT = 1.5  # shaped lab, several receivers: a relaying receiver's CPU per GiB / relay=False's


def _issue33_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """Speed against HTTPTransport(4) and plain TCP over unshaped links; a relaying receiver's CPU per byte."""
    targets: list[Target] = []
    for result in results:
        scenario, lab = result.scenario, result.scenario.lab
        if lab is None or scenario.kill is not None or scenario.rogue is not None or scenario.disallow is not None:
            continue
        if not lab.shaped:
            checks = _FAST_ONE if scenario.receivers == 1 else _FAST_MANY
            for method, anchor, limit in checks:
                entry = result.summary.get(method)
                if entry is not None and anchor in entry.ratios:
                    text = f"{method} speed / {anchor}" + (" (slowest receivers)" if scenario.receivers > 1 else "")
                    targets.append(Target(scenario.name, text, entry.ratios[anchor], limit, True, 33))
                    # A job start meets the source's first step (a swarm until measured), which medians hide.
                    if scenario.receivers > 1 and entry.first_step_s:
                        text = f"{method} speed on its source's first step / {anchor} (slowest receivers)"
                        measured = result.summary[anchor].slowest_s / entry.first_step_s
                        targets.append(Target(scenario.name, text, measured, limit, True, 33))
            continue
        direct = result.summary.get("zmq-norelay")
        if scenario.receivers < 2 or lab.mixed or direct is None or direct.recv_cpu_per_gib <= 0:
            continue
        for method in RELAYING:
            entry = result.summary.get(method)
            if entry is not None and entry.recv_cpu_per_gib > 0:
                text = f"{method} receiver CPU per GiB (mean) / zmq-norelay's"
                measured = entry.recv_cpu_per_gib / direct.recv_cpu_per_gib
                targets.append(Target(scenario.name, text, measured, _RELAY_CPU_OVER_DIRECT, False, 33))
    return targets
