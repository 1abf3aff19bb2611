"""Fan-out in the benchmark (issues 13, 22): several receivers against one, each against its own link, who sent what.

Every lab row with several receivers on one NIC each is compared with the
one-receiver time of the same run (a lab scenario with one receiver, one NIC,
the same size and rate, e.g. ``lab-1to1``): the slowest receiver's seconds over
the one receiver's, per method (a method absent there is compared with
ZMQTransport's ``zmq-fresh``). The source's upload is the lab's counter of the
source host's NIC (Ethernet frames: the payload plus a few percent).

Each ZMQTransport receiver reports bytes per endpoint (``stats.paths``); in a
lab, host h has address ``10.77.{nic}.{h+1}``, the source is host 0 and
receiver rank r runs on host r, so an endpoint names who sent the bytes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .runner import ScenarioResult

_MIB = float(1 << 20)
# The rows that relay (ZMQTransport with its default relay=True), where issue 13's targets apply.
RELAYING = ("zmq-fresh", "zmq-inplace")
FALLBACK_REFERENCE = "zmq-fresh"


@dataclass(frozen=True)
class RelayRow:
    scenario: str
    method: str
    receivers: int
    killed: int  # receivers SIGKILLed per trial (their times are not counted)
    rogue: str  # the rogue relay's mode ("" without one; its own time is not counted)
    slowest_s: float
    reference_method: str
    reference_s: float
    sent_over_state: float  # the source host's NIC bytes / state bytes (median trial)
    shaped: bool = True  # the lab's links are rate-limited (issue 33's unshaped rows are not)

    @property
    def times_one(self) -> float:
        return self.slowest_s / self.reference_s


def _is_reference(candidate: ScenarioResult, result: ScenarioResult) -> bool:
    one, many = candidate.scenario, result.scenario
    return (
        one.receivers == 1
        and one.kill is None
        and one.rogue is None
        and one.lab is not None
        and one.lab == many.lab
        and one.total_bytes == many.total_bytes
    )


def one_receiver_times(results: Sequence[ScenarioResult], result: ScenarioResult) -> dict[str, float]:
    """Method -> median seconds of the run's one-receiver scenario comparable with ``result`` ({} if none)."""
    for candidate in results:
        if _is_reference(candidate, result):
            return {method: entry.slowest_s for method, entry in candidate.summary.items()}
    return {}


def relay_rows(results: Sequence[ScenarioResult]) -> list[RelayRow]:
    """Every several-receiver lab row (one NIC per host) with its one-receiver reference in the same run."""
    rows: list[RelayRow] = []
    for result in results:
        scenario = result.scenario
        if scenario.lab is None or scenario.lab.nics != 1 or scenario.receivers < 2:
            continue
        ones = one_receiver_times(results, result)
        for method, entry in result.summary.items():
            reference = method if method in ones else FALLBACK_REFERENCE
            if reference not in ones:
                continue
            mine = [trial for trial in result.trials if trial.method == method]
            killed = max((len(trial.killed) for trial in mine), default=0)
            sent = sum(entry.source_sent) / scenario.total_bytes
            rogue = scenario.rogue.mode if scenario.rogue is not None else ""
            row = RelayRow(
                scenario.name,
                method,
                scenario.receivers,
                killed,
                rogue,
                entry.slowest_s,
                reference,
                ones[reference],
                sent,
                scenario.lab.shaped,
            )
            rows.append(row)
    return rows


def format_relay_summary(results: Sequence[ScenarioResult]) -> str:
    """Issue 13's table: slowest receiver over one receiver, and the source's upload over the state."""
    rows = relay_rows(results)
    if not rows:
        return ""
    header = ["scenario", "method", "receivers", "killed", "rogue"]
    header += ["slowest s", "one-receiver s", "x one", "sent/state"]
    table = [header]
    for row in rows:
        borrowed = "" if row.reference_method == row.method else f" ({row.reference_method})"
        reference = f"{row.reference_s:.3f}{borrowed}"
        table.append(
            [
                row.scenario,
                row.method,
                str(row.receivers),
                str(row.killed),
                row.rogue or "-",
                f"{row.slowest_s:.3f}",
                reference,
                f"{row.times_one:.2f}",
                f"{row.sent_over_state:.2f}",
            ]
        )
    title = (
        "relays (issue 13): slowest receiver / the one-receiver time of this run (same method, else zmq-fresh); "
        "sent/state: the source host's NIC bytes / the state (median trial); killed: receivers SIGKILLed mid-transfer; "
        "rogue: receiver 1's relaying modified (issue 21), its own time not counted"
    )
    return "\n".join([title, *_plain_table(table)])


