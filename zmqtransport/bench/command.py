"""The benchmark's command line: ``python -m zmqtransport.bench`` and ``zmqtransport bench``."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from .. import lab
from .config import (
    DEFAULT_SETTLE_S,
    FAST_PRESETS,
    GROWTH_PRESETS,
    LAB_PRESETS,
    LARGE_PRESETS,
    LOOPBACK_PRESETS,
    PRESETS,
    RELAY_PRESETS,
    ROGUE_PRESETS,
    Knobs,
    LabSpec,
    Profiling,
    Scenario,
    exact_size,
    numpy_available,
    parse_option,
    parse_size,
    settle_for,
    torchft_available,
)
from .layouts import UNIFORM
from .methods import METHODS, NUMPY, TORCHFT, VARIANTS
from .plot import edge_table, plot_fanout
from .profilereport import format_profiles
from .relayreport import format_link_summary, format_paths_detail, format_relay_summary
from .report import format_growth, format_result, format_targets, machine_description, memory_available, to_json
from .runner import BenchError, ScenarioResult, run_scenario
from .targets import evaluate_targets


def _add_size_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--total", type=parse_size, help="bytes to move per receiver (e.g. 1G); default 1G")
    parser.add_argument("--tensor", type=parse_size, help="bytes per float32 tensor (e.g. 4M); default 4M")
    parser.add_argument("--receivers", type=int, help="receivers at once (default 1)")
    parser.add_argument(
        "--mode",
        choices=["inplace", "fresh", "both"],
        help="custom run: into existing tensors, fresh ones, or both (default both)",
    )
    parser.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)}")
    parser.add_argument("--skip", default="", help="comma-separated methods to leave out")
    parser.add_argument("--reps", type=int, help="measured trials per method (one fresh receiver process each)")
    parser.add_argument("--warmup", type=int, help="unmeasured whole trials first (default 0)")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="also time a second receive in the same receiver process (the 'warm s' column)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        help=f"idle seconds after each trial so freed memory goes back to the host "
        f"(default {DEFAULT_SETTLE_S:g} per GiB, at least {DEFAULT_SETTLE_S:g}, for 64 MiB and more on loopback, "
        "else 0)",
    )


def _add_transport_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", choices=["cpu"], help="tensor device (only cpu for now)")
    parser.add_argument("--chunk-bytes", type=parse_size, help="ZMQTransport chunk_bytes")
    parser.add_argument("--window", type=int, help="ZMQTransport window (credit)")
    parser.add_argument("--pack-below", type=parse_size, help="ZMQTransport pack_below")
    parser.add_argument("--io-threads", type=int, help="ZMQTransport io_threads")
    parser.add_argument(
        "--zmq-option",
        action="append",
        type=parse_option,
        default=[],
        metavar="NAME=VALUE",
        help="any other ZMQTransport keyword option (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="transport timeout, seconds")
    parser.add_argument("--no-verify", action="store_true", help="skip the content check after each receive")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    parser.add_argument(
        "--detail",
        action="store_true",
        help="also print, per trial and receiver, from whom it received how many bytes (ZMQTransport's stats.paths)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE",
        help="draw one fan-out (the median trial of the first several-receiver lab scenario): each receiver's "
        "bytes over time and who served whom (needs the plot extra: matplotlib; the edges are printed without it)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zmqtransport.bench",
        description="Benchmark ZMQTransport beside plain TCP, bare pyzmq and torchft's transports: "
        "a fresh receiver process per trial, on loopback or in a network lab (--lab, needs root).",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=[*PRESETS, "all", "lab", "relay", "rogue", "growth", "large", "fast"],
        help="a preset (repeatable; 'all': every loopback preset but the large ones; 'lab': every lab preset; "
        "'fast': the lab over unshaped links, MTU 1500 and 9000, one and three receivers (issue 33); "
        "'relay': the fan-out lab rows and the one-receiver row they compare with; 'rogue': issue 21's rogue "
        "relays beside a clean fan-out; 'growth': 1, 2 and 4 GiB uniform, with a table of seconds per GiB; "
        "'large': the transformer state, 4 and 8 GiB uniform); sizes below override it",
    )
    parser.add_argument("--lab", action="store_true", help="run the lab presets (same as --scenario lab)")
    parser.add_argument("--rate", type=float, help="lab link rate, Mbit/s per NIC and direction (default 400)")
    parser.add_argument(
        "--unshaped",
        action="store_true",
        help="lab scenarios over unshaped links (no tbf): as fast as the kernel moves bytes between namespaces",
    )
    parser.add_argument("--mtu", type=int, help="lab scenarios: every link's MTU (e.g. 9000; default the preset's)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="record where each process spends its CPU in every trial: per thread, the receive's phases, and "
        "the receiving thread's functions (cProfile); printed after the tables (zmqtransport.bench.profiling)",
    )
    parser.add_argument(
        "--no-cprofile",
        action="store_true",
        help="with --profile: no cProfile of the receiving thread (it slows Python-heavy code by tens of "
        "per cent), so the per-thread CPU seconds are the code's own",
    )
    parser.add_argument(
        "--perf",
        metavar="DIR",
        help="with --profile: also 'perf record -g' the source and receiver 1 over each trial's receives into DIR",
    )
    _add_size_options(parser)
    _add_transport_options(parser)
    return parser


def available_requirements() -> frozenset[str]:
    """The optional packages present here (methods that need others are left out)."""
    present = set()
    if torchft_available():
        present.add(TORCHFT)
        if numpy_available():
            present.add(NUMPY)
    return frozenset(present)


def _chosen_presets(args: argparse.Namespace) -> list[str]:
    names: list[str] = []
    groups = {
        "all": LOOPBACK_PRESETS,
        "lab": LAB_PRESETS,
        "relay": RELAY_PRESETS,
        "rogue": ROGUE_PRESETS,
        "growth": GROWTH_PRESETS,
        "large": LARGE_PRESETS,
        "fast": FAST_PRESETS,
    }
    for name in args.scenario or []:
        names += list(groups.get(name, [name]))
    if args.lab:
        names += list(LAB_PRESETS)
    return list(dict.fromkeys(names))


def _methods_for(
    args: argparse.Namespace, scenario: Scenario, custom: bool, available: frozenset[str]
) -> tuple[str, ...]:
    if args.methods:
        methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    elif custom:
        mode = args.mode or "both"
        wanted = {"inplace": True, "fresh": False}.get(mode)
        methods = tuple(
            name
            for name, m in METHODS.items()
            if name not in VARIANTS and (wanted is None or m.anchor or m.into_targets == wanted)
        )
    else:
        methods = scenario.methods
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s): {', '.join(unknown)}")
    skip = {m.strip() for m in args.skip.split(",") if m.strip()}
    methods = tuple(m for m in methods if m not in skip and METHODS[m].requires <= available)
    if not methods:
        raise SystemExit("no methods left to run")
    return methods


def scenarios_from_args(args: argparse.Namespace, available: frozenset[str]) -> list[Scenario]:
    names = _chosen_presets(args)
    custom = not names
    base = [PRESETS[name] for name in names] or [Scenario("custom", 1 << 30, 4 << 20)]
    chosen: list[Scenario] = []
    for scenario in base:
        total = args.total if args.total is not None else scenario.total_bytes
        tensor = min(args.tensor if args.tensor is not None else scenario.tensor_bytes, total)
        if tensor % 4 or total % 4:
            raise SystemExit("--total and --tensor must be multiples of 4 bytes (float32)")
        if args.settle is not None:
            settle = args.settle
        elif custom or (args.total is not None and scenario.lab is None):
            settle = settle_for(total)
        else:
            settle = scenario.settle_s
        if scenario.disallow is not None and args.warm:
            raise SystemExit(f"--warm does not apply to {scenario.name}: its step is withdrawn mid-transfer")
        spec = scenario.lab
        if spec is not None and args.rate is not None:
            spec = LabSpec(spec.nics, args.rate, mtu=spec.mtu)  # a rate shapes the links, whatever the preset
        if spec is not None and args.unshaped:
            spec = replace(spec, shaped=False, host_rates=())
        if spec is not None and args.mtu is not None:
            spec = replace(spec, mtu=args.mtu)
        chosen.append(
            _sized(
                scenario,
                total_bytes=total,
                tensor_bytes=tensor,
                receivers=args.receivers if args.receivers is not None else scenario.receivers,
                methods=_methods_for(args, scenario, custom, available),
                reps=args.reps if args.reps is not None else scenario.reps,
                warmup=args.warmup if args.warmup is not None else scenario.warmup,
                settle_s=settle,
                warm=args.warm,
                lab=spec,
                profiling=Profiling(args.perf or "", functions=not args.no_cprofile) if args.profile else None,
            )
        )
    return chosen


def _sized(scenario: Scenario, **changes: object) -> Scenario:
    """``scenario`` with ``changes``; a shaped layout's total is what it really holds."""
    changed = replace(scenario, **changes)  # type: ignore[arg-type]
    return changed if changed.layout == UNIFORM else exact_size(changed)


