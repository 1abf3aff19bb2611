"""Shared fixtures: transports that are always shut down, and a default timeout."""

from __future__ import annotations

import atexit
import ctypes
import math
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import pytest
import torch

from zmqtransport import RemoteError, ZMQTransport, wire
from zmqtransport.lab import Lab

from .warmstart import WarmProcess, WarmStarter

TIMEOUT = timedelta(seconds=20)

# torchft sets up its Rust logging on first import; keep its INFO lines out of test output.
os.environ.setdefault("RUST_LOG", "warn")


@pytest.fixture
def make_transport() -> Iterator[Callable[..., ZMQTransport[Any]]]:
    """Build transports bound to loopback; all are shut down when the test ends."""
    made: list[ZMQTransport[Any]] = []

    def make(**options: Any) -> ZMQTransport[Any]:
        options.setdefault("bind_host", "127.0.0.1")
        transport: ZMQTransport[Any] = ZMQTransport(options.pop("timeout", TIMEOUT), **options)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.shutdown()


def fetch_racing_disallow(
    sender: ZMQTransport[Any],
    receivers: list[ZMQTransport[Any]],
    step: int,
    after_disallow: Callable[[], None],
) -> list[Any]:
    """Start every receiver fetching ``step``, disallow mid-transfer, then run
    ``after_disallow`` (which typically mutates the staged tensors).

    Returns each receiver's outcome: the state it got, or the ``disallowed``
    RemoteError. A receiver must never get a mix of old and mutated bytes.
    """
    outcomes: list[Any] = []

    def fetch(receiver: ZMQTransport[Any]) -> None:
        try:
            outcomes.append(receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT))
        except RemoteError as exc:
            assert exc.code == wire.ERR_DISALLOWED, exc
            outcomes.append(exc)

    threads = [threading.Thread(target=fetch, args=(receiver,)) for receiver in receivers]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    sender.disallow_checkpoint()
    after_disallow()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == len(receivers), "a receiver neither finished nor failed"
    return outcomes


def assert_same(got: Any, want: Any, path: str = "state") -> None:
    """Exact equality: types, structure, tensor dtype/shape/stride/bytes."""
    assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert got.stride() == want.stride(), path
        assert got.requires_grad == want.requires_grad, path
        # Compare raw bytes so NaNs, -0.0 and float8 payloads count too.
        assert bytes_of(got) == bytes_of(want), path
    elif isinstance(want, dict):
        assert list(got.keys()) == list(want.keys()), path
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), path
    else:
        assert got == want, path


def bytes_of(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().resolve_conj().contiguous().reshape(-1)
    if not flat.numel():
        return b""
    # Read the memory itself: through .tolist() (a Python int per byte) one 16 MiB tensor took 0.46
    # CPU-s, and the suite's comparisons of 64 MiB states were a tenth of its CPU (2026-12-05).
    raw = flat.view(torch.uint8).cpu()
    return ctypes.string_at(raw.data_ptr(), raw.numel())


class _TestStdio:
    """The test's own stdout and stderr, handed to a child when it starts.

    A forked server's children would write to the server's stdio, which is
    whatever pytest's capture was when the server started (an earlier test's,
    long gone); this passes the current ones, as a spawned child inherits them.
    """

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:
        from multiprocessing import reduction

        # Called while the child's process object is pickled: the descriptors travel with it.
        return (_TestStdio._detach, (reduction.DupFd(1), reduction.DupFd(2)))  # type: ignore[attr-defined]

    @staticmethod
    def _detach(out: Any, err: Any) -> tuple[int, int]:
        return out.detach(), err.detach()


def _with_test_stdio(stdio: tuple[int, int], target: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> None:
    for fd, into in zip(stdio, (1, 2), strict=True):
        os.dup2(fd, into)
        os.close(fd)
    target(*args, **kwargs)


class Processes(mp.context.ForkServerContext):
    """Real child processes for tests, each forked from one server that has imported torch and zmqtransport.

    A spawned child starts an interpreter and imports torch, about 3 s of CPU
    on this project's machine: most of the suite's CPU went to that. A child of
    the fork server is a new process all the same (its own memory, sockets and
    pid, killable and stoppable on its own) that starts in milliseconds.
    """

    def Process(  # type: ignore[override]
        self,
        group: None = None,
        target: Callable[..., Any] | None = None,
        name: str | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        daemon: bool | None = None,
    ) -> Any:
        assert target is not None
        wrapped = (_TestStdio(), target, tuple(args), dict(kwargs or {}))
        return super().Process(group, _with_test_stdio, name, wrapped, daemon=daemon)


PROCESSES = Processes()
PROCESSES.set_forkserver_preload(["torch", "zmqtransport"])


@pytest.fixture
def processes() -> Iterator[Processes]:
    """Real child processes (:class:`Processes`); children still alive at the end are killed."""
    yield PROCESSES
    for child in mp.active_children():
        child.kill()
        child.join(10)


_WARM: list[WarmStarter] = []  # this pytest process's warm server, started with its first lab child


def warm_python(
    namespace: str, script: str, *args: str, env: Mapping[str, str] | None = None, stderr: bool = True
) -> WarmProcess:
    """Run ``python -c script args`` in network namespace ``namespace``: stdin and stdout (and stderr)
    piped, as text.

    Forked from a warm server (tests/warmstart.py: a cold interpreter spends
    about 3 s of CPU importing torch first). ``env``: the whole environment
    (default: this one); torch's warnings are off either way.
    """
    if not _WARM:
        _WARM.append(WarmStarter())
        atexit.register(_WARM[0].close)
    environment = {**(os.environ if env is None else env), "PYTHONWARNINGS": "ignore"}
    return _WARM[0].popen(namespace, script, args, environment, stderr=stderr)


def lab_python(
    lab: Lab, host: int, script: str, *args: str, env: Mapping[str, str] | None = None, stderr: bool = True
) -> WarmProcess:
    """:func:`warm_python` on a lab host; the lab stops it when it closes, if it still runs."""
    process = warm_python(lab.namespace(host), script, *args, env=env, stderr=stderr)
    lab.adopt(process)
    return process
