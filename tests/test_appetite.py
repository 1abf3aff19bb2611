"""A peer that asks and never reads cannot make a serving side hold more than its bounds.

Credit is something a peer *says*: one that grants it and never reads would have
the source queue every message it may send, and a frame of packed small tensors
is a copy (docs/security.md, "Memory a peer can make this side hold"). Real
processes: the source is a child serving a state of small tensors (every data
frame a packed copy); the attacker is another child running modified peer code,
raw DEALERs that ask for the whole plan four times per connection, keep granting
credit and never read. The source's peak resident memory (``VmHWM``) is read
from /proc before and after, while an honest receiver fetches beside them.

Before the bounds, four such connections made the source hold about 1 GiB more
(four transfers of the whole 64 MiB plan per connection); memory bounds here are
checked with a generous margin, and time bounds are hang detectors, not
performance assertions. All traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from zmqtransport import ZMQTransport, wire
from zmqtransport.net import parse_metadata

from .conftest import Processes, assert_same
from .floods import keep_granting, unread_dealer

pytestmark = pytest.mark.timeout(120)

LOOPBACK = "127.0.0.1"
MiB = 1 << 20
TENSORS = 2048  # of 32 KiB: 64 MiB, all below pack_below, so every frame is a packed copy
ELEMENTS = 8192
QUEUE_BYTES = 48 * MiB  # the source's send_queue_bytes
STALL = 1.5
ATTACK_SECONDS = 6.0
CONNECTIONS = 4
PER_CONNECTION = 4  # fetches per connection: the per-peer transfer limit


def small_tensors() -> dict[str, Any]:
    return {f"t{i:04d}": torch.full((ELEMENTS,), float(i)) for i in range(TENSORS)} | {"step": 1}


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _serve(metadata: Any, stop: Any, log_path: str) -> None:
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    logging.getLogger("zmqtransport").addHandler(handler)
    logging.getLogger("zmqtransport").setLevel(logging.INFO)
    source: ZMQTransport[Any] = ZMQTransport(
        timedelta(seconds=60), stall_timeout=STALL, bind_host=LOOPBACK, send_queue_bytes=QUEUE_BYTES
    )
    try:
        source.send_checkpoint([1], 1, small_tensors(), timedelta(seconds=60))
        metadata.put(source.metadata())
        stop.wait(100)
    finally:
        source.shutdown()


def _ask_and_never_read(metadata: str, connections: int, seconds: float) -> None:
    """Modified peer code: whole-plan fetches with all the credit the protocol allows, never a read."""
    address = parse_metadata(metadata)
    context = zmq.Context()
    dealers = []
    for _ in range(connections):
        dealer = unread_dealer(context, address.host, address.port)
        for xfer in range(PER_CONNECTION):
            dealer.send(wire.fetch_request(100 + xfer, 1, 1000, wire.MAX_CREDIT, False))
        dealers.append(dealer)
    keep_granting(dealers, range(100, 100 + PER_CONNECTION), seconds)
    context.destroy(linger=0)


def test_a_peer_that_asks_and_never_reads_cannot_make_the_source_hold_more_than_its_bounds(
    processes: Processes, tmp_path: Path
) -> None:
    log_path = tmp_path / "source.log"
    metadata_queue, stop = processes.Queue(), processes.Event()
    source = processes.Process(target=_serve, args=(metadata_queue, stop, str(log_path)))
    source.start()
    honest: ZMQTransport[Any] = ZMQTransport(timedelta(seconds=60), bind_host=LOOPBACK)
    attacker = None
    try:
        metadata = metadata_queue.get(timeout=60)
        want = small_tensors()
        # A clean receive first: the source's own buffers are warm, its peak is the baseline.
        assert_same(honest.recv_checkpoint(0, metadata, 1, timedelta(seconds=60)), want)
        assert source.pid is not None
        baseline = _status(source.pid, "VmHWM")

        attacker = processes.Process(target=_ask_and_never_read, args=(metadata, CONNECTIONS, ATTACK_SECONDS))
        attacker.start()
        time.sleep(1.0)  # the source has queued what it will for the attacker
        # Honest receivers are still served, bit-exact, while the attacker asks and does not read.
        for _ in range(2):
            assert_same(honest.recv_checkpoint(0, metadata, 1, timedelta(seconds=60)), want)
        attacker.join(ATTACK_SECONDS + 30)
        assert attacker.exitcode == 0

        grown = _status(source.pid, "VmHWM") - baseline
        print(f"source peak RSS grew {grown / MiB:.0f} MiB under the attack (copy bound {QUEUE_BYTES // MiB} MiB)")
        # The copies queued for all connections together stay within send_queue_bytes; the
        # margin covers the honest receives' own copies and allocator slack, far below the
        # ~1 GiB that whole-plan credit over four connections queued before.
        assert grown <= QUEUE_BYTES + 64 * MiB, f"the source's peak RSS grew {grown / MiB:.0f} MiB"
        log = log_path.read_text()
        assert "cut the connection" in log, "the attacker's connections were never cut:\n" + log[-2000:]
        # One line per connection cut, not one per message.
        assert log.count("cut the connection") <= CONNECTIONS * 3, log[-2000:]
    finally:
        stop.set()
        if attacker is not None and attacker.is_alive():
            attacker.kill()
        source.join(30)
        if source.is_alive():
            source.kill()
        honest.shutdown()
