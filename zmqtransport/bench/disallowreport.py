"""Issue 23 in the benchmark: ``disallow_checkpoint`` mid-transfer, then a mutation (``scenario.disallow``).

Per method: how long the source's ``disallow_checkpoint`` held it (median and
slowest of the trials), what the running receives could still ask for at the
call and what it copied for them (ZMQTransport's ``last_disallow_stats``:
``needed_bytes``, ``snapshot_bytes``; less is copied than needed where the
network sends the rest meanwhile), what one memcpy of the needed bytes into
fresh memory takes in the same process (once the receives are done), and in how many trials
every receiver got the staged bytes (every element checked after the source
added to every tensor).
"""

from __future__ import annotations

from .runner import ScenarioResult

_MIB = float(1 << 20)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def disallow_table(result: ScenarioResult) -> tuple[str, list[list[str]], list[str]]:
    """The disallow table of one scenario with a disallow: its title, rows (header first) and notes."""
    plan = result.scenario.disallow
    assert plan is not None
    rows = [["method", "receive s", "disallow s", "slowest", "needed MiB", "copied MiB", "memcpy s", "staged bytes"]]
    for entry in result.summary.values():
        rows.append(
            [
                entry.method,
                _seconds(entry.slowest_s),
                _seconds(entry.disallow_s),
                _seconds(entry.disallow_max_s),
                f"{entry.needed_bytes / _MIB:.1f}",
                f"{entry.snapshot_bytes / _MIB:.1f}",
                _seconds(entry.memcpy_s) if entry.needed_bytes else "-",
                f"{entry.exact_trials}/{result.scenario.reps}",
            ]
        )
    title = (
        f"disallow_checkpoint {plan.at_s:g} s into the receives, then +{plan.add:g} to every tensor "
        "(disallow s: the source held; staged bytes: trials in which every receiver got them, every element checked)"
    )
    notes = [f"first failure, {e.method}: {e.error[:300]}" for e in result.summary.values() if e.error]
    return title, rows, notes
