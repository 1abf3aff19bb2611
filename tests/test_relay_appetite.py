"""A peer that asks a relay and never reads cannot make the recovering replica hold more than its bounds.

tests/test_appetite.py floods a source's port; this floods a *relaying
receiver's* (a member serving onward what it lands, docs/protocol.md, "Swarm"),
the recovering replica itself. Every relayed message is a copy, so before the
bounds each whole-plan span fetch that grants credit and never reads had the
relay queue a copy of every message it landed: four connections of four
fetches made a relay of a 64 MiB state hold about 1 GiB more, still held after
``recv_checkpoint`` returned, and logged a WARNING per refused message.

Real processes on 127.0.0.1 (``RELAY_LOOPBACK`` on in each, as the swarm tests
do): a source child; a relaying receiver child with default options whose
receive is slowed by its progress callback (so there is a window to flood; its
serving thread is untouched); and the attacker, modified peer code in a child
of its own that joins the source's swarm as a member would (a header fetch
with a relay offer), learns the relay's address and token from the source's
relay order, and opens several connections to the relay, each asking for the
whole plan four times with all the credit the protocol allows, granting more
and never reading. Honest receivers (this process) fetch meanwhile, from the
source and the relay, and must land bit-exact.

The same run without the attacker is the clean baseline: the relay's peak
resident memory (``VmHWM``) under attack may exceed it by at most the documented
bound (32 MiB per connection, ``send_queue_bytes`` for all copies together)
plus a margin, and so may its resident memory as ``recv_checkpoint`` returns;
once the relay's stall bound has passed, what the process still has allocated
(glibc's in-use bytes, ``mallinfo2``: Python's and libzmq's allocations) by at
most the margin: the cut frees the attacker's queues. Its resident memory then
may exceed the clean run's by the margin plus one thread arena's heap (64 MiB):
glibc is asked to hand back what nothing references (``malloc_trim``), but it
does not trim the top of a thread's arena, so the serving or I/O thread's
arena can keep up to a heap of free memory resident (seen in 5 of 41 runs
as +60 to +65 MiB of RSS with the in-use bytes equal to the clean run's).
The relay logs at most a few WARNINGs: one per peer and kind. Two
states: small tensors (every message a packed frame) and large ones (1 MiB
frames of a few storages). Memory bounds have generous margins; time bounds
are hang detectors, not performance assertions.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from zmqtransport import ZMQTransport, digests, relayed, wire
from zmqtransport.net import parse_metadata

from .conftest import Processes, assert_same
from .floods import ARENA_HEAP, allocated, keep_granting, unread_dealer

pytestmark = pytest.mark.timeout(150)

LOOPBACK = "127.0.0.1"
MiB = 1 << 20
STEP = 1
CONNECTIONS = 4
PER_CONNECTION = 4  # fetches per connection: the per-peer transfer limit
RELAY_STALL = 1.0  # the relay's stall bound (seconds): how long an unread connection may hold its queue
RECEIVE_SECONDS = 2.0  # the relay's own receive is slowed to about this long: the window to flood in
QUEUED_PER_CONNECTION = 32 * MiB  # serve/frames.py, documented in docs/security.md
MARGIN = 64 * MiB  # the honest receivers' fetches, allocator slack, a run's noise
TIMEOUT = timedelta(seconds=60)


def _state(kind: str) -> dict[str, Any]:
    """64 MiB either way: 2048 tensors of 32 KiB (packed frames) or 4 of 16 MiB (1 MiB frames)."""
    if kind == "small":
        return {f"t{i:04d}": torch.full((8192,), float(i)) for i in range(2048)} | {"step": STEP}
    return {f"w{i}": torch.arange(4 << 20, dtype=torch.float32) + i for i in range(4)} | {"step": STEP}


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _log_to(path: str) -> None:
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    logging.getLogger("zmqtransport").addHandler(handler)
    logging.getLogger("zmqtransport").setLevel(logging.INFO)


def _serve(kind: str, metadata: Any, stop: Any) -> None:
    relayed.RELAY_LOOPBACK = True  # a spawned process: chain local receivers, as across hosts
    source: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host=LOOPBACK)
    try:
        source.send_checkpoint([1, 2, 3, 4], STEP, _state(kind), TIMEOUT)
        metadata.put(source.metadata())
        stop.wait(120)
    finally:
        source.shutdown()


def _resident_now() -> int:
    """This process's resident memory, once what nothing references went back to the system."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed heap pages otherwise
    return _status_self("VmRSS")