@dataclass(frozen=True)
class LinkRow:
    """One receiver of a mixed-links scenario: its median time against its own link's ideal."""

    scenario: str
    method: str
    rank: int
    rate_mbit: float
    seconds: float
    ideal_s: float
    sent_over_state: float  # the source host's NIC bytes / state bytes (median trial), same for every rank

    @property
    def times_ideal(self) -> float:
        return self.seconds / self.ideal_s


def link_rows(results: Sequence[ScenarioResult]) -> list[LinkRow]:
    """Per method and receiver of every mixed-links lab scenario (no receiver killed)."""
    rows: list[LinkRow] = []
    for result in results:
        scenario, lab = result.scenario, result.scenario.lab
        if lab is None or not lab.mixed or scenario.kill is not None:
            continue
        for method, entry in result.summary.items():
            mine = [trial for trial in result.trials if trial.method == method]
            sent = sum(entry.source_sent) / scenario.total_bytes
            for rank in range(1, scenario.receivers + 1):
                seconds = statistics.median(trial.seconds[rank - 1] for trial in mine)
                ideal = lab.ideal_s(scenario.total_bytes, rank)
                rows.append(LinkRow(scenario.name, method, rank, lab.rate_of(rank), seconds, ideal, sent))
    return rows


def format_link_summary(results: Sequence[ScenarioResult]) -> str:
    """Issue 22's table: every receiver's time over its own link's ideal, on unequal links."""
    rows = link_rows(results)
    if not rows:
        return ""
    table = [["scenario", "method", "receiver", "Mbit/s", "seconds", "own ideal s", "x own ideal", "sent/state"]]
    for row in rows:
        table.append(
            [
                row.scenario,
                row.method,
                f"r{row.rank}",
                f"{row.rate_mbit:g}",
                f"{row.seconds:.3f}",
                f"{row.ideal_s:.3f}",
                f"{row.times_ideal:.2f}",
                f"{row.sent_over_state:.2f}",
            ]
        )
    title = (
        "mixed links (issue 22): each receiver's median seconds / the state over its own link's nominal rate; "
        "r1 asks first; sent/state: the source host's NIC bytes / the state"
    )
    return "\n".join([title, *_plain_table(table)])


def _plain_table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def host_label(endpoint: str) -> str:
    """``src`` for the lab's host 0, ``r{h}`` for host h; the address itself outside a lab."""
    address = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    parts = address.split(".")
    if len(parts) == 4 and parts[:2] == ["10", "77"] and parts[3].isdigit():
        host = int(parts[3]) - 1
        return "src" if host == 0 else f"r{host}"
    return address


def format_paths_detail(results: Sequence[ScenarioResult]) -> str:
    """Per trial and receiver: from whom it landed how many MiB (ZMQTransport's stats.paths)."""
    lines: list[str] = []
    for result in results:
        receivers = result.scenario.receivers
        for trial in result.trials:
            if not any(trial.recv_paths):
                continue
            survivors = [rank for rank in range(1, receivers + 1) if rank not in (*trial.killed, *trial.rogue)]
            parts = []
            for rank, paths, seconds in zip(survivors, trial.recv_paths, trial.seconds, strict=True):
                sources = ", ".join(
                    f"{host_label(endpoint)} {nbytes / _MIB:.1f}"
                    for endpoint, nbytes in sorted(paths.items(), key=lambda item: -item[1])
                )
                parts.append(f"r{rank} {seconds:.2f} s <- {sources}")
            killed = f" (killed: {', '.join(f'r{rank}' for rank in trial.killed)})" if trial.killed else ""
            killed += f" (rogue: {', '.join(f'r{rank}' for rank in trial.rogue)})" if trial.rogue else ""
            sent = sum(trial.source_sent) / _MIB
            lines.append(
                f"  [{result.scenario.name}] {trial.method} trial {trial.trial}{killed}: source sent {sent:.1f} MiB; "
                + "; ".join(parts)
            )
    if not lines:
        return ""
    return "\n".join(["who sent what (MiB per sender, from each receiver's stats.paths; src: the source):", *lines])
