"""The network lab (zmqtransport.lab): hosts as namespaces, rate-limited links, counters, cleanup.

Needs root and iproute2 (CI has both); skips with the reason elsewhere. Sizes
are small: every test takes about a second or less, except the ZMQTransport
transfer (two Python processes importing torch). Nothing may be left behind:
a fixture checks ``ip netns list`` after every test, also after a failure.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from zmqtransport import lab as lab_module
from zmqtransport.lab import Lab, Shaping, build_plan, remove_leftovers, tcp_transfer

from .conftest import lab_python

REASON = lab_module.unavailable_reason()
needs_lab = pytest.mark.skipif(REASON is not None, reason=REASON or "")
MINE = f"{lab_module.NAME_ROOT}{os.getpid()}x"


def _namespaces() -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=True)
    return [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    yield
    if REASON is not None:
        return
    left = [name for name in _namespaces() if name.startswith(MINE)]
    for name in left:  # clean up anyway, so one failure does not leak into the machine
        subprocess.run(["ip", "netns", "delete", name], timeout=30, check=False)
    assert not left, f"namespaces left behind: {left}"


@pytest.mark.system
def test_plan_shapes_every_nic_in_both_directions() -> None:
    plan = build_plan(["a0", "a1"], "sw", nics=2, shaping=Shaping(100.0))
    shaped = [" ".join(line) for key, lines in plan.items() if key.startswith("tc:") for line in lines]
    # Two hosts x two NICs, each limited on the host end (upload) and on its switch port (download).
    assert len(shaped) == 8
    assert all("tbf rate 100000kbit" in line for line in shaped)
    ports = {line.split()[3] for line in shaped}
    assert ports == {"eth0", "eth1", "h0n0", "h0n1", "h1n0", "h1n1"}
    addresses = [
        line[2] for key, lines in plan.items() if key.startswith("ip:a") for line in lines if line[0] == "addr"
    ]
    assert addresses == ["10.77.0.1/24", "10.77.1.1/24", "10.77.0.2/24", "10.77.1.2/24"]
    # The switch is built first: the host ends of the veth pairs are created there.
    assert next(iter(plan)) == "ip:sw"


@pytest.mark.system
def test_plan_gives_each_host_its_own_rate() -> None:
    plan = build_plan(["a0", "a1"], "sw", nics=1, shaping=[Shaping(400.0), Shaping(100.0)])

    def rates(key: str) -> list[tuple[str, str]]:
        return [(line[3], line[line.index("rate") + 1]) for line in plan[key]]

    # Host 1 is slower both ways: on its own NIC (upload) and on its switch port (download).
    assert rates("tc:a0") == [("eth0", "400000kbit")]
    assert rates("tc:a1") == [("eth0", "100000kbit")]
    assert rates("tc:sw") == [("h0n0", "400000kbit"), ("h1n0", "100000kbit")]
    with pytest.raises(ValueError, match="2 shapings for 3 hosts"):
        build_plan(["a0", "a1", "a2"], "sw", nics=1, shaping=[Shaping(1.0), Shaping(2.0)])


@pytest.mark.system
def test_plan_without_shaping_and_with_an_mtu() -> None:
    plan = build_plan(["a0", "a1"], "sw", nics=2, shaping=None, mtu=9000)
    assert not [line for key, lines in plan.items() if key.startswith("tc:") for line in lines]
    switch = [" ".join(line) for line in plan["ip:sw"]]
    # Every bridge and both ends of every veth pair get the MTU.
    assert "link add br0 mtu 9000 type bridge" in switch and "link add br1 mtu 9000 type bridge" in switch
    veths = [line for line in switch if "type veth" in line]
    assert len(veths) == 4 and all(line.count("mtu 9000") == 2 for line in veths)
    # Without an MTU the kernel's default stays: no mtu argument anywhere.
    plain = build_plan(["a0"], "sw", nics=1, shaping=Shaping(100.0))
    assert not [line for lines in plain.values() for line in lines if "mtu" in line]


@pytest.mark.system
def test_bad_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"1\.\.250 hosts"):
        Lab(hosts=0)
    with pytest.raises(ValueError, match="positive rate"):
        Lab(hosts=2, rate_mbit=0)
    with pytest.raises(ValueError, match="positive rate"):
        Lab(hosts=2, host_rates={1: 0.0})
    with pytest.raises(ValueError, match=r"outside 0\.\.1"):
        Lab(hosts=2, host_rates={2: 100.0})
    with pytest.raises(ValueError, match="MTU"):
        Lab(hosts=2, mtu=40)
    with pytest.raises(ValueError, match="shaped"):
        Lab(hosts=2, shaped=False, host_rates={1: 100.0})


@pytest.mark.system
@needs_lab
def test_rate_limited_tcp_transfer_and_counters() -> None:
    nbytes, rate_mbit = 4 << 20, 100.0
    with Lab(hosts=2, nics=1, rate_mbit=rate_mbit) as lab:
        assert lab.namespace(0) in _namespaces()
        sent_before, received_before = lab.tx_bytes(0), lab.rx_bytes(1)
        result = tcp_transfer(lab, source=0, sink=1, nbytes=nbytes, timeout=30.0)
        sent = lab.tx_bytes(0) - sent_before
        received = lab.rx_bytes(1) - received_before
    assert result.received == nbytes
    # The link really limits: no faster than the rate allows, less the bucket tbf lets through at once.
    floor_s = (nbytes - lab.shaping.burst_bytes) / lab.link_bytes_per_s
    assert result.seconds >= floor_s
    # The counters count Ethernet frames: the payload plus a few percent of headers.
    for counted in (sent, received):
        assert nbytes <= counted <= nbytes * 1.06 + (64 << 10)
    assert lab.namespace(0) not in _namespaces()


@pytest.mark.system
@needs_lab
def test_an_unshaped_lab_has_no_qdisc_and_its_mtu() -> None:
    nbytes = 4 << 20
    with Lab(hosts=2, nics=1, shaped=False, mtu=9000) as lab:
        for host in (0, 1):
            shown = lab.run(host, ["ip", "-j", "link", "show", "eth0"], capture_output=True, text=True, timeout=30)
            assert json.loads(shown.stdout)[0]["mtu"] == 9000
            qdiscs = lab.run(host, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, timeout=30)
            assert "tbf" not in qdiscs.stdout
        result = tcp_transfer(lab, source=0, sink=1, nbytes=nbytes, timeout=30.0)
    assert result.received == nbytes


@pytest.mark.system
@needs_lab
def test_a_host_rate_limits_that_host_both_ways() -> None:
    nbytes = 2 << 20
    with Lab(hosts=3, nics=1, rate_mbit=400.0, host_rates={2: 25.0}) as lab:
        slow_bytes_per_s = lab.host_rate_mbit(2) * 1e6 / 8
        floor_s = (nbytes - lab.shaping.burst_bytes) / slow_bytes_per_s
        into_slow = tcp_transfer(lab, source=0, sink=2, nbytes=nbytes, timeout=30.0)
        out_of_slow = tcp_transfer(lab, source=2, sink=1, nbytes=nbytes, timeout=30.0)
        between_fast = tcp_transfer(lab, source=0, sink=1, nbytes=nbytes, timeout=30.0)
    assert into_slow.received == out_of_slow.received == between_fast.received == nbytes
    assert into_slow.seconds >= floor_s and out_of_slow.seconds >= floor_s
    # The other hosts keep their own rate: 16x faster, well under the slow host's floor.
    assert between_fast.seconds < floor_s / 2


@pytest.mark.system
@needs_lab
def test_link_down_and_up() -> None:
    with Lab(hosts=2, nics=2, rate_mbit=400) as lab:
        lab.link_down(1, 1)
        state = lab.run(1, ["cat", "/sys/class/net/eth1/carrier"], capture_output=True, text=True, timeout=30)
        assert state.stdout.strip() == "0"
        with pytest.raises(lab_module.LabError, match="TCP source failed"):
            tcp_transfer(lab, 0, 1, 1 << 20, nic=1, timeout=1.0)
        # The other NIC keeps working while one is down.
        assert tcp_transfer(lab, 0, 1, 1 << 20, nic=0, timeout=30.0).received == 1 << 20
        lab.link_up(1, 1)
        assert tcp_transfer(lab, 0, 1, 1 << 20, nic=1, timeout=30.0).received == 1 << 20


@pytest.mark.system
@needs_lab
def test_removed_on_error() -> None:
    with pytest.raises(RuntimeError, match="boom"), Lab(hosts=2) as lab:
        names = [lab.namespace(0), lab.namespace(1), lab.switch]
        raise RuntimeError("boom")
    assert not set(names) & set(_namespaces())


@pytest.mark.system
@needs_lab
def test_removed_on_sigterm() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from zmqtransport.lab import Lab
        with Lab(hosts=2) as lab:
            lab.popen(1, ["sleep", "30"])
            print(lab.prefix, flush=True)
            time.sleep(30)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        prefix = child.stdout.readline().strip()
        assert prefix and any(name.startswith(prefix) for name in _namespaces())
        child.send_signal(signal.SIGTERM)
        assert child.wait(20) == -signal.SIGTERM
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
    assert not [name for name in _namespaces() if name.startswith(prefix)]


@pytest.mark.system
@needs_lab
def test_leftovers_of_a_dead_process_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    name = f"{lab_module.NAME_ROOT}{dead.pid}x0h0"
    subprocess.run(["ip", "netns", "add", name], timeout=30, check=True)
    try:
        assert name in remove_leftovers()
        assert name not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30, check=False)


SENDER = """
import sys, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
address = sys.argv[1]
stall = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
generator = torch.Generator().manual_seed(7)
state = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(4)}
state["ints"] = torch.arange(1000, dtype=torch.int64)
transport = ZMQTransport(timedelta(seconds=30), bind_host=address, advertise_host=address, stall_timeout=stall)
transport.send_checkpoint([1], 3, state, timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.readline()
transport.shutdown()
"""

RECEIVER = """
import sys, time, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
generator = torch.Generator().manual_seed(7)
expected = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(4)}
expected["ints"] = torch.arange(1000, dtype=torch.int64)
stall = float(sys.argv[1]) if len(sys.argv) > 1 else 5.0
transport = ZMQTransport(timedelta(seconds=30), stall_timeout=stall)
metadata = sys.stdin.readline().strip()
started = time.perf_counter()
got = transport.recv_checkpoint(0, metadata, 3, timedelta(seconds=30))
seconds = time.perf_counter() - started
assert got.keys() == expected.keys()
for key, tensor in expected.items():
    assert got[key].dtype == tensor.dtype and got[key].shape == tensor.shape
    assert got[key].view(torch.uint8).equal(tensor.view(torch.uint8)), key
