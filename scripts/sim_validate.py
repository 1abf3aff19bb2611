#!/usr/bin/env python3
"""Issue 35, item 2: run the validation's cases in the lab and record their figures; or compare the model.

    python scripts/sim_validate.py lab [--reps 2] [--only NAME ...] [--large] [--merge]  # root; writes lab_points.json
    python scripts/sim_validate.py compare [--only NAME ...] [--large]           # the model beside the recorded points

``lab`` runs each case (zmqtransport/sim/validation.py) through the benchmark (``zmq-fresh``, fresh receiver
processes per trial, the lab's network namespaces) and merges, per case, every trial's per-receiver seconds,
the busiest receiver's CPU, what the source sent, and the machine's ``uptime`` load before and after, into
``zmqtransport/sim/lab_points.json`` (medians over the trials of the slowest and the median receiver).
``compare`` prints the model's figures beside them, error in %. Run from the repository root with the
package importable (``PYTHONPATH=$PWD``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from zmqtransport.bench.config import Kill, Knobs, LabSpec, Scenario
from zmqtransport.bench.report import machine_description
from zmqtransport.bench.runner import run_scenario
from zmqtransport.sim import validation
from zmqtransport.sim.validation import LAB_POINTS, Case

MIB = 1 << 20


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def scenario_of(case: Case, mib: float, reps: int) -> Scenario:
    if case.shaped:
        spec = LabSpec(rate_mbit=validation.RATE_MBIT, host_rates=tuple((r, case.rate_of(r)) for r in case.slow))
    else:
        spec = LabSpec(shaped=False)
    kill = None
    if case.killed is not None:
        kill = Kill(rank=case.killed, at_fraction=validation.KILL_AT, lead_s=validation.KILL_LEAD_S)
    return Scenario(
        f"val-{case.name}", int(mib * MIB), 4 * MIB, receivers=case.receivers, methods=("zmq-fresh",), reps=reps,
        lab=spec, kill=kill,
    )  # fmt: skip


def run_lab(case: Case, mib: float, reps: int) -> dict[str, Any]:
    """``reps`` trials, each a run of its own (a new lab): a trial whose receive fails is recorded, not fatal."""
    scenario = scenario_of(case, mib, 1)
    before = uptime()
    started = time.monotonic()
    trials: list[dict[str, Any]] = []
    failures: list[str] = []
    for _ in range(reps):
        try:
            result = run_scenario(scenario, Knobs(), lambda line: print(line, file=sys.stderr))
        except Exception as error:  # noqa: BLE001 - a receive that fails in the lab is a finding, recorded
            failures.append(f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}")
            print(f"{case.name}: trial failed: {failures[-1]}", file=sys.stderr)
            continue
        for trial in result.trials:
            if any(trial.errors):
                failures.append(f"receive error: {trial.errors}")
                continue
            trials.append({
                "seconds": [round(s, 4) for s in trial.seconds],
                "killed": trial.killed,
                **{k: round(v, 4) for k, v in validation.summarize_times(trial.seconds).items()},
                "recv_cpu_max_s": round(max(trial.recv_cpu, default=0.0), 4),
                # Each receiver's process from just before the receives to the end of the trial (relaying
                # for others after its own receive included), and the source's from its release.
                "recv_process_cpu_s": [round(c, 4) for c in trial.recv_process_cpu],
                "source_cpu_s": round(trial.send_cpu, 4),
                "source_sent": sum(trial.source_sent),
                "uptime": uptime(),
            })
    after = uptime()
    total = scenario.total_bytes
    point: dict[str, Any] = {
        "case": case.name,
        "receivers": case.receivers,
        "links": case.links,
        "shaped": case.shaped,
        "mib": mib,
        "trials": trials,
        "failed_trials": failures,
        "uptime_before": before,
        "uptime_after": after,
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wall_s": round(time.monotonic() - started, 1),
    }
    return summarized(point, total)


def summarized(point: dict[str, Any], total: int) -> dict[str, Any]:
    """``point`` with the medians over its trials (of ``total`` state bytes), if any completed."""
    trials = point["trials"]
    if trials:
        point.update({
            "slowest_s": round(statistics.median(t["slowest_s"] for t in trials), 4),
            "median_s": round(statistics.median(t["median_s"] for t in trials), 4),
            "sent_over_state": round(statistics.median(t["source_sent"] for t in trials) / total, 4),
            "recv_cpu_max_s": round(statistics.median(t["recv_cpu_max_s"] for t in trials), 4),
            "recv_process_cpu_max_s": round(statistics.median(max(t["recv_process_cpu_s"]) for t in trials), 4),
            "recv_process_cpu_median_s": round(
                statistics.median(statistics.median(t["recv_process_cpu_s"]) for t in trials), 4
            ),
            "source_cpu_s": round(statistics.median(t["source_cpu_s"] for t in trials), 4),
        })
    return point


def merged(before: dict[str, Any], point: dict[str, Any], total: int) -> dict[str, Any]:
    """``point``'s trials added to an earlier run's of the same case (``--merge``): the medians over all."""
    if before.get("mib") != point["mib"]:
        return point
    point["trials"] = before["trials"] + point["trials"]
    point["failed_trials"] = before["failed_trials"] + point["failed_trials"]
    point["when"] = f"{before['when']}; {point['when']}"
    point["uptime_before"] = before["uptime_before"]
    point["wall_s"] = round(before["wall_s"] + point["wall_s"], 1)
    return summarized(point, total)


def chosen(args: argparse.Namespace) -> list[Case]:
    every = validation.large_cases() if args.large else validation.cases()
    return [validation.by_name(n) for n in args.only] if args.only else every


def lab(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise SystemExit("the lab needs root (network namespaces)")
    for case in chosen(args):
        mib = args.mib if args.mib is not None else validation.MIB
        point = run_lab(case, mib, args.reps)
        data = validation.load_lab_points(args.out)  # re-read: rows run one at a time are merged
        before = data.get("points", {}).get(case.name)
        if args.merge and before is not None:
            point = merged(before, point, int(mib * MIB))
        machine = machine_description()
        data["machine"] = {"cpus": machine["cpus"], "cpu": machine["cpu_model"], "load": "see each trial's uptime"}
        data["command"] = "python scripts/sim_validate.py lab --reps N [--only CASE] [--merge]"
        data.setdefault("points", {})[case.name] = point
        args.out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(json.dumps({k: v for k, v in point.items() if k != "trials"}))
    return 0


def compare(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.ERROR)  # the planners' warnings (peers dropped) are the model's, not news
    points = validation.load_lab_points(args.out)["points"]
    print("| case | lab slowest s | model | error | lab median s | model | error | lab sent/state | model "
          "| lab recv CPU-s (max) | model | lab source CPU-s | model |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for case in chosen(args):
        if case.name not in points or "slowest_s" not in points[case.name]:
            continue
        measured = points[case.name]
        modelled = validation.model_point(case, measured["mib"])
        row = validation.compare(case, measured, modelled)
        print(
            f"| {case.name} | {row['lab_slowest_s']:.3f} | {row['model_slowest_s']:.3f} | {row['slowest_error']:+.0%} "
            f"| {row['lab_median_s']:.3f} | {row['model_median_s']:.3f} | {row['median_error']:+.0%} "
            f"| {measured['sent_over_state']:.2f} | {modelled['upload_over_state']:.2f} "
            f"| {measured.get('recv_process_cpu_max_s', float('nan')):.2f} | {modelled['max_receiver_cpu_s']:.2f} "
            f"| {measured.get('source_cpu_s', float('nan')):.2f} | {modelled['source_cpu_s']:.2f} |",
            flush=True,
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["lab", "compare"])
    parser.add_argument("--reps", type=int, default=2, help="trials per case (lab)")
    parser.add_argument("--only", nargs="*", default=[], help="case names (e.g. shaped-equal-7)")
    parser.add_argument("--large", action="store_true", help="the item-4 cases (as many receivers as fit)")
    parser.add_argument("--mib", type=float, default=None, help="state size (default the validation's)")
    parser.add_argument("--out", type=Path, default=LAB_POINTS)
    parser.add_argument("--merge", action="store_true", help="lab: add the trials to a case's recorded ones")
    args = parser.parse_args()
    return lab(args) if args.what == "lab" else compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
