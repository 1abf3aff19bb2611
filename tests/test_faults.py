"""Dead and stalled peers, leaks over many cycles, and concurrent receivers (issue 5).

Processes that must die mid-transfer are real (forked by the ``processes`` fixture) and
die by SIGKILL, so no cleanup code of theirs runs. Time bounds here are hang
detectors with generous slack, not performance assertions.

All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack
import pytest
import torch
import zmq

from zmqtransport import ConnectionLostError, ZMQTransport, wire
from zmqtransport.serve.router import Router

from .conftest import Processes

LOOPBACK = "127.0.0.1"
SLACK = 5.0  # seconds a bound may be exceeded by on a loaded 2-core machine


def big_state(seed: int, megabytes: int = 64) -> dict[str, Any]:
    """One large tensor (zero-copy frames) plus a few small ones (packed frames)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(megabytes * 2**18, generator=generator),
        "bias": torch.randn(1000, generator=generator),
        "step": seed,
    }


def assert_big_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["step"] == want["step"]
    assert torch.equal(got["weight"], want["weight"])
    assert torch.equal(got["bias"], want["bias"])


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _threads_settle_to(count: int, seconds: float = 3.0) -> int:
    """The OS thread count once it is back to ``count``, or after ``seconds``.

    A joined thread leaves ``/proc/self/task`` a moment after ``join`` returns
    (the OS thread still unwinds); on a loaded machine that moment is long
    enough to be counted. A leaked thread stays, so the bound is unchanged.
    """
    deadline = time.monotonic() + seconds
    while _threads() > count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _threads()



# ----------------------------------------------------------------------------- child processes


def _serve_forever(seed: int, out: Any) -> None:
    """Stage a big checkpoint, publish its metadata and wait to be killed."""
    transport: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=30), bind_host=LOOPBACK)
    transport.send_checkpoint([1], 1, big_state(seed), timedelta(seconds=30))
    out.put((os.getpid(), transport.metadata()))
    time.sleep(120)


def _receive_then_die(metadata: str, step: int) -> None:
    """Start receiving; SIGKILL this process on the first data message."""

    def die(done: int, total: int) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    transport: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=30), bind_host=LOOPBACK, window=2, progress=die)
    transport.recv_checkpoint(0, metadata, step, timedelta(seconds=30))
    raise AssertionError("the receiver survived its own SIGKILL")


# ----------------------------------------------------------------------------- dead sender


def test_sender_killed_mid_transfer(processes: Processes) -> None:
    """The kernel closes a killed sender's connection: the receiver says so at once, not at the timeout."""
    out = processes.Queue()
    sender = processes.Process(target=_serve_forever, args=(3, out), daemon=True)
    sender.start()
    pid, metadata = out.get(timeout=60)
    killed: list[float] = []

    def kill_sender(done: int, total: int) -> None:
        if not killed:
            os.kill(pid, signal.SIGKILL)
            killed.append(time.monotonic())
        assert done < total  # it died with most of the data unsent

    timeout = 60.0
    receiver: ZMQTransport[Any] = ZMQTransport(
        timedelta(seconds=timeout), bind_host=LOOPBACK, window=2, progress=kill_sender
    )
    try:
        with pytest.raises(ConnectionLostError, match="connection lost") as caught:
            receiver.recv_checkpoint(0, metadata, 1, timedelta(seconds=timeout))
        assert killed, "the transfer finished before the sender could be killed"
        detected = time.monotonic() - killed[0]
        print(f"sender SIGKILLed mid-transfer: receiver raised {detected:.3f} s after the kill")
        assert detected <= 10.0, f"raised {detected:.2f} s after the kill"  # a hang guard; measured ~0.1 s
        assert "step 1" in str(caught.value) and metadata.split("//")[1] in str(caught.value)
        assert "rank 0" in str(caught.value)
        sender.join(10)
        assert sender.exitcode == -signal.SIGKILL
    finally:
        receiver.shutdown()


