"""The driver: a sender process per scenario, fresh receiver processes per trial, medians."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import statistics
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from ..lab import Lab
from .children import receiver_main, sender_main
from .config import Kill, Knobs, Scenario
from .methods import METHODS, CutMethod, Place


class BenchError(RuntimeError):
    """A child process failed; the message carries its traceback."""


class Network(Protocol):
    """Where host ``h`` runs (0 is the source) and what the source has sent so far."""

    def place(self, host: int) -> Place: ...
    def source_sent(self) -> list[int]: ...  # bytes per source NIC; empty where unknown
    def set_source_link(self, nic: int, up: bool) -> None: ...  # a lab only


class Loopback:
    def place(self, host: int) -> Place:
        return Place()

    def source_sent(self) -> list[int]:
        return []

    def set_source_link(self, nic: int, up: bool) -> None:
        raise BenchError("links can only be cut in a lab scenario")


class LabNetwork:
    """Host h of the lab. Methods use its first NIC; ZMQTransport serves on all (one path each)."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab

    def place(self, host: int) -> Place:
        more = tuple(self.lab.address(host, nic) for nic in range(1, self.lab.nics))
        return Place(self.lab.namespace(host), self.lab.address(host, 0), self.lab.interface(0), more)

    def source_sent(self) -> list[int]:
        return [tx for tx, _ in self.lab.counters(0).values()]

    def set_source_link(self, nic: int, up: bool) -> None:
        if up:
            self.lab.link_up(0, nic)
        else:
            self.lab.link_down(0, nic)


@contextlib.contextmanager
def network_for(scenario: Scenario) -> Iterator[Network]:
    if scenario.lab is None:
        yield Loopback()
        return
    spec = scenario.lab
    hosts = scenario.receivers + 1
    with Lab(
        hosts=hosts,
        nics=spec.nics,
        rate_mbit=spec.rate_mbit,
        host_rates=dict(spec.host_rates),
        shaped=spec.shaped,
        mtu=spec.mtu,
    ) as lab:
        yield LabNetwork(lab)


class _Child:
    def __init__(self, process: Any, conn: Connection, name: str) -> None:
        self.process = process
        self.conn = conn
        self.name = name

    def send(self, *command: Any) -> None:
        self.conn.send(command)

    def reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise BenchError(f"{self.name} did not answer within {timeout:.0f} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise BenchError(f"{self.name} died (exit code {self.process.exitcode})") from None
        if status != "ok":
            raise BenchError(f"{self.name} failed:\n{value}")
        return value

    def call(self, timeout: float, *command: Any) -> Any:
        self.send(*command)
        return self.reply(timeout)

    def stop(self) -> None:
        self.conn.close()  # a child still waiting for a command sees the end of its pipe and exits
        self.process.join(5.0)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)


def _go(
    receivers: Sequence[_Child],
    timeout: float,
    step: int,
    receives: int,
    kill: Kill | None,
    lead_s: float = 0.0,
    rogue: bool = False,
) -> list[list[Any] | None]:
    """Start every receive and collect the outcomes; None for a receiver not counted (killed as planned, a rogue).

    With a :class:`Kill`, its victim starts ``lead_s`` before the others (first
    in the source's relay chain) and must die of SIGKILL, or finish first.
    Without one, ``lead_s`` > 0 starts receiver 1 that much before the others.
    ``rogue``: receiver 1 is a rogue relay (:class:`Rogue`); its own outcome
    is not counted (it may even fail).
    """
    leader = receivers[kill.rank - 1] if kill is not None else receivers[0] if lead_s > 0 else None
    if leader is None:
        for child in receivers:
            child.send("go", step, receives)
    else:
        leader.send("go", step, receives)
        time.sleep(kill.lead_s if kill is not None else lead_s)
        for child in receivers:
            if child is not leader:
                child.send("go", step, receives)
    replies: list[list[Any] | None] = []
    for rank, child in enumerate(receivers, start=1):
        if kill is not None and child is leader:
            replies.append(_victim_reply(child, timeout))
        elif rogue and rank == 1:
            with contextlib.suppress(BenchError):  # a rogue that shut itself down fails its own receive
                child.reply(timeout)
            replies.append(None)
        else:
            replies.append(child.reply(timeout))
    return replies


