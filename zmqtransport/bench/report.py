"""Tables and JSON for benchmark results, and a description of the machine."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch
import zmq

from .config import Knobs, Scenario
from .disallowreport import disallow_table
from .growth import growth_series, seconds_per_gib
from .layouts import UNIFORM
from .methods import METHODS, CutMethod
from .runner import MethodSummary, ScenarioResult, path_host
from .tables import table
from .targets import Target, evaluate_targets

_MIB = float(1 << 20)


def machine_description() -> dict[str, Any]:
    model = platform.processor() or "unknown cpu"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = 0
    with contextlib.suppress(OSError, ValueError):
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    thp = "unknown"
    with (
        contextlib.suppress(OSError),
        open("/sys/kernel/mm/transparent_hugepage/enabled") as enabled,
    ):
        thp = enabled.read().strip()
    load = "unknown"
    with contextlib.suppress(OSError):
        load = "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
    }
    # torchft's releases and its nightly builds are two distributions that both install `torchft`.
    for distribution in ("torchft", "torchft-nightly"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[distribution] = importlib.metadata.version(distribution)
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(memory / (1 << 30), 1),
        "kernel": platform.release(),
        "transparent_hugepage": thp,
        "load_average": load,
        "versions": versions,
    }


def human_bytes(nbytes: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes:.0f} B"


def _seconds(value: float) -> str:
    return f"{value:.4f}" if value < 0.1 else f"{value:.3f}"


def memory_available() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where unknown)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _what(scenario: Scenario) -> str:
    count = len(scenario.tensor_sizes)
    if scenario.layout == UNIFORM:
        return f"{count} float32 tensor(s) of {human_bytes(scenario.tensor_bytes)}"
    sizes = scenario.tensor_sizes
    return (
        f"{count} float32 tensors of {human_bytes(min(sizes))} to {human_bytes(max(sizes))} "
        f"({scenario.payload.description})"
    )


def _title(result: ScenarioResult) -> str:
    scenario = result.scenario
    where = "loopback"
    if scenario.lab is not None:
        where = f"lab: {scenario.receivers + 1} hosts x {scenario.lab.nics} NIC(s), {scenario.lab.describe()}"
    return (
        f"scenario {scenario.name}: {human_bytes(scenario.total_bytes)} as {_what(scenario)}, "
        f"{scenario.receivers} receiver(s), {where}; "
        f"{scenario.reps} trial(s), fresh receiver processes, {scenario.settle_s:g} s settle, "
        f"medians ({result.wall_seconds:.0f} s wall)"
    )


def _notes(result: ScenarioResult) -> list[str]:
    scenario, notes = result.scenario, []
    count = len(scenario.tensor_sizes)
    partial = [
        f"{m} ({e.in_place_tensors}/{count})"
        for m, e in result.summary.items()
        if METHODS[m].into_targets and e.in_place_tensors != count
    ]
    if partial:
        notes.append("note: tensors received in place fewer than expected: " + ", ".join(partial))
    if not result.peak_resettable:
        notes.append("note: /proc/self/clear_refs unavailable; RSS columns are lifetime peaks (upper bounds)")
    return notes


def format_result(result: ScenarioResult) -> str:
    """The loopback table: cold seconds (first receive in a fresh process), ratios to anchors."""
    if result.scenario.lab is not None:
        return format_lab_result(result)
    scenario = result.scenario
    anchors = [a for a in result.summary if METHODS[a].anchor]
    multi = scenario.receivers > 1
    header = ["method", "cold slowest s" if multi else "cold s"]
    header += ["fastest s", "slow/fast"] if multi else []
    header += ["warm s"] if scenario.warm else []
    header += ["GB/s", *(f"x {a}" for a in anchors), "recv cpu s", *_cpu_header(multi), "send +MiB", "recv +MiB"]
    rows = [header]
    for method, entry in result.summary.items():
        row = [method, _seconds(entry.slowest_s)]
        row += [_seconds(entry.fastest_s), f"{entry.spread:.2f}"] if multi else []
        row += [_seconds(entry.warm_slowest_s or 0.0)] if scenario.warm else []
        row += [f"{entry.gbps:.3g}", *(f"{entry.ratios[a]:.2f}" for a in anchors), _seconds(entry.recv_cpu_s)]
        row += _cpu_cells(entry, multi)
        row += [f"{entry.send_rss_max / _MIB:.0f}", f"{entry.recv_rss_max / _MIB:.0f}"]
        rows.append(row)
    lines = [_title(result), *table(rows), CPU_NOTE]
    return "\n".join([*lines, *_notes(result), *_disallow_lines(result)])


CPU_NOTE = (
    "cpu s/GiB: CPU seconds (user + system, every thread) per GiB moved, medians over trials: recv, each "
    "receiver's process from just before the receives start to the trial's end (relaying included) per GiB it "
    "received (mean over receivers; busiest: the receiver that spent most); src, the source's process from its "
    "release of the step per GiB delivered to all receivers; all, every process together per GiB delivered"
)


def _cpu_header(multi: bool) -> list[str]:
    return ["recv cpu s/GiB", *(["busiest"] if multi else []), "src cpu s/GiB", "all cpu s/GiB"]


def _cpu_cells(entry: MethodSummary, multi: bool) -> list[str]:
    cells = [f"{entry.recv_cpu_per_gib:.2f}"]
    cells += [f"{entry.recv_cpu_per_gib_max:.2f}"] if multi else []
    return [*cells, f"{entry.send_cpu_per_gib:.2f}", f"{entry.cpu_per_gib:.2f}"]


def _ideal_s(result: ScenarioResult) -> float | None:
    """State bytes over what the receiver's NICs can take at their nominal rate (None: unshaped links)."""
    lab = result.scenario.lab
    assert lab is not None
    if not lab.shaped:
        return None
    return result.scenario.total_bytes / (lab.nics * lab.rate_mbit * 1e6 / 8)