def test_sender_killed_before_the_header(processes: Processes) -> None:
    """A sender that dies between metadata exchange and the fetch: timeout, no hang."""
    out = processes.Queue()
    sender = processes.Process(target=_serve_forever, args=(4, out), daemon=True)
    sender.start()
    pid, metadata = out.get(timeout=60)
    os.kill(pid, signal.SIGKILL)
    sender.join(10)
    receiver: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=1), bind_host=LOOPBACK)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="timed out"):
            receiver.recv_checkpoint(0, metadata, 1, timedelta(seconds=1))
        assert time.monotonic() - started <= 1.0 + 1.0
    finally:
        receiver.shutdown()


# ----------------------------------------------------------------------------- dead receiver


def test_receiver_killed_mid_transfer(processes: Processes) -> None:
    timeout = 3.0
    state = big_state(5)
    sender: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=timeout), bind_host=LOOPBACK)
    survivor: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=30), bind_host=LOOPBACK)
    try:
        sender.send_checkpoint([1, 2], 1, state, timedelta(seconds=timeout))
        victim = processes.Process(target=_receive_then_die, args=(sender.metadata(), 1))
        victim.start()
        # Another receiver fetches the same step while the victim dies.
        results: queue.Queue[Any] = queue.Queue()
        other = threading.Thread(
            target=lambda: results.put(survivor.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=30)))
        )
        other.start()
        victim.join(60)
        assert victim.exitcode == -signal.SIGKILL
        other.join(60)
        assert_big_state(results.get_nowait(), state)

        started = time.monotonic()
        sender.disallow_checkpoint()
        assert time.monotonic() - started <= timeout + SLACK

        # The caller may now mutate; the next step is served normally.
        state["weight"].mul_(-1)
        state["step"] = 2
        sender.send_checkpoint([2], 2, state, timedelta(seconds=timeout))
        got = survivor.recv_checkpoint(0, sender.metadata(), 2, timedelta(seconds=30))
        assert_big_state(got, state)
        sender.disallow_checkpoint()
    finally:
        survivor.shutdown()
        sender.shutdown()


# ----------------------------------------------------------------------------- stalled receiver


def stalled_dealer(context: zmq.Context[Any], endpoint: str, credit: int, xfer: int = 9) -> Any:
    """A DEALER that asks for step 1 with ``credit`` and then never reads.

    RCVHWM=1 and a tiny kernel receive buffer make libzmq stop pulling from TCP
    almost at once, so the sender's frames really pile up on the sender's side.
    """
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    sock.send(wire.fetch_request(xfer, 1, 1000, credit, False))
    return sock


