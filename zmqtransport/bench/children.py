"""The benchmark's child processes: one long-lived sender, fresh receivers per trial.

Each child answers commands from the driver over a pipe: ``("ok", value)`` or
``("error", traceback)``, until ``exit``. A child placed in a lab host enters
that host's network namespace before it opens any socket.
"""

from __future__ import annotations

import http.server
import logging
import os
import signal
import socketserver
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ..lab import enter_namespace
from .config import Knobs, Scenario
from .methods import METHODS, Place, Receiving, RecvEnv, SendEnv, Serving, ZmqMethod
from .payload import (
    PeakMeter,
    check,
    check_every_element,
    make_tensors,
    memcpy_seconds,
    stamp,
)
from .profiling import Phases, ThreadClock, process_cpu_seconds, thread_profiler, top_functions
from .rogue import become_rogue, shutdown_halfway


def serve_commands(conn: Connection, handlers: dict[str, Callable[..., Any]]) -> None:
    """Answer ("ok", value) or ("error", traceback) to each command until "exit"."""
    while True:
        try:
            command = conn.recv()
        except EOFError:
            return
        name, args = command[0], command[1:]
        if name == "exit":
            conn.send(("ok", None))
            return
        try:
            value = handlers[name](*args)
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", value))


def _enter(place: Place) -> None:
    if place.namespace is not None:
        enter_namespace(place.namespace)
    os.environ["GLOO_SOCKET_IFNAME"] = place.interface  # keep gloo on the benchmark's network
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if os.environ.get("ZMQTRANSPORT_BENCH_LOG"):  # to see why a trial took the time it took ("debug": more)
        level = logging.DEBUG if os.environ["ZMQTRANSPORT_BENCH_LOG"] == "debug" else logging.INFO
        logging.basicConfig(level=level, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    else:
        logging.disable(logging.WARNING)  # the transports log INFO lines per transfer
    # HTTPTransport's handler writes an access-log line per request to stderr.
    http.server.BaseHTTPRequestHandler.log_message = lambda *args: None  # type: ignore[method-assign]


class SenderProcess:
    """Holds the payload and every method's serving side; stages one step per trial."""

    def __init__(self, scenario: Scenario, knobs: Knobs, place: Place) -> None:
        self.scenario = scenario
        layout = scenario.payload
        self.tensors = make_tensors(layout.shapes, 0.0)
        self.env = SendEnv(self.tensors, layout.state(self.tensors), knobs, place, scenario.receivers)
        self.servings: dict[str, Serving] = {}
        self.step = -1
        self.meter: PeakMeter | None = None
        self.cpu_base = 0.0  # this process's CPU seconds at the last release
        self.clock: ThreadClock | None = None  # scenario.profiling: per thread since the last release

    def setup(self) -> dict[str, str]:
        """Start every method's serving side; returns each one's metadata."""
        for name in self.scenario.methods:
            self.servings[name] = METHODS[name].serve(self.env)
        return {name: serving.metadata() for name, serving in self.servings.items()}

    def stage(self, method: str, step: int) -> float:
        """Make ``step`` available through ``method``; returns the staging seconds."""
        if step != self.step:
            stamp(self.tensors, step)
            self.step = step
        self.meter = PeakMeter()
        started = time.perf_counter()
        self.servings[method].stage(step)
        return time.perf_counter() - started

    def rendezvous(self, method: str, step: int) -> None:
        self.servings[method].rendezvous(step)

    def release(self, method: str, step: int, receives: int) -> None:
        self.cpu_base = process_cpu_seconds()
        if self.scenario.profiling is not None:
            self.clock = ThreadClock()
        self.servings[method].release(step, receives)

    def usage(self) -> dict[str, Any]:
        """CPU seconds of this process since the last release (every thread), and its profile if asked for."""
        cpu = process_cpu_seconds() - self.cpu_base
        profile = self.clock.stop() if self.clock is not None else {}
        return {"cpu": cpu, "profile": profile}

    def disallow(self, method: str, add: float) -> dict[str, float]:
        """disallow_checkpoint mid-transfer (timed), then ``add`` to every tensor (an optimizer step)."""
        started = time.perf_counter()
        said = self.servings[method].disallow()
        seconds = time.perf_counter() - started
        for tensor in self.tensors:
            tensor.add_(add)
        return {"seconds": seconds, "needed_bytes": said.get("needed", 0), "snapshot_bytes": said.get("copied", 0)}

    def memcpy(self, nbytes: int) -> float:
        """Issue 23's yardstick, once the receives are done: one memcpy of ``nbytes`` into fresh memory."""
        return memcpy_seconds(self.tensors, nbytes)

    def finish(self, method: str) -> int:
        """End the method's serving of this step; returns the sender's peak RSS growth."""
        self.servings[method].finish()
        assert self.meter is not None
        return self.meter.growth()

    def close(self) -> None:
        for serving in self.servings.values():
            serving.close()


def _expect_killed_peers() -> None:
    """A receiver killed on purpose (scenario.kill) resets its connections: servers' tracebacks are expected."""
    logging.disable(logging.ERROR)  # HTTPTransport logs each reset with logger.exception
    socketserver.BaseServer.handle_error = lambda *args: None  # type: ignore[method-assign]


def sender_main(conn: Connection, scenario: Scenario, knobs: Knobs, place: Place) -> None:
    _enter(place)
    if scenario.kill is not None:
        _expect_killed_peers()
    sender = SenderProcess(scenario, knobs, place)
    try:
        handlers: dict[str, Callable[..., Any]] = {
            "setup": sender.setup,
            "stage": sender.stage,
            "rendezvous": sender.rendezvous,
            "release": sender.release,
            "disallow": sender.disallow,
            "memcpy": sender.memcpy,
            "finish": sender.finish,
            "usage": sender.usage,
        }
        serve_commands(conn, handlers)
    finally:
        sender.close()


def _die_past(fraction: float) -> Callable[[int, int], None]:
    """A progress callback that SIGKILLs this process once ``fraction`` of the bytes have landed."""

    def progress(done: int, total: int) -> None:
        if os.environ.get("ZMQTRANSPORT_BENCH_LOG"):
            logging.getLogger("bench").info("progress %d/%d", done, total)
        if done >= fraction * total:
            os.kill(os.getpid(), signal.SIGKILL)

    return progress


# Points one receive's timeline keeps (it is sent to the driver with the outcome).
TIMELINE_POINTS = 200


class Timeline:
    """Bytes landed over time in one receive, from ZMQTransport's progress callback (``--plot``)."""

    def __init__(self, then: Callable[[int, int], None] | None = None) -> None:
        self.then = then  # another progress callback to call after recording (a planned kill)
        self.started = time.perf_counter()
        self.points: list[tuple[float, int]] = []

    def start(self) -> None:
        self.started = time.perf_counter()
        self.points = [(0.0, 0)]

    def __call__(self, done: int, total: int) -> None:
        self.points.append((time.perf_counter() - self.started, done))
        if self.then is not None:
            self.then(done, total)

    def sampled(self) -> list[tuple[float, int]]:
        """At most :data:`TIMELINE_POINTS` points, the last one kept."""
        points = self.points
        step = max(1, len(points) // TIMELINE_POINTS)
        kept = points[::step]
        return kept if not points or kept[-1] == points[-1] else [*kept, points[-1]]


def _one_link_ideal_s(scenario: Scenario) -> float:
    rate_mbit = scenario.lab.rate_mbit if scenario.lab is not None else 1e4
    return scenario.total_bytes / (rate_mbit * 1e6 / 8)


class ReceiverProcess:
    """One fresh process, one method: builds its receiving side, then times its receives."""

    def __init__(self, scenario: Scenario, knobs: Knobs, place: Place, rank: int, started: Any = None) -> None:
        self.scenario = scenario
        self.started = started  # a multiprocessing Event set as the first receive begins (scenario.disallow)
        self.knobs = knobs
        self.place = place
        self.rank = rank
        self.layout = scenario.payload
        self.targets: list[Any] = []
        self.receiving: Receiving | None = None
        self.kill_timer_s: float | None = None  # the victim of a Kill, for a method without progress
        self.timeline: Timeline | None = None  # bytes over time (ZMQTransport, which reports progress)
        self.meter: PeakMeter | None = None  # the first receive's, made by ready()
        self.cpu_base = 0.0  # this process's CPU seconds when ready() ran
        self.clock: ThreadClock | None = None  # scenario.profiling: per thread since ready()
        self.phases: Phases | None = None  # scenario.profiling: the receive's phases (ZMQTransport)
        self.profiled: dict[str, Any] = {}  # scenario.profiling: the cold receive's phases and functions

    def setup(self, method: str, metadata: str, step: int) -> None:
        """Untimed: the recovering model's own tensors (touched) and the method's receiver."""
        chosen = METHODS[method]
        if chosen.into_targets:
            self.targets = make_tensors(self.layout.shapes, -1.0)
        world = self.scenario.receivers + 1
        progress = None
        kill = self.scenario.kill
        if kill is not None and kill.rank == self.rank:
            if isinstance(chosen, ZmqMethod):
                progress = _die_past(kill.at_fraction)
            else:
                self.kill_timer_s = kill.at_fraction * _one_link_ideal_s(self.scenario)
        rogue = self.scenario.rogue
        shut_down: list[Any] | None = None  # the rogue's own transport, for its progress callback
        if rogue is not None and self.rank == 1 and isinstance(chosen, ZmqMethod):
            become_rogue(rogue.mode)  # this process is the rogue's alone: a fresh receiver per trial
            if rogue.mode == "shutdown":
                shut_down = []
                progress = shutdown_halfway(shut_down)
        if isinstance(chosen, ZmqMethod):
            progress = self.timeline = Timeline(progress)
        if self.scenario.profiling is not None:
            self.phases = Phases()
        env = RecvEnv(self.layout, self.targets, self.knobs, self.place, self.rank, world, metadata, step, progress)
        self.receiving = chosen.receiver(env)
        if shut_down is not None:
            shut_down.append(getattr(self.receiving, "transport", None))

    def ready(self) -> None:
        """Untimed, before any receiver of the trial starts: the first receive's memory accounting (a
        garbage collection and a heap trim, tens of ms of CPU with torch loaded), so that none of it
        runs on the shared cores while other receivers are being timed."""
        self.meter = PeakMeter()
        self.cpu_base = process_cpu_seconds()
        if self.scenario.profiling is not None:
            self.clock = ThreadClock()

    def usage(self) -> dict[str, Any]:
        """Once every receive of the trial is done: this process's CPU seconds since ready() (its relaying
        for others included), and its profile if asked for."""
        cpu = process_cpu_seconds() - self.cpu_base
        profile = {**self.clock.stop(), **self.profiled} if self.clock is not None else {}
        return {"cpu": cpu, "profile": profile}

    def go(self, step: int, receives: int) -> list[dict[str, Any]]:
        """Time ``receives`` receives of ``step``, the first one cold; verify each."""
        timer = None
        if self.kill_timer_s is not None:
            timer = threading.Timer(self.kill_timer_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        # No trim after a receive: the next one's PeakMeter trims first, and after the last the others of
        # the trial may still be receiving on the same cores, while nothing more is measured here.
        outcomes = [self._receive_once(step) for _ in range(receives)]
        if timer is not None:
            timer.cancel()  # it finished before its kill: it reports like any receiver
        return outcomes

    def _receive_once(self, step: int) -> dict[str, Any]:
        assert self.receiving is not None
        meter, self.meter = self.meter or PeakMeter(), None
        cpu_before = process_cpu_seconds()
        if self.timeline is not None:
            self.timeline.start()
        started = time.perf_counter()
        if self.scenario.disallow is not None:
            if self.started is not None:
                self.started.set()
            return self._receive_disallowed(step, meter, cpu_before, started)
        profiling = self.scenario.profiling
        functions = profiling is not None and profiling.functions
        profiler = thread_profiler() if self.clock is not None and functions and not self.profiled else None
        if self.phases is not None:
            self.phases.start()
        if profiler is not None:
            profiler.enable()
        tensors = self.receiving.receive(step)
        if profiler is not None:
            profiler.disable()
        ended = time.perf_counter()
        seconds = ended - started
        cpu = process_cpu_seconds() - cpu_before
        if self.clock is not None and not self.profiled:
            phases = self.phases.seconds(ended) if self.phases is not None else {}
            self.profiled = {"receive_s": seconds, "receive_cpu_s": cpu, "phases": phases}
            if profiler is not None:
                self.profiled["functions"] = top_functions(profiler)
        growth = meter.growth()
        in_place = 0
        if self.knobs.verify:
            check(tensors, step, len(self.layout.paths))
            owned = {t.untyped_storage().data_ptr() for t in self.targets}
            in_place = sum(1 for t in tensors if t.untyped_storage().data_ptr() in owned)
        del tensors
        stats = self.receiving.stats()
        return {
            "seconds": seconds,
            "cpu": cpu,
            "rss": growth,
            "in_place": in_place,
            "resettable": meter.resettable,
            "paths": stats.get("paths", {}),
            "duplicates": stats.get("duplicates", 0),
            "way": stats.get("way", ""),
            "timeline": self.timeline.sampled() if self.timeline is not None else [],
        }

    def _receive_disallowed(self, step: int, meter: PeakMeter, cpu_before: float, started: float) -> dict[str, Any]:
        """A receive the source disallows mid-transfer: its outcome (bit-exact, or why not), never raised."""
        assert self.receiving is not None
        error = ""
        try:
            tensors = self.receiving.receive(step)
        except Exception as exc:  # noqa: BLE001 - the outcome is what this scenario measures
            tensors, error = [], f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - started
        cpu, growth = process_cpu_seconds() - cpu_before, meter.growth()
        in_place = 0
        if not error:
            try:
                check_every_element(tensors, step, len(self.layout.paths))
            except AssertionError as exc:
                error = f"other bytes than staged: {exc}"
            owned = {t.untyped_storage().data_ptr() for t in self.targets}
            in_place = sum(1 for t in tensors if t.untyped_storage().data_ptr() in owned)
        del tensors
        stats = {} if error else self.receiving.stats()
        outcome = {"seconds": seconds, "cpu": cpu, "rss": growth, "in_place": in_place, "resettable": meter.resettable}
        timeline = self.timeline.sampled() if self.timeline is not None else []
        return {**outcome, "paths": stats.get("paths", {}), "duplicates": 0, "timeline": timeline, "error": error}

    def close(self) -> None:
        if self.receiving is not None:
            self.receiving.close()


def receiver_main(
    conn: Connection, scenario: Scenario, knobs: Knobs, place: Place, rank: int, started: Any = None
) -> None:
    _enter(place)
    receiver = ReceiverProcess(scenario, knobs, place, rank, started)
    try:
        handlers: dict[str, Callable[..., Any]] = {
            "setup": receiver.setup,
            "ready": receiver.ready,
            "go": receiver.go,
            "usage": receiver.usage,
        }
        serve_commands(conn, handlers)
    finally:
        receiver.close()
