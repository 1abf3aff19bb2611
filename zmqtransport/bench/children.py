"""The benchmark's child processes: one long-lived sender, fresh receivers per trial.

Each child answers commands from the driver over a pipe: ``("ok", value)`` or
``("error", traceback)``, until ``exit``. A child placed in a lab host enters
that host's network namespace before it opens any socket.
"""

from __future__ import annotations

import http.server
import logging
import os
import resource
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
from .payload import PeakMeter, check, make_tensors, release_free_memory, stamp
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
        self.servings[method].release(step, receives)

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
            "finish": sender.finish,
        }
        serve_commands(conn, handlers)
    finally:
        sender.close()


def _cpu_seconds() -> float:
    """User and system CPU of every thread of this process so far (libzmq's I/O thread included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _die_past(fraction: float) -> Callable[[int, int], None]:
    """A progress callback that SIGKILLs this process once ``fraction`` of the bytes have landed."""

    def progress(done: int, total: int) -> None:
        if done >= fraction * total:
            os.kill(os.getpid(), signal.SIGKILL)

    return progress


def _one_link_ideal_s(scenario: Scenario) -> float:
    rate_mbit = scenario.lab.rate_mbit if scenario.lab is not None else 1e4
    return scenario.total_bytes / (rate_mbit * 1e6 / 8)


class ReceiverProcess:
    """One fresh process, one method: builds its receiving side, then times its receives."""

    def __init__(self, scenario: Scenario, knobs: Knobs, place: Place, rank: int) -> None:
        self.scenario = scenario
        self.knobs = knobs
        self.place = place
        self.rank = rank
        self.layout = scenario.payload
        self.targets: list[Any] = []
        self.receiving: Receiving | None = None
        self.kill_timer_s: float | None = None  # the victim of a Kill, for a method without progress

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
        env = RecvEnv(self.layout, self.targets, self.knobs, self.place, self.rank, world, metadata, step, progress)
        self.receiving = chosen.receiver(env)
        if shut_down is not None:
            shut_down.append(getattr(self.receiving, "transport", None))

    def go(self, step: int, receives: int) -> list[dict[str, Any]]:
        """Time ``receives`` receives of ``step``, the first one cold; verify each."""
        timer = None
        if self.kill_timer_s is not None:
            timer = threading.Timer(self.kill_timer_s, os.kill, (os.getpid(), signal.SIGKILL))
            timer.daemon = True
            timer.start()
        outcomes = [self._receive_once(step) for _ in range(receives)]
        if timer is not None:
            timer.cancel()  # it finished before its kill: it reports like any receiver
        return outcomes

    def _receive_once(self, step: int) -> dict[str, Any]:
        assert self.receiving is not None
        meter = PeakMeter()
        cpu_before = _cpu_seconds()
        started = time.perf_counter()
        tensors = self.receiving.receive(step)
        seconds = time.perf_counter() - started
        cpu = _cpu_seconds() - cpu_before
        growth = meter.growth()
        in_place = 0
        if self.knobs.verify:
            check(tensors, step, len(self.layout.paths))
            owned = {t.untyped_storage().data_ptr() for t in self.targets}
            in_place = sum(1 for t in tensors if t.untyped_storage().data_ptr() in owned)
        del tensors
        release_free_memory()
        stats = self.receiving.stats()
        return {
            "seconds": seconds,
            "cpu": cpu,
            "rss": growth,
            "in_place": in_place,
            "resettable": meter.resettable,
            "paths": stats.get("paths", {}),
            "duplicates": stats.get("duplicates", 0),
        }

    def close(self) -> None:
        if self.receiving is not None:
            self.receiving.close()


def receiver_main(conn: Connection, scenario: Scenario, knobs: Knobs, place: Place, rank: int) -> None:
    _enter(place)
    receiver = ReceiverProcess(scenario, knobs, place, rank)
    try:
        serve_commands(conn, {"setup": receiver.setup, "go": receiver.go})
    finally:
        receiver.close()