def test_stalled_receiver_forces_release_and_the_port_is_reused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A receiver that never reads holds zero-copy frames in libzmq's queue; after the
    transport timeout, disallow closes and rebinds the ROUTER, returns, and serving
    goes on on the same port."""
    timeout = 2.0
    state = big_state(6)
    sender: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=timeout), bind_host=LOOPBACK)
    receiver: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=30), bind_host=LOOPBACK)
    context = zmq.Context()
    try:
        sender.send_checkpoint([1], 1, state, timedelta(seconds=timeout))
        port = sender.address.port
        baseline = _rss()
        staller = stalled_dealer(context, sender.metadata(), credit=wire.MAX_CREDIT)
        time.sleep(0.5)
        # Zero-copy: 64 MiB queued for the staller cost (almost) no memory.
        assert _rss() - baseline < 32 * 2**20
        # Others are still served while one receiver stalls.
        assert_big_state(receiver.recv_checkpoint(0, sender.metadata(), 1, timedelta(seconds=30)), state)

        started = time.monotonic()
        sender.disallow_checkpoint()
        elapsed = time.monotonic() - started
        assert elapsed <= timeout + SLACK, f"disallow_checkpoint took {elapsed:.1f} s"
        # Referenced until here on purpose: pyzmq closes a garbage-collected
        # socket, which would end the stall early.
        assert not staller.closed
        # Released by cutting the staller's connection (serve/router.py, Router.cut), or by
        # closing the whole socket at the timeout: the two fall due together here (stall = timeout).
        freed = ("closing the socket", "cut the connection")
        assert any(text in r.getMessage() for r in caplog.records for text in freed), (
            "the stall never held frames: this test did not exercise the forced release"
        )

        # libzmq no longer references the tensor: mutate it, stage the next step.
        state["weight"].fill_(7.0)
        state["step"] = 2
        sender.send_checkpoint([1], 2, state, timedelta(seconds=timeout))
        assert sender.address.port == port
        with socket.create_connection((LOOPBACK, port), timeout=5):
            pass  # the same port accepts connections again
        assert_big_state(receiver.recv_checkpoint(0, sender.metadata(), 2, timedelta(seconds=30)), state)
        sender.disallow_checkpoint()
        assert sender._server.alive
    finally:
        context.destroy(linger=0)
        receiver.shutdown()
        sender.shutdown()


def test_stalled_receiver_memory_is_bounded_by_its_credit() -> None:
    """Packed frames are copies: a staller with credit 4 may cost 4 frames, not the state."""
    timeout = 5.0
    generator = torch.Generator().manual_seed(8)
    # 64 MiB in 8 KiB tensors: every frame is a 1 MiB copy made for the send.
    state = {"small": [torch.randn(2048, generator=generator) for _ in range(8192)]}
    sender: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=timeout), bind_host=LOOPBACK)
    context = zmq.Context()
    try:
        sender.send_checkpoint([1], 1, state, timedelta(seconds=timeout))
        baseline = _rss()
        sock = stalled_dealer(context, sender.metadata(), credit=4)
        time.sleep(1.0)
        grown = _rss() - baseline
        assert grown < 24 * 2**20, f"a stalled receiver cost the sender {grown >> 20} MiB"
        sock.send(wire.cancel_request(9))
    finally:
        context.destroy(linger=0)
        sender.shutdown()


def test_receiver_that_stops_granting_credit_is_dropped() -> None:
    timeout = 1.0
    sender: ZMQTransport[Any] = ZMQTransport(
        timedelta(seconds=timeout), bind_host=LOOPBACK, chunk_bytes=4096, pack_below=4096
    )
    context = zmq.Context()
    try:
        sender.send_checkpoint([1], 1, big_state(9, megabytes=1), timedelta(seconds=timeout))
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(sender.metadata())
        sock.send(wire.fetch_request(11, 1, 1000, 2, False))
        ops = []
        deadline = time.monotonic() + timeout + SLACK
        while time.monotonic() < deadline:
            if not sock.poll(200):
                continue
            message = msgpack.unpackb(sock.recv_multipart()[0])
            ops.append(message["op"])
            if message["op"] == wire.OP_ERROR:
                assert message["code"] == wire.ERR_STALLED, message
                break
        assert ops[:3] == ["header", "data", "data"] and ops[-1] == "error", ops
        assert ops.count("data") == 2  # no more than the credit it granted
        # Dropping it released everything: disallow is immediate.
        started = time.monotonic()
        sender.disallow_checkpoint()
        assert time.monotonic() - started < timeout + SLACK
    finally:
        context.destroy(linger=0)
        sender.shutdown()


def test_waiting_receiver_survives_a_forced_rebind(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fetch for a step not staged yet, parked on the sender while a stalled receiver
    forces the ROUTER to be rebuilt, is still answered when the step is staged."""
    # The stalled connection alone would be cut (Router.cut); where that cannot be
    # done (no descriptor known), the socket is rebuilt: this test plays that case.
    monkeypatch.setattr(Router, "cut", lambda self, peer: False)
    timeout = 2.0
    state = big_state(10)
    sender: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=timeout), bind_host=LOOPBACK)
    waiting: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=30), bind_host=LOOPBACK)
    context = zmq.Context()
    try:
        sender.send_checkpoint([1], 1, state, timedelta(seconds=timeout))
        staller = stalled_dealer(context, sender.metadata(), credit=wire.MAX_CREDIT)
        time.sleep(0.3)
        results: queue.Queue[Any] = queue.Queue()

        def fetch_step_2() -> None:
            try:
                results.put(waiting.recv_checkpoint(0, sender.metadata(), 2, timedelta(seconds=30)))
            except BaseException as exc:  # reported to the main thread
                results.put(exc)

        disallowing = threading.Thread(target=sender.disallow_checkpoint)
        disallowing.start()
        time.sleep(0.2)  # step 1 is withdrawn; step 2 is not staged yet
        fetcher = threading.Thread(target=fetch_step_2)
        fetcher.start()
        disallowing.join(timeout + SLACK)
        assert not disallowing.is_alive()
        assert any("closing the socket" in r.getMessage() for r in caplog.records)
        assert not staller.closed  # (see the test above)
        # Stage at once: the fetcher's DEALER is most likely still reconnecting to
        # the new ROUTER, so the sender must keep its request until it is back.
        state["step"] = 2
        sender.send_checkpoint([1], 2, state, timedelta(seconds=timeout))
        fetcher.join(40)
        outcome = results.get_nowait()
        if isinstance(outcome, BaseException):
            raise outcome
        assert_big_state(outcome, state)
    finally:
        context.destroy(linger=0)
        waiting.shutdown()
        sender.shutdown()


