"""Benchmark ZMQTransport beside plain TCP and torchft's own transports.

Run ``python -m zmqtransport.bench --help``. One sender process and N receiver
processes (multiprocessing ``spawn``) talk over loopback. In every trial each
method is run once, in an order rotated from trial to trial, so slow drifts of
a shared machine hit every method alike; the table reports medians.

Methods (``--methods``):

* ``tcp-reused``: anchor. A plain TCP socket; the receiver reads with
  ``recvmsg_into`` straight into tensors that already exist and were touched
  (the loopback ceiling for this machine).
* ``tcp-fresh``: anchor. The same socket, into freshly allocated tensors (what
  any receiver that allocates pays in page faults).
* ``zmq-inplace`` / ``zmq-fresh``: ZMQTransport with / without the
  ``state_dict`` option.
* ``http`` / ``http-4``: torchft's HTTPTransport with ``num_chunks`` 0 (its
  default) and 4 (needs torchft).
* ``pg-inplace`` / ``pg-fresh``: torchft's PGTransport over ProcessGroupGloo.

Timing is the receiver's wall time of one complete receive (``recv_checkpoint``
from call to return, or the TCP loop from connect to the last byte); with
several receivers the slowest and the fastest are reported. Peak RSS is the
rise of ``VmHWM`` above ``VmRSS`` measured just before the trial, after the
peak was reset through ``/proc/self/clear_refs``; setup memory (the sender's
state dict, the receiver's in-place targets) is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import http.server
import importlib.metadata
import json
import logging
import math
import multiprocessing
import os
import platform
import resource
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed
import zmq

from .buffers import tensor_view
from .transport import ZMQTransport

# Anchors come first: the ratio columns refer to them.
ANCHORS = ("tcp-reused", "tcp-fresh", "http", "http-4")
ALL_METHODS = (
    "tcp-reused",
    "tcp-fresh",
    "zmq-inplace",
    "zmq-fresh",
    "http",
    "http-4",
    "pg-inplace",
    "pg-fresh",
)
TORCHFT_METHODS = ("http", "http-4", "pg-inplace", "pg-fresh")
# Methods whose receiver writes into pre-built, touched target tensors.
TARGET_METHODS = ("tcp-reused", "zmq-inplace", "pg-inplace")
_IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux UIO_MAXIOV)
DEFAULT_SETTLE_S = 3.0


class BenchError(RuntimeError):
    """A child process failed; the message carries its traceback."""


# ----------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class Scenario:
    """One benchmark configuration: what moves, to how many receivers, and how."""

    name: str
    total_bytes: int
    tensor_bytes: int
    receivers: int = 1
    methods: tuple[str, ...] = ()
    reps: int = 5
    warmup: int = 1
    # Idle seconds after each receive. This VM's balloon reports freed memory
    # back to the host about 2 s after it is freed, and touching it again then
    # costs several times more than touching recycled pages: without a pause a
    # method that runs right after a fresh receive inherits its warm pages.
    settle_s: float = 0.0

    @property
    def tensor_sizes(self) -> list[int]:
        full, rest = divmod(self.total_bytes, self.tensor_bytes)
        return [self.tensor_bytes] * full + ([rest] if rest else [])


@dataclass(frozen=True)
class Knobs:
    """Transport options shared by every process of a run."""

    chunk_bytes: int | None = None
    window: int | None = None
    pack_below: int | None = None
    io_threads: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    timeout_s: float = 600.0
    verify: bool = True

    def zmq_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for name in ("chunk_bytes", "window", "pack_below", "io_threads"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        kwargs.update(dict(self.extra))
        return kwargs


def _presets() -> dict[str, Scenario]:
    gib, mib, kib = 1 << 30, 1 << 20, 1 << 10
    big = ("tcp-reused", "tcp-fresh", "http", "http-4")
    settle = DEFAULT_SETTLE_S
    return {
        "inplace": Scenario("inplace", gib, 4 * mib, methods=(*big, "zmq-inplace", "pg-inplace"), settle_s=settle),
        "fresh": Scenario("fresh", gib, 4 * mib, methods=(*big, "zmq-fresh", "pg-fresh"), settle_s=settle),
        "small": Scenario(
            "small",
            80 * mib,
            4 * kib,
            methods=(*big, "zmq-fresh", "zmq-inplace", "pg-fresh"),
            settle_s=settle,
        ),
        "fanout": Scenario(
            "fanout",
            gib,
            4 * mib,
            receivers=3,
            methods=(*big, "zmq-fresh", "zmq-inplace"),
            reps=3,
            settle_s=settle,
        ),
        "tiny": Scenario(
            "tiny",
            kib,
            kib,
            methods=("tcp-reused", "tcp-fresh", "http", "zmq-fresh", "zmq-inplace", "pg-fresh"),
            reps=30,
            warmup=3,
        ),
    }


PRESETS = _presets()


def parse_size(text: str) -> int:
    """``"1G"``, ``"4MiB"``, ``"4k"`` or plain bytes; binary multiples."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    scale = 1
    for suffix, factor in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40)):
        if value.endswith(suffix):
            value, scale = value[:-1], factor
            break
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    if number <= 0 or not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return int(number * scale)


