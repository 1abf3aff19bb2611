"""disallow_checkpoint mid-transfer in the network lab (issue 23): receivers on other hosts, links of unequal rates.

The source (host 0) stages a seeded state, calls ``disallow_checkpoint`` 0.3 s
after both receivers began, then adds 1.0 to every tensor. Receiver 1 (in
place, a 400 Mbit/s link) and receiver 2 (fresh memory, its link slowed to
100 Mbit/s, so it is chained behind receiver 1 or fetches long after the call)
must both get the staged bytes. Needs root and iproute2, as tests/test_lab.py.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from zmqtransport import lab as lab_module
from zmqtransport.lab import Lab, Shaping

from .conftest import lab_python

REASON = lab_module.unavailable_reason()
pytestmark = [pytest.mark.system, pytest.mark.skipif(REASON is not None, reason=REASON or ""), pytest.mark.timeout(180)]

STATE = """
import torch
def seeded():
    generator = torch.Generator().manual_seed(23)
    state = {f"w{i}": torch.randn(1 << 20, generator=generator) for i in range(6)}  # 24 MiB
    state["small"] = [torch.randn(n, generator=generator) for n in (5, 500, 5000)]
    return state
"""

SOURCE = (
    STATE
    + """
import json, sys, time
from datetime import timedelta
from zmqtransport import ZMQTransport
address = sys.argv[1]
state = seeded()
transport = ZMQTransport(timedelta(seconds=60), bind_host=address, advertise_host=address)
transport.send_checkpoint([1, 2], 3, state, timedelta(seconds=60))
print(transport.metadata(), flush=True)
sys.stdin.readline()
started = time.perf_counter()
transport.disallow_checkpoint()
held = time.perf_counter() - started
with torch.no_grad():
    for key, value in state.items():
        for tensor in value if isinstance(value, list) else [value]:
            tensor.add_(1.0)
stats = getattr(transport, "last_disallow_stats", None)
print(json.dumps({"held": held, "receives": getattr(stats, "receives", None)}), flush=True)
sys.stdin.readline()
transport.shutdown()
"""
)

RECEIVER = (
    STATE
    + """
import json, sys, time
from datetime import timedelta
from zmqtransport import ZMQTransport
in_place = sys.argv[1] == "in-place"
expected = seeded()
target = seeded()
for value in target.values():
    for tensor in value if isinstance(value, list) else [value]:
        tensor.fill_(-7.0)
options = {"state_dict": (lambda: target)} if in_place else {}
transport = ZMQTransport(timedelta(seconds=60), **options)
metadata = sys.stdin.readline().strip()
print("started", flush=True)
outcome = {"error": ""}
try:
    got = transport.recv_checkpoint(0, metadata, 3, timedelta(seconds=60))
    for key, value in expected.items():
        pairs = zip(value, got[key]) if isinstance(value, list) else [(value, got[key])]
        for want, have in pairs:
            if not want.view(torch.uint8).equal(have.view(torch.uint8)):
                outcome["error"] = f"{key}: other bytes than staged"
    if in_place and got["w0"].data_ptr() != target["w0"].data_ptr():
        outcome["error"] = "not received in place"
    outcome["paths"] = transport.last_recv_stats.paths
except Exception as exc:
    outcome["error"] = f"{type(exc).__name__}: {exc}"
transport.shutdown()
print(json.dumps(outcome), flush=True)
"""
)


def _slow_download(lab: Lab, host: int, rate_mbit: float) -> None:
    """Limit what ``host`` downloads (its switch port's egress) to ``rate_mbit``."""
    port = lab_module.switch_port(host, 0)
    tbf = Shaping(rate_mbit).tc_args().split()
    argv = ["ip", "netns", "exec", lab.switch, "tc", "qdisc", "replace", "dev", port, "root", *tbf]
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


def test_receives_on_other_hosts_complete_with_the_staged_bytes_after_a_disallow() -> None:
    with Lab(hosts=3, nics=1, rate_mbit=400) as lab:
        _slow_download(lab, 2, 100)
        source = lab_python(lab, 0, SOURCE, lab.address(0), stderr=False)
        receivers = [lab_python(lab, 1, RECEIVER, "in-place"), lab_python(lab, 2, RECEIVER, "fresh")]
        assert source.stdout is not None and source.stdin is not None
        metadata = source.stdout.readline().strip()
        assert metadata, "the source did not start"
        for receiver in receivers:
            assert receiver.stdin is not None and receiver.stdout is not None
            receiver.stdin.write(metadata + "\n")
            receiver.stdin.flush()
        for receiver in receivers:
            assert receiver.stdout is not None
            assert receiver.stdout.readline().strip() == "started"
        time.sleep(0.3)
        source.stdin.write("go\n")
        source.stdin.flush()
        report = json.loads(source.stdout.readline())
        outcomes = []
        for receiver in receivers:
            out, err = receiver.communicate(timeout=90)
            assert receiver.returncode == 0, err
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
        source.stdin.write("\n")
        source.stdin.flush()
        assert source.wait(30) == 0
    assert [outcome["error"] for outcome in outcomes] == ["", ""], outcomes
    assert report["receives"] == 2
    assert report["held"] < 5.0, f"disallow_checkpoint held the source {report['held']:.2f} s"  # a hang detector