transport.shutdown()
print(seconds, flush=True)
"""


def _transfer_between_two_hosts(rate_mbit: float, stall: float) -> tuple[float, int, float]:
    """Run SENDER on host 0 and RECEIVER on host 1; the receive's seconds, bytes host 0 sent, link bytes/s."""
    with Lab(hosts=2, nics=1, rate_mbit=rate_mbit) as lab:
        sender = lab_python(lab, 0, SENDER, lab.address(0), str(stall), stderr=False)
        # Started at once, so the two imports of torch overlap; the receiver waits for the metadata.
        receiver = lab_python(lab, 1, RECEIVER, str(stall))
        assert sender.stdout is not None and sender.stdin is not None
        metadata = sender.stdout.readline().strip()
        assert metadata, "the sender did not start"
        before = lab.tx_bytes(0)
        out, err = receiver.communicate(metadata + "\n", timeout=60)
        assert receiver.returncode == 0, err
        sent = lab.tx_bytes(0) - before
        sender.stdin.write("\n")
        sender.stdin.flush()
        assert sender.wait(30) == 0
        floor = (STATE_BYTES - lab.shaping.burst_bytes) / lab.link_bytes_per_s
    return float(out.split()[-1]), sent, floor


STATE_BYTES = 4 * (1 << 18) * 4 + 1000 * 8