def _status_self(field: str) -> int:
    import os

    return _status(os.getpid(), field)


def _relay(kind: str, metadata: str, started: Any, results: Any, stop: Any, log_path: str) -> None:
    """The recovering replica: a receive with default options (relaying on), slowed by its progress callback."""
    relayed.RELAY_LOOPBACK = True
    _log_to(log_path)
    last = [0]

    def progress(done: int, total: int) -> None:
        started.set()
        time.sleep(RECEIVE_SECONDS * (done - last[0]) / total)  # the receiving thread only
        last[0] = done

    receiver: ZMQTransport[Any] = ZMQTransport(
        TIMEOUT, bind_host=LOOPBACK, stall_timeout=RELAY_STALL, progress=progress
    )
    try:
        began = time.monotonic()
        got = receiver.recv_checkpoint(0, metadata, STEP, TIMEOUT)
        seconds = time.monotonic() - began
        at_return = _status_self("VmRSS")  # what the attacker's queues hold is still there
        exact = True
        try:
            assert_same(got, _state(kind))
        except AssertionError:
            exact = False
        # The stall bound passes: what an unread connection queued is freed. 3 s past it, not 1: on the
        # merged main the memory still held 2 s after the receive read -4 to +63 MiB over runs of the same
        # code (connections cut later than the bound on a loaded machine).
        time.sleep(RELAY_STALL + 3.0)
        results.put(
            {
                "exact": exact,
                "seconds": seconds,
                "peak": _status_self("VmHWM"),
                "at_return": at_return,
                "after": _resident_now(),
                "allocated": allocated(),
            }
        )
        stop.wait(60)
    finally:
        receiver.shutdown()


def _flood_relay(source_metadata: str, joined: Any, seconds: float) -> None:
    """Modified peer code: joins the swarm, then asks the relay for the whole plan and never reads."""
    relayed.RELAY_LOOPBACK = True
    address = parse_metadata(source_metadata)
    context = zmq.Context()
    to_source = context.socket(zmq.DEALER)
    to_source.setsockopt(zmq.LINGER, 0)
    to_source.connect(f"tcp://{address.host}:{address.port}")
    listener = context.socket(zmq.ROUTER)  # something listens where it offers, as a member would
    offer = f"tcp://{LOOPBACK}:{listener.bind_to_random_port(f'tcp://{LOOPBACK}')}"
    request = wire.fetch_request(1, STEP, 1000, 4, False, header_only=True, relay=offer, verify=digests.offered())
    to_source.send(request)
    assert to_source.poll(10_000), "the source did not answer"
    envelope_frame, body_frame = to_source.recv_multipart()[:2]
    envelope = wire.unpack(envelope_frame, wire.MAX_HEADER_BYTES)
    body = wire.unpack(body_frame, wire.MAX_HEADER_BYTES)
    relay_at, token = envelope["relay"]["peers"][0]  # the source names the members so far: the relay
    messages = len(wire.plan_chunks(body["storages"], body["chunk_bytes"], body["pack_below"]))
    relay = parse_metadata(relay_at)
    dealers = []
    for _ in range(CONNECTIONS):
        dealer = unread_dealer(context, relay.host, relay.port)
        for xfer in range(PER_CONNECTION):
            span = wire.fetch_request(
                100 + xfer, STEP, 1000, wire.MAX_CREDIT, False, span=(0, messages), stage=envelope["stage"], token=token
            )
            dealer.send(span)
        dealers.append(dealer)
    joined.set()
    keep_granting(dealers, range(100, 100 + PER_CONNECTION), seconds)
    context.destroy(linger=0)


