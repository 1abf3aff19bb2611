"""The default number of libzmq I/O threads: one per usable core, 1 to 4 (issue 33, session direct3)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import zmq

from zmqtransport import ZMQTransport, sockets

TIMEOUT = timedelta(seconds=20)
LOOPBACK = "127.0.0.1"


def test_default_io_threads_follows_the_cores_up_to_four() -> None:
    assert sockets.default_io_threads(None) == 1
    assert sockets.default_io_threads(0) == 1
    assert sockets.default_io_threads(1) == 1
    assert sockets.default_io_threads(2) == 2
    assert sockets.default_io_threads(3) == 3
    assert sockets.default_io_threads(16) == sockets.DEFAULT_IO_THREADS_MAX == 4


def test_usable_cpus_is_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    assert sockets.usable_cpus() == 3


def _io_threads(transport: ZMQTransport[Any]) -> int:
    return int(transport._context.get(zmq.IO_THREADS))


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (64, 4)])
def test_transport_default_takes_one_io_thread_per_core(
    monkeypatch: pytest.MonkeyPatch, cores: int, threads: int
) -> None:
    # Where the process may run on two cores or more, a source serving several
    # receivers copies on more than one (before: always one I/O thread).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    try:
        assert _io_threads(transport) == threads
    finally:
        transport.shutdown()


def test_explicit_io_threads_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, io_threads=1)
    try:
        assert _io_threads(transport) == 1
    finally:
        transport.shutdown()


def test_several_receivers_over_several_io_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three receivers at once from a source whose connections spread over its I/O threads: all bit-exact."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    state = {f"w{i}": torch.randn(1 << 18, generator=torch.Generator().manual_seed(i)) for i in range(6)}
    source: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    receivers: list[ZMQTransport[Any]] = [ZMQTransport(TIMEOUT, bind_host=LOOPBACK) for _ in range(3)]
    try:
        assert _io_threads(source) == 4
        source.send_checkpoint([1, 2, 3], step=7, state_dict=state, timeout=TIMEOUT)
        with ThreadPoolExecutor(3) as pool:
            got = list(
                pool.map(lambda r: r.recv_checkpoint(0, source.metadata(), step=7, timeout=TIMEOUT), receivers)
            )
        for received in got:
            assert received.keys() == state.keys()
            for key, tensor in state.items():
                assert torch.equal(received[key], tensor), key
    finally:
        for transport in (source, *receivers):
            transport.shutdown()
