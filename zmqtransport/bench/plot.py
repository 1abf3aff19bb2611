"""A picture of one fan-out (``--plot FILE``): each receiver's bytes over time, and who served whom.

Drawn for the median trial (by its slowest receiver) of the first
several-receiver lab scenario, for the first method that reported progress
(ZMQTransport's). Left: bytes landed over time per receiver, from the first
receiver's start (a receiver that asked later starts later). Right: the lab's
hosts in a ring, an arrow per edge that carried bytes, as wide as its share
of the state, labelled in MiB (from each receiver's ``stats.paths``).

Needs matplotlib (the ``plot`` extra: ``pip install 'zmqtransport[plot]'``);
without it nothing is drawn and the caller prints the same edges as a table
(:func:`edge_table`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .relayreport import host_label
from .runner import ScenarioResult, Trial

_MIB = float(1 << 20)
EXTRA_HINT = "pip install 'zmqtransport[plot]' (matplotlib)"


def chosen_trial(results: Sequence[ScenarioResult]) -> tuple[ScenarioResult, Trial] | None:
    """The run and trial a plot shows: the median trial of the first fan-out with timelines."""
    for result in results:
        lab = result.scenario.lab
        if lab is None or not lab.shaped or result.scenario.receivers < 2:  # unshaped links have no ideal to draw
            continue
        for method in result.scenario.methods:
            trials = [t for t in result.trials if t.method == method and any(t.timelines)]
            if trials:
                ordered = sorted(trials, key=lambda trial: max(trial.seconds))
                return result, ordered[len(ordered) // 2]
    return None


def edges(result: ScenarioResult, trial: Trial) -> dict[tuple[str, str], int]:
    """(sender, receiver) -> bytes, by lab host label (``src``, ``r1``...), for the trial's survivors."""
    survivors = [r for r in range(1, result.scenario.receivers + 1) if r not in trial.killed]
    flows: dict[tuple[str, str], int] = {}
    for rank, paths in zip(survivors, trial.recv_paths, strict=True):
        for endpoint, nbytes in paths.items():
            key = (host_label(endpoint), f"r{rank}")
            flows[key] = flows.get(key, 0) + nbytes
    return flows


def edge_table(results: Sequence[ScenarioResult]) -> str:
    """The edges of the trial a plot would show, as text (no matplotlib needed)."""
    chosen = chosen_trial(results)
    if chosen is None:
        return ""
    result, trial = chosen
    flows = sorted(edges(result, trial).items())
    rows = [f"{sender} -> {receiver}: {nbytes / _MIB:.1f} MiB" for (sender, receiver), nbytes in flows]
    title = f"who served whom, [{result.scenario.name}] {trial.method} trial {trial.trial} (median):"
    return "\n".join([title, *(f"  {row}" for row in rows)])


def plot_fanout(results: Sequence[ScenarioResult], path: str) -> tuple[bool, str]:
    """Draw the picture into ``path`` (PNG, SVG, PDF: by its ending); whether it was drawn, and what was done."""
    chosen = chosen_trial(results)
    if chosen is None:
        return False, "--plot: no several-receiver lab scenario with ZMQTransport's progress in this run"
    try:
        import matplotlib

        matplotlib.use("Agg")  # no screen: draw into a file
        import matplotlib.pyplot as plt
    except ImportError:
        return False, f"--plot: matplotlib is not installed ({EXTRA_HINT}); the edges are printed instead"
    result, trial = chosen
    figure, (timeline, graph) = plt.subplots(1, 2, figsize=(13, 5.5))
    _draw_timelines(timeline, result, trial)
    _draw_edges(graph, result, trial)
    figure.suptitle(
        f"{result.scenario.name}: {trial.method}, trial {trial.trial} (median of {result.scenario.reps}); "
        f"{result.scenario.total_bytes / _MIB:.0f} MiB to {result.scenario.receivers} receivers"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True, f"--plot: drew {result.scenario.name} / {trial.method} trial {trial.trial} into {path}"


def _draw_timelines(axes: Any, result: ScenarioResult, trial: Trial) -> None:
    scenario = result.scenario
    lab = scenario.lab
    assert lab is not None
    survivors = [r for r in range(1, scenario.receivers + 1) if r not in trial.killed]
    for rank, points in zip(survivors, trial.timelines, strict=True):
        if not points:
            continue
        # Receivers other than the first asked scenario.lead_s later (see Scenario.lead_s).
        offset = scenario.lead_s if rank != 1 else 0.0
        times = [offset + t for t, _ in points]
        label = f"r{rank} ({lab.rate_of(rank):g} Mbit/s)"
        axes.plot(times, [nbytes / _MIB for _, nbytes in points], label=label)
    for rank in survivors:
        ideal = lab.ideal_s(scenario.total_bytes, rank) + (scenario.lead_s if rank != 1 else 0.0)
        axes.axvline(ideal, linestyle=":", linewidth=0.8, color="grey")
    axes.set_xlabel("seconds from the first receiver's request (dotted: each link's ideal)")
    axes.set_ylabel("MiB landed")
    axes.set_title("each receiver's bytes over time")
    axes.legend(loc="lower right")


def _draw_edges(axes: Any, result: ScenarioResult, trial: Trial) -> None:
    flows = edges(result, trial)
    names = ["src", *(f"r{rank}" for rank in range(1, result.scenario.receivers + 1))]
    angle = {name: math.pi / 2 - 2 * math.pi * i / len(names) for i, name in enumerate(names)}
    where = {name: (math.cos(a), math.sin(a)) for name, a in angle.items()}
    total = result.scenario.total_bytes
    for (sender, receiver), nbytes in flows.items():
        if sender not in where or receiver not in where:
            continue
        (x0, y0), (x1, y1) = where[sender], where[receiver]
        width = 0.5 + 6.0 * nbytes / total
        axes.annotate(
            "",
            xy=(x1 * 0.88, y1 * 0.88),
            xytext=(x0 * 0.88, y0 * 0.88),
            arrowprops={"arrowstyle": "-|>", "lw": width, "alpha": 0.6, "connectionstyle": "arc3,rad=0.12"},
        )
        # Along the arrow, nearer its head, and to the side its arc bends to: the two
        # directions of one pair of hosts get their labels on opposite sides.
        dx, dy = x1 - x0, y1 - y0
        norm = math.hypot(dx, dy) or 1.0
        at = (x0 + 0.6 * dx + 0.1 * dy / norm, y0 + 0.6 * dy - 0.1 * dx / norm)
        axes.text(at[0] * 0.88, at[1] * 0.88, f"{nbytes / _MIB:.0f}", fontsize=8, ha="center", va="center")
    lab = result.scenario.lab
    assert lab is not None
    for name, (x, y) in where.items():
        rate = lab.rate_of(0 if name == "src" else int(name[1:]))
        box = {"boxstyle": "round", "fc": "white"}
        axes.text(x, y, f"{name}\n{rate:g} Mbit/s", ha="center", va="center", fontsize=9, bbox=box)
    axes.set_title(f"who served whom (MiB); the source's NIC sent {sum(trial.source_sent) / _MIB:.0f} MiB")
    axes.set_xlim(-1.3, 1.3)
    axes.set_ylim(-1.3, 1.3)
    axes.set_aspect("equal")
    axes.axis("off")