def _parse_option(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    value: Any = raw
    if raw.lower() in ("true", "false"):
        value = raw.lower() == "true"
    else:
        with contextlib.suppress(ValueError):
            value = int(raw)
    return name, value


def torchft_available() -> bool:
    try:
        # Optional: the benchmark runs without torchft, minus its methods.
        import torchft.checkpointing  # noqa: F401
    except Exception:  # noqa: BLE001 - torchft's import fails in many ways on odd installs
        return False
    return True


def numpy_available() -> bool:
    """PGTransport's receive decodes its metadata through numpy."""
    try:
        import numpy  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------------- memory accounting


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False if impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def release_free_memory() -> None:
    """Give freed heap memory back to the kernel (glibc ``malloc_trim``).

    glibc keeps freed blocks for reuse, so a long-lived receiver would get its
    next "fresh" tensors from pages the previous trial already faulted in, and
    fresh receives would look as cheap as reused ones. Trimming after each
    trial makes every trial's fresh memory as fresh as a new process's.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class PeakMeter:
    """Peak RSS growth over a region, in bytes."""

    def __init__(self) -> None:
        release_free_memory()
        self.resettable = reset_peak()
        self.baseline = _status_kib("VmRSS") * 1024
        if not self.resettable:
            # Without clear_refs only the lifetime peak is known: an upper bound.
            self.baseline = min(self.baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def growth(self) -> int:
        return max(0, _status_kib("VmHWM") * 1024 - self.baseline)


# ----------------------------------------------------------------------------- payload


def make_tensors(sizes: Sequence[int], fill: float) -> list[Any]:
    """float32 tensors of the given byte sizes, touched (every page written)."""
    return [torch.full((max(1, n // 4),), fill, dtype=torch.float32) for n in sizes]


def stamp(tensors: Sequence[Any], step: int) -> None:
    """Give every tensor content that identifies both the tensor and the trial."""
    for index, tensor in enumerate(tensors):
        tensor.fill_(float(step))
        tensor[0] = float(index % (1 << 24))


def check(tensors: Sequence[Any], step: int, count: int) -> None:
    if len(tensors) != count:
        raise AssertionError(f"received {len(tensors)} tensors, expected {count}")
    for index, tensor in enumerate(tensors):
        flat = tensor.reshape(-1)
        if float(flat[0]) != float(index % (1 << 24)) or float(flat[-1]) != float(step):
            raise AssertionError(f"tensor {index} has wrong content after step {step}")


def state_dict_of(tensors: Sequence[Any]) -> dict[str, Any]:
    return {f"layer{index:06d}.weight": tensor for index, tensor in enumerate(tensors)}


def _views(tensors: Sequence[Any]) -> list[memoryview]:
    return [tensor_view(tensor) for tensor in tensors]


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send every view, in order, straight from its memory (gathered writes)."""
    pending = [view for view in views if len(view)]
    while pending:
        batch = pending[:_IOV_MAX]
        sent = sock.sendmsg(batch)
        done = 0
        while done < len(batch) and sent >= len(batch[done]):
            sent -= len(batch[done])
            done += 1
        rest = pending[done:]
        if sent:
            rest[0] = rest[0][sent:]
        pending = rest


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view, in order, straight from the socket (scattered reads)."""
    pending = [view for view in views if len(view)]
    while pending:
        batch = pending[:_IOV_MAX]
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            raise ConnectionError("the TCP sender closed early")
        done = 0
        while done < len(batch) and got >= len(batch[done]):
            got -= len(batch[done])
            done += 1
        rest = pending[done:]
        if got:
            rest[0] = rest[0][got:]
        pending = rest


# ----------------------------------------------------------------------------- child plumbing


def _serve_commands(conn: Connection, handlers: dict[str, Callable[..., Any]]) -> None:
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


def _quiet_child() -> None:
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.disable(logging.WARNING)  # the transports log INFO lines per transfer
    # HTTPTransport's handler writes an access-log line per request to stderr.
    http.server.BaseHTTPRequestHandler.log_message = lambda *args: None  # type: ignore[method-assign]


def _http_transport(timeout: timedelta, chunks: int) -> Any:
    # Optional dependency, imported only by the processes that run its methods.
    from torchft.checkpointing import (
        HTTPTransport,
    )

    return HTTPTransport(timeout, num_chunks=chunks)


def _pg_transport(pg: Any, timeout: timedelta, state_dict: Callable[[], Any] | None) -> Any:
    from torchft.checkpointing.pg_transport import (
        PGTransport,
    )

    return PGTransport(pg, timeout, torch.device("cpu"), state_dict=state_dict)


def _pg_init(store_port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    from torchft.process_group import (
        ProcessGroupGloo,
    )

    pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
    pg.configure(f"127.0.0.1:{store_port}/zmqtransport-bench", "bench", rank, world_size)
    return pg


class _SenderProcess:
    """Holds the payload and one server per method; stages a step on request."""

    def __init__(self, scenario: Scenario, knobs: Knobs) -> None:
        self.scenario = scenario
        self.knobs = knobs
        self.timeout = timedelta(seconds=knobs.timeout_s)
        self.tensors = make_tensors(scenario.tensor_sizes, 0.0)
        self.state = state_dict_of(self.tensors)
        self.views = _views(self.tensors)
        self.methods = set(scenario.methods)
        self.dst_ranks = list(range(1, scenario.receivers + 1))
        self.step = -1
        self.meter: PeakMeter | None = None
        self.threads: list[threading.Thread] = []
        self.errors: list[str] = []
        self.zmq: Any = None
        self.http: dict[str, Any] = {}
        self.pg: Any = None
        self.pg_transport: Any = None
        self.store: Any = None
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        threading.Thread(target=self._accept, daemon=True).start()

    def setup(self) -> dict[str, Any]:
        addresses: dict[str, Any] = {"tcp": self.listener.getsockname()[1]}
        if self.methods & {"zmq-inplace", "zmq-fresh"}:
            self.zmq = ZMQTransport(
                self.timeout,
                bind_host="127.0.0.1",
                advertise_host="127.0.0.1",
                **self.knobs.zmq_kwargs(),
            )
            addresses["zmq"] = self.zmq.metadata()
        for method, chunks in (("http", 0), ("http-4", 4)):
            if method in self.methods:
                transport = _http_transport(self.timeout, chunks)
                self.http[method] = transport
                port = transport.metadata().rstrip("/").split("/")[2].rsplit(":", 1)[1]
                addresses[method] = f"http://127.0.0.1:{port}/checkpoint/"
        if self.methods & {"pg-inplace", "pg-fresh"}:
            self.store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", 0, is_master=True, timeout=self.timeout, wait_for_workers=False
            )
            addresses["pg_store"] = self.store.port
        return addresses

    def pg_init(self, store_port: int) -> None:
        self.pg = _pg_init(store_port, 0, self.scenario.receivers + 1, self.knobs.timeout_s)
        self.pg_transport = _pg_transport(self.pg, self.timeout, None)

    # -- TCP anchor: a request carries the step; the reply is every tensor's bytes.
    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve_tcp, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve_tcp(self, conn: socket.socket) -> None:
        try:
            with conn:
                request = b""
                while len(request) < 8:
                    chunk = conn.recv(8 - len(request))
                    if not chunk:
                        return
                    request += chunk
                if int.from_bytes(request, "little") != self.step:
                    raise RuntimeError("TCP request for a step that is not staged")
                send_views(conn, self.views)
        except BaseException:  # noqa: BLE001 - reported by finish()
            self.errors.append(traceback.format_exc())

    def stage(self, method: str, step: int) -> float:
        """Make ``step`` available through ``method``; returns the staging seconds."""
        if step != self.step:
            stamp(self.tensors, step)
            self.step = step
        self.threads = [t for t in self.threads if t.is_alive()]
        self.meter = PeakMeter()
        started = time.perf_counter()
        if method.startswith("zmq"):
            self.zmq.send_checkpoint(self.dst_ranks, step, self.state, self.timeout)
        elif method in self.http:
            self.http[method].send_checkpoint(self.dst_ranks, step, self.state, self.timeout)
        return time.perf_counter() - started

    def go(self, method: str, step: int) -> None:
        if method.startswith("pg"):
            # PGTransport's send blocks until every receiver has its data.
            def send() -> None:
                try:
                    self.pg_transport.send_checkpoint(self.dst_ranks, step, self.state, self.timeout)
                except BaseException:  # noqa: BLE001 - reported by finish()
                    self.errors.append(traceback.format_exc())

            thread = threading.Thread(target=send, daemon=True)
            self.threads.append(thread)
            thread.start()

    def finish(self, method: str) -> int:
        """Wait for the method's serving work to end; returns the sender's peak RSS growth."""
        deadline = time.monotonic() + self.knobs.timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if method.startswith("zmq"):
            self.zmq.disallow_checkpoint()
        elif method in self.http:
            self.http[method].disallow_checkpoint()
        assert self.meter is not None
        growth = self.meter.growth()
        if self.errors:
            errors, self.errors = self.errors, []
            raise BenchError("\n".join(errors))
        return growth

    def close(self) -> None:
        self.listener.close()
        if self.zmq is not None:
            self.zmq.shutdown()
        for transport in self.http.values():
            transport.shutdown(wait=False)


def _sender_main(conn: Connection, scenario: Scenario, knobs: Knobs) -> None:
    _quiet_child()
    sender = _SenderProcess(scenario, knobs)
    try:
        _serve_commands(
            conn,
            {
                "setup": sender.setup,
                "pg_init": sender.pg_init,
                "stage": sender.stage,
                "go": sender.go,
                "finish": sender.finish,
            },
        )
    finally:
        sender.close()


class _ReceiverProcess:
    """Receives one step per command through the named method, timing only the receive."""

    def __init__(self, scenario: Scenario, knobs: Knobs, rank: int) -> None:
        self.scenario = scenario
        self.knobs = knobs
        self.rank = rank
        self.timeout = timedelta(seconds=knobs.timeout_s)
        self.sizes = scenario.tensor_sizes
        self.methods = set(scenario.methods)
        self.targets: list[Any] = []
        self.target_views: list[memoryview] = []
        if self.methods & set(TARGET_METHODS):
            # The recovering model's own tensors: allocated and touched up front.
            self.targets = make_tensors(self.sizes, -1.0)
            self.target_views = _views(self.targets)
        self.target_state = state_dict_of(self.targets)
        self.transports: dict[str, Any] = {}
        self.pg: Any = None
        self.addresses: dict[str, Any] = {}
        self.prepared: tuple[str, str, int] | None = None
        self.meter: PeakMeter | None = None

    def setup(self, addresses: dict[str, Any]) -> None:
        self.addresses = addresses
        kwargs: dict[str, Any] = {
            "bind_host": "127.0.0.1",
            "advertise_host": "127.0.0.1",
            **self.knobs.zmq_kwargs(),
        }
        if "zmq-inplace" in self.methods:
            self.transports["zmq-inplace"] = ZMQTransport(self.timeout, state_dict=lambda: self.target_state, **kwargs)
        if "zmq-fresh" in self.methods:
            self.transports["zmq-fresh"] = ZMQTransport(self.timeout, **kwargs)
        for method, chunks in (("http", 0), ("http-4", 4)):
            if method in self.methods:
                self.transports[method] = _http_transport(self.timeout, chunks)

    def pg_init(self, store_port: int) -> None:
        world_size = self.scenario.receivers + 1
        self.pg = _pg_init(store_port, self.rank, world_size, self.knobs.timeout_s)
        self.transports["pg-inplace"] = _pg_transport(self.pg, self.timeout, lambda: self.target_state)
        self.transports["pg-fresh"] = _pg_transport(self.pg, self.timeout, None)

    def prepare(self, method: str, metadata: str, step: int) -> None:
        self.prepared = (method, metadata, step)
        self.meter = PeakMeter()

    def go(self) -> dict[str, Any]:
        assert self.prepared is not None and self.meter is not None
        method, metadata, step = self.prepared
        started = time.perf_counter()
        result, tensors = self._receive(method, metadata, step)
        seconds = time.perf_counter() - started
        growth = self.meter.growth()
        in_place = 0
        if self.knobs.verify:
            check(tensors, step, len(self.sizes))
            if self.targets:
                owned = {t.untyped_storage().data_ptr() for t in self.targets}
                in_place = sum(1 for t in tensors if t.untyped_storage().data_ptr() in owned)
        del result, tensors
        release_free_memory()
        return {
            "seconds": seconds,
            "rss": growth,
            "in_place": in_place,
            "resettable": self.meter.resettable,
        }

    def _receive(self, method: str, metadata: str, step: int) -> tuple[Any, list[Any]]:
        if method.startswith("tcp"):
            if method == "tcp-reused":
                tensors, views = self.targets, self.target_views
            else:
                tensors = [_empty_float32(n) for n in self.sizes]
                views = _views(tensors)
            with socket.create_connection(("127.0.0.1", int(metadata))) as conn:
                conn.sendall(step.to_bytes(8, "little"))
                recv_views(conn, views)
            return tensors, list(tensors)
        result = self.transports[method].recv_checkpoint(0, metadata, step, self.timeout)
        return result, list(result.values())

    def close(self) -> None:
        for transport in self.transports.values():
            with contextlib.suppress(Exception):
                transport.shutdown(wait=False)


def _empty_float32(nbytes: int) -> Any:
    return torch.empty(max(1, nbytes // 4), dtype=torch.float32)


def _receiver_main(conn: Connection, scenario: Scenario, knobs: Knobs, rank: int) -> None:
    _quiet_child()
    receiver = _ReceiverProcess(scenario, knobs, rank)
    try:
        _serve_commands(
            conn,
            {
                "setup": receiver.setup,
                "pg_init": receiver.pg_init,
                "prepare": receiver.prepare,
                "go": receiver.go,
            },
        )
    finally:
        receiver.close()


# ----------------------------------------------------------------------------- driver


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


def _gather(children: Sequence[_Child], timeout: float, *command: Any) -> list[Any]:
    for child in children:
        child.send(*command)
    return [child.reply(timeout) for child in children]


@dataclass
class Trial:
    method: str
    trial: int
    seconds: list[float]
    recv_rss: list[int]
    send_rss: int
    stage_seconds: float
    in_place: list[int]


@dataclass
class MethodSummary:
    method: str
    slowest_s: float
    fastest_s: float
    gbps: float
    spread: float  # median over trials of slowest / fastest receiver
    send_rss_max: int
    recv_rss_max: int
    stage_s: float
    in_place_tensors: int
    ratios: dict[str, float] = field(default_factory=dict)


@dataclass
class ScenarioResult:
    scenario: Scenario
    trials: list[Trial]
    summary: dict[str, MethodSummary]
    wall_seconds: float
    peak_resettable: bool


def _default_methods(with_torchft: bool) -> tuple[str, ...]:
    return tuple(m for m in ALL_METHODS if with_torchft or m not in TORCHFT_METHODS)


def run_scenario(scenario: Scenario, knobs: Knobs, log: Callable[[str], None]) -> ScenarioResult:
    """Start the processes, run warm-up and measured trials, and summarize."""
    context = multiprocessing.get_context("spawn")
    started = time.monotonic()
    setup_timeout = 300.0 + scenario.total_bytes / 50e6
    trial_timeout = knobs.timeout_s + 60.0
    children: list[_Child] = []

    def spawn(name: str, target: Callable[..., None], *args: Any) -> _Child:
        parent_end, child_end = context.Pipe()
        process = context.Process(target=target, args=(child_end, *args), name=name, daemon=True)
        process.start()
        child_end.close()
        child = _Child(process, parent_end, name)
        children.append(child)
        return child

    env_before = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # keep gloo on loopback
    try:
        sender = spawn("bench-sender", _sender_main, scenario, knobs)
        receivers = [
            spawn(f"bench-receiver-{rank}", _receiver_main, scenario, knobs, rank)
            for rank in range(1, scenario.receivers + 1)
        ]
        addresses = sender.call(setup_timeout, "setup")
        _gather(receivers, setup_timeout, "setup", addresses)
        if "pg_store" in addresses:
            _gather([sender, *receivers], setup_timeout, "pg_init", addresses["pg_store"])
        trials: list[Trial] = []
        resettable = True
        methods = list(scenario.methods)
        for index in range(scenario.warmup + scenario.reps):
            step = index + 1
            shift = index % len(methods)
            for method in methods[shift:] + methods[:shift]:
                if method.startswith("tcp"):
                    metadata = str(addresses["tcp"])
                elif method.startswith("zmq"):
                    metadata = addresses["zmq"]
                elif method.startswith("pg"):
                    metadata = "<n/a>"
                else:
                    metadata = addresses[method]
                stage_seconds = sender.call(trial_timeout, "stage", method, step)
                _gather(receivers, trial_timeout, "prepare", method, metadata, step)
                sender.call(trial_timeout, "go", method, step)
                outcomes = _gather(receivers, trial_timeout, "go")
                send_rss = sender.call(trial_timeout, "finish", method)
                time.sleep(scenario.settle_s)
                if index < scenario.warmup:
                    continue
                trials.append(
                    Trial(
                        method,
                        index - scenario.warmup,
                        [o["seconds"] for o in outcomes],
                        [o["rss"] for o in outcomes],
                        send_rss,
                        stage_seconds,
                        [o["in_place"] for o in outcomes],
                    )
                )
                resettable = resettable and all(o["resettable"] for o in outcomes)
            log(f"  [{scenario.name}] trial {index + 1}/{scenario.warmup + scenario.reps} done")
        _gather(children, 30.0, "exit")
    finally:
        for child in children:
            child.process.join(5.0)
            if child.process.is_alive():
                child.process.terminate()
                child.process.join(5.0)
        if env_before is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
    summary = summarize(scenario, trials)
    return ScenarioResult(scenario, trials, summary, time.monotonic() - started, resettable)


def summarize(scenario: Scenario, trials: Sequence[Trial]) -> dict[str, MethodSummary]:
    summary: dict[str, MethodSummary] = {}
    for method in scenario.methods:
        mine = [t for t in trials if t.method == method]
        if not mine:
            continue
        slowest = statistics.median(max(t.seconds) for t in mine)
        summary[method] = MethodSummary(
            method=method,
            slowest_s=slowest,
            fastest_s=statistics.median(min(t.seconds) for t in mine),
            gbps=scenario.total_bytes / slowest / 1e9,
            spread=statistics.median(max(t.seconds) / max(min(t.seconds), 1e-12) for t in mine),
            send_rss_max=max(t.send_rss for t in mine),
            recv_rss_max=max(max(t.recv_rss) for t in mine),
            stage_s=statistics.median(t.stage_seconds for t in mine),
            in_place_tensors=min(min(t.in_place) for t in mine),
        )
    for entry in summary.values():
        for anchor in ANCHORS:
            if anchor in summary:
                # > 1 means faster than the anchor (ratio of median slowest-receiver times).
                entry.ratios[anchor] = summary[anchor].slowest_s / entry.slowest_s
    return summary


# ----------------------------------------------------------------------------- targets (issue 4)


@dataclass
class Target:
    scenario: str
    text: str
    measured: float
    limit: float
    higher_is_better: bool

    @property
    def holds(self) -> bool:
        return self.measured >= self.limit if self.higher_is_better else self.measured <= self.limit


def evaluate_targets(results: Sequence[ScenarioResult]) -> list[Target]:
    """The performance targets of issue 4, wherever the run measured what they need."""
    targets: list[Target] = []
    mib = float(1 << 20)

    def add(scenario: str, text: str, measured: float, limit: float, higher: bool = True) -> None:
        targets.append(Target(scenario, text, measured, limit, higher))

    for result in results:
        name, s = result.scenario.name, result.summary
        zi, zf = s.get("zmq-inplace"), s.get("zmq-fresh")
        if name == "inplace" and zi is not None:
            if "tcp-reused" in zi.ratios:
                add(name, "zmq-inplace speed / tcp-reused ceiling", zi.ratios["tcp-reused"], 0.75)
            add(name, "sender peak RSS growth, MiB", zi.send_rss_max / mib, 64, higher=False)
            add(
                name,
                "in-place receiver peak RSS growth, MiB",
                zi.recv_rss_max / mib,
                128,
                higher=False,
            )
        if name == "fresh" and zf is not None:
            if "http" in zf.ratios:
                add(name, "zmq-fresh speed / http (num_chunks=0)", zf.ratios["http"], 2.0)
            if "http-4" in zf.ratios:
                add(name, "zmq-fresh speed / http-4 (num_chunks=4)", zf.ratios["http-4"], 1.3)
            add(name, "sender peak RSS growth, MiB", zf.send_rss_max / mib, 64, higher=False)
        if name == "small" and zf is not None and "http" in zf.ratios:
            add(name, "zmq-fresh speed / http (num_chunks=0)", zf.ratios["http"], 6.0)
        if name == "fanout":
            for method in ("zmq-fresh", "zmq-inplace"):
                entry = s.get(method)
                if entry is None:
                    continue
                if "http" in entry.ratios:
                    add(
                        name,
                        f"{method} slowest receiver speed / http slowest",
                        entry.ratios["http"],
                        2.0,
                    )
                add(name, f"{method} slowest / fastest receiver", entry.spread, 1.5, higher=False)
        if name == "tiny":
            for method in ("zmq-fresh", "zmq-inplace"):
                entry = s.get(method)
                if entry is not None:
                    add(name, f"{method} median recv, ms", entry.slowest_s * 1000, 5.0, higher=False)
    return targets


# ----------------------------------------------------------------------------- report


def machine_description() -> dict[str, Any]:
    model = platform.processor() or "unknown cpu"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = 0
    with contextlib.suppress(OSError, ValueError):
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    thp = "unknown"
    with (
        contextlib.suppress(OSError),
        open("/sys/kernel/mm/transparent_hugepage/enabled") as enabled,
    ):
        thp = enabled.read().strip()
    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
    }
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        versions["torchft"] = importlib.metadata.version("torchft")
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(memory / (1 << 30), 1),
        "kernel": platform.release(),
        "transparent_hugepage": thp,
        "versions": versions,
    }


def _human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.4g} {unit}"
    return f"{nbytes} B"


def format_result(result: ScenarioResult) -> str:
    scenario = result.scenario
    sizes = scenario.tensor_sizes
    lines = [
        f"scenario {scenario.name}: {_human(scenario.total_bytes)} as {len(sizes)} float32 "
        f"tensor(s) of {_human(scenario.tensor_bytes)}, {scenario.receivers} receiver(s), "
        f"{scenario.reps} trial(s) after {scenario.warmup} warm-up, "
        f"{scenario.settle_s:g} s settle, medians ({result.wall_seconds:.0f} s wall)",
    ]
    anchors = [a for a in ANCHORS if a in result.summary]
    multi = scenario.receivers > 1
    header = ["method", "slowest s" if multi else "seconds"]
    if multi:
        header += ["fastest s", "slow/fast"]
    header += ["GB/s", *(f"x {a}" for a in anchors), "send +MiB", "recv +MiB"]
    rows = [header]
    for method, entry in result.summary.items():
        row = [method, _seconds(entry.slowest_s)]
        if multi:
            row += [_seconds(entry.fastest_s), f"{entry.spread:.2f}"]
        row += [f"{entry.gbps:.3g}"]
        row += [f"{entry.ratios[a]:.2f}" for a in anchors]
        row += [f"{entry.send_rss_max / (1 << 20):.0f}", f"{entry.recv_rss_max / (1 << 20):.0f}"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for number, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if number == 0:
            lines.append("  ".join("-" * width for width in widths))
    partial = [
        f"{m} ({e.in_place_tensors}/{len(sizes)})"
        for m, e in result.summary.items()
        if m in TARGET_METHODS and e.in_place_tensors != len(sizes)
    ]
    if partial:
        lines.append("note: tensors received in place fewer than expected: " + ", ".join(partial))
    if not result.peak_resettable:
        lines.append("note: /proc/self/clear_refs unavailable; RSS columns are lifetime peaks (upper bounds)")
    return "\n".join(lines)


def _seconds(value: float) -> str:
    return f"{value:.4f}" if value < 0.1 else f"{value:.3f}"


def format_targets(targets: Sequence[Target]) -> str:
    lines = ["targets (issue 4):"]
    for target in targets:
        relation = ">=" if target.higher_is_better else "<="
        verdict = "holds" if target.holds else "MISSED"
        lines.append(
            f"  [{target.scenario}] {target.text}: {target.measured:.3g} (target {relation} {target.limit:g}) {verdict}"
        )
    return "\n".join(lines)


def to_json(results: Sequence[ScenarioResult], knobs: Knobs, argv: Sequence[str]) -> dict[str, Any]:
    return {
        "command": ["python", "-m", "zmqtransport.bench", *argv],
        "machine": machine_description(),
        "knobs": {**asdict(knobs), "extra": dict(knobs.extra)},
        "scenarios": [
            {
                "scenario": asdict(result.scenario),
                "tensors": len(result.scenario.tensor_sizes),
                "wall_seconds": result.wall_seconds,
                "peak_resettable": result.peak_resettable,
                "summary": {m: asdict(e) for m, e in result.summary.items()},
                "trials": [asdict(t) for t in result.trials],
            }
            for result in results
        ],
        "targets": [{**asdict(t), "holds": t.holds} for t in evaluate_targets(results)],
    }


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zmqtransport.bench",
        description="Benchmark ZMQTransport beside plain TCP and torchft's transports (loopback).",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=[*PRESETS, "all"],
        help="a preset from issue 4 (repeatable; 'all' runs every one); sizes below override it",
    )
    parser.add_argument("--total", type=parse_size, help="bytes to move per receiver (e.g. 1G); default 1G")
    parser.add_argument("--tensor", type=parse_size, help="bytes per float32 tensor (e.g. 4M); default 4M")
    parser.add_argument("--receivers", type=int, help="receivers at once (default 1)")
    parser.add_argument(
        "--mode",
        choices=["inplace", "fresh", "both"],
        help="custom run: into existing tensors, fresh ones, or both (default both)",
    )
    parser.add_argument("--methods", help=f"comma-separated subset of {','.join(ALL_METHODS)}")
    parser.add_argument("--skip", default="", help="comma-separated methods to leave out")
    parser.add_argument("--reps", type=int, help="measured trials per method")
    parser.add_argument("--warmup", type=int, help="unmeasured trials first")
    parser.add_argument(
        "--settle",
        type=float,
        help=f"idle seconds after each receive so freed memory goes back to the host "
        f"(default {DEFAULT_SETTLE_S:g} for 64 MiB and more, else 0)",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu"], help="tensor device (only cpu for now)")
    parser.add_argument("--chunk-bytes", type=parse_size, help="ZMQTransport chunk_bytes")
    parser.add_argument("--window", type=int, help="ZMQTransport window (credit)")
    parser.add_argument("--pack-below", type=parse_size, help="ZMQTransport pack_below")
    parser.add_argument("--io-threads", type=int, help="ZMQTransport io_threads")
    parser.add_argument(
        "--zmq-option",
        action="append",
        type=_parse_option,
        default=[],
        metavar="NAME=VALUE",
        help="any other ZMQTransport keyword option (repeatable)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="transport timeout, seconds")
    parser.add_argument("--no-verify", action="store_true", help="skip the content check after each receive")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    return parser


def scenarios_from_args(args: argparse.Namespace, with_torchft: bool, with_pg: bool) -> list[Scenario]:
    names: list[str] = []
    for name in args.scenario or []:
        names += list(PRESETS) if name == "all" else [name]
    custom = not names
    base = [PRESETS[name] for name in dict.fromkeys(names)] or [Scenario("custom", 1 << 30, 4 << 20, methods=())]
    skip = {m.strip() for m in args.skip.split(",") if m.strip()}
    chosen: list[Scenario] = []
    for scenario in base:
        total = args.total if args.total is not None else scenario.total_bytes
        tensor = args.tensor if args.tensor is not None else scenario.tensor_bytes
        tensor = min(tensor, total)
        if tensor % 4 or total % 4:
            raise SystemExit("--total and --tensor must be multiples of 4 bytes (float32)")
        if args.methods:
            methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
        elif custom:
            mode = args.mode or "both"
            methods = tuple(
                m for m in _default_methods(with_torchft) if mode == "both" or m in ANCHORS or m.endswith(mode)
            )
        else:
            methods = scenario.methods
        unknown = [m for m in methods if m not in ALL_METHODS]
        if unknown:
            raise SystemExit(f"unknown method(s): {', '.join(unknown)}")
        methods = tuple(
            m
            for m in methods
            if m not in skip and (with_torchft or m not in TORCHFT_METHODS) and (with_pg or not m.startswith("pg"))
        )
        if not methods:
            raise SystemExit("no methods left to run")
        if args.settle is not None:
            settle = args.settle
        elif custom:
            settle = DEFAULT_SETTLE_S if total >= 64 << 20 else 0.0
        else:
            settle = scenario.settle_s
        chosen.append(
            replace(
                scenario,
                total_bytes=total,
                tensor_bytes=tensor,
                receivers=args.receivers if args.receivers is not None else scenario.receivers,
                methods=methods,
                reps=args.reps if args.reps is not None else scenario.reps,
                warmup=args.warmup if args.warmup is not None else scenario.warmup,
                settle_s=settle,
            )
        )
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.receivers is not None and args.receivers < 1:
        raise SystemExit("--receivers must be at least 1")
    if (args.reps is not None and args.reps < 1) or (args.warmup is not None and args.warmup < 0):
        raise SystemExit("--reps must be >= 1 and --warmup >= 0")
    with_torchft = torchft_available()
    with_pg = with_torchft and numpy_available()
    scenarios = scenarios_from_args(args, with_torchft, with_pg)
    knobs = Knobs(
        chunk_bytes=args.chunk_bytes,
        window=args.window,
        pack_below=args.pack_below,
        io_threads=args.io_threads,
        extra=tuple(args.zmq_option),
        timeout_s=args.timeout,
        verify=not args.no_verify,
    )

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if not with_torchft:
        log("torchft is not importable: HTTPTransport and PGTransport are left out")
    elif not with_pg:
        log("numpy is not importable (PGTransport's receive needs it): PGTransport is left out")
    results: list[ScenarioResult] = []
    try:
        for scenario in scenarios:
            log(f"running scenario {scenario.name}: {', '.join(scenario.methods)}")
            results.append(run_scenario(scenario, knobs, log))
    except BenchError as exc:
        log(f"benchmark failed: {exc}")
        return 1
    if args.json:
        print(json.dumps(to_json(results, knobs, argv), indent=2))
        return 0
    machine = machine_description()
    print(
        f"machine: {machine['cpus']} x {machine['cpu_model']}, {machine['memory_gib']} GiB, "
        f"kernel {machine['kernel']}, THP {machine['transparent_hugepage']}; "
        + ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    )
    print("command: python -m zmqtransport.bench " + " ".join(argv))
    print("ratio columns: anchor seconds / method seconds (above 1 = faster than the anchor)")
    for result in results:
        print()
        print(format_result(result))
    targets = evaluate_targets(results)
    if targets:
        print()
        print(format_targets(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