def _victim_reply(victim: _Child, timeout: float) -> list[Any] | None:
    """The victim's outcome if it finished before its kill, None if it died of SIGKILL."""
    if victim.conn.poll(timeout):
        with contextlib.suppress(EOFError):
            status, value = victim.conn.recv()
            if status != "ok":
                raise BenchError(f"{victim.name} failed:\n{value}")
            return list(value)
    victim.process.join(5.0)
    if victim.process.exitcode != -signal.SIGKILL:
        raise BenchError(f"{victim.name} neither finished nor died of SIGKILL (exit code {victim.process.exitcode})")
    return None


def _gather(children: Sequence[_Child], timeout: float, *command: Any) -> list[Any]:
    for child in children:
        child.send(*command)
    return [child.reply(timeout) for child in children]


# How children start. "forkserver" (the default): each is forked from one server process
# that has imported torch and zmqtransport and done nothing else, so a child is a new
# process that has received nothing, allocated no tensor and opened no socket; what is
# timed starts at recv_checkpoint, after the imports either way. A spawned child
# (ZMQTRANSPORT_BENCH_START=spawn) first spends about 3 s of CPU importing torch, which
# was most of a short benchmark's run time. Measured alike: docs/history.md.
START_METHOD = os.environ.get("ZMQTRANSPORT_BENCH_START", "forkserver")
PRELOAD = ["torch", "zmqtransport", "zmqtransport.bench.children"]
# perf needs a moment to attach to a running process before what it should see begins.
PERF_ATTACH_S = 1.0


def _context() -> Any:
    """The multiprocessing context of :data:`START_METHOD` (typed loosely: each method has its own class)."""
    context = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        context.set_forkserver_preload(PRELOAD)
    return context


def _spawn(name: str, target: Callable[..., None], *args: Any) -> _Child:
    context = _context()
    parent_end, child_end = context.Pipe()
    process = context.Process(target=target, args=(child_end, *args), name=name, daemon=True)
    # torch warns at import (in every spawned child, or once in the fork server) that numpy is
    # missing; it does not matter here.
    previous = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = previous or "ignore::UserWarning"
    try:
        process.start()
    finally:
        if previous is None:
            del os.environ["PYTHONWARNINGS"]
    child_end.close()
    return _Child(process, parent_end, name)


@dataclass
class Trial:
    method: str
    trial: int
    seconds: list[float]  # per receiver: the first receive in a fresh process
    warm_seconds: list[float]  # per receiver: the second receive in that process (if --warm)
    recv_rss: list[int]
    send_rss: int
    stage_seconds: float
    in_place: list[int]
    source_sent: list[int]  # bytes per source NIC during the trial (lab only)
    recv_cpu: list[float] = field(default_factory=list)  # per receiver: CPU seconds of its cold receive
    recv_paths: list[dict[str, int]] = field(default_factory=list)  # per receiver: ZMQTransport's bytes per path
    duplicates: list[int] = field(default_factory=list)  # per receiver: data messages that came twice (dropped)
    cut_s: float | None = None  # a CutMethod's trial: when the link went down, seconds after the receives began
    killed: list[int] = field(default_factory=list)  # ranks SIGKILLed mid-transfer (scenario.kill); lists skip them
    # Per receiver: (seconds into its receive, bytes landed) points, from ZMQTransport's progress ([] otherwise).
    timelines: list[list[tuple[float, int]]] = field(default_factory=list)
    rogue: list[int] = field(default_factory=list)  # ranks of rogue relays (scenario.rogue); lists skip them
    # scenario.disallow: how long the source's disallow_checkpoint held it, what it copied, a memcpy of
    # that many bytes in the same process, and each receiver's failure ("": bit-exact with the staged step).
    disallow: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    # CPU seconds (user + system, all threads) of each counted receiver's process from just before the
    # receives start to the end of the trial (relaying for others included), and of the source's process
    # from its release of the step to the end of the trial.
    recv_process_cpu: list[float] = field(default_factory=list)
    send_cpu: float = 0.0
    # scenario.profiling: per process ("source", "r1"...), where its CPU went (see profiling).
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per receiver: how ZMQTransport's data came (TransferStats.path: "direct", "striped", "swarm"; "" others).
    recv_ways: list[str] = field(default_factory=list)