def _check_arguments(args: argparse.Namespace) -> None:
    if args.receivers is not None and args.receivers < 1:
        raise SystemExit("--receivers must be at least 1")
    if (args.reps is not None and args.reps < 1) or (args.warmup is not None and args.warmup < 0):
        raise SystemExit("--reps must be >= 1 and --warmup >= 0")
    if args.rate is not None and args.rate <= 0:
        raise SystemExit("--rate must be positive")
    if args.mtu is not None and not 68 <= args.mtu <= 65535:
        raise SystemExit("--mtu must be within 68..65535")
    if args.perf and not args.profile:
        raise SystemExit("--perf goes with --profile")
    if args.no_cprofile and not args.profile:
        raise SystemExit("--no-cprofile goes with --profile")
    if args.perf and shutil.which("perf") is None:
        raise SystemExit("--perf needs perf (linux-tools) on the PATH")


def _print_relays(results: Sequence[ScenarioResult], detail: bool) -> None:
    """The fan-out tables (several receivers against one; each against its own link) and who sent what to whom."""
    detailed = format_paths_detail(results) if detail else ""
    for text in (format_relay_summary(results), format_link_summary(results), detailed):
        if text:
            print()
            print(text)


def _print_tables(
    results: Sequence[ScenarioResult], argv: Sequence[str], detail: bool = False, skipped: Sequence[str] = ()
) -> None:
    machine = machine_description()
    print(
        f"machine: {machine['cpus']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
        f"kernel {machine['kernel']}, THP {machine['transparent_hugepage']}, "
        f"load average {machine['load_average']} at the end; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    )
    print("command: python -m zmqtransport.bench " + " ".join(argv))
    print("cold: the first receive in a fresh receiver process, timed from the recv_checkpoint call to its return")
    print("ratio columns: anchor seconds / method seconds (above 1 = faster than the anchor)")
    for result in results:
        print()
        print(format_result(result))
    for reason in skipped:
        print()
        print(reason)
    growth = format_growth(results)
    if growth:
        print()
        print(growth)
    _print_relays(results, detail)
    profiles = format_profiles(results)
    if profiles:
        print()
        print(profiles)
    targets = evaluate_targets(results)
    if targets:
        print()
        print(format_targets(targets))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _check_arguments(args)
    available = available_requirements()
    scenarios = scenarios_from_args(args, available)
    knobs = Knobs(
        chunk_bytes=args.chunk_bytes,
        window=args.window,
        pack_below=args.pack_below,
        io_threads=args.io_threads,
        extra=tuple(args.zmq_option),
        timeout_s=args.timeout,
        verify=not args.no_verify,
    )
    reason = lab.unavailable_reason()
    if reason is not None and any(s.lab is not None for s in scenarios):
        raise SystemExit(f"cannot run the lab scenarios: {reason}")

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    _log_missing(available, log)
    results: list[ScenarioResult] = []
    skipped: list[str] = []
    try:
        for scenario in scenarios:
            reason = _too_little_memory(scenario)
            if reason:
                skipped.append(reason)
                log(reason)
                continue
            log(f"running scenario {scenario.name}: {', '.join(scenario.methods)}")
            results.append(run_scenario(scenario, knobs, log))
    except BenchError as exc:
        log(f"benchmark failed: {exc}")
        return 1
    if args.json:
        print(json.dumps({**to_json(results, knobs, argv), "skipped": skipped}, indent=2))
    else:
        _print_tables(results, argv, args.detail, skipped)
    if args.plot:
        drawn, what = plot_fanout(results, args.plot)
        log(what)
        if not drawn:
            print(edge_table(results))
    return 0


def _too_little_memory(scenario: Scenario) -> str:
    """Why ``scenario`` is skipped on this machine now, or "" (both sides must fit in memory together)."""
    available, needed = memory_available(), scenario.memory_needed
    if available is None or available >= needed:
        return ""
    gib = float(1 << 30)
    return (
        f"skipped scenario {scenario.name}: it needs {needed / gib:.1f} GiB of available memory "
        f"(the sender and each receiver hold the state), {available / gib:.1f} GiB are available"
    )


def _log_missing(available: frozenset[str], log: Callable[[str], None]) -> None:
    if TORCHFT not in available:
        log("torchft is not importable: HTTPTransport and PGTransport are left out")
    elif NUMPY not in available:
        log("numpy is not importable (PGTransport's receive needs it): PGTransport is left out")
