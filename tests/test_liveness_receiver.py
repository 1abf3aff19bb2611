"""A receiver notices a dead or frozen source in seconds, not at the transfer timeout (issue 15).

Sources are real processes (forked by the ``processes`` fixture) that are SIGKILLed or
SIGSTOPped; every transfer timeout here is 60 s, so a receive that ends in
seconds ended because of the liveness checks. Time bounds are hang guards with
generous slack; the measured figures are printed (run with ``-s``).

All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import zmq

from zmqtransport import ConnectionLostError, StalledError, ZMQTransport
from zmqtransport.fetch.liveness import RECONNECT_GRACE, ConnectionState

from .conftest import Processes

LOOPBACK = "127.0.0.1"
TIMEOUT = timedelta(seconds=60)
SLACK = 5.0  # seconds a bound may be exceeded by on a loaded 2-core machine


def big_state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"weight": torch.randn(16 * 2**20, generator=generator), "step": seed}  # 64 MiB



def _serve(seed: int, stage: bool, out: Any) -> None:
    """Publish metadata (staging step 1 if ``stage``) and wait to be killed or stopped."""
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    if stage:
        transport.send_checkpoint([1], 1, big_state(seed), TIMEOUT)
    out.put((os.getpid(), transport.metadata()))
    time.sleep(120)


def _start_source(processes: Processes, stage: bool = True) -> tuple[int, str]:
    out = processes.Queue()
    processes.Process(target=_serve, args=(1, stage, out), daemon=True).start()
    pid, metadata = out.get(timeout=60)
    return int(pid), str(metadata)


# ----------------------------------------------------------------------------- the event logic


def test_only_an_established_connection_can_be_lost() -> None:
    state = ConnectionState()
    state.on_event(zmq.EVENT_DISCONNECTED, 1.0)  # e.g. a connect before the source bound
    assert state.lost_for(5.0) is None and not state.established
    state.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 6.0)
    state.on_event(zmq.EVENT_DISCONNECTED, 7.0)
    assert state.lost_for(7.5) == 0.5
    state.on_event(zmq.EVENT_DISCONNECTED, 8.0)  # another failed reconnect: still lost since 7.0
    assert state.lost_for(9.0) == 2.0
    state.on_event(zmq.EVENT_HANDSHAKE_SUCCEEDED, 9.5)  # back (a source that rebuilt its ROUTER)
    assert state.lost_for(10.0) is None


def test_the_monitor_events_liveness_reads_are_libzmqs() -> None:
    from zmqtransport.fetch import liveness

    assert (liveness.HANDSHAKE_SUCCEEDED, liveness.DISCONNECTED, liveness.CONNECT_RETRIED) == (
        zmq.EVENT_HANDSHAKE_SUCCEEDED,
        zmq.EVENT_DISCONNECTED,
        zmq.EVENT_CONNECT_RETRIED,
    )


# ----------------------------------------------------------------------------- dead source


def test_source_killed_while_the_receiver_waits_for_its_step(processes: Processes) -> None:
    """Connected, waiting for a step not staged yet: a killed source ends the wait after the reconnect grace."""
    pid, metadata = _start_source(processes, stage=False)
    receiver: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    try:
        killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        with pytest.raises(ConnectionLostError, match="connection lost to rank 0") as caught:
            receiver.recv_checkpoint(0, metadata, 1, TIMEOUT)
        after_kill = time.monotonic() - started - 1.0
        killer.join()
        print(f"source SIGKILLed before the header: receiver raised {after_kill:.3f} s after the kill")
        assert after_kill >= RECONNECT_GRACE - 0.5  # it waited for the source to come back
        assert after_kill <= RECONNECT_GRACE + SLACK
        assert "the checkpoint header" in str(caught.value)
    finally:
        receiver.shutdown()


# ----------------------------------------------------------------------------- frozen source


def test_source_stopped_mid_transfer_is_a_stall(processes: Processes) -> None:
    pid, metadata = _start_source(processes)
    stopped: list[float] = []

    def stop_source(done: int, total: int) -> None:
        if not stopped:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(time.monotonic())

    stall = 1.5
    receiver: ZMQTransport[Any] = ZMQTransport(
        TIMEOUT, bind_host=LOOPBACK, window=2, progress=stop_source, stall_timeout=timedelta(seconds=stall)
    )
    try:
        with pytest.raises(StalledError, match=r"stalled: nothing from rank 0 .* for 1.5 s") as caught:
            receiver.recv_checkpoint(0, metadata, 1, TIMEOUT)
        assert stopped
        after_stop = time.monotonic() - stopped[0]
        print(f"source SIGSTOPped mid-transfer: stall error {after_stop:.3f} s after the stop (stall bound {stall} s)")
        assert stall <= after_stop <= stall + SLACK
        assert isinstance(caught.value, TimeoutError) and "data message" in str(caught.value)
    finally:
        os.kill(pid, signal.SIGCONT)
        receiver.shutdown()


def test_source_stopped_before_the_header_is_noticed_by_heartbeats(processes: Processes) -> None:
    """A source that stops answering (as a vanished host would) while the receiver waits for its step."""
    pid, metadata = _start_source(processes, stage=False)
    stall = 1.0
    receiver: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, stall_timeout=stall)
    stopper = threading.Timer(1.0, os.kill, (pid, signal.SIGSTOP))
    try:
        stopper.start()
        started = time.monotonic()
        with pytest.raises(ConnectionLostError, match="the checkpoint header"):
            receiver.recv_checkpoint(0, metadata, 1, TIMEOUT)
        after_stop = time.monotonic() - started - 1.0
        print(f"source SIGSTOPped before the header: receiver raised {after_stop:.3f} s after the stop")
        # heartbeat timeout (stall + 1 s) after the next ping, then the reconnect grace
        assert after_stop >= stall + 1.0
        assert after_stop <= stall + 2.0 + RECONNECT_GRACE + SLACK
    finally:
        stopper.join()
        os.kill(pid, signal.SIGCONT)
        receiver.shutdown()


def test_a_busy_receiver_is_not_stalled(make_transport: Any) -> None:
    """Only time spent waiting for the source counts: a receiver that is itself slow
    (each message handled longer than the stall bound) completes its transfer."""
    stall = 0.5
    sender = make_transport(timeout=TIMEOUT, chunk_bytes=1 << 20)  # 1 MiB frames, not a small state's smaller ones
    handled: list[int] = []

    def crawl(done: int, total: int) -> None:
        handled.append(done)
        time.sleep(0.8)  # longer than the stall bound; the next message waits in the queue

    receiver = make_transport(timeout=TIMEOUT, window=1, stall_timeout=stall, progress=crawl)
    state = {"weight": torch.randn(2**20), "bias": torch.randn(10)}  # 5 data messages
    sender.send_checkpoint([1], 1, state, TIMEOUT)
    got = receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
    sender.disallow_checkpoint()
    assert torch.equal(got["weight"], state["weight"]) and len(handled) == 5


# ----------------------------------------------------------------------------- early receiver


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def test_receiver_started_before_the_source_binds(make_transport: Any) -> None:
    """Connection retries before any handshake are not a lost connection: the receive waits and succeeds."""
    port = _free_port()
    receiver = make_transport(timeout=TIMEOUT, stall_timeout=1.0)
    results: queue.Queue[Any] = queue.Queue()

    def fetch() -> None:
        try:
            results.put(receiver.recv_checkpoint(0, f"tcp://{LOOPBACK}:{port}", 1, TIMEOUT))
        except BaseException as exc:  # reported to the main thread
            results.put(exc)

    fetcher = threading.Thread(target=fetch)
    fetcher.start()
    time.sleep(RECONNECT_GRACE + 1.5)  # longer than any bound on a lost connection
    assert fetcher.is_alive()
    sender = make_transport(timeout=TIMEOUT, port=port)
    state = {"weight": torch.randn(1000)}
    sender.send_checkpoint([1], 1, state, TIMEOUT)
    fetcher.join(30)
    outcome = results.get_nowait()
    if isinstance(outcome, BaseException):
        raise outcome
    assert torch.equal(outcome["weight"], state["weight"])
    sender.disallow_checkpoint()