@pytest.mark.system
@needs_lab
def test_zmq_transport_between_two_hosts_is_bit_exact_and_link_bound() -> None:
    seconds, sent, floor = _transfer_between_two_hosts(rate_mbit=100, stall=5.0)
    assert seconds >= floor
    # What the source sent is the state plus headers and protocol frames (a few percent).
    assert STATE_BYTES <= sent <= STATE_BYTES * 1.06 + (64 << 10)


@pytest.mark.system
@needs_lab
def test_slow_progressing_transfer_is_never_cut_by_the_stall_bound() -> None:
    # 4 MiB at 10 Mbit/s: about 3.4 s, each 1 MiB data message about 0.9 s, so the
    # whole transfer takes well over the 1.5 s stall bound on both sides. It must
    # complete bit-exact: the bound is on silence, not on the transfer's length.
    seconds, _, floor = _transfer_between_two_hosts(rate_mbit=10, stall=1.5)
    assert seconds >= floor > 1.5 * 2


# ----------------------------------------------------------------------------- several paths (issue 12)

# The source listens on ``bind`` (comma-separated) and advertises ``advertise``;
# ``mib`` tensors of 1 MiB, the same on both sides (seeded).
PATHS_SENDER = """
import sys, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
bind, advertise, mib, stall = sys.argv[1].split(","), sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
generator = torch.Generator().manual_seed(12)
state = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(mib)}
transport = ZMQTransport(timedelta(seconds=30), bind_host=bind, advertise_host=advertise, stall_timeout=stall)
transport.send_checkpoint([1], 3, state, timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.readline()
transport.shutdown(wait=False)
"""

