"""The network lab (zmqtransport.lab): hosts as namespaces, rate-limited links, counters, cleanup.

Needs root and iproute2 (CI has both); skips with the reason elsewhere. Sizes
are small: every test takes about a second or less, except the ZMQTransport
transfer (two Python processes importing torch). Nothing may be left behind:
a fixture checks ``ip netns list`` after every test, also after a failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from zmqtransport import lab as lab_module
from zmqtransport.lab import Lab, Shaping, build_plan, remove_leftovers, tcp_transfer

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


def test_bad_shape_is_refused() -> None:
    with pytest.raises(ValueError, match=r"1\.\.250 hosts"):
        Lab(hosts=0)
    with pytest.raises(ValueError, match="positive rate"):
        Lab(hosts=2, rate_mbit=0)


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


@needs_lab
def test_removed_on_error() -> None:
    with pytest.raises(RuntimeError, match="boom"), Lab(hosts=2) as lab:
        names = [lab.namespace(0), lab.namespace(1), lab.switch]
        raise RuntimeError("boom")
    assert not set(names) & set(_namespaces())


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
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    with Lab(hosts=2, nics=1, rate_mbit=rate_mbit) as lab:
        sender = lab.popen(
            0,
            [sys.executable, "-c", SENDER, lab.address(0), str(stall)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        # Started at once, so the two imports of torch overlap; the receiver waits for the metadata.
        receiver = lab.popen(
            1,
            [sys.executable, "-c", RECEIVER, str(stall)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
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


@needs_lab
def test_zmq_transport_between_two_hosts_is_bit_exact_and_link_bound() -> None:
    seconds, sent, floor = _transfer_between_two_hosts(rate_mbit=100, stall=5.0)
    assert seconds >= floor
    # What the source sent is the state plus headers and protocol frames (a few percent).
    assert STATE_BYTES <= sent <= STATE_BYTES * 1.06 + (64 << 10)


@needs_lab
def test_slow_progressing_transfer_is_never_cut_by_the_stall_bound() -> None:
    # 4 MiB at 10 Mbit/s: about 3.4 s, each 1 MiB data message about 0.9 s, so the
    # whole transfer takes well over the 1.5 s stall bound on both sides. It must
    # complete bit-exact: the bound is on silence, not on the transfer's length.
    seconds, _, floor = _transfer_between_two_hosts(rate_mbit=10, stall=1.5)
    assert seconds >= floor > 1.5 * 2