def _run(processes: Processes, kind: str, attack: bool, tmp_path: Path) -> tuple[dict[str, Any], str]:
    """One relayed receive (flooded or clean) beside two honest receivers: the relay's figures and its log."""
    log_path = tmp_path / f"relay-{kind}-{'attack' if attack else 'clean'}.log"
    metadata_queue, results, stop, started, joined = (
        processes.Queue(),
        processes.Queue(),
        processes.Event(),
        processes.Event(),
        processes.Event(),
    )
    children = [processes.Process(target=_serve, args=(kind, metadata_queue, stop))]
    children[0].start()
    honest = [ZMQTransport(TIMEOUT, bind_host=LOOPBACK) for _ in range(2)]
    try:
        metadata = metadata_queue.get(timeout=60)
        relay = processes.Process(target=_relay, args=(kind, metadata, started, results, stop, str(log_path)))
        children.append(relay)
        relay.start()
        assert started.wait(60), "the relay's receive never started"
        if attack:
            attacker = processes.Process(target=_flood_relay, args=(metadata, joined, RECEIVE_SECONDS + 4.0))
            children.append(attacker)
            attacker.start()
            assert joined.wait(30), "the attacker never reached the relay"
            time.sleep(1.0)  # the relay queues what it will for the attacker as messages land
        want = _state(kind)
        for receiver in honest:  # members of the same swarm: sent to the relay as well as the source
            assert_same(receiver.recv_checkpoint(0, metadata, STEP, TIMEOUT), want)
        outcome: dict[str, Any] = results.get(timeout=60)
    finally:
        stop.set()
        for child in children:
            child.join(30)
            if child.is_alive():
                child.kill()
        for receiver in honest:
            receiver.shutdown()
    return outcome, log_path.read_text()


@pytest.mark.parametrize("kind", ["small", "large"])
def test_a_peer_that_asks_a_relay_and_never_reads_cannot_make_the_replica_hold_more_than_its_bounds(
    processes: Processes, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)  # the honest receivers here are members too
    clean, _ = _run(processes, kind, attack=False, tmp_path=tmp_path)
    flooded, log = _run(processes, kind, attack=True, tmp_path=tmp_path)
    assert clean["exact"] and flooded["exact"], (clean, flooded)
    grown, kept = flooded["peak"] - clean["peak"], flooded["after"] - clean["after"]
    still_allocated = flooded["allocated"] - clean["allocated"]
    returned = flooded["at_return"] - clean["at_return"]
    print(
        f"{kind}: relay peak RSS {clean['peak'] / MiB:.0f} MiB clean, {flooded['peak'] / MiB:.0f} MiB flooded"
        f" (+{grown / MiB:.0f}); at return +{returned / MiB:.0f} MiB;"
        f" after the stall bound {clean['after'] / MiB:.0f} / {flooded['after'] / MiB:.0f} MiB"
        f" (+{kept / MiB:.0f}), allocated +{still_allocated / MiB:.0f} MiB; {log.count('WARNING')} WARNINGs"
    )
    # What one connection may hold (every relayed message is a copy, so the copy bound,
    # 256 MiB by default, is above the four connections' 128 MiB and does not bind).
    bound = CONNECTIONS * QUEUED_PER_CONNECTION
    assert grown <= bound + MARGIN, f"the relay's peak RSS grew {grown / MiB:.0f} MiB (bound {bound // MiB} MiB)"
    assert returned <= bound + MARGIN, f"the replica held {returned / MiB:.0f} MiB more as its receive returned"
    assert still_allocated <= MARGIN, f"the replica still has {still_allocated / MiB:.0f} MiB more allocated"
    assert kept <= MARGIN + ARENA_HEAP, f"the replica still holds {kept / MiB:.0f} MiB more after its receive"
    warnings = [line for line in log.splitlines() if line.startswith("WARNING")]
    # One per peer and kind (the attacker is one address), and the counts summed up: never one per message.
    assert len(warnings) <= 6, "\n".join(warnings[:20])