# Prints "go" just before recv_checkpoint, then one JSON line: the outcome.
PATHS_RECEIVER = """
import json, sys, time, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
mib, streams, stall, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
generator = torch.Generator().manual_seed(12)
expected = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(mib)}
transport = ZMQTransport(
    timedelta(seconds=timeout), stall_timeout=stall, streams=None if streams == "default" else int(streams)
)
metadata = sys.stdin.readline().strip()
print("go", flush=True)
started = time.perf_counter()
try:
    got = transport.recv_checkpoint(0, metadata, 3, timedelta(seconds=timeout))
except Exception as exc:
    outcome = {"error": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - started}
    print(json.dumps(outcome), flush=True)
    sys.exit(0)
seconds = time.perf_counter() - started
exact = got.keys() == expected.keys() and all(
    got[key].dtype == tensor.dtype and got[key].view(torch.uint8).equal(tensor.view(torch.uint8))
    for key, tensor in expected.items()
)
stats = transport.last_recv_stats
outcome = {"seconds": seconds, "exact": exact, "paths": stats.paths, "streams": stats.streams}
print(json.dumps(outcome), flush=True)
transport.shutdown(wait=False)
"""

PATHS_MIB = 24  # at 200 Mbit/s: about 1 s on one NIC, 0.5 s on two
PATHS_RATE_MBIT = 200
PATHS_TIMEOUT_S = 20.0
# The source's stall bound: longer than any of these transfers, so a cut path's
# stuck frames never make the source rebind its socket mid-transfer (which
# closes the surviving path's connection too: a known issue, docs/history.md, "Several paths and streams").
SENDER_STALL_S = 15.0


@dataclass
class PathsRun:
    """What a receive from a source on several paths did."""

    outcome: dict[str, Any]  # the receiver's: seconds, exact, paths, streams; or error, message
    sent: dict[int, int]  # bytes the source sent per NIC during the receive
    endpoints: list[str]  # tcp://ADDRESS:PORT of the source's NICs, in NIC order
    cut_at: dict[int, int] | None = None  # bytes sent per NIC when the links were cut


def _paths_transfer(
    lab: Lab,
    bind: Sequence[int],
    advertise: Sequence[str] | None = None,
    streams: int | None = None,
    cut: Sequence[int] = (),
    stall: float = 1.0,
) -> PathsRun:
    """Host 0 serves on its NICs ``bind``; host 1 receives. ``cut``: source NICs taken down mid-transfer.

    ``stall`` is the receiver's stall bound (the source's is :data:`SENDER_STALL_S`).

    The cut comes once the source has sent a quarter of the state (read from
    the NIC counters), so every path has carried some of it by then.
    """
    hosts = [lab.address(0, nic) for nic in bind]
    advertised = ",".join(advertise if advertise is not None else hosts)
    sender_args = [",".join(hosts), advertised, str(PATHS_MIB), str(SENDER_STALL_S)]
    sender = lab_python(lab, 0, PATHS_SENDER, *sender_args, stderr=False)
    options = [str(PATHS_MIB), str(streams or "default"), str(stall), str(PATHS_TIMEOUT_S)]
    receiver = lab_python(lab, 1, PATHS_RECEIVER, *options)
    assert sender.stdout is not None and sender.stdin is not None
    assert receiver.stdout is not None and receiver.stdin is not None
    metadata = sender.stdout.readline().strip()
    assert metadata, "the sender did not start"
    port = metadata.rsplit(":", 1)[1].split("?")[0]
    before = lab.counters(0)
    receiver.stdin.write(metadata + "\n")
    receiver.stdin.flush()
    assert receiver.stdout.readline().strip() == "go", "the receiver did not start"
    cut_at = _cut_when_a_quarter_is_sent(lab, before, cut) if cut else None
    out, err = receiver.communicate(timeout=PATHS_TIMEOUT_S + 30)
    assert receiver.returncode == 0, err
    after = lab.counters(0)
    sender.stdin.write("\n")
    sender.stdin.flush()
    assert sender.wait(30) == 0
    sent = {nic: after[nic][0] - before[nic][0] for nic in after}
    endpoints = [f"tcp://{lab.address(0, nic)}:{port}" for nic in range(lab.nics)]
    return PathsRun(json.loads(out.strip().splitlines()[-1]), sent, endpoints, cut_at)


