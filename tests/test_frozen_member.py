"""A member frozen (SIGSTOP) with the whole plan reserved at the source cannot hold the others' receives.

A swarm member asks the source to reserve messages for it (a ``claim``;
docs/protocol.md, "Swarm"), and the others wait for those from it rather than
ask the source. Here the member is honest code that reserves in large batches
(the whole 64-message plan in one claim, the most a claim may ask for), and
stops (SIGSTOP: every thread, its serving one too) as soon as its first
message lands, so its reservations cover nearly everything and it will never
serve, answer or close a connection. Before claims had deadlines the next
receiver believed those reservations and waited for the frozen member until
its own timeout; now they lapse after the claim bound
(zmqtransport/fetch/claims.py) and the member is dropped for that receive.

Real processes on 127.0.0.1 (``RELAY_LOOPBACK`` on, as the swarm tests do):
the source and the member are children, the honest receiver is this process.
The honest receive's timeout (:data:`HONEST_TIMEOUT`) is the assertion: it
must complete bit-exact within it, where before it timed out. A hang detector,
not a performance assertion: a clean receive takes a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from zmqtransport import ZMQTransport, relayed, wire
from zmqtransport.fetch import planner
from zmqtransport.serve import relayed_steps

from .conftest import Processes, assert_same

pytestmark = pytest.mark.timeout(90)

LOOPBACK = "127.0.0.1"
STEP = 1
SOURCE_STALL = 20.0  # seconds: the source's stall bound
HONEST_TIMEOUT = 4.0  # seconds: a clean receive here takes well under 1 s; before, this one waited about 7 s
TIMEOUT = timedelta(seconds=30)


def _state() -> dict[str, Any]:
    return {f"w{i}": torch.arange(4 << 20, dtype=torch.float32) + i for i in range(4)} | {"step": STEP}


def _serve(metadata: Any, stop: Any) -> None:
    relayed.RELAY_LOOPBACK = True  # a spawned process: chain local receivers, as across hosts
    # The source gives up on a receiver that takes nothing after its stall bound, which also
    # ends a frozen member's membership; 20 s rather than the default 5 s, so that what the
    # claims themselves cost stands apart from it.
    source: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, stall_timeout=SOURCE_STALL)
    try:
        source.send_checkpoint([1, 2, 3], STEP, _state(), TIMEOUT)
        metadata.put(source.metadata())
        stop.wait(80)
    finally:
        source.shutdown()


def _member_that_freezes(metadata: str, told: Any) -> None:
    """Honest code reserving the whole plan at once, frozen right after it tells a peer what it is fetching.

    Its receive stalls after its first message (the progress callback sleeps,
    as a receiver busy elsewhere would), so what it says it is fetching is
    nearly the whole plan; the first ``have`` answer naming at least half of it
    is the moment it stops (SIGSTOP, 50 ms later: the answer goes out first).
    """
    relayed.RELAY_LOOPBACK = True
    planner.CLAIM_MESSAGES = wire.MAX_CREDIT  # one claim reserves every message of the 64
    honest_have = relayed_steps.RelayedSteps.have

    def have(self: relayed_steps.RelayedSteps, peer: bytes, request: wire.Request) -> Any:
        answer = honest_have(self, peer, request)
        if answer is not None and bin(answer.coming).count("1") * 2 >= answer.messages and not told.is_set():
            told.set()
            threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGSTOP)).start()
        return answer

    relayed_steps.RelayedSteps.have = have  # type: ignore[method-assign]
    started: list[bool] = []

    def progress(done: int, total: int) -> None:
        if not started:
            started.append(True)
            time.sleep(60)  # stopped long before this ends

    member: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK, progress=progress)
    member.recv_checkpoint(0, metadata, STEP, TIMEOUT)


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_member_frozen_with_the_plan_reserved_does_not_hold_the_next_receiver(
    processes: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)  # the honest receiver here is a member too
    metadata_queue, stop, told = processes.Queue(), processes.Event(), processes.Event()
    source = processes.Process(target=_serve, args=(metadata_queue, stop))
    source.start()
    member = None
    honest: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    try:
        metadata = metadata_queue.get(timeout=60)
        member = processes.Process(target=_member_that_freezes, args=(metadata, told))
        member.start()
        time.sleep(3.0)  # the member has its header, its claim and its first message (hang detector below)
        # The honest receiver asks the member what it holds; the member answers "fetching
        # nearly everything" and freezes.
        got = honest.recv_checkpoint(0, metadata, STEP, timedelta(seconds=HONEST_TIMEOUT))
        assert member.pid is not None and told.is_set() and _stopped(member.pid), "the member never froze"
        assert_same(got, _state())
    finally:
        stop.set()
        if member is not None:
            member.kill()  # stopped: SIGKILL still ends it
            member.join(10)
        source.join(30)
        if source.is_alive():
            source.kill()
        honest.shutdown()
