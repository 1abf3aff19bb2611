"""A peer that asks and never reads, in the network lab: the source's and a relay's memory stay bounded.

tests/test_appetite.py and tests/test_relay_appetite.py play it on loopback;
here every party is a real process on a host of its own (network namespaces,
links at 200 Mbit/s). Host 0 is the source (64 MiB of 32 KiB tensors: every
message a packed copy), host 1 a receiver that relays as it lands (default
options but a 2 s stall bound), host 2 the attacker, modified peer code that
joins the swarm as a member would (a header fetch with a relay offer), learns
the relay's address and token from the source's relay order, and opens four
connections to the source and four to the relay, each asking for the whole
plan four times with all the credit the protocol allows, granting more and
never reading; host 3 an honest receiver with default options that starts
during the flood. The same run without the attacker is the baseline. (The
relay's stall bound is short so that the test sees it pass; it is 2 s, not 1 s,
and the honest receiver keeps the default 5 s, because under CI's load, three
test workers on two cores, the source packing the attacker's first copies once
went quiet for the honest receiver for over 1 s, which failed its receive.)

Asserted: the source's and the relay's peak resident memory (``VmHWM``) grow by
at most what four connections may hold (32 MiB each) and a margin; what the relay
still has allocated once its stall bound has passed after its receive by at most
the margin, and its resident memory by at most the margin and one thread arena's
heap (tests/floods.py, ``ALLOCATED``); every receiver bit-exact. Before the bounds the relay alone grew by
about 0.5 GiB here. Needs root and iproute2 (the lab); skips elsewhere.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from zmqtransport.lab import Lab

from .conftest import lab_python
from .floods import ALLOCATED, ARENA_HEAP
from .test_lab import _go, needs_lab, nothing_left_behind  # noqa: F401  (the fixture)

MiB = 1 << 20
RATE_MBIT = 200
CONNECTIONS = 4  # to the source and to the relay each
QUEUED_PER_CONNECTION = 32 * MiB  # serve/frames.py, docs/security.md
MARGIN = 64 * MiB
TIMEOUT_S = 30.0
RELAY_STALL_S = 2.0  # the relay's stall bound: it cuts the attacker's connections once it passes

_STATUS = ALLOCATED + """
import ctypes, gc, json, sys, time, torch
def status(field):
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field + ":"))
def trimmed():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status("VmRSS")
def state():
    return {f"t{i:04d}": torch.full((8192,), float(i)) for i in range(2048)} | {"step": 5}
"""

# Serves step 5; prints its metadata, then on a line from stdin its peak memory.
SOURCE = _STATUS + """
from datetime import timedelta
from zmqtransport import ZMQTransport
address = sys.argv[1]
transport = ZMQTransport(timedelta(seconds=30), bind_host=address, advertise_host=address)
transport.send_checkpoint([1, 2, 3], 5, state(), timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.readline()
print(json.dumps({"peak": status("VmHWM")}), flush=True)
transport.shutdown(wait=False)
"""

# A receiver with default options (it relays) but the stall bound in argv[1]: prints "go METADATA",
# then its figures once its stall bound has passed after the receive.
RECEIVER = _STATUS + """
from datetime import timedelta
from zmqtransport import ZMQTransport
stall = float(sys.argv[1])
transport = ZMQTransport(timedelta(seconds=30), stall_timeout=stall)
metadata = sys.stdin.readline().strip()
print("go", transport.metadata(), flush=True)
got = transport.recv_checkpoint(0, metadata, 5, timedelta(seconds=30))
at_return = status("VmRSS")
exact = all(got[key].equal(value) if key != "step" else got[key] == value for key, value in state().items())
del got
time.sleep(stall + 1.5)
print(json.dumps({"exact": exact, "peak": status("VmHWM"), "at_return": at_return, "after": trimmed(),
                  "allocated": allocated()}), flush=True)
transport.shutdown(wait=False)
"""

# Modified peer code: joins the swarm, then asks the source and the relay for everything, never reading.
ATTACKER = """
import contextlib, sys, time, zmq
from zmqtransport import digests, wire
from zmqtransport.net import parse_metadata
metadata, own, seconds, connections = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
source = parse_metadata(metadata)
context = zmq.Context()
ask = context.socket(zmq.DEALER)
ask.connect(f"tcp://{source.host}:{source.port}")
listener = context.socket(zmq.ROUTER)  # something listens where it offers, as a member would
offer = f"tcp://{own}:{listener.bind_to_random_port(f'tcp://{own}')}"
ask.send(wire.fetch_request(1, 5, 1000, 4, False, header_only=True, relay=offer, verify=digests.offered()))
assert ask.poll(10_000), "the source did not answer"
envelope_frame, body_frame = ask.recv_multipart()[:2]
envelope = wire.unpack(envelope_frame, wire.MAX_HEADER_BYTES)
body = wire.unpack(body_frame, wire.MAX_HEADER_BYTES)
relay_at, token = envelope["relay"]["peers"][0]
relay = parse_metadata(relay_at)
messages = len(wire.plan_chunks(body["storages"], body["chunk_bytes"], body["pack_below"]))
def dealer(host, port):
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVHWM, 1)
    socket.setsockopt(zmq.RCVBUF, 4096)
    socket.connect(f"tcp://{host}:{port}")
    return socket
