"""Misconfiguration fails fast with a clear error, and every failed set-up releases what it took.

The bug class: a constructor opens a ZeroMQ socket (or starts a thread), a
later step fails, and the socket stays open; the cleanup then waits forever in
``Context.term()``. So every construction here runs in a helper thread joined
with a bound (a regression fails the test instead of hanging the suite), and
each test checks that nothing was left behind: no thread of this package, no
file descriptor, no "left open" error from the bounded context teardown.

The CLI tests at the end run ``python -m zmqtransport`` in a subprocess and
check that stderr carries the command's own words only (no third-party warnings).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import zmq

from zmqtransport import BindError, ZMQTransport, buffers, device, fetch, security, sockets
from zmqtransport import transport as transport_module
from zmqtransport.net import ADVERTISE_ENV, PeerAddress
from zmqtransport.serve import Server
from zmqtransport.serve import server as serve_server

pytestmark = pytest.mark.timeout(120)  # a backstop: each wait below is bounded on its own

HANG_S = 20.0  # far above the milliseconds these take; only a hang gets near it
TIMEOUT = timedelta(seconds=5)
LOOPBACK = "127.0.0.1"
NOT_LOCAL = "192.0.2.1"  # TEST-NET-1 (RFC 5737): never an address of this host
UNRESOLVABLE = "nohost.invalid"  # .invalid never resolves (RFC 2606)
RealThread = threading.Thread  # some tests replace threading.Thread for the code under test


# Every context a test makes stays referenced: a context whose socket was left
# open would otherwise hang the garbage collector (pyzmq terminates a context
# when it is collected, and term() waits for the open socket).
_CONTEXTS: list[zmq.Context[Any]] = []


def new_context() -> zmq.Context[Any]:
    context: zmq.Context[Any] = zmq.Context()
    _CONTEXTS.append(context)
    return context


def call_bounded(fn: Callable[[], Any], seconds: float = HANG_S) -> tuple[Any, BaseException | None, float]:
    """Run ``fn`` in a daemon thread; fail the test if it has not returned or raised after ``seconds``."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as exc:
            outcome["error"] = exc

    started = time.monotonic()
    worker = RealThread(target=run, name="failfast-call", daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"hung for {seconds:.0f} s (a socket left open blocks Context.term())"
    return outcome.get("value"), outcome.get("error"), time.monotonic() - started


def expect_error(fn: Callable[[], Any], kind: type[BaseException]) -> BaseException:
    value, error, _ = call_bounded(fn)
    if error is None and isinstance(value, ZMQTransport):
        value.shutdown()
    assert isinstance(error, kind), f"expected {kind.__name__}, got {error!r}"
    return error


def _our_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("zmqtransport")}


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def nothing_left(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """After the test: no new thread of ours alive, no new descriptor, no socket reported left open."""
    caplog.set_level(logging.ERROR, logger="zmqtransport")
    threads, fds = _our_threads(), _open_fds()
    yield
    deadline = time.monotonic() + 5
    while _our_threads() - threads and time.monotonic() < deadline:
        time.sleep(0.01)  # a thread that was told to stop may need a moment to exit
    assert not _our_threads() - threads, f"threads left running: {_our_threads() - threads}"
    assert not _open_fds() - fds, "file descriptors left open"
    # get_records: caplog.text here would hold the teardown's records only.
    left_open = [r.getMessage() for r in caplog.get_records("call") if "left open" in r.getMessage()]
    assert not left_open, left_open


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port some other socket is listening on."""
    with socket.socket() as holder:
        holder.bind((LOOPBACK, 0))
        holder.listen()
        yield holder.getsockname()[1]


# ----------------------------------------------------------------------------- ZMQTransport


@pytest.mark.usefixtures("nothing_left")
def test_port_in_use_raises_promptly(busy_port: int) -> None:
    error = expect_error(lambda: ZMQTransport(TIMEOUT, bind_host=LOOPBACK, port=busy_port), BindError)
    assert isinstance(error, OSError) and error.errno == errno.EADDRINUSE
    assert f"port={busy_port} is already in use" in str(error)


@pytest.mark.usefixtures("nothing_left")
def test_port_in_use_with_curve_stops_the_zap_handler(busy_port: int) -> None:
    # The ZAP handler (a thread with sockets of its own) is up before the bind fails.
    secret = security.new_job_secret()
    error = expect_error(
        lambda: ZMQTransport(TIMEOUT, bind_host=LOOPBACK, port=busy_port, curve_secret=secret), BindError
    )
    assert f"port={busy_port}" in str(error)


@pytest.mark.usefixtures("nothing_left")
def test_bind_host_not_on_this_host() -> None:
    error = expect_error(lambda: ZMQTransport(TIMEOUT, bind_host=NOT_LOCAL), BindError)
    assert isinstance(error, OSError) and error.errno == errno.EADDRNOTAVAIL
    assert str(error) == f"bind_host={NOT_LOCAL!r}: not an address of this host"


@pytest.mark.usefixtures("nothing_left")
def test_bind_host_that_does_not_resolve() -> None:
    error = expect_error(lambda: ZMQTransport(TIMEOUT, bind_host=UNRESOLVABLE), BindError)
    assert str(error).startswith(f"bind_host={UNRESOLVABLE!r}: not an address, interface name or resolvable")


@pytest.mark.usefixtures("nothing_left")
@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"port": 70000}, "port=70000"),  # libzmq would bind some other port
        ({"port": -1}, "port=-1"),
        ({"port": "5555"}, "port='5555'"),
        ({"io_threads": 0}, "io_threads=0"),  # libzmq would fail every bind, obscurely
        ({"window": 0}, "window=0"),
        ({"chunk_bytes": 1}, "chunk_bytes=1"),
        ({"pack_below": 2 << 20}, "pack_below=2097152"),
        ({"timeout": timedelta(0)}, "timeout=0:00:00"),
        ({"device": "tpu"}, "'tpu'"),
        ({"curve_secret": "short"}, "at least 16 bytes"),
        ({"curve_allowed_clients": ["not-a-key"]}, "allowed client key"),
        ({"curve_secret": "s" * 16, "curve_server_keypair": (b"x" * 40, b"y" * 40)}, "curve_server_keypair"),
        # An invalid combination: CURVE on, but no client key could ever be served.
        ({"curve_server_keypair": security.generate_keypair()}, "no client may fetch"),
    ],
)
def test_invalid_options_are_named(options: dict[str, Any], named: str) -> None:
    timeout = options.pop("timeout", TIMEOUT)
    error = expect_error(lambda: ZMQTransport(timeout, bind_host=LOOPBACK, **options), ValueError)
    assert named in str(error)


@pytest.mark.parametrize(("cores", "io_threads"), [(1, 1), (2, 1), (7, 1), (8, 2), (12, 3), (16, 4), (128, 4)])
def test_io_threads_default_to_one_per_four_cores_at_most_four(
    monkeypatch: pytest.MonkeyPatch, cores: int, io_threads: int
) -> None:
    monkeypatch.setattr(transport_module, "available_cores", lambda: cores)
    with ZMQTransport(TIMEOUT, bind_host=LOOPBACK) as transport:
        assert transport._context.get(zmq.IO_THREADS) == io_threads
        # Several I/O threads: a receive that is no swarm member reads over four connections.
        assert transport._fetch_options.direct_streams == (4 if io_threads > 1 else 1)
    with ZMQTransport(TIMEOUT, bind_host=LOOPBACK, io_threads=1) as transport:
        assert transport._context.get(zmq.IO_THREADS) == 1
        assert transport._fetch_options.direct_streams == 1


def test_a_receive_into_device_memory_keeps_one_connection_per_path() -> None:
    # The extra streams' gain was measured in host memory; a GPU heal was not faster with them (docs/cuda.md).
    options = fetch.FetchOptions(direct_streams=4)
    assert options.into(None).direct_streams == 4
    assert options.into({"w": torch.zeros(4), "step": 1}).direct_streams == 4
    assert options.into({"w": torch.zeros(4), "b": [torch.empty(2, device="meta")]}).direct_streams == 1
    assert fetch.FetchOptions(direct_streams=4, device=torch.device("cuda")).into(None).direct_streams == 1
    assert fetch.FetchOptions(direct_streams=1).into(None).direct_streams == 1


@pytest.mark.usefixtures("nothing_left")
def test_malformed_advertise_variable_is_named_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    # The environment is read at construction: a bad value must fail like a bad
    # option, before the serving thread and its socket exist.
    monkeypatch.setenv(ADVERTISE_ENV, "10.0.0.7,,10.0.0.8")
    error = expect_error(lambda: ZMQTransport(TIMEOUT, bind_host=LOOPBACK), ValueError)
    assert str(error).startswith(f"{ADVERTISE_ENV}='10.0.0.7,,10.0.0.8': ")


def test_construction_after_failures_still_works(busy_port: int) -> None:
    """A failed construction leaves the process able to build a working transport."""
    expect_error(lambda: ZMQTransport(TIMEOUT, bind_host=LOOPBACK, port=busy_port), BindError)
    with ZMQTransport(TIMEOUT, bind_host=LOOPBACK) as transport:
        assert transport.address.port > 0


# ----------------------------------------------------------------------------- the parts


@pytest.mark.usefixtures("nothing_left")
def test_bind_helper_closes_the_socket_it_could_not_bind(busy_port: int) -> None:
    context = new_context()
    router = context.socket(zmq.ROUTER)
    error = expect_error(lambda: sockets.bind(router, LOOPBACK, busy_port), BindError)
    assert error.errno == errno.EADDRINUSE and isinstance(error.__cause__, zmq.ZMQError)
    assert router.closed
    assert sockets.terminate(context, HANG_S)


@pytest.mark.usefixtures("nothing_left")
def test_server_closes_its_socket_when_configuring_it_fails() -> None:
    context = new_context()

    def refuse(sock: zmq.Socket[Any]) -> None:
        raise ValueError("bad key")

    expect_error(lambda: Server(context, LOOPBACK, 0, 1.0, configure=refuse), ValueError)
    assert sockets.terminate(context, HANG_S), "the ROUTER was left open"


@pytest.mark.usefixtures("nothing_left")
def test_server_releases_socket_and_pipe_when_its_thread_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    class Unstartable(RealThread):
        def start(self) -> None:
            if self.name.startswith("zmqtransport-serve"):
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(serve_server.threading, "Thread", Unstartable)  # where the serving thread starts
    context = new_context()
    expect_error(lambda: Server(context, LOOPBACK, 0, 1.0), RuntimeError)
    assert sockets.terminate(context, HANG_S), "the ROUTER was left open"


@pytest.mark.usefixtures("nothing_left")
def test_server_bind_failure_closes_everything(busy_port: int) -> None:
    context = new_context()
    expect_error(lambda: Server(context, LOOPBACK, busy_port, 1.0), BindError)
    assert sockets.terminate(context, HANG_S), "the ROUTER was left open"


@pytest.mark.usefixtures("nothing_left")
def test_fetch_closes_its_socket_when_configuring_it_fails() -> None:
    context = new_context()

    def refuse(sock: zmq.Socket[Any]) -> None:
        raise ValueError("CURVE is not available in this libzmq")

    options = fetch.FetchOptions()
    address = PeerAddress(LOOPBACK, 9)  # never contacted: the set-up fails first
    expect_error(lambda: fetch.fetch(context, address, 0, 1, 1.0, options, refuse), ValueError)
    expect_error(lambda: fetch.fetch_header(context, address, 1, 1.0, options, refuse), ValueError)
    assert sockets.terminate(context, HANG_S), "the DEALER was left open"


@pytest.mark.usefixtures("nothing_left")
def test_zap_handler_that_cannot_start_leaves_no_socket() -> None:
    context = new_context()
    allowed = frozenset({security.generate_keypair().public})
    first = security.ZapHandler(context, allowed)
    try:
        # One ZAP handler per context (RFC 27's fixed endpoint): the second cannot bind.
        error = expect_error(lambda: security.ZapHandler(context, allowed), RuntimeError)
        assert "cannot start the ZAP handler" in str(error)
    finally:
        first.close()
    assert sockets.terminate(context, HANG_S), "a ZAP handler socket was left open"


# ----------------------------------------------------------------------------- shutdown: every wait bounded


def _wait_for(condition: Callable[[], bool], seconds: float = HANG_S) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.usefixtures("nothing_left")
def test_shutdown_closes_everything_and_warns_about_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="zmqtransport")
    peer: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    peer.send_checkpoint([], 1, {"w": torch.arange(4.0)}, TIMEOUT)
    _, error, _ = call_bounded(peer.shutdown)
    assert error is None
    assert peer._context.closed and not peer._server.alive
    assert not [r.getMessage() for r in caplog.get_records("call") if r.levelno >= logging.WARNING]


def test_shutdown_with_a_leaked_socket_returns_within_its_bound(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    bound = 0.5
    monkeypatch.setattr(transport_module, "SHUTDOWN_TERM_TIMEOUT", bound)
    caplog.set_level(logging.WARNING, logger="zmqtransport")
    threads = _our_threads()
    peer: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    _CONTEXTS.append(peer._context)  # see _CONTEXTS: collecting it would wait for the leaked socket
    leaked = peer._context.socket(zmq.DEALER)  # a caller's socket on the transport's context, never closed
    try:
        _, error, seconds = call_bounded(peer.shutdown)  # hung for good in Context.term() before the bound
        assert error is None
        assert seconds < bound + HANG_S / 2
        assert not peer._server.alive
        warnings = [r for r in caplog.get_records("call") if "did not terminate" in r.getMessage()]
        assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, warnings
        assert "zmq.DEALER" in warnings[0].getMessage(), "the warning does not name the socket left open"
    finally:
        leaked.close(linger=0)
    # Once the leak is closed, the abandoned term() finishes: nothing of ours stays behind.
    assert _wait_for(lambda: peer._context.closed), "the context did not terminate after the leak was closed"
    assert _wait_for(lambda: not _our_threads() - threads), f"threads left running: {_our_threads() - threads}"


@pytest.mark.usefixtures("nothing_left")
def test_server_stop_gives_up_on_a_stuck_serving_thread(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="zmqtransport")
    release = threading.Event()
    finish = serve_server.Server._shutdown_in_thread

    def stuck_then_finish(self: serve_server.Server) -> None:
        release.wait(HANG_S)  # a serving thread that does not get to its cleanup in time
        finish(self)

    monkeypatch.setattr(serve_server.Server, "_shutdown_in_thread", stuck_then_finish)
    context = new_context()
    server = serve_server.Server(context, LOOPBACK, 0, 1.0)
    try:
        stopped, error, _ = call_bounded(lambda: server.stop(wait=True, timeout=0.2))
        assert error is None and stopped is False and server.alive
        message = " ".join(r.getMessage() for r in caplog.get_records("call"))
        assert "did not stop within 0.2 s" in message and "zmqtransport-serve-" in message
    finally:
        release.set()
    assert server.stop(wait=True)
    assert sockets.terminate(context, HANG_S), "the ROUTER was left open"


def test_unstager_gives_its_kit_back_when_an_engine_fails() -> None:
    def no_engine(where: torch.device) -> device.CopyEngine:
        raise RuntimeError("CUDA error: out of memory")

    staging = device.DeviceStaging(make_engine=no_engine)
    landing = SimpleNamespace(view=memoryview(b""), device_bytes=torch.zeros(8, dtype=torch.uint8))
    expect_error(lambda: device.RecvUnstager.borrow(staging, [landing]), RuntimeError)
    assert len(staging._idle) == 1, "the failed receive kept its kit (a pinned ring) for good"


@pytest.mark.usefixtures("nothing_left")
def test_prefaulter_stops_started_workers_when_another_cannot_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_madvise(pointer: int, length: int, advice: int) -> int:
        time.sleep(0.05)  # keeps a worker busy for seconds unless it is told to stop
        return 0

    monkeypatch.setattr(buffers, "_madvise", lambda: slow_madvise)
    started: list[threading.Thread] = []

    class SecondFails(RealThread):
        def start(self) -> None:
            if self.name == "zmqtransport-prefault":
                if started:
                    raise RuntimeError("can't start new thread")
                started.append(self)
            super().start()

    monkeypatch.setattr(buffers.threading, "Thread", SecondFails)
    # Fake addresses: the patched madvise never touches them.
    regions = [(0, 1 << 30, 64 * buffers.PREFAULT_PIECE)]
    expect_error(lambda: buffers.Prefaulter(regions, threads=2, plan=buffers.PrefaultPlan()), RuntimeError)
    assert started and not started[0].is_alive(), "a prefault worker outlived the failed construction"


# ----------------------------------------------------------------------------- the command line

CLI_TIMEOUT_S = 120  # per subprocess (torch's import alone takes seconds on a loaded machine)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m zmqtransport ARGS`` with the environment a user has: no warning filters of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "ZMQTRANSPORT_DEBUG")}
    return subprocess.run(
        [sys.executable, "-m", "zmqtransport", *args],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def only_own_error_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    """stderr is exactly the command's one error line: no warning from torch or anyone else."""
    assert result.returncode == 1, result
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"zmqtransport {command}: error: "), result.stderr
    return result.stderr.strip()


