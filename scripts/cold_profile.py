"""Profile one cold receive: a fresh receiver process, its first recv_checkpoint.

A sender process stages a state dict once; each trial spawns a fresh receiver
process that imports, builds its transport (and, in place, its own touched
tensors), then times its first receive with the process's resource counters
(minor page faults, user and system CPU of all its threads, context switches)
and, with ``--cprofile``, a cProfile of the receiving thread.

    PYTHONPATH=$PWD python scripts/cold_profile.py --mode fresh --trials 3
    PYTHONPATH=$PWD python scripts/cold_profile.py --mode inplace --cprofile 25
    PYTHONPATH=$PWD python scripts/cold_profile.py --mode fresh --perf /tmp/perf.data
    PYTHONPATH=$PWD python scripts/cold_profile.py --mode fresh --layout transformer --total 3.5G

``--perf`` records the receiver with ``perf record -g`` over its receive only.
Extra ``ZMQTransport`` options: ``--option window=32`` (both sides). ``--ab-malloc``
alternates trials without and with :func:`zmqtransport.buffers.settle_malloc_thresholds`;
``--ab-set module.CONSTANT=int`` alternates trials without and with that setting.

Each trial also prints the receive's phases (header, landing: allocation and
the prefault start, data, build), what the prefault workers did (bytes
faulted, skipped because the data got there first, overtaken by the data
while faulting) and how idle the machine's CPUs were during the receive.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import multiprocessing as mp
import os
import pstats
import resource
import signal
import subprocess
import time
from datetime import timedelta
from typing import Any

TIMEOUT = timedelta(seconds=120)


def _options(pairs: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        name, _, raw = pair.partition("=")
        options[name] = int(raw) if raw.lstrip("-").isdigit() else raw == "true" if raw in ("true", "false") else raw
    return options


def sender(conn: Any, layout: Any, options: dict[str, Any]) -> None:
    from zmqtransport import ZMQTransport
    from zmqtransport.bench.payload import make_tensors, stamp

    tensors = make_tensors(layout.shapes, 0.0)
    stamp(tensors, 1)
    state = layout.state(tensors)
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1", advertise_host="127.0.0.1", **options)
    transport.send_checkpoint([1], 1, state, TIMEOUT)
    conn.send(transport.metadata())
    while conn.recv() == "usage":  # until the parent is done
        conn.send(_usage())
    transport.shutdown()


def _usage() -> tuple[float, float, int, int, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime, ru.ru_minflt, ru.ru_nvcsw, ru.ru_nivcsw


def _machine_idle() -> tuple[float, float]:
    """Idle and total CPU seconds of the whole machine so far (/proc/stat, all CPUs)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (ticks[3] + ticks[4]) / hz, sum(ticks[:8]) / hz


def _instrument(phases: dict[str, Any]) -> None:
    """Record the receive's phase boundaries and the prefaulter's counts into ``phases``."""
    from zmqtransport import buffers
    from zmqtransport.fetch import receive as receiver

    land, build, close = receiver.land, receiver.build, buffers.Prefaulter.close

    def timed_land(*args: Any, **kwargs: Any) -> Any:
        phases["land0"] = time.perf_counter()
        try:
            return land(*args, **kwargs)
        finally:
            phases["land1"] = time.perf_counter()

    def timed_build(*args: Any, **kwargs: Any) -> Any:
        phases["build0"] = time.perf_counter()
        return build(*args, **kwargs)

    def counted_close(self: Any) -> None:
        close(self)
        phases["counts"] = self.counts

    receiver.land, receiver.build = timed_land, timed_build  # type: ignore[assignment]
    buffers.Prefaulter.close = counted_close  # type: ignore[method-assign]


def _phase_text(phases: dict[str, Any], started: float, ended: float) -> str:
    if "land0" not in phases:
        return ""
    text = (
        f"phases s: header {phases['land0'] - started:.3f} land {phases['land1'] - phases['land0']:.3f} "
        f"data {phases['build0'] - phases['land1']:.3f} build {ended - phases['build0']:.3f}"
    )
    counts = phases.get("counts")
    if counts is not None:
        mib = 1 << 20
        text += (
            f"; prefault MiB: faulted {counts.faulted // mib} skipped {counts.skipped // mib} "
            f"overtaken {counts.overtaken // mib}"
        )
    return text