def _cut_when_a_quarter_is_sent(lab: Lab, before: dict[int, tuple[int, int]], nics: Sequence[int]) -> dict[int, int]:
    deadline = time.monotonic() + PATHS_TIMEOUT_S
    while True:  # bounded: the deadline, then cut anyway (the assertions will tell)
        now = lab.counters(0)
        sent = {nic: now[nic][0] - before[nic][0] for nic in now}
        if sum(sent.values()) >= PATHS_BYTES // 4 or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    for nic in nics:
        lab.link_down(0, nic)
    # What each NIC sent until it was down: bytes still go out between the
    # reading above and the link going down (a few KiB at 200 Mbit/s).
    now = lab.counters(0)
    return {nic: now[nic][0] - before[nic][0] for nic in now}


PATHS_BYTES = PATHS_MIB << 20


@pytest.mark.system
@needs_lab
def test_two_paths_both_carry_the_checkpoint() -> None:
    with Lab(hosts=2, nics=2, rate_mbit=PATHS_RATE_MBIT) as lab:
        run = _paths_transfer(lab, bind=[0, 1])
    outcome = run.outcome
    assert outcome.get("exact") is True, outcome
    assert outcome["streams"] == 2
    # Each NIC carried a fair share (credit-driven, equal links), and the receiver says so per path.
    assert set(outcome["paths"]) == set(run.endpoints)
    assert sum(outcome["paths"].values()) == PATHS_BYTES
    for nic, endpoint in enumerate(run.endpoints):
        assert outcome["paths"][endpoint] >= PATHS_BYTES // 4, outcome["paths"]
        assert run.sent[nic] >= PATHS_BYTES // 4, run.sent


@needs_lab
@pytest.mark.parametrize("cut", [0, 1], ids=["first-path-cut", "second-path-cut"])
def test_a_path_cut_mid_transfer_is_taken_over_by_the_other(cut: int) -> None:
    with Lab(hosts=2, nics=2, rate_mbit=PATHS_RATE_MBIT) as lab:
        run = _paths_transfer(lab, bind=[0, 1], cut=[cut])
    outcome, kept = run.outcome, 1 - cut
    assert outcome.get("exact") is True, outcome
    assert outcome["seconds"] < PATHS_TIMEOUT_S / 2, outcome
    assert run.cut_at is not None
    # The cut path carried only what it had sent before the cut; the other carried the rest.
    cut_path, kept_path = outcome["paths"].get(run.endpoints[cut], 0), outcome["paths"][run.endpoints[kept]]
    assert cut_path + kept_path == PATHS_BYTES
    assert cut_path <= run.cut_at[cut], (outcome["paths"], run.cut_at)
    assert run.sent[kept] >= PATHS_BYTES - run.cut_at[cut], (run.sent, run.cut_at)


@pytest.mark.system
@needs_lab
def test_every_path_cut_fails_in_time_naming_the_paths() -> None:
    with Lab(hosts=2, nics=2, rate_mbit=PATHS_RATE_MBIT) as lab:
        run = _paths_transfer(lab, bind=[0, 1], cut=[0, 1])
    outcome = run.outcome
    assert outcome.get("error") in ("StalledError", "ConnectionLostError", "TimeoutError"), outcome
    # Not a hang: well within the transfer timeout (the stall bound is 1 s).
    assert outcome["seconds"] < PATHS_TIMEOUT_S / 2, outcome
    for endpoint in run.endpoints:
        assert endpoint in outcome["message"], outcome


