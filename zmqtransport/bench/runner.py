"""The driver: a sender process per scenario, fresh receiver processes per trial, medians."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol

from ..lab import Lab
from .children import receiver_main, sender_main
from .config import Knobs, Scenario
from .methods import METHODS, Place


class BenchError(RuntimeError):
    """A child process failed; the message carries its traceback."""


class Network(Protocol):
    """Where host ``h`` runs (0 is the source) and what the source has sent so far."""

    def place(self, host: int) -> Place: ...
    def source_sent(self) -> list[int]: ...  # bytes per source NIC; empty where unknown


class Loopback:
    def place(self, host: int) -> Place:
        return Place()

    def source_sent(self) -> list[int]:
        return []


class LabNetwork:
    """Host h of the lab; every process uses its first NIC (today's transports pick one)."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab

    def place(self, host: int) -> Place:
        return Place(self.lab.namespace(host), self.lab.address(host, 0), self.lab.interface(0))

    def source_sent(self) -> list[int]:
        return [tx for tx, _ in self.lab.counters(0).values()]


@contextlib.contextmanager
def network_for(scenario: Scenario) -> Iterator[Network]:
    if scenario.lab is None:
        yield Loopback()
        return
    spec = scenario.lab
    with Lab(hosts=scenario.receivers + 1, nics=spec.nics, rate_mbit=spec.rate_mbit) as lab:
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


def _gather(children: Sequence[_Child], timeout: float, *command: Any) -> list[Any]:
    for child in children:
        child.send(*command)
    return [child.reply(timeout) for child in children]


def _spawn(name: str, target: Callable[..., None], *args: Any) -> _Child:
    context = multiprocessing.get_context("spawn")
    parent_end, child_end = context.Pipe()
    process = context.Process(target=target, args=(child_end, *args), name=name, daemon=True)
    # torch warns at import, in every fresh child, that numpy is missing; it does not matter here.
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
    ratios: dict[str, float] = field(default_factory=dict)


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
        self.sender = _spawn("bench-sender", sender_main, scenario, knobs, network.place(0))
        self.metadata: dict[str, str] = {}

    def start(self) -> None:
        self.metadata = self.sender.call(self.setup_timeout, "setup")

    def trial(self, method: str, step: int, number: int) -> Trial:
        scenario, timeout = self.scenario, self.trial_timeout
        stage_seconds = self.sender.call(timeout, "stage", method, step)
        receivers = [
            _spawn(f"bench-receiver-{rank}", receiver_main, scenario, self.knobs, self.network.place(rank), rank)
            for rank in range(1, scenario.receivers + 1)
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
            outcomes = _gather(receivers, timeout, "go", step, self.receives)
            send_rss = self.sender.call(timeout, "finish", method)
            after = self.network.source_sent()
            _gather(receivers, 30.0, "exit")
        finally:
            for receiver in receivers:
                receiver.stop()
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
        )

    def close(self) -> None:
        with contextlib.suppress(BenchError, OSError):
            self.sender.call(30.0, "exit")
        self.sender.stop()


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
        )
    anchors = [m for m in summary if METHODS[m].anchor]
    for entry in summary.values():
        for anchor in anchors:
            # > 1 means faster than the anchor (ratio of median slowest-receiver times).
            entry.ratios[anchor] = summary[anchor].slowest_s / entry.slowest_s
    return summary