def _path_hosts(result: ScenarioResult) -> list[str]:
    """The addresses ZMQTransport's receivers landed bytes from: the source's paths and, relaying, other receivers."""
    endpoints = {endpoint for entry in result.summary.values() for endpoint in entry.recv_paths}
    return sorted({path_host(endpoint) for endpoint in endpoints})


def _lab_row(
    result: ScenarioResult,
    entry: MethodSummary,
    ideal: float | None,
    hosts: list[str],
    anchors: list[str],
    first: bool,
) -> list[str]:
    total = result.scenario.total_bytes
    sent = sum(entry.source_sent)
    multi = result.scenario.receivers > 1
    row = [entry.method, _seconds(entry.slowest_s)]
    row += [_seconds(entry.fastest_s)] if multi else []
    row += [_seconds(entry.first_step_s) if entry.first_step_s is not None else "-"] if first else []
    if ideal is not None:
        row += [f"{entry.slowest_s / ideal:.2f}"]
        row += [f"{entry.fastest_s / ideal:.2f}"] if multi else []
    else:
        row += [f"{entry.gbps:.3g}", *(f"{entry.ratios[a]:.2f}" for a in anchors)]
    row += _cpu_cells(entry, multi)
    row += [f"{sent / _MIB:.1f}", f"{sent / total:.2f}"]
    if len(entry.source_sent) > 1:
        row.append("/".join(f"{nic / _MIB:.0f}" for nic in entry.source_sent))
    if hosts and entry.recv_paths:
        per_host = [sum(n for e, n in entry.recv_paths.items() if path_host(e) == host) for host in hosts]
        row += ["/".join(f"{nbytes / _MIB:.0f}" for nbytes in per_host), str(entry.duplicates)]
    elif hosts:
        row += ["-", "-"]
    return row


def _path_notes(result: ScenarioResult) -> list[str]:
    """Which paths the receive stats name, and when a cut came."""
    notes = []
    hosts = _path_hosts(result)
    if hosts:
        notes.append(
            f"recv paths: bytes ZMQTransport's receivers landed per path (stats.paths), on {' / '.join(hosts)}"
        )
    for entry in result.summary.values():
        chosen = METHODS[entry.method]
        if isinstance(chosen, CutMethod):
            when = "never (the receive ended first)" if entry.cut_s is None else f"{entry.cut_s:.2f} s into the receive"
            notes.append(
                f"{entry.method}: the source's NIC {chosen.nic} went down {when} (median; planned at "
                f"{chosen.after_fraction:g} x the one-NIC ideal), up again after it; stamps checked"
            )
    return notes