@pytest.mark.system
@needs_lab
@pytest.mark.parametrize("unreachable", ["no-listener", "receiver-link-down"])
def test_an_unreachable_preferred_path_is_skipped(unreachable: str) -> None:
    with Lab(hosts=2, nics=2, rate_mbit=PATHS_RATE_MBIT) as lab:
        dead, alive = lab.address(0, 1), lab.address(0, 0)
        if unreachable == "no-listener":
            # Advertised first, but the source listens only on NIC 0: connecting to NIC 1 is refused.
            run = _paths_transfer(lab, bind=[0], advertise=[dead, alive])
        else:
            # The source listens on both, but the receiver's NIC 1 has no link: NIC 1 answers nothing.
            lab.link_down(1, 1)
            run = _paths_transfer(lab, bind=[1, 0])
    outcome = run.outcome
    assert outcome.get("exact") is True, outcome
    # Skipped after the short connect bound, not waited on for the transfer timeout.
    assert outcome["seconds"] < PATHS_TIMEOUT_S / 2, outcome
    assert outcome["paths"] == {run.endpoints[0]: PATHS_BYTES}
    assert run.sent[1] < 64 << 10, run.sent


# ----------------------------------------------------------------------------- relays (issue 13)

# Host 0 stages ``mib`` tensors of 1 MiB (seeded, checksums on) for ``receivers`` ranks.
RELAY_SENDER = """
import sys, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
address, mib, receivers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
generator = torch.Generator().manual_seed(13)
state = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(mib)}
transport = ZMQTransport(timedelta(seconds=30), bind_host=address, advertise_host=address, checksum=True)
transport.send_checkpoint(list(range(1, receivers + 1)), 5, state, timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.readline()
transport.shutdown(wait=False)
"""

# Default bind and advertise settings: inside a lab host the only non-loopback
# address is the host's lab address, so that is what it offers to relay at.
# Prints "go METADATA" just before recv_checkpoint, then one JSON line. With a
# kill fraction above 0 it SIGKILLs itself once that fraction of the bytes landed
# and it has relayed some (on a loaded machine the others can ask it late), or
# on its last message.
RELAY_RECEIVER = """
import json, os, signal, sys, time, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
mib, relay, kill_at, timeout = int(sys.argv[1]), sys.argv[2] == "relay", float(sys.argv[3]), float(sys.argv[4])
generator = torch.Generator().manual_seed(13)
expected = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(mib)}

def progress(done, total):
    if kill_at and done >= kill_at * total and (transport.sent_bytes > 0 or done == total):
        os.kill(os.getpid(), signal.SIGKILL)

transport = ZMQTransport(timedelta(seconds=timeout), relay=relay, progress=progress)
metadata = sys.stdin.readline().strip()
print("go", transport.metadata(), flush=True)
started = time.perf_counter()
got = transport.recv_checkpoint(0, metadata, 5, timedelta(seconds=timeout))
seconds = time.perf_counter() - started
exact = got.keys() == expected.keys() and all(
    got[key].view(torch.uint8).equal(tensor.view(torch.uint8)) for key, tensor in expected.items()
)
print(json.dumps({"seconds": seconds, "exact": exact, "paths": transport.last_recv_stats.paths}), flush=True)
transport.shutdown(wait=False)
"""

RELAY_MIB = 32  # at 200 Mbit/s: about 1.3 s per receiver at link speed
RELAY_RATE_MBIT = 200
RELAY_BYTES = RELAY_MIB << 20
RELAY_TIMEOUT_S = 20.0


@dataclass
class FanOut:
    """What one source and several receivers on their own hosts did."""

    source: str  # the source's metadata
    receivers: list[str]  # each receiver's metadata, by rank - 1
    outcomes: list[dict[str, Any] | None]  # each receiver's JSON outcome; None: it was killed
    exit_codes: list[int]
    uploaded: int  # bytes host 0's NIC sent during the receives


def _start_receivers(lab: Lab, count: int, relay: bool, kill_first_at: float) -> list[subprocess.Popen[str]]:
    mode = "relay" if relay else "direct"
    return [
        lab_python(
            lab,
            host,
            RELAY_RECEIVER,
            str(RELAY_MIB),
            mode,
            str(kill_first_at if host == 1 else 0.0),
            str(RELAY_TIMEOUT_S),
        )
        for host in range(1, count + 1)
    ]


def _go(receiver: subprocess.Popen[str], metadata: str) -> str:
    """Hand ``receiver`` the source's metadata; returns its own once it starts receiving."""
    assert receiver.stdin is not None and receiver.stdout is not None
    receiver.stdin.write(metadata + "\n")
    receiver.stdin.flush()
    started = receiver.stdout.readline().split()
    assert started[:1] == ["go"], "the receiver did not start"
    return started[1]


