"""The ``--profile`` tables: CPU per process and thread, a receive's phases, its busiest functions (:mod:`.profiling`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from .runner import ScenarioResult, Trial
from .tables import table

# Functions printed per profiled receiver (of the TOP_FUNCTIONS each receive keeps).
PRINTED_FUNCTIONS = 15
_PHASES = ("header", "land", "data", "build")


def _median_of(trials: Sequence[Trial], process: str, pick: Any) -> float | None:
    values = [pick(t.profiles[process]) for t in trials if process in t.profiles]
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def _thread_rows(trials: Sequence[Trial], gib: float) -> list[list[str]]:
    processes = list(dict.fromkeys(name for t in trials for name in t.profiles))
    rows = [["process", "thread", "cpu s", "cpu s/GiB", "share"]]
    for process in processes:
        total = _median_of(trials, process, lambda p: p.get("total_s"))
        if total is None:
            continue
        rows.append([process, "(all)", f"{total:.3f}", f"{total / gib:.3f}", "1.00"])
        mine = [t.profiles[process] for t in trials if process in t.profiles]
        labels = list(dict.fromkeys(label for profile in mine for label in profile["threads"]))
        for label in labels:
            seconds = statistics.median(
                t.profiles[process]["threads"].get(label, 0.0) for t in trials if process in t.profiles
            )
            if seconds < 0.005:  # below the 10 ms clock: nothing to read
                continue
            share = seconds / total if total > 0 else 0.0
            rows.append(["", label, f"{seconds:.3f}", f"{seconds / gib:.3f}", f"{share:.2f}"])
    return rows


def _phase_rows(trials: Sequence[Trial]) -> list[list[str]]:
    receivers = [n for n in dict.fromkeys(name for t in trials for name in t.profiles) if n != "source"]
    rows = [["receiver", "receive s", "receive cpu s", *(f"{phase} s" for phase in _PHASES)]]
    for name in receivers:
        receive = _median_of(trials, name, lambda p: p.get("receive_s"))
        cpu = _median_of(trials, name, lambda p: p.get("receive_cpu_s"))
        if receive is None or cpu is None:
            continue
        phases = [_median_of(trials, name, lambda p, ph=phase: p.get("phases", {}).get(ph)) for phase in _PHASES]
        rows.append([name, f"{receive:.3f}", f"{cpu:.3f}", *("-" if x is None else f"{x:.3f}" for x in phases)])
    return rows if len(rows) > 1 else []


def _function_lines(trial: Trial) -> list[str]:
    lines: list[str] = []
    for name, profile in trial.profiles.items():
        functions = profile.get("functions") or []
        if not functions:
            continue
        rows = [["function", "calls", "own s", "cumulative s"]]
        rows += [[label, str(calls), f"{own:.3f}", f"{cum:.3f}"] for label, calls, own, cum in functions]
        lines.append(f"  {name}: its receiving thread's functions by own time (cProfile, trial {trial.trial})")
        lines += ["    " + line for line in table(rows[: PRINTED_FUNCTIONS + 1])]
    return lines


def format_profiles(results: Sequence[ScenarioResult]) -> str:
    """Per scenario and method: CPU per process and thread (medians over trials), phases, functions (last trial)."""
    blocks: list[str] = []
    for result in results:
        scenario = result.scenario
        if scenario.profiling is None:
            continue
        gib = scenario.total_bytes / (1 << 30)
        for method in scenario.methods:
            trials = [t for t in result.trials if t.method == method and t.profiles]
            if not trials:
                continue
            lines = [
                f"profile of {scenario.name} / {method} ({len(trials)} trial(s), medians; --profile slows the "
                "receiving thread: read proportions, not speed). CPU from just before the receives start to the "
                "trial's end, per process and thread; cpu s/GiB per GiB of the state",
                *table(_thread_rows(trials, gib)),
            ]
            phases = _phase_rows(trials)
            if phases:
                lines += ["  the cold receive's phases (wall s) and its process's CPU over it:"]
                lines += ["    " + line for line in table(phases)]
            lines += _function_lines(trials[-1])
            blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
