"""A rogue relay in the network lab: real processes on their own hosts, a modified peer among them.

Host 0 is the source. Host 1 asks first, so the source makes it the head of its
relay chain, and is the rogue: a ZMQTransport whose relaying is modified as
the benchmark's rogue is (``zmqtransport.bench.rogue``: it flips the bytes it
forwards and forges their CRC32, answers every span fetch with an error,
serves nothing), an honest relay whose transport shuts down mid-transfer, or
one that makes the source reserve it every message and fetches none of them
(docs/protocol.md, "Swarm", claims: the others then fetch as without claims),
one that also answers every question about what it holds with "nothing, but
fetching everything" and serves nothing (``liar``), or an honest relay that
stops itself (SIGSTOP) halfway with claims outstanding (``freeze``): claims are
hints with deadlines (zmqtransport/fetch/claims.py).
Hosts 2 and 3 are honest receivers with default options (tests/test_lab.py's
source and receivers); one of them is sent to the rogue. Each must complete
bit-exact, well before its timeout, and the one sent to the rogue names it in
a WARNING.

Needs root and iproute2 (the lab); skips elsewhere. The benchmark's
``lab-rogue`` rows time the same runs against a clean fan-out.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from zmqtransport.lab import Lab

from .conftest import lab_python
from .test_lab import (
    RELAY_MIB,
    RELAY_RATE_MBIT,
    RELAY_RECEIVER,
    RELAY_SENDER,
    _go,
    _wait_until_sent,
    needs_lab,
    nothing_left_behind,  # noqa: F401  (the fixture: no namespace left behind)
)

TIMEOUT_S = 20.0

# A receiver whose relaying is modified as the benchmark's rogue is (zmqtransport.bench.rogue):
# argv[1] is the mode. Prints "go METADATA" when it starts receiving; its own outcome does not matter.
ROGUE = """
import sys
from datetime import timedelta
from zmqtransport import ZMQTransport
from zmqtransport.bench.rogue import become_rogue, freeze_halfway, shutdown_halfway
mode, timeout = sys.argv[1], float(sys.argv[2])
become_rogue(mode)
itself = []
progress = shutdown_halfway(itself) if mode == "shutdown" else freeze_halfway() if mode == "freeze" else None
transport = ZMQTransport(timedelta(seconds=timeout), progress=progress)
itself.append(transport)
metadata = sys.stdin.readline().strip()
print("go", transport.metadata(), flush=True)
try:
    transport.recv_checkpoint(0, metadata, 5, timedelta(seconds=timeout))
except Exception as exc:
    print("the rogue's own receive:", exc, file=sys.stderr)
transport.shutdown(wait=False)
"""


def _rogue_run(mode: str) -> tuple[str, list[tuple[int, dict[str, Any] | None, str]]]:
    """The rogue's metadata, and each honest receiver's exit code, outcome and stderr."""
    with Lab(hosts=4, nics=1, rate_mbit=RELAY_RATE_MBIT) as lab:
        source = lab_python(lab, 0, RELAY_SENDER, lab.address(0), str(RELAY_MIB), "3", stderr=False)
        rogue = lab_python(lab, 1, ROGUE, mode, str(TIMEOUT_S))
        # Honest receivers with default options (tests/test_lab.py's); their WARNINGs go to stderr.
        honest = [
            lab_python(lab, host, RELAY_RECEIVER, str(RELAY_MIB), "relay", "0", str(TIMEOUT_S)) for host in (2, 3)
        ]
        assert source.stdout is not None and source.stdin is not None
        metadata = source.stdout.readline().strip()
        assert metadata, "the source did not start"
        before = lab.tx_bytes(0)
        rogue_at = _go(rogue, metadata)
        _wait_until_sent(lab, before, 1 << 20)  # the rogue heads the chain and is receiving
        for child in honest:
            assert child.stdin is not None
            child.stdin.write(metadata + "\n")
            child.stdin.flush()
        results = []
        for child in honest:
            out, err = child.communicate(timeout=TIMEOUT_S + 30)
            lines = [line for line in out.splitlines() if line.startswith("{")]
            results.append((child.returncode, json.loads(lines[-1]) if lines else None, err))
        if mode == "freeze":
            rogue.kill()  # it stopped itself: it would never end
        rogue.communicate(timeout=TIMEOUT_S + 30)
        source.stdin.write("\n")
        source.stdin.flush()
        assert source.wait(30) == 0
    return rogue_at, results


# The rogue's error replies of other codes, its malformed messages, and a
# device-memory receive behind it are tried on loopback (tests/test_verify.py).
MODES = ["flip", "error", "silent", "shutdown", "hoard", "liar", "freeze"]


@needs_lab
@pytest.mark.system
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_a_rogue_relay_changes_nothing(mode: str) -> None:
    rogue_at, results = _rogue_run(mode)
    for code, outcome, err in results:
        assert code == 0, err
        assert outcome is not None and outcome["exact"], (outcome, err)
        assert outcome["seconds"] < TIMEOUT_S / 2, outcome
        assert sum(outcome["paths"].values()) == RELAY_MIB << 20, outcome
    rogue_endpoint = rogue_at.split("?")[0]
    # No logging configured: Python's last-resort handler writes WARNINGs (and above) to stderr.
    named = [line for _, _, err in results for line in err.splitlines() if f"the peer at {rogue_endpoint}" in line]
    if mode not in ("shutdown", "hoard", "freeze"):  # an honest relay that goes away is routine; a rogue is named
        assert named, [err for _, _, err in results]
