"""``python -m zmqtransport.sim``: one modelled job start, its figures as JSON on the last line."""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import wire
from ..codec.tensors import EncodedTree
from ..serve.admission import Limits
from ..serve.scheduler import Scheduler
from ..serve.staged import Staged
from . import model
from .loop import Loop
from .nodes import STALL, TIMEOUT, Member, Net, Server, content

TENSOR_BYTES = 4 * model.MIB  # the benchmark's state: 4 MiB tensors
PACK_BELOW = 64 * 1024  # transport.DEFAULT_PACK_BELOW
HEADER_BYTES = 4096  # a header of that many tensors, about


def staged_state(mib: float, chunk_bytes: int | None = None) -> Staged:
    """The benchmark's state of ``mib`` MiB, cut as the source cuts it (``chunk_bytes``: the transport's option;
    None: :func:`wire.frame_bytes`)."""
    total = int(mib * model.MIB)
    storages = [TENSOR_BYTES] * (total // TENSOR_BYTES) + ([total % TENSOR_BYTES] if total % TENSOR_BYTES else [])
    chunk = wire.frame_bytes(total, PACK_BELOW) if chunk_bytes is None else chunk_bytes
    plan = wire.plan_chunks(storages, chunk, PACK_BELOW)
    return Staged(STEP_0, bytes(HEADER_BYTES), EncodedTree(skeleton=None), plan, None)


STEP_0 = 0


def host(name: str, mbit: float, latency: float, cores: model.Cores, tbf: bool = False) -> model.Host:
    """``tbf``: the link is a tbf-shaped veth of the lab, whose kernel costs CPU per byte (sim/model.py)."""
    bps = mbit * 1e6
    burst = model.TBF_BURST_BYTES if tbf else 0.0
    up = model.Link(bps, cpu_per_byte=model.TBF_SEND_PER_BYTE if tbf else 0.0, cores=cores, burst=burst)
    down = model.Link(bps, cpu_per_byte=model.TBF_RECV_PER_BYTE if tbf else 0.0, cores=cores, burst=burst)
    return model.Host(name, up, down, latency, cores)


def simulate(
    receivers: int,
    mib: float = 256.0,
    rate_mbit: float = 400.0,
    mixed: bool = False,
    kill: float = 0.0,
    liars: int = 0,
    seed: int = 0,
    latency: float = 0.25e-3,
    cores: int = 1,
    shared_cores: int = 0,
    relay: bool = True,
    source_transfers: int | None = None,
    *,
    slow_ranks: tuple[int, ...] | None = None,
    killed_ranks: tuple[int, ...] | None = None,
    kill_at: float = 0.4,
    lead: dict[int, float] | None = None,
    tbf: bool = False,
    chunk_bytes: int | None = None,
    measured_mbit: float | None = None,
    after_return: bool = True,
) -> dict[str, Any]:
    """One job start: a source and ``receivers`` receivers starting together. Returns the figures.

    ``cores``: cores per process (1: a receive's Python work holds the GIL); ``shared_cores``: all the
    processes share that many (the lab: one machine), instead. ``source_transfers``: the source's
    ``Limits.transfers`` (None: the default), to see a design with another limit.

    The lab's scenarios name their receivers (sim/validation.py): ``slow_ranks`` and ``killed_ranks``
    (0-based) replace the seed's draw of who is slow and who dies (``kill_at``: after that fraction of its
    messages); ``lead``: receiver -> seconds it asks before the others (the benchmark's ``lead_s``). Each
    row's ``own_seconds`` is its time from its own start, as the lab's receivers time themselves. ``tbf``:
    every link is one of the lab's tbf-shaped veths, which cost the kernel CPU per byte (sim/model.py).
    ``chunk_bytes``: the source's option of that name (None: unset, the frame follows the state's size).
    ``measured_mbit``: the source measured its uplink at that rate on a step before (a heal after the job's
    first step; ``serve.uplink``), so it judges whether a swarm pays for these receivers; None: nothing
    measured yet (a job start), the swarm engages. The source is told how many receive (torchft's
    ``dst_ranks``). ``after_return``: the receivers' ``relay_after_return`` (a member that is done serves the
    others until every receive has ended: torchft's ``disallow_checkpoint``); False: a short tail, then not.
    """
    rng = random.Random(seed)  # noqa: S311 (a model's draws, reproducible by seed; nothing secret)
    loop, started, cpu_started = Loop(), time.monotonic(), time.process_time()
    net = Net(loop)
    pool = model.Cores(shared_cores) if shared_cores else None

    def cores_for() -> model.Cores:
        return pool if pool is not None else model.Cores(cores)

    staged = staged_state(mib, chunk_bytes)
    staged.receivers = receivers
    state_bytes = wire.plan_bytes(staged.plan)
    source_host = host("10.0.0.1", rate_mbit, latency, cores_for(), tbf)
    limits = Limits() if source_transfers is None else Limits(transfers=source_transfers)
    # Relay tokens drawn by the seed too: past MAX_PEERS a member's pick of peers is seeded by its token.
    tokens = random.Random(f"tokens {seed}")  # noqa: S311 (the model's tokens guard nothing)
    scheduler = Scheduler(
        TIMEOUT, STALL, limits, make_token=lambda: tokens.randbytes(wire.RELAY_TOKEN_BYTES), is_local=lambda _: False
    )
    if measured_mbit is not None:
        scheduler.uplink.judged_rate = measured_mbit * 1e6 / 8
    source = Server(net, source_host, scheduler, staged)
    order = list(range(receivers))
    rng.shuffle(order)  # who is slow, who dies, who lies: drawn by the seed
    slow = set(order[: receivers // 4]) if mixed else set()
    killed = set(order[receivers // 4 : receivers // 4 + round(kill * receivers)])
    if slow_ranks is not None:
        slow = set(slow_ranks)
    if killed_ranks is not None:
        killed = set(killed_ranks)
    lead = lead or {}
    later = max(lead.values(), default=0.0)
    lying = set(order[-liars:]) if liars else set()
    directory: dict[str, Server] = {}
    members: list[Member] = []
    for i in range(receivers):
        name = f"10.1.{i // 250}.{i % 250 + 1}"
        h = host(name, rate_mbit / 4 if i in slow else rate_mbit, latency, cores_for(), tbf)
        server = None
        if relay:
            server = Server(net, h, Scheduler(TIMEOUT, STALL, is_local=lambda _: False), None, liar=i in lying)
            directory[name] = server
        members.append(Member(net, h, source, directory, server, kill_at if i in killed else None, after_return))
    starts: list[float] = []
    for i, member in enumerate(members):
        member.others = members
        # Requests reach the source in some order within a millisecond (torchft starts them together).
        starts.append(later - lead.get(i, 0.0) + rng.random() * 1e-3)
        loop.at(starts[-1], member.start)
    loop.run(TIMEOUT, lambda: all(m.finished for m in members))
    truth = {seq: content(seq) for seq in range(staged.messages)}
    rows: list[dict[str, Any]] = []
    for i, member in enumerate(members):
        out = member.outcome
        ideal = state_bytes * 8 / member.host.down.bps
        bit_exact = out.done_at is not None and out.landed == truth
        rows.append({
            "receiver": i,
            "mbit": member.host.down.bps / 1e6,
            "seconds": out.done_at,
            "own_seconds": None if out.done_at is None else out.done_at - starts[i],
            "over_ideal": None if out.done_at is None else out.done_at / ideal,
            "bit_exact": bit_exact,
            "killed": out.killed,
            "liar": i in lying,
            "failed": out.failed,
            "member": out.member,
            "from_source": sum(1 for s in out.sources.values() if s == source_host.name),
            "cpu_s": round(member.host.cpu, 4),
        })
    survivors = [r for r in rows if not r["killed"]]
    ratios = [r["over_ideal"] for r in survivors if r["over_ideal"] is not None]
    c = net.counters
    return {
        "receivers": receivers,
        "mib": mib,
        "rate_mbit": rate_mbit,
        "mixed": mixed,
        "kill": kill,
        "liars": liars,
        "seed": seed,
        "messages": staged.messages,
        "slowest_over_ideal": round(max(ratios), 4) if ratios else None,
        "median_over_ideal": round(sorted(ratios)[len(ratios) // 2], 4) if ratios else None,
        "upload_over_state": round(c.source_data_bytes / state_bytes, 4),
        "source_control_over_state": round(c.source_control_bytes / state_bytes, 4),
        "control_per_receiver": round(c.control_messages / receivers, 2),
        "source_control_per_receiver": round(c.source_control / receivers, 2),
        "control_by_kind_per_receiver": {k: round(v / receivers, 2) for k, v in sorted(c.by_kind.items())},
        "completed": sum(1 for r in rows if r["bit_exact"]),
        "members": sum(1 for r in rows if r["member"]),
        "survivors": len(survivors),
        "failed": sum(1 for r in rows if r["failed"]),
        "duplicates": c.duplicates,
        "planner_passes_per_receiver": round(c.planner_passes / receivers, 1),
        "source_cpu_s": round(source_host.cpu, 4),
        "max_receiver_cpu_s": round(max((r["cpu_s"] for r in rows), default=0.0), 4),
        "simulated_s": round(loop.now, 4),
        "events": loop.events,
        "wall_s": round(time.monotonic() - started, 2),
        "sim_cpu_s": round(time.process_time() - cpu_started, 2),  # the simulator's own CPU (wall_s: shared cores)
        "per_receiver": rows,
    }


PLOT_RECEIVERS = (1, 3, 7, 11, 16, 32, 64)
PlotCommand = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def main(argv: Sequence[str] | None = None, plot: PlotCommand | None = None) -> int:
    """``plot``: what ``--plot`` runs (sim/sweep.py; passed in by ``__main__``, which imports both, since the
    sweep runs :func:`simulate` and this module must not import it back)."""
    parser = argparse.ArgumentParser(prog="python -m zmqtransport.sim", description=__doc__)
    parser.add_argument("--receivers", type=int, help="N (required unless --plot)")
    parser.add_argument("--mib", type=float, default=256.0, help="state size (MiB, as 4 MiB tensors)")
    parser.add_argument("--rate-mbit", type=float, default=400.0, help="every host's up- and downlink")
    parser.add_argument("--mixed", action="store_true", help="a quarter of the receivers at a quarter of the rate")
    parser.add_argument("--kill", type=float, default=0.0, help="fraction of members killed at 40%% of their receive")
    parser.add_argument("--liars", type=int, default=0, help="members that claim everything, deliver nothing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency-ms", type=float, default=0.25, help="one way, per host")
    parser.add_argument("--cores", type=int, default=1, help="cores per process")
    parser.add_argument("--shared-cores", type=int, default=0, help="all processes share this many (the lab)")
    parser.add_argument("--no-relay", action="store_true", help="relay=False: every receiver from the source")
    parser.add_argument("--source-transfers", type=int, default=None,
                        help="the source's limit on data transfers at once (default: Limits' own)")
    parser.add_argument("--tbf", action="store_true",
                        help="links are the lab's tbf-shaped veths, whose kernel costs CPU per byte (sim/model.py)")
    parser.add_argument("--chunk-kib", type=int, default=None,
                        help="the source's chunk_bytes option, in KiB (default: unset, wire.frame_bytes decides)")
    parser.add_argument("--measured-mbit", type=float, default=None,
                        help="the source measured its uplink at this rate on a step before, and judges whether "
                             "a swarm pays (default: nothing measured, a job start: the swarm engages)")
    parser.add_argument("--no-after-return", action="store_true",
                        help="relay_after_return=False: a member stops serving as its receive returns")
    parser.add_argument("--json", action="store_true", help="the per-receiver rows too, before the summary")
    parser.add_argument("--verbose", action="store_true", help="the planners' log (peers dropped and why)")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="a PNG of the slowest receiver over ideal against N: the model at --plot-receivers "
                             "(equal links, the other options as given), the recorded lab points, HTTPTransport's N "
                             "(needs the plot extra: matplotlib)")
    parser.add_argument("--plot-receivers", default=",".join(map(str, PLOT_RECEIVERS)),
                        help="comma-separated N for --plot (default %(default)s)")
    parser.add_argument("--plot-no-lab-model", action="store_true",
                        help="--plot without the model run as the lab ran (its N, its two shared cores, tbf links)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    if args.plot is not None:
        if plot is None:
            parser.error("--plot is the command line's (python -m zmqtransport.sim)")
        return plot(args, parser)
    if args.receivers is None or args.receivers < 1:
        parser.error("--receivers must be given, at least 1")
    result = simulate(args.receivers, args.mib, args.rate_mbit, args.mixed, args.kill, args.liars, args.seed,
                      args.latency_ms / 1000, args.cores, args.shared_cores, not args.no_relay,
                      args.source_transfers, tbf=args.tbf,
                      chunk_bytes=None if args.chunk_kib is None else args.chunk_kib * 1024,
                      measured_mbit=args.measured_mbit, after_return=not args.no_after_return)
    rows = result.pop("per_receiver")
    if args.json:
        for row in rows:
            print(json.dumps(row))
    else:
        for key, value in result.items():
            print(f"{key:28} {value}", file=sys.stderr)
    print(json.dumps(result))
    return 0
