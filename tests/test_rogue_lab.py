"""A rogue relay in the network lab: real processes on their own hosts, a modified peer among them.

Host 0 is the source. Host 1 asks first, so the source makes it the head of its
relay chain, and is the rogue: a ZMQTransport whose relaying is modified
(it flips the bytes it forwards and forges their CRC32, answers every span
fetch with an error, serves nothing) or an honest relay whose transport shuts
down mid-transfer. Hosts 2 and 3 are honest receivers with default options;
one of them is sent to the rogue. Each must complete bit-exact, well before
its timeout, and the one sent to the rogue names it in a WARNING.

Needs root and iproute2 (the lab); skips elsewhere. The benchmark's
``lab-rogue`` rows time the same runs against a clean fan-out.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from zmqtransport.lab import Lab

from .conftest import lab_python
from .test_lab import needs_lab, nothing_left_behind  # noqa: F401  (the fixture: no namespace left behind)

MIB_STATE = 32  # at 200 Mbit/s: about 1.3 s per receiver at link speed
RATE_MBIT = 200
TIMEOUT_S = 20.0

SOURCE = """
import sys, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
address, mib = sys.argv[1], int(sys.argv[2])
generator = torch.Generator().manual_seed(21)
state = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(mib)}
transport = ZMQTransport(timedelta(seconds=30), bind_host=address, advertise_host=address, checksum=True)
transport.send_checkpoint([1, 2, 3], 7, state, timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.readline()
transport.shutdown(wait=False)
"""

# A receiver whose relaying is modified as argv[1] says (see the module docstring).
# Prints "go METADATA" when it starts receiving; its own outcome does not matter.
ROGUE = """
import sys, time, zlib
from datetime import timedelta
from zmqtransport import ZMQTransport, relayed, wire
from zmqtransport.serve import scheduler
mode, timeout = sys.argv[1], float(sys.argv[2])
honest = relayed.Relayed.payload
if mode == "flip":
    def payload(self, seq):
        data, referenced = honest(self, seq)
        forged = bytearray(data)
        forged[::997] = bytes(b ^ 0x5A for b in forged[::997])
        return bytes(forged), referenced
    relayed.Relayed.payload = payload
    relayed.Relayed.crc = lambda self, seq, payload: zlib.crc32(payload)  # a CRC that matches the forgery
elif mode.startswith("error-"):
    code = mode.removeprefix("error-")
    def refuse(self, peer, request, address, now):
        return [scheduler.Refuse(peer, request.xfer, code, "rogue")]
    scheduler.Scheduler._start_relayed = refuse
elif mode == "silent":
    relayed.Relayed.available = lambda self, seq: False
def progress(done, total):
    if mode == "shutdown" and done >= total // 2:
        transport.shutdown(wait=False)  # an honest relay that shuts its transport down mid-transfer
transport = ZMQTransport(timedelta(seconds=timeout), progress=progress)
metadata = sys.stdin.readline().strip()
print("go", transport.metadata(), flush=True)
try:
    transport.recv_checkpoint(0, metadata, 7, timedelta(seconds=timeout))
except Exception as exc:
    print("rogue's own receive:", exc, file=sys.stderr)
transport.shutdown(wait=False)
"""

# An honest receiver, default options; WARNINGs of the transport on stderr.
HONEST = """
import json, logging, sys, time, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s %(message)s")
mib, timeout = int(sys.argv[1]), float(sys.argv[2])
generator = torch.Generator().manual_seed(21)
expected = {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(mib)}
transport = ZMQTransport(timedelta(seconds=timeout))
metadata = sys.stdin.readline().strip()
print("go", transport.metadata(), flush=True)
started = time.perf_counter()
got = transport.recv_checkpoint(0, metadata, 7, timedelta(seconds=timeout))
seconds = time.perf_counter() - started
exact = got.keys() == expected.keys() and all(
    got[key].view(torch.uint8).equal(tensor.view(torch.uint8)) for key, tensor in expected.items()
)
print(json.dumps({"seconds": seconds, "exact": exact, "paths": transport.last_recv_stats.paths}), flush=True)
transport.shutdown(wait=False)
"""


def _handshake(child: subprocess.Popen[str], metadata: str) -> str:
    """Hand ``child`` the source's metadata; returns its own once it starts receiving."""
    assert child.stdin is not None and child.stdout is not None
    child.stdin.write(metadata + "\n")
    child.stdin.flush()
    started = child.stdout.readline().split()
    assert started[:1] == ["go"], "the receiver did not start"
    return started[1]


def _rogue_run(mode: str) -> tuple[str, list[tuple[int, dict[str, Any] | None, str]]]:
    """The rogue's metadata, and each honest receiver's exit code, outcome and stderr."""
    with Lab(hosts=4, nics=1, rate_mbit=RATE_MBIT) as lab:
        source = lab_python(lab, 0, SOURCE, lab.address(0), str(MIB_STATE), stderr=False)
        rogue = lab_python(lab, 1, ROGUE, mode, str(TIMEOUT_S))
        honest = [lab_python(lab, host, HONEST, str(MIB_STATE), str(TIMEOUT_S)) for host in (2, 3)]
        assert source.stdout is not None and source.stdin is not None
        metadata = source.stdout.readline().strip()
        assert metadata, "the source did not start"
        before = lab.tx_bytes(0)
        rogue_at = _handshake(rogue, metadata)
        while lab.tx_bytes(0) - before < 1 << 20:  # the rogue heads the chain and is receiving
            assert rogue.poll() is None, rogue.communicate()[1]
        for child in honest:
            assert child.stdin is not None
            child.stdin.write(metadata + "\n")
            child.stdin.flush()
        results = []
        for child in honest:
            out, err = child.communicate(timeout=TIMEOUT_S + 30)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            results.append((child.returncode, json.loads(lines[-1]) if lines else None, err))
        rogue.communicate(timeout=TIMEOUT_S + 30)
        source.stdin.write("\n")
        source.stdin.flush()
        assert source.wait(30) == 0
    return rogue_at, results


# The rogue's error replies of other codes, its malformed messages, and a
# device-memory receive behind it are tried on loopback (tests/test_verify.py).
MODES = ["flip", "error-stalled", "silent", "shutdown"]


@needs_lab
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_rogue_relay_changes_nothing(mode: str) -> None:
    rogue_at, results = _rogue_run(mode)
    for code, outcome, err in results:
        assert code == 0, err
        assert outcome is not None and outcome["exact"], (outcome, err)
        assert outcome["seconds"] < TIMEOUT_S / 2, outcome
        assert sum(outcome["paths"].values()) == MIB_STATE << 20, outcome
    rogue_endpoint = rogue_at.split("?")[0]
    warnings = [line for _, _, err in results for line in err.splitlines() if line.startswith("WARNING")]
    if mode != "shutdown":  # an honest relay that goes away is routine; a rogue is named
        assert any(rogue_endpoint in line for line in warnings), warnings
