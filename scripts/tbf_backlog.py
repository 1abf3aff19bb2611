#!/usr/bin/env python3
"""How full the lab's shaped queues get: tbf's backlog on each switch port while a command runs.

The simulator's shaped links hold what TCP keeps in a tbf queue, not tbf's
limit (``zmqtransport/sim/model.py``, ``TBF_QUEUE_MESSAGES``; docs/sim.md, "The
model's shaped queue, measured"). This reads that backlog: it runs the command
given after ``--`` (a lab benchmark, as root), and every ``--every`` seconds
while it runs reads ``tc -s qdisc`` in each lab switch namespace (the port
toward host N is ``hNn0``: what waits for host N's downlink). Read-only: it
changes nothing in the lab, and stops with the command or at ``--timeout``.

    python scripts/tbf_backlog.py -- python -m zmqtransport.bench --scenario lab-mixed --methods zmq-fresh --reps 2
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time

from zmqtransport.lab import switch_namespaces

_QDISC = re.compile(r"qdisc tbf \S+ dev (\S+)")
_BACKLOG = re.compile(r"backlog (\d+)b")


def backlogs(text: str) -> dict[str, int]:
    """Bytes waiting in each tbf qdisc of ``tc -s qdisc show`` output, by device."""
    found: dict[str, int] = {}
    device = None
    for line in text.splitlines():
        if (qdisc := _QDISC.match(line)) is not None:
            device = qdisc.group(1)
        elif line.lstrip().startswith("qdisc"):
            device = None  # another kind of qdisc: not a shaped queue
        elif device is not None and (backlog := _BACKLOG.search(line)) is not None:
            found[device] = int(backlog.group(1))
            device = None
    return found


def summary(samples: dict[str, list[int]]) -> list[str]:
    """Per port: samples, how many found a queue, and its median, 90th percentile and largest (KiB)."""
    lines = []
    for device, values in sorted(samples.items()):
        queued = sorted(v for v in values if v > 0)
        if not queued:
            lines.append(f"{device}: {len(values)} samples, never a queue")
            continue
        median, p90 = queued[len(queued) // 2], queued[int(len(queued) * 0.9)]
        lines.append(
            f"{device}: {len(values)} samples, {len(queued)} with a queue: median {median / 1024:.0f} KiB, "
            f"90th percentile {p90 / 1024:.0f} KiB, largest {queued[-1] / 1024:.0f} KiB"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=0.03, help="seconds between readings")
    parser.add_argument("--timeout", type=float, default=600.0, help="stop the command after this many seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command to run (a lab benchmark)")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    samples: dict[str, list[int]] = {}
    child = subprocess.Popen(command)
    deadline = time.monotonic() + args.timeout
    try:
        while child.poll() is None and time.monotonic() < deadline:
            for switch in switch_namespaces():
                shown = subprocess.run(
                    ["tc", "-n", switch, "-s", "qdisc", "show"], capture_output=True, text=True, check=False
                )
                for device, queued in backlogs(shown.stdout).items():
                    samples.setdefault(device, []).append(queued)
            time.sleep(args.every)
    finally:
        if child.poll() is None:
            child.terminate()
        child.wait(timeout=30)
    print("\n".join(summary(samples)))
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
