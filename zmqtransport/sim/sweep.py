"""``python -m zmqtransport.sim --plot PATH``: the model over N, beside the lab's recorded points (sim/plot.py)."""

from __future__ import annotations

import argparse
import json
import sys

from . import plot, validation
from .cli import simulate


def plot_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``--plot PATH``: the sweep over ``--plot-receivers``, the recorded lab points, the picture."""
    try:
        plot.require()  # before a sweep of minutes
        counts = sorted({int(n) for n in args.plot_receivers.split(",") if n.strip()})
    except plot.PlotUnavailable as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ValueError:
        parser.error(f"--plot-receivers: not a list of integers: {args.plot_receivers!r}")
    if not counts or counts[0] < 1:
        parser.error("--plot-receivers: each N at least 1")
    points = []
    for n in counts:
        result = simulate(n, args.mib, args.rate_mbit, False, 0.0, 0, args.seed, args.latency_ms / 1000, args.cores,
                          args.shared_cores, not args.no_relay, args.source_transfers, tbf=args.tbf,
                          after_return=not args.no_after_return)
        result.pop("per_receiver")
        points.append(result)
        print(json.dumps(result), flush=True)
    recorded = validation.load_lab_points()["points"]
    lab = plot.lab_series(recorded)
    shared: list[dict[str, object]] = []
    # The model as the lab ran: the same state, its two shared cores, its tbf links.
    for n in [] if args.plot_no_lab_model else sorted({n for n, _ in lab}):
        mib = next(p["mib"] for p in recorded.values() if p["receivers"] == n and p["links"] == "equal")
        result = simulate(n, mib, validation.RATE_MBIT, seed=args.seed, latency=validation.LAB_LATENCY_S,
                          shared_cores=validation.LAB_CORES, tbf=True)
        result.pop("per_receiver")
        shared.append(result)
    title = (f"one source, N receivers: {args.mib:g} MiB at {args.rate_mbit:g} Mbit/s (model), "
             f"seed {args.seed}")
    plot.draw(args.plot, points, lab, title, shared)
    print(f"wrote {args.plot}", file=sys.stderr)
    return 0
