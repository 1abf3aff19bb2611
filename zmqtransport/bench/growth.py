"""How cold receive times grow with the state: the run's uniform scenarios of different sizes."""

from __future__ import annotations

from collections.abc import Sequence

from .layouts import UNIFORM
from .runner import ScenarioResult


def growth_series(results: Sequence[ScenarioResult]) -> list[ScenarioResult]:
    """The uniform one-receiver loopback results of different sizes (smallest first), if there are two or more."""
    series = [
        r for r in results if r.scenario.layout == UNIFORM and r.scenario.lab is None and r.scenario.receivers == 1
    ]
    sizes = {r.scenario.total_bytes for r in series}
    if len(sizes) < 2:
        return []
    by_size = {r.scenario.total_bytes: r for r in series}  # the last run of each size
    return [by_size[size] for size in sorted(sizes)]


def seconds_per_gib(result: ScenarioResult, method: str) -> float:
    return result.summary[method].slowest_s / (result.scenario.total_bytes / (1 << 30))