@dataclass
class MethodSummary:
    method: str
    slowest_s: float
    fastest_s: float
    warm_slowest_s: float | None
    gbps: float
    spread: float  # median over trials of slowest / fastest receiver
    send_rss_max: int
    recv_rss_max: int
    stage_s: float
    in_place_tensors: int
    source_sent: list[int]  # median bytes per source NIC (lab only)
    recv_cpu_s: float = 0.0  # median over trials of the busiest receiver's CPU seconds (all its threads)
    recv_paths: dict[str, int] = field(default_factory=dict)  # median bytes per path address, all receivers
    duplicates: int = 0  # most duplicate data messages in one trial, all receivers together
    # Receives by how their data came ("direct", "striped", "swarm"), all trials together (ZMQTransport only).
    ways: dict[str, int] = field(default_factory=dict)
    cut_s: float | None = None  # median time of the cut (CutMethod)
    # The slowest receiver of the method's first trial, where the scenario has no warm-up: its source's first
    # step (nothing measured yet; what a job start meets), which the medians above hide.
    first_step_s: float | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    # CPU seconds per GiB moved (medians over trials): each receiver's process per GiB it received (the
    # mean over receivers, and the busiest), the source's per GiB delivered to all receivers, and every
    # process together per GiB delivered (with --warm, both receives count).
    recv_cpu_per_gib: float = 0.0
    recv_cpu_per_gib_max: float = 0.0
    send_cpu_per_gib: float = 0.0
    cpu_per_gib: float = 0.0
    # scenario.disallow: medians of the source's disallow seconds, bytes the receives still needed, bytes
    # copied, and memcpy seconds of the needed bytes; the slowest disallow; trials in which every receiver
    # got the staged bytes, and an error seen.
    disallow_s: float | None = None
    disallow_max_s: float | None = None
    needed_bytes: int = 0
    snapshot_bytes: int = 0
    memcpy_s: float | None = None
    exact_trials: int = 0
    error: str = ""


@dataclass
class ScenarioResult:
    scenario: Scenario
    trials: list[Trial]
    summary: dict[str, MethodSummary]
    wall_seconds: float
    peak_resettable: bool


