"""``python -m zmqtransport.sim --plot PATH``: the slowest receiver over the ideal against N (issue 35, item 6).

Three series on a log-N axis: the model (the real planner and scheduler, one core per process, the
design's view), the lab's shaped equal-links points recorded by ``scripts/sim_validate.py``
(``lab_points.json``: the slowest receiver's median time over the state's time at 400 Mbit/s), and
HTTPTransport's line: its source uploads the state once per receiver over one uplink as fast as a
receiver's downlink, so the last receiver ends at N times the ideal (slowest / ideal = N).

Needs matplotlib (the ``plot`` extra: ``pip install 'zmqtransport[plot]'``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import validation

EXTRA_HINT = "pip install 'zmqtransport[plot]' (matplotlib)"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def lab_series(points: dict[str, Any]) -> list[tuple[int, float]]:
    """(N, slowest over ideal) of the recorded shaped equal-links lab runs, by N."""
    series = []
    for point in points.values():
        if point.get("shaped") and point.get("links") == "equal" and "slowest_s" in point:
            ideal = point["mib"] * (1 << 20) * 8 / (validation.RATE_MBIT * 1e6)
            series.append((int(point["receivers"]), point["slowest_s"] / ideal))
    return sorted(series)


def require() -> None:
    """Raise :class:`PlotUnavailable` now, before a sweep of minutes, if matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(f"--plot needs matplotlib, which is not installed: {EXTRA_HINT}") from None


def draw(
    path: Path,
    model: Sequence[dict[str, Any]],
    lab: Sequence[tuple[int, float]],
    title: str,
    model_lab: Sequence[dict[str, Any]] = (),
) -> None:
    """``model``: the simulator's summaries (``receivers``, ``slowest_over_ideal``, ``completed``);
    ``model_lab``: the same at the lab's N with the lab's two shared cores (the validation's view)."""
    require()
    import matplotlib

    matplotlib.use("Agg")  # no screen: draw into a file
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.8))
    every = sorted({*(int(m["receivers"]) for m in model), *(n for n, _ in lab)})
    if every:
        axes.plot(every, every, "--", color="grey", label="HTTPTransport: N (the source uploads the state N times)")
    done = [m for m in model if m["slowest_over_ideal"] is not None]
    axes.plot([m["receivers"] for m in done], [m["slowest_over_ideal"] for m in done], "o-", color="C0",
              label="model (real planner; one core per process)")
    for m in done:
        if m["completed"] < m["receivers"]:  # say so on the point: the ratio is over those that completed
            axes.annotate(f"{m['completed']}/{m['receivers']} completed", (m["receivers"], m["slowest_over_ideal"]),
                          textcoords="offset points", xytext=(4, -12), fontsize=7, color="C3")
    if model_lab:
        axes.plot([m["receivers"] for m in model_lab], [m["slowest_over_ideal"] for m in model_lab], "x",
                  color="C2", markersize=8, label="model on the lab's 2 shared cores")
    if lab:
        axes.plot([n for n, _ in lab], [r for _, r in lab], "s", color="C1", markersize=7,
                  label="lab (400 Mbit/s, 64 MiB; 15 and up 16 MiB; all on 2 shared cores)")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log", base=2)
    ticks: list[int] = []
    for n in every:  # a tick per N, but none crowding the previous one (15 beside 16)
        if not ticks or n / ticks[-1] > 1.2:
            ticks.append(n)
    axes.set_xticks(ticks, [str(n) for n in ticks])
    top = max([*(m["slowest_over_ideal"] for m in done), *(r for _, r in lab), *every, 1.0])
    levels = [2**k for k in range(0, 12) if 2**k <= 2 * top]
    axes.set_yticks(levels, [f"{v:g}x" for v in levels])
    axes.minorticks_off()
    axes.set_xlabel("receivers N (one source, equal links)")
    axes.set_ylabel("slowest receiver / ideal")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
