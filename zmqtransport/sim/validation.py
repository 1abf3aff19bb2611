"""The model beside the lab (issue 35, item 2): the validation's scenarios and the model's side of them.

One :class:`Case` is one swarm run: N receivers of one state from one source, on equal links, mixed links
(the first ``max(1, N // 4)`` receivers at a quarter of the others' rate) or with one receiver killed (it
asks 0.2 s before the others, so it heads the relay chain, and is SIGKILLed at 40% of its receive: the
benchmark's :class:`~zmqtransport.bench.config.Kill`), over shaped links (400 Mbit/s, tbf: link-bound) or
unshaped veth pairs (CPU-bound). ``scripts/sim_validate.py`` runs each case in the lab (the benchmark,
``zmq-fresh``) and records the per-receiver times in ``lab_points.json`` beside this module;
:func:`model_point` runs the same case in the model with every process on the lab machine's two cores.
``tests/test_sim.py`` holds the two within :data:`TOLERANCE`.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .cli import simulate

LAB_POINTS = Path(__file__).with_name("lab_points.json")
MIB = 64.0  # the state: 64 MiB as 4 MiB tensors, 256 data messages of 256 KiB (the lab-1to3 calibration point)
RATE_MBIT = 400.0
# An unshaped veth pair has no rate: the kernel moves the bytes, on the same two cores. The model's link is set
# well above what those cores move (tcp-reused over these veths: 7-14 Gbit/s, docs/fast-links.md) so that the
# model's CPU costs, which include the kernel's copies (they are process CPU seconds), decide.
UNSHAPED_MBIT = 40_000.0
# The lab: one machine of two cores, every process on it.
LAB_CORES = 2
# The lab's links add no delay (tbf only): a veth hop and the bridge, tens of microseconds.
LAB_LATENCY_S = 0.05e-3
KILL_LEAD_S = 0.2  # bench.config.Kill.lead_s
KILL_AT = 0.4  # bench.config.Kill.at_fraction
TOLERANCE = 0.15  # issue 35: per-receiver times within 15%
# Cases the model misses, and why (docs/sim.md, "Validation against the lab"); the CI check skips them.
_UNSHAPED = (
    "unshaped links, CPU-bound on two shared cores: the lab moved more than the tolerance within an hour "
    "(equal-7 with the same code: 0.659 s at 07:40 UTC, 0.551-0.553 s at 08:50), and the model, within 15% of "
    "the first run (kill-11's median at +15%), is 18-34% slower than the last (its swarm steps aside later: "
    "the lab's source uploaded 2.0-7.9 states, the model's 1.7-6.0)"
)
KNOWN_MISSES = {
    name: _UNSHAPED
    for name in ("unshaped-equal-3", "unshaped-equal-7", "unshaped-equal-11", "unshaped-kill-7", "unshaped-kill-11")
}
SEEDS = (0,)  # the model's draws (who asks first within a millisecond): one, so that CI runs it in seconds


@dataclass(frozen=True)
class Case:
    receivers: int
    links: str  # "equal", "mixed" or "kill"
    shaped: bool = True

    @property
    def name(self) -> str:
        return f"{'shaped' if self.shaped else 'unshaped'}-{self.links}-{self.receivers}"

    @property
    def slow(self) -> tuple[int, ...]:
        """Receiver ranks (1-based, the benchmark's hosts) on a quarter rate link."""
        return tuple(range(1, max(1, self.receivers // 4) + 1)) if self.links == "mixed" else ()

    @property
    def killed(self) -> int | None:
        """The rank SIGKILLed at 40% (it leads by 0.2 s), or None."""
        return 1 if self.links == "kill" else None

    def rate_of(self, rank: int) -> float:
        return RATE_MBIT / 4 if rank in self.slow else RATE_MBIT


def cases() -> list[Case]:
    """3, 7 and 11 receivers; equal, mixed, one killed; shaped and unshaped (mixed: shaped only, since an
    unshaped lab has no rate to make a quarter of)."""
    found: list[Case] = []
    for shaped in (True, False):
        for links in ("equal", "mixed", "kill"):
            if links == "mixed" and not shaped:
                continue
            found.extend(Case(n, links, shaped) for n in (3, 7, 11))
    return found


def by_name(name: str) -> Case:
    for case in [*cases(), *large_cases()]:
        if case.name == name:
            return case
    raise KeyError(f"no validation case {name!r}")


def large_cases() -> list[Case]:
    """Issue 35 item 4: the lab at the largest N this machine carries (equal shaped links, small state)."""
    return [Case(n, "equal", True) for n in (15, 19, 23, 31)]


def summarize_times(seconds: list[float]) -> dict[str, float]:
    return {"slowest_s": max(seconds), "median_s": statistics.median(seconds), "fastest_s": min(seconds)}


def model_point(case: Case, mib: float = MIB, seeds: tuple[int, ...] = SEEDS) -> dict[str, Any]:
    """The model's figures for ``case``: per-receiver seconds from each receiver's own start (as the lab's
    receivers time themselves), the killed one left out; medians over ``seeds`` of slowest and median."""
    runs = []
    for seed in seeds:
        lead = {0: KILL_LEAD_S} if case.killed is not None else {}
        result = simulate(
            case.receivers,
            mib=mib,
            rate_mbit=RATE_MBIT if case.shaped else UNSHAPED_MBIT,
            seed=seed,
            latency=LAB_LATENCY_S,
            shared_cores=LAB_CORES,
            slow_ranks=tuple(rank - 1 for rank in case.slow),
            killed_ranks=() if case.killed is None else (case.killed - 1,),
            kill_at=KILL_AT,
            lead=lead,
            tbf=case.shaped,
        )
        rows = [row for row in result["per_receiver"] if not row["killed"]]
        seconds = [row["own_seconds"] for row in rows if row["own_seconds"] is not None]
        if len(seconds) != len(rows):
            raise RuntimeError(f"{case.name} seed {seed}: {len(rows) - len(seconds)} receives did not complete")
        runs.append({
            **summarize_times(seconds),
            "seconds": [round(s, 4) for s in seconds],
            "upload_over_state": result["upload_over_state"],
            "max_receiver_cpu_s": result["max_receiver_cpu_s"],
            "source_cpu_s": result["source_cpu_s"],
            "wall_s": result["wall_s"],
        })
    return {
        "case": case.name,
        "slowest_s": statistics.median(r["slowest_s"] for r in runs),
        "median_s": statistics.median(r["median_s"] for r in runs),
        "upload_over_state": statistics.median(r["upload_over_state"] for r in runs),
        "max_receiver_cpu_s": statistics.median(r["max_receiver_cpu_s"] for r in runs),
        "source_cpu_s": statistics.median(r["source_cpu_s"] for r in runs),
        "runs": runs,
    }


def load_lab_points(path: Path = LAB_POINTS) -> dict[str, Any]:
    if not path.exists():
        return {"machine": {}, "points": {}}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def compare(case: Case, lab: dict[str, Any], modelled: dict[str, Any]) -> dict[str, Any]:
    """Model over lab - 1 (the error) for the slowest and the median receiver."""
    return {
        "case": case.name,
        "lab_slowest_s": lab["slowest_s"],
        "model_slowest_s": modelled["slowest_s"],
        "slowest_error": modelled["slowest_s"] / lab["slowest_s"] - 1,
        "lab_median_s": lab["median_s"],
        "model_median_s": modelled["median_s"],
        "median_error": modelled["median_s"] / lab["median_s"] - 1,
    }