class _Run:
    """One scenario's processes and trials."""

    def __init__(self, scenario: Scenario, knobs: Knobs, network: Network) -> None:
        self.scenario = scenario
        self.knobs = knobs
        self.network = network
        self.setup_timeout = 120.0 + scenario.total_bytes / 50e6
        self.trial_timeout = knobs.timeout_s + 60.0
        self.receives = 2 if scenario.warm else 1
        self.resettable = True
        _check_cuts(scenario)
        self.sender = _spawn("bench-sender", sender_main, scenario, knobs, network.place(0))
        self.metadata: dict[str, str] = {}

    def start(self) -> None:
        self.metadata = self.sender.call(self.setup_timeout, "setup")

    def trial(self, method: str, step: int, number: int) -> Trial:
        scenario, timeout = self.scenario, self.trial_timeout
        stage_seconds = self.sender.call(timeout, "stage", method, step)
        context = _context()
        started = [context.Event() if scenario.disallow else None for _ in range(scenario.receivers)]
        receivers = [
            _spawn(
                f"bench-receiver-{rank}", receiver_main, scenario, self.knobs, self.network.place(rank), rank, begun
            )
            for rank, begun in enumerate(started, start=1)
        ]
        try:
            # Together: a process group forms only when every rank joins.
            self.sender.send("rendezvous", method, step)
            for receiver in receivers:
                receiver.send("setup", method, self.metadata[method], step)
            for child in [self.sender, *receivers]:
                child.reply(self.setup_timeout)
            before = self.network.source_sent()
            self.sender.call(timeout, "release", method, step, self.receives)
            _gather(receivers, timeout, "ready")  # every receiver's untimed preparation, before any starts
            with (
                self._perf_during(method, number, receivers),  # first: it waits for perf to attach
                self._cut_link(method) as cut,
                self._disallow_during(method, started) as disallowed,
            ):
                has_rogue = scenario.rogue is not None
                replies = _go(receivers, timeout, step, self.receives, scenario.kill, scenario.lead_s, has_rogue)
            send_rss = self.sender.call(timeout, "finish", method)
            survivors = [r for r, runs in zip(receivers, replies, strict=True) if runs is not None]
            # Every receive is done: what each process spent since it began (its relaying included).
            send_usage = self.sender.call(timeout, "usage")
            recv_usage = _gather(survivors, 30.0, "usage")
            if disallowed:  # measured here, not while the receives ran: they would have shared the cores
                disallowed["memcpy_s"] = self.sender.call(timeout, "memcpy", disallowed["needed_bytes"])
            after = self.network.source_sent()
            _gather(survivors, 30.0, "exit")
        finally:
            for receiver in receivers:
                receiver.stop()
        # The survivors, in rank order (a killed receiver or a rogue has no outcome).
        outcomes = [runs for runs in replies if runs is not None]
        uncounted = [rank for rank, runs in enumerate(replies, start=1) if runs is None]
        rogue = [1] if scenario.rogue is not None else []
        killed = [rank for rank in uncounted if rank not in rogue]
        cold = [runs[0] for runs in outcomes]
        self.resettable = self.resettable and all(o["resettable"] for o in cold)
        return Trial(
            method,
            number,
            [o["seconds"] for o in cold],
            [runs[-1]["seconds"] for runs in outcomes] if scenario.warm else [],
            [o["rss"] for o in cold],
            send_rss,
            stage_seconds,
            [o["in_place"] for o in cold],
            [b - a for a, b in zip(before, after, strict=True)],
            [o["cpu"] for o in cold],
            [o["paths"] for o in cold],
            [o["duplicates"] for o in cold],
            cut.at_s,
            killed,
            [o["timeline"] for o in cold],
            rogue,
            disallowed,
            [o.get("error", "") for o in cold],
            [usage["cpu"] for usage in recv_usage],
            send_usage["cpu"],
            _profiles(send_usage, recv_usage, [r for r, runs in enumerate(replies, start=1) if runs is not None]),
            [o.get("way", "") for o in cold],
        )

    @contextlib.contextmanager
    def _disallow_during(self, method: str, started: Sequence[Any]) -> Iterator[dict[str, float]]:
        """With scenario.disallow: the sender's disallow_checkpoint ``at_s`` after every receive began
        (each receiver sets its ``started`` event), then its mutation."""
        outcome: dict[str, float] = {}
        plan = self.scenario.disallow
        if plan is None:
            yield outcome
            return
        failures: list[BaseException] = []

        def disallow() -> None:
            try:
                if not all(event.wait(self.setup_timeout) for event in started):
                    raise BenchError("a receiver never began its receive")
                time.sleep(plan.at_s)
                outcome.update(self.sender.call(self.trial_timeout, "disallow", method, plan.add))
            except BaseException as exc:  # noqa: BLE001 - reported after the receives
                failures.append(exc)

        timer = threading.Thread(target=disallow, name="bench-disallow", daemon=True)
        timer.start()
        try:
            yield outcome
        finally:
            timer.join()  # the sender's pipe is free again before "finish"
        if failures:
            raise BenchError(f"disallow_checkpoint in the sender failed: {failures[0]}")

    @contextlib.contextmanager
    def _perf_during(self, method: str, number: int, receivers: Sequence[_Child]) -> Iterator[None]:
        """With ``--perf DIR``: ``perf record -g`` of the source and receiver 1 while the receives run."""
        profiling = self.scenario.profiling
        if profiling is None or not profiling.perf_dir:
            yield
            return
        os.makedirs(profiling.perf_dir, exist_ok=True)
        stem = os.path.join(profiling.perf_dir, f"{self.scenario.name}-{method}-{number}")
        targets = [("source", self.sender), *(("r1", r) for r in receivers[:1])]
        recorders = [
            subprocess.Popen(
                ["perf", "record", "-e", "cpu-clock", "-g", "-q", "-o", f"{stem}-{name}.data", "-p", str(pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for name, child in targets
            if (pid := child.process.pid) is not None
        ]
        time.sleep(PERF_ATTACH_S)
        try:
            yield
        finally:
            for recorder in recorders:
                recorder.send_signal(signal.SIGINT)
            for recorder in recorders:
                try:
                    recorder.wait(30.0)
                except subprocess.TimeoutExpired:
                    recorder.kill()
                    recorder.wait()

    @contextlib.contextmanager
    def _cut_link(self, method: str) -> Iterator[_Cut]:
        """For a :class:`CutMethod`: take the source's link down during the receives, up again after."""
        cut = _Cut()
        chosen = METHODS[method]
        if not isinstance(chosen, CutMethod):
            yield cut
            return
        assert self.scenario.lab is not None  # _check_cuts
        one_nic_s = self.scenario.total_bytes / (self.scenario.lab.rate_mbit * 1e6 / 8)
        started = time.monotonic()

        def down() -> None:
            try:
                self.network.set_source_link(chosen.nic, up=False)
                cut.at_s = time.monotonic() - started
            except Exception as exc:  # noqa: BLE001 - reported after the receives
                cut.error = exc

        timer = threading.Timer(chosen.after_fraction * one_nic_s, down)
        timer.start()
        try:
            yield cut
        finally:
            timer.cancel()
            timer.join()
            self.network.set_source_link(chosen.nic, up=True)  # also when it never went down
        if cut.error is not None:
            raise BenchError(f"cutting the source's NIC {chosen.nic} failed: {cut.error}")

    def close(self) -> None:
        with contextlib.suppress(BenchError, OSError):
            self.sender.call(30.0, "exit")
        self.sender.stop()


def _profiles(send: dict[str, Any], receivers: Sequence[dict[str, Any]], ranks: Sequence[int]) -> dict[str, Any]:
    """The trial's per-process profiles by name ("source", "r1"...), where scenario.profiling made any."""
    named = [("source", send), *((f"r{rank}", usage) for rank, usage in zip(ranks, receivers, strict=True))]
    return {name: usage["profile"] for name, usage in named if usage.get("profile")}


@dataclass
class _Cut:
    at_s: float | None = None
    error: Exception | None = None


def _check_cuts(scenario: Scenario) -> None:
    for method in scenario.methods:
        chosen = METHODS[method]
        if isinstance(chosen, CutMethod) and (scenario.lab is None or chosen.nic >= scenario.lab.nics):
            raise BenchError(f"{method} cuts the source's NIC {chosen.nic}: it needs a lab scenario with more NICs")


def run_scenario(
    scenario: Scenario, knobs: Knobs, log: Callable[[str], None], network: Network | None = None
) -> ScenarioResult:
    """Run the scenario's trials (each method once per trial, rotated order) and summarize."""
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if network is None:
            network = stack.enter_context(network_for(scenario))
        run = _Run(scenario, knobs, network)
        stack.callback(run.close)
        run.start()
        trials: list[Trial] = []
        methods = list(scenario.methods)
        step = 0
        for index in range(scenario.warmup + scenario.reps):
            shift = index % len(methods)
            for method in methods[shift:] + methods[:shift]:
                step += 1
                trial = run.trial(method, step, index - scenario.warmup)
                time.sleep(scenario.settle_s)
                if index >= scenario.warmup:
                    trials.append(trial)
            log(f"  [{scenario.name}] trial {index + 1}/{scenario.warmup + scenario.reps} done")
    summary = summarize(scenario, trials)
    return ScenarioResult(scenario, trials, summary, time.monotonic() - started, run.resettable)


def summarize(scenario: Scenario, trials: Sequence[Trial]) -> dict[str, MethodSummary]:
    summary: dict[str, MethodSummary] = {}
    for method in scenario.methods:
        mine = [t for t in trials if t.method == method]
        if not mine:
            continue
        slowest = statistics.median(max(t.seconds) for t in mine)
        nics = len(mine[0].source_sent)
        summary[method] = MethodSummary(
            method=method,
            slowest_s=slowest,
            fastest_s=statistics.median(min(t.seconds) for t in mine),
            warm_slowest_s=statistics.median(max(t.warm_seconds) for t in mine) if scenario.warm else None,
            gbps=scenario.total_bytes / slowest / 1e9,
            spread=statistics.median(max(t.seconds) / max(min(t.seconds), 1e-12) for t in mine),
            send_rss_max=max(t.send_rss for t in mine),
            recv_rss_max=max(max(t.recv_rss) for t in mine),
            stage_s=statistics.median(t.stage_seconds for t in mine),
            in_place_tensors=min(min(t.in_place) for t in mine),
            source_sent=[int(statistics.median(t.source_sent[nic] for t in mine)) for nic in range(nics)],
            recv_cpu_s=statistics.median(max(t.recv_cpu, default=0.0) for t in mine),
            recv_paths=_median_paths(mine),
            duplicates=max(sum(t.duplicates) for t in mine),
            ways=dict(Counter(way for t in mine for way in t.recv_ways if way)),
            cut_s=_median_or_none([t.cut_s for t in mine]),
            first_step_s=None if scenario.warmup else max(min(mine, key=lambda t: t.trial).seconds),
            **_cpu_summary(scenario.total_bytes * (2 if scenario.warm else 1), mine),
            **_disallow_summary(mine),
        )
    anchors = [m for m in summary if METHODS[m].anchor]
    for entry in summary.values():
        for anchor in anchors:
            # > 1 means faster than the anchor (ratio of median slowest-receiver times).
            entry.ratios[anchor] = summary[anchor].slowest_s / entry.slowest_s
    return summary


def _cpu_summary(received_bytes: int, trials: Sequence[Trial]) -> dict[str, Any]:
    """CPU seconds per GiB moved, medians over trials (see MethodSummary); ``received_bytes``: into each
    receiver per trial."""
    gib = received_bytes / (1 << 30)
    per_trial = [t for t in trials if t.recv_process_cpu]
    if not per_trial or gib <= 0:
        return {}
    delivered = [gib * len(t.recv_process_cpu) for t in per_trial]
    return {
        "recv_cpu_per_gib": statistics.median(statistics.mean(t.recv_process_cpu) / gib for t in per_trial),
        "recv_cpu_per_gib_max": statistics.median(max(t.recv_process_cpu) / gib for t in per_trial),
        "send_cpu_per_gib": statistics.median(t.send_cpu / d for t, d in zip(per_trial, delivered, strict=True)),
        "cpu_per_gib": statistics.median(
            (t.send_cpu + sum(t.recv_process_cpu)) / d for t, d in zip(per_trial, delivered, strict=True)
        ),
    }


def _disallow_summary(trials: Sequence[Trial]) -> dict[str, Any]:
    outcomes = [t.disallow for t in trials if t.disallow]
    if not outcomes:
        return {}
    errors = [error for t in trials for error in t.errors if error]
    return {
        "disallow_s": statistics.median(o["seconds"] for o in outcomes),
        "disallow_max_s": max(o["seconds"] for o in outcomes),
        "needed_bytes": int(statistics.median(o["needed_bytes"] for o in outcomes)),
        "snapshot_bytes": int(statistics.median(o["snapshot_bytes"] for o in outcomes)),
        "memcpy_s": statistics.median(o["memcpy_s"] for o in outcomes),
        "exact_trials": sum(1 for t in trials if not any(t.errors)),
        "error": errors[0] if errors else "",
    }


def _median_paths(trials: Sequence[Trial]) -> dict[str, int]:
    """Per path address, the median over trials of the bytes all receivers landed from it.

    By address, not endpoint: a relaying receiver is a new process with a new
    port in every trial (the source's port stays).
    """
    totals: list[dict[str, int]] = []
    for trial in trials:
        total: dict[str, int] = {}
        for paths in trial.recv_paths:
            for endpoint, nbytes in paths.items():
                host = path_host(endpoint)
                total[host] = total.get(host, 0) + nbytes
        totals.append(total)
    hosts = sorted({host for total in totals for host in total})
    return {host: int(statistics.median(total.get(host, 0) for total in totals)) for host in hosts}


def path_host(endpoint: str) -> str:
    """``tcp://HOST:PORT`` -> ``HOST`` (an address alone stays as it is)."""
    hostport = endpoint.removeprefix("tcp://")
    host, sep, port = hostport.rpartition(":")
    return host if sep and port.isdigit() else hostport


def _median_or_none(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None