def _wait_until_sent(lab: Lab, before: int, nbytes: int) -> None:
    deadline = time.monotonic() + RELAY_TIMEOUT_S
    while lab.tx_bytes(0) - before < nbytes and time.monotonic() < deadline:
        time.sleep(0.01)


def _fan_out(lab: Lab, count: int, relay: bool = True, kill_first_at: float = 0.0) -> FanOut:
    """Host 0 serves ``count`` receivers on hosts 1..count, started together.

    With ``kill_first_at``, receiver 1 starts first (it heads the source's relay
    chain: the others start once the source has sent it 1 MiB) and SIGKILLs
    itself once it has that fraction of the state and has relayed some of it.
    """
    sender = lab_python(lab, 0, RELAY_SENDER, lab.address(0), str(RELAY_MIB), str(count), stderr=False)
    receivers = _start_receivers(lab, count, relay, kill_first_at)
    assert sender.stdout is not None and sender.stdin is not None
    source = sender.stdout.readline().strip()
    assert source, "the sender did not start"
    before = lab.tx_bytes(0)
    advertised = []
    if kill_first_at:
        advertised.append(_go(receivers[0], source))
        _wait_until_sent(lab, before, 1 << 20)
        advertised += [_go(receiver, source) for receiver in receivers[1:]]
    else:
        for receiver in receivers:  # all at once: each one's "go" is read after every metadata is handed out
            assert receiver.stdin is not None
            receiver.stdin.write(source + "\n")
            receiver.stdin.flush()
        for receiver in receivers:
            assert receiver.stdout is not None
            started = receiver.stdout.readline().split()
            assert started[:1] == ["go"], "a receiver did not start"
            advertised.append(started[1])
    outcomes: list[dict[str, Any] | None] = []
    for receiver in receivers:
        out, err = receiver.communicate(timeout=RELAY_TIMEOUT_S + 30)
        lines = out.strip().splitlines()
        outcomes.append(json.loads(lines[-1]) if receiver.returncode == 0 and lines else None)
        assert receiver.returncode in (0, -signal.SIGKILL), err
    uploaded = lab.tx_bytes(0) - before
    sender.stdin.write("\n")
    sender.stdin.flush()
    assert sender.wait(30) == 0
    return FanOut(source, advertised, outcomes, [r.returncode for r in receivers], uploaded)


@pytest.mark.system
@needs_lab
@pytest.mark.parametrize("relay", [True, False], ids=["relay", "relay-off"])
def test_three_receivers_on_three_hosts(relay: bool) -> None:
    with Lab(hosts=4, nics=1, rate_mbit=RELAY_RATE_MBIT) as lab:
        run = _fan_out(lab, 3, relay=relay)
        addresses = [lab.address(host) for host in (1, 2, 3)]
    # Each receiver offers to relay at its own lab address (the default advertise rules, in a namespace).
    assert [endpoint.removeprefix("tcp://").rsplit(":", 1)[0] for endpoint in run.receivers] == addresses
    assert all(outcome is not None and outcome["exact"] for outcome in run.outcomes), run.outcomes
    outcomes = [outcome for outcome in run.outcomes if outcome is not None]
    assert all(sum(outcome["paths"].values()) == RELAY_BYTES for outcome in outcomes)
    from_receivers = sum(n for o in outcomes for endpoint, n in o["paths"].items() if endpoint in run.receivers)
    if relay:
        # The source's NIC carried the state about once, the receivers' uplinks the rest.
        assert run.uploaded < 2 * RELAY_BYTES, run.uploaded
        assert from_receivers >= RELAY_BYTES, [o["paths"] for o in outcomes]
    else:
        # As every transport did before: once per receiver, all from the source.
        assert run.uploaded >= 3 * RELAY_BYTES, run.uploaded
        assert from_receivers == 0, [o["paths"] for o in outcomes]