dealers = []
for _ in range(connections):
    to_source = dealer(source.host, source.port)
    to_relay = dealer(relay.host, relay.port)
    for xfer in range(4):
        to_source.send(wire.fetch_request(100 + xfer, 5, 1000, wire.MAX_CREDIT, False))
        span = (0, messages)
        to_relay.send(wire.fetch_request(100 + xfer, 5, 1000, wire.MAX_CREDIT, False, span=span,
                                         stage=envelope["stage"], token=token))
    dealers += [to_source, to_relay]
print("joined", flush=True)
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for socket in dealers:
        for xfer in range(4):
            with contextlib.suppress(zmq.ZMQError):
                socket.send(wire.credit_request(100 + xfer, wire.MAX_CREDIT), zmq.NOBLOCK)
    time.sleep(0.05)
context.destroy(linger=0)
"""


def _run(attack: bool) -> dict[str, Any]:
    """The source's peak, the relay's and the honest receiver's figures, with or without the attacker."""
    with Lab(hosts=4, nics=1, rate_mbit=RATE_MBIT) as lab:
        source = lab_python(lab, 0, SOURCE, lab.address(0))
        relay = lab_python(lab, 1, RECEIVER, str(RELAY_STALL_S))
        honest = lab_python(lab, 3, RECEIVER, "5")
        assert source.stdout is not None and source.stdin is not None
        metadata = source.stdout.readline().strip()
        assert metadata, "the source did not start"
        before = lab.rx_bytes(1)
        _go(relay, metadata)
        deadline = time.monotonic() + TIMEOUT_S
        while lab.rx_bytes(1) - before < 4 * MiB and time.monotonic() < deadline:
            time.sleep(0.01)  # the relay is a member and receiving
        if attack:
            attacker = lab_python(lab, 2, ATTACKER, metadata, lab.address(2), "10", str(CONNECTIONS))
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "joined", "the attacker never reached the relay"
            time.sleep(1.0)  # the source and the relay queue what they will for it
        _go(honest, metadata)
        figures = {}
        for name, child in (("relay", relay), ("honest", honest)):
            out, err = child.communicate(timeout=TIMEOUT_S + 30)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            assert lines, err
            figures[name] = json.loads(lines[-1])
        source.stdin.write("\n")
        source.stdin.flush()
        out, _ = source.communicate(timeout=30)
        figures["source"] = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    return figures


@needs_lab
@pytest.mark.system
@pytest.mark.timeout(150)
def test_a_flood_of_unread_requests_in_the_lab_leaves_the_source_and_the_relay_within_their_bounds() -> None:
    clean, flooded = _run(attack=False), _run(attack=True)
    for run in (clean, flooded):
        assert run["relay"]["exact"] and run["honest"]["exact"], run
    bound = CONNECTIONS * QUEUED_PER_CONNECTION
    source_grew = flooded["source"]["peak"] - clean["source"]["peak"]
    relay_grew = flooded["relay"]["peak"] - clean["relay"]["peak"]
    relay_kept = flooded["relay"]["after"] - clean["relay"]["after"]
    relay_allocated = flooded["relay"]["allocated"] - clean["relay"]["allocated"]
    print(
        f"peak RSS grew: source {source_grew / MiB:.0f} MiB, relay {relay_grew / MiB:.0f} MiB;"
        f" the relay after its stall bound {relay_kept / MiB:.0f} MiB (allocated {relay_allocated / MiB:.0f} MiB)"
        f" (bound {bound // MiB} MiB)"
    )
    assert source_grew <= bound + MARGIN, f"the source's peak RSS grew {source_grew / MiB:.0f} MiB"
    assert relay_grew <= bound + MARGIN, f"the relay's peak RSS grew {relay_grew / MiB:.0f} MiB"
    assert relay_allocated <= MARGIN, f"the relay still has {relay_allocated / MiB:.0f} MiB more allocated"
    assert relay_kept <= MARGIN + ARENA_HEAP, f"the relay still holds {relay_kept / MiB:.0f} MiB more after its receive"