def receiver(
    conn: Any,
    layout: Any,
    metadata: str,
    mode: str,
    profile: int,
    perf: str,
    options: dict,
    sets: list,
    settle: bool = True,
) -> None:
    import importlib

    from zmqtransport import ZMQTransport
    from zmqtransport.bench.payload import check, make_tensors

    phases: dict[str, Any] = {}
    _instrument(phases)
    if not settle:  # the receive as before issue 16: glibc's thresholds left at their start values
        from zmqtransport import buffers

        buffers.settle_malloc_thresholds = lambda: False  # type: ignore[assignment]
    for name, value in sets:  # experiments: module constants set in the receiver only
        module, _, attr = name.rpartition(".")
        setattr(importlib.import_module(f"zmqtransport.{module}"), attr, value)
    state = None
    if mode == "inplace":
        state = layout.state(make_tensors(layout.shapes, -1.0))
    into = (lambda: state) if state else None
    host = "127.0.0.1"
    transport: ZMQTransport[Any] = ZMQTransport(
        TIMEOUT, bind_host=host, advertise_host=host, state_dict=into, **options
    )
    recorder = None
    if perf:
        command = ["perf", "record", "-e", "cpu-clock", "-g", "-q", "-o", perf, "-p", str(os.getpid())]
        recorder = subprocess.Popen(command)
        time.sleep(1.0)  # perf attaches
    profiler = cProfile.Profile() if profile else None
    before = _usage()
    idle_before = _machine_idle()
    started = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    result = transport.recv_checkpoint(0, metadata, 1, TIMEOUT)
    if profiler is not None:
        profiler.disable()
    ended = time.perf_counter()
    seconds = ended - started
    after = _usage()
    idle_after = _machine_idle()
    idle = (idle_after[0] - idle_before[0]) / max(idle_after[1] - idle_before[1], 1e-9)
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait()
    check(layout.tensors_in(result), 1, len(layout.paths))
    text = f"  {_phase_text(phases, started, ended)}; machine idle {idle:.0%}\n"
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(profile)
        text += out.getvalue()
    delta = [b - a for a, b in zip(before, after, strict=True)]
    conn.send((seconds, delta, text))
    transport.shutdown()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["fresh", "inplace"], default="fresh")
    parser.add_argument("--count", type=int, default=256, help="uniform: tensors")
    parser.add_argument("--tensor", type=int, default=4 << 20, help="uniform: bytes per tensor")
    parser.add_argument("--layout", choices=["uniform", "transformer"], default="uniform")
    parser.add_argument("--total", default="3.5G", help="transformer: about this many bytes with Adam's moments")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--cprofile", type=int, default=0, help="print the top N functions of the last trial")
    parser.add_argument("--perf", default="", help="perf.data path: the receiver over the last trial's receive")
    parser.add_argument("--perf-sender", default="", help="perf.data path: the sender over the last trial")
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument("--option", action="append", default=[])
    parser.add_argument("--set", action="append", default=[], help="module.CONSTANT=int in the receiver")
    parser.add_argument("--ab-malloc", action="store_true", help="alternate trials without and with the malloc settle")
    parser.add_argument(
        "--ab-set", action="append", default=[], help="module.CONSTANT=int only in odd trials (alternating A/B)"
    )
    return parser


def _trial(args: argparse.Namespace, trial: int, ctx: Any, parent: Any, source: Any, metadata: str) -> None:
    last = trial == args.trials - 1
    here, there = ctx.Pipe()
    settle = not (args.ab_malloc and trial % 2 == 0)
    sets = list(_options(args.set).items())
    if trial % 2:
        sets += list(_options(args.ab_set).items())
    arguments = (
        there,
        _layout(args),
        metadata,
        args.mode,
        args.cprofile if last else 0,
        args.perf if last else "",
        _options(args.option),
        sets,
        settle,
    )
    proc = ctx.Process(target=receiver, args=arguments)
    parent.send("usage")
    sender_before = parent.recv()
    recorder = None
    if last and args.perf_sender:
        command = ["perf", "record", "-e", "cpu-clock", "-g", "-q", "-o", args.perf_sender, "-p", str(source.pid)]
        recorder = subprocess.Popen(command)
    proc.start()
    seconds, (user, system, faults, vol, invol), text = here.recv()
    proc.join()
    if recorder is not None:
        recorder.send_signal(signal.SIGINT)
        recorder.wait()
    parent.send("usage")
    sender_after = parent.recv()
    sender_cpu = sum(sender_after[:2]) - sum(sender_before[:2])
    label = " B" if args.ab_set and trial % 2 else " A" if args.ab_set else ""
    print(
        f"{args.mode}{'' if settle else ' unsettled'}{label} trial {trial}: {seconds:.3f} s, "
        f"cpu user {user:.3f} sys {system:.3f}, minor faults {faults}, ctx switches {vol}+{invol}; "
        f"sender cpu {sender_cpu:.3f} (its receiver's set-up included)",
        flush=True,
    )
    if text:
        print(text.rstrip("\n"))


def _layout(args: argparse.Namespace) -> Any:
    from zmqtransport.bench import layouts
    from zmqtransport.bench.config import parse_size

    if args.layout == "transformer":
        return layouts.transformer(parse_size(args.total))
    return layouts.uniform(args.count * args.tensor, args.tensor)


def main() -> None:
    args = _parser().parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    source = ctx.Process(target=sender, args=(child, _layout(args), _options(args.option)))
    source.start()
    metadata = parent.recv()
    try:
        for trial in range(args.trials):
            _trial(args, trial, ctx, parent, source, metadata)
            time.sleep(args.settle)
    finally:
        parent.send("done")
        source.join()


if __name__ == "__main__":
    main()