# ----------------------------------------------------------------------------- leaks


def test_hundred_cycles_leak_nothing() -> None:
    timeout = timedelta(seconds=10)
    generator = torch.Generator().manual_seed(12)
    state = {
        "w": torch.randn(2**18, generator=generator),
        "small": [torch.randn(64, generator=generator) for _ in range(32)],
        "step": 0,
    }
    sender: ZMQTransport[Any] = ZMQTransport(timeout, bind_host=LOOPBACK)
    receiver: ZMQTransport[Any] = ZMQTransport(timeout, bind_host=LOOPBACK)
    try:

        def cycle(step: int) -> None:
            state["step"] = step
            state["w"].add_(1.0)
            sender.send_checkpoint([1], step, state, timeout)
            got = receiver.recv_checkpoint(0, sender.metadata(), step, timeout)
            assert got["step"] == step and torch.equal(got["w"], state["w"])
            assert all(torch.equal(a, b) for a, b in zip(got["small"], state["small"], strict=True))
            sender.disallow_checkpoint()

        for step in range(10):  # warm up allocator pools and lazy imports
            cycle(step)
        threads, fds, rss = _threads(), _fds(), _rss()
        for step in range(10, 110):
            cycle(step)
        assert _threads_settle_to(threads) <= threads, "threads leaked"
        # libzmq's reaper thread closes a closed socket's descriptors (its mailbox,
        # a receive's monitor pair) asynchronously: give it a bounded moment on a
        # loaded machine; a real leak stays above the bound.
        deadline = time.monotonic() + 3
        while _fds() > fds + 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _fds() <= fds + 2, f"file descriptors grew from {fds} to {_fds()}"
        grown = _rss() - rss
        assert grown < 32 * 2**20, f"RSS grew by {grown >> 20} MiB over 100 cycles"
    except BaseException:
        # A leaked socket would make a waiting shutdown hang in zmq_ctx_term and
        # hide the assertion above; do not wait.
        receiver.shutdown(wait=False)
        sender.shutdown(wait=False)
        raise
    receiver.shutdown()
    sender.shutdown()


def test_transports_made_and_shut_down_leak_nothing() -> None:
    def make_use_and_close() -> None:
        a: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=5), bind_host=LOOPBACK)
        b: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=5), bind_host=LOOPBACK)
        a.send_checkpoint([1], 1, {"x": torch.ones(10)}, timedelta(seconds=5))
        assert torch.equal(b.recv_checkpoint(0, a.metadata(), 1, timedelta(seconds=5))["x"], torch.ones(10))
        a.shutdown()
        b.shutdown()

    make_use_and_close()
    threads, fds = _threads(), _fds()
    for _ in range(20):
        make_use_and_close()
    assert _threads_settle_to(threads) <= threads
    assert _fds() <= fds + 2


# ----------------------------------------------------------------------------- concurrency


def varied_state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(3 * 2**18, generator=generator)  # 3 MiB: several chunks
    return {
        "base": base,
        "view": base[2**17 : 2**17 + 1000],
        "ints": torch.randint(-(2**31), 2**31 - 1, (4096,), generator=generator, dtype=torch.int64),
        "half": torch.randn(777, generator=generator).to(torch.bfloat16),
        "tiny": [torch.full((i + 1,), seed + i, dtype=torch.int32) for i in range(50)],
        "meta": {"seed": seed, "lr": seed / 1000},
    }


def assert_varied(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in ("base", "view", "ints", "half"):
        assert got[key].dtype == want[key].dtype
        assert torch.equal(got[key].view(torch.uint8), want[key].view(torch.uint8)), key
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(got["tiny"], want["tiny"], strict=True))
    assert got["meta"] == want["meta"]