@pytest.mark.system
@needs_lab
def test_a_relay_sigkilled_mid_transfer() -> None:
    with Lab(hosts=4, nics=1, rate_mbit=RELAY_RATE_MBIT) as lab:
        run = _fan_out(lab, 3, kill_first_at=0.4)
    assert run.exit_codes[0] == -signal.SIGKILL, run.exit_codes
    survivors = run.outcomes[1:]
    assert all(outcome is not None and outcome["exact"] for outcome in survivors), survivors
    outcomes = [outcome for outcome in survivors if outcome is not None]
    # Before the timeout: the killed relay's part went elsewhere, not to a timeout.
    assert all(outcome["seconds"] < RELAY_TIMEOUT_S / 2 for outcome in outcomes), outcomes
    # The killed relay had served a survivor part of the state: that one got the rest from another sender.
    served = [o["paths"] for o in outcomes if o["paths"].get(run.receivers[0], 0) > 0]
    assert served, [o["paths"] for o in outcomes]
    assert all(len(paths) >= 2 and sum(paths.values()) == RELAY_BYTES for paths in served), served


# ----------------------------------------------------------------------------- swarm (issue 22)


def _receive_on(lab: Lab, hosts: list[int], lead_bytes: int = 0) -> tuple[list[dict[str, Any]], list[str], int]:
    """A source on host 0 and a receiver on each of ``hosts`` (repeats: several on one host).

    With ``lead_bytes``, the first receiver asks first and the others once the
    source has sent it that much. Returns the outcomes, the receivers' own
    metadata, and the bytes host 0's NIC sent.
    """
    sender = lab_python(lab, 0, RELAY_SENDER, lab.address(0), str(RELAY_MIB), str(len(hosts)), stderr=False)
    receivers = [
        lab_python(lab, host, RELAY_RECEIVER, str(RELAY_MIB), "relay", "0", str(RELAY_TIMEOUT_S)) for host in hosts
    ]
    assert sender.stdout is not None and sender.stdin is not None
    source = sender.stdout.readline().strip()
    assert source, "the sender did not start"
    before = lab.tx_bytes(0)
    advertised = [_go(receivers[0], source)]
    if lead_bytes:
        _wait_until_sent(lab, before, lead_bytes)
    advertised += [_go(receiver, source) for receiver in receivers[1:]]
    outcomes = []
    for receiver in receivers:
        out, err = receiver.communicate(timeout=RELAY_TIMEOUT_S + 30)
        assert receiver.returncode == 0, err
        outcomes.append(json.loads(out.strip().splitlines()[-1]))
    uploaded = lab.tx_bytes(0) - before
    sender.stdin.write("\n")
    sender.stdin.flush()
    assert sender.wait(30) == 0
    return outcomes, advertised, uploaded


@needs_lab
def test_a_slow_first_receiver_holds_nobody_back() -> None:
    # Receiver 1 asks first, on a link 4x slower than the others'. In a chain
    # the two fast ones fetched everything through it, at its pace; in the
    # swarm they fetch from the source and from each other as fast as each
    # delivers, and take little from the slow one.
    slow_rate = RELAY_RATE_MBIT / 4
    with Lab(hosts=4, nics=1, rate_mbit=RELAY_RATE_MBIT, host_rates={1: slow_rate}) as lab:
        outcomes, advertised, uploaded = _receive_on(lab, [1, 2, 3], lead_bytes=1 << 20)
    assert all(outcome["exact"] for outcome in outcomes), outcomes
    slow, *fast = outcomes
    for outcome in fast:
        assert sum(outcome["paths"].values()) == RELAY_BYTES
        assert outcome["paths"].get(advertised[0], 0) < RELAY_BYTES // 2, outcome["paths"]
        # Bound by their own links, they are done long before the slow one's link can carry the state.
        assert outcome["seconds"] < slow["seconds"], (outcome["seconds"], slow["seconds"])
    assert set(fast[0]["paths"]) - {advertised[0]}, "the fast receivers fetch beside the slow one"
    assert uploaded < 2.5 * RELAY_BYTES, uploaded


@needs_lab
def test_receivers_on_the_sources_host_are_served_directly_whatever_address_they_use() -> None:
    # Two receivers on the source's own host reach it over its lab address
    # (not loopback), a third is on another host: only that one may serve or
    # be served by others; the two local ones fetch everything from the source.
    with Lab(hosts=2, nics=1, rate_mbit=RELAY_RATE_MBIT) as lab:
        outcomes, advertised, _ = _receive_on(lab, [0, 0, 1])
        source = f"tcp://{lab.address(0)}:"
    assert all(outcome["exact"] for outcome in outcomes), outcomes
    for outcome in outcomes[:2]:
        assert list(outcome["paths"]) and all(endpoint.startswith(source) for endpoint in outcome["paths"]), outcome
    assert all(advertised[0] not in outcome["paths"] and advertised[1] not in outcome["paths"] for outcome in outcomes)