@pytest.mark.system  # the CLI: a layer above the bindings (pyproject.toml)
def test_cli_help_prints_nothing_on_stderr() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result
    assert result.stderr == ""
    assert "usage: zmqtransport" in result.stdout


@pytest.mark.system  # the CLI: a layer above the bindings (pyproject.toml)
def test_cli_inspect_runs_and_errors_without_foreign_warnings() -> None:
    with ZMQTransport(TIMEOUT, bind_host=LOOPBACK) as peer:
        peer.send_checkpoint([], 3, {"w": torch.arange(4.0)}, TIMEOUT)
        result = run_cli("inspect", peer.metadata(), "--step", "3", "--json")
        assert result.returncode == 0, result
        assert result.stderr == ""
        # The peer serves step 3, not 4: refused, reported as the command's one line.
        line = only_own_error_line(run_cli("inspect", peer.metadata(), "--step", "4"), "inspect")
        assert "requested step 4 but this peer serves step 3" in line


@pytest.mark.system  # the CLI: a layer above the bindings (pyproject.toml)
def test_cli_serve_misconfiguration_is_one_line(tmp_path: Any, busy_port: int) -> None:
    checkpoint = tmp_path / "small.pt"
    torch.save({"w": torch.arange(6.0)}, checkpoint)
    in_use = run_cli("serve", str(checkpoint), "--step", "0", "--bind", LOOPBACK, "--port", str(busy_port))
    assert f"port={busy_port} is already in use" in only_own_error_line(in_use, "serve")
    elsewhere = run_cli("serve", str(checkpoint), "--step", "0", "--bind", NOT_LOCAL)
    assert f"bind_host={NOT_LOCAL!r}: not an address of this host" in only_own_error_line(elsewhere, "serve")