def format_lab_result(result: ScenarioResult) -> str:
    """The lab table: receiver times against the link-bound ideal, and the source's upload."""
    ideal = _ideal_s(result)
    multi = result.scenario.receivers > 1
    header = ["method", "slowest s", "fastest s"] if multi else ["method", "seconds"]
    first = any(entry.first_step_s is not None for entry in result.summary.values())
    header += ["1st step s"] if first else []
    # Unshaped links have no ideal: the ratios to the anchors of the same run instead.
    anchors = [a for a in result.summary if METHODS[a].anchor] if ideal is None else []
    if ideal is not None:
        header += ["slowest x ideal", "fastest x ideal"] if multi else ["x ideal"]
    else:
        header += ["GB/s", *(f"x {a}" for a in anchors)]
    header += [*_cpu_header(multi), "source sent MiB", "sent/state"]
    nics = result.scenario.lab.nics if result.scenario.lab is not None else 1
    if nics > 1:
        header.append("per NIC MiB")
    hosts = _path_hosts(result)
    header += ["recv paths MiB", "dup msgs"] if hosts else []
    rows = [header] + [_lab_row(result, entry, ideal, hosts, anchors, first) for entry in result.summary.values()]
    explained = "state bytes / the nominal rate of one receiver's NICs together"
    lines = [_title(result)]
    if ideal is not None:
        lines.append(f"ideal: {_seconds(ideal)} s ({explained})")
    else:
        lines.append("unshaped links: no ideal; ratio columns: anchor seconds / method seconds (above 1 = faster)")
    notes = [*([FIRST_STEP_NOTE] if first else []), *_path_notes(result), *_notes(result)]
    tail = [CPU_NOTE, *notes, *_disallow_lines(result)]
    return "\n".join([*lines, *table(rows), *tail])


FIRST_STEP_NOTE = (
    "1st step s: the slowest receiver of the method's first trial, its source's first step (nothing measured "
    "yet, as at a job start); the other columns are medians over trials"
)


def _disallow_lines(result: ScenarioResult) -> list[str]:
    if result.scenario.disallow is None:
        return []
    title, rows, notes = disallow_table(result)
    return ["", title, *table(rows), *notes]


def format_growth(results: Sequence[ScenarioResult]) -> str:
    """How each method's cold seconds per GiB grow with the state, over the run's uniform scenarios."""
    series = growth_series(results)
    if not series:
        return ""
    methods = [m for m in series[0].summary if all(m in r.summary for r in series)]
    sizes = [human_bytes(r.scenario.total_bytes) for r in series]
    header = ["method", *(f"s/GiB at {size}" for size in sizes), f"growth {sizes[-1]} / {sizes[0]}"]
    rows = [header]
    for method in methods:
        per_gib = [seconds_per_gib(r, method) for r in series]
        rows.append([method, *(f"{x:.3f}" for x in per_gib), f"{per_gib[-1] / per_gib[0]:.2f}"])
    title = (
        "growth: cold seconds per GiB by state size (medians of each scenario above); growth is seconds per GiB "
        f"at {sizes[-1]} over seconds per GiB at {sizes[0]} (1.00: time grows as the bytes)"
    )
    return "\n".join([title, *table(rows)])


def format_targets(targets: Sequence[Target]) -> str:
    previous = 0
    lines: list[str] = []
    for target in targets:
        if not lines or target.issue != previous:
            lines.append(f"targets (issue {target.issue}, measured cold):")
            previous = target.issue
        relation = ">=" if target.higher_is_better else "<="
        verdict = "holds" if target.holds else "MISSED"
        lines.append(
            f"  [{target.scenario}] {target.text}: {target.measured:.3g} (target {relation} {target.limit:g}) {verdict}"
        )
    return "\n".join(lines)


def to_json(results: Sequence[ScenarioResult], knobs: Knobs, argv: Sequence[str]) -> dict[str, Any]:
    return {
        "command": ["python", "-m", "zmqtransport.bench", *argv],
        "machine": machine_description(),
        "knobs": {**asdict(knobs), "extra": dict(knobs.extra)},
        "scenarios": [
            {
                "scenario": asdict(result.scenario),
                "tensors": len(result.scenario.tensor_sizes),
                "wall_seconds": result.wall_seconds,
                "peak_resettable": result.peak_resettable,
                "summary": {m: asdict(e) for m, e in result.summary.items()},
                "trials": [asdict(t) for t in result.trials],
            }
            for result in results
        ],
        "targets": [{**asdict(t), "holds": t.holds} for t in evaluate_targets(results)],
    }