@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "crc32"])
def test_eight_receivers_at_once_repeatedly(checksum: bool) -> None:
    timeout = timedelta(seconds=30)
    sender: ZMQTransport[Any] = ZMQTransport(timeout, bind_host=LOOPBACK, checksum=checksum, chunk_bytes=256 * 1024)
    receivers: list[ZMQTransport[Any]] = [ZMQTransport(timeout, bind_host=LOOPBACK) for _ in range(8)]
    try:
        for round_number in range(3):
            step = 100 + round_number
            state = varied_state(step)
            sender.send_checkpoint(list(range(8)), step, state, timeout)
            barrier = threading.Barrier(8)
            results: queue.Queue[tuple[int, Any]] = queue.Queue()

            def fetch(
                rank: int,
                step: int = step,
                barrier: threading.Barrier = barrier,
                results: queue.Queue[tuple[int, Any]] = results,
            ) -> None:
                try:
                    barrier.wait(30)
                    metadata = sender.metadata()
                    results.put((rank, receivers[rank].recv_checkpoint(0, metadata, step, timeout)))
                except BaseException as exc:  # reported to the main thread
                    results.put((rank, exc))

            workers = [threading.Thread(target=fetch, args=(rank,)) for rank in range(8)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(60)
            seen = set()
            while not results.empty():
                rank, outcome = results.get_nowait()
                if isinstance(outcome, BaseException):
                    raise outcome
                assert_varied(outcome, state)
                seen.add(rank)
            assert seen == set(range(8))
            sender.disallow_checkpoint()
    finally:
        for receiver in receivers:
            receiver.shutdown()
        sender.shutdown()


def test_disallow_during_transfers_never_shows_mutated_state() -> None:
    """Receives running at disallow_checkpoint finish with the staged bytes, never the mutated ones.

    The disallow waits until every receiver has taken data: a request that
    reached the source only after it would be parked for a later staging of
    the step (as torchft's HTTPTransport holds it), which is not what this
    test is about (and under a loaded CI machine 50 ms was not always enough
    for four threads to ask).
    """
    timeout = timedelta(seconds=30)
    taking = [threading.Event() for _ in range(4)]

    def on_progress(event: threading.Event) -> Callable[[int, int], None]:
        return lambda done, total: event.set()

    sender: ZMQTransport[Any] = ZMQTransport(timeout, bind_host=LOOPBACK)
    receivers = [
        ZMQTransport(timeout, bind_host=LOOPBACK, window=1, progress=on_progress(event)) for event in taking
    ]
    state = big_state(13)
    try:
        sender.send_checkpoint([1], 1, state, timeout)
        results: queue.Queue[Any] = queue.Queue()

        def fetch(receiver: ZMQTransport[Any]) -> None:
            try:
                results.put(receiver.recv_checkpoint(0, sender.metadata(), 1, timeout))
            except BaseException as exc:  # reported to the main thread
                results.put(exc)

        workers = [threading.Thread(target=fetch, args=(r,)) for r in receivers]
        for worker in workers:
            worker.start()
        for event in taking:
            assert event.wait(30), "a receiver took no data in 30 s"
        sender.disallow_checkpoint()
        state["weight"].zero_()  # allowed now: nobody may see these zeros
        for worker in workers:
            worker.join(60)
        assert not any(worker.is_alive() for worker in workers)
        for _ in workers:
            outcome = results.get_nowait()
            if isinstance(outcome, BaseException):
                raise outcome
            assert not torch.equal(outcome["weight"], state["weight"])
            assert_big_state(outcome, big_state(13))
    finally:
        for receiver in receivers:
            receiver.shutdown()
        sender.shutdown()


def test_exit_waits_for_shutdowns_started_without_waiting() -> None:
    # shutdown(wait=False) tears the transport down on a thread; a process
    # exiting meanwhile would abandon libzmq mid-teardown. The exit hook waits.
    from zmqtransport import transport as transport_module

    made: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=5), bind_host=LOOPBACK)
    serving = made._server._thread
    made.shutdown(wait=False)
    transport_module._finish_pending_shutdowns()
    assert not serving.is_alive()
    assert not transport_module._PENDING_SHUTDOWNS
