"""The benchmark's torchft methods run with whichever torchft is installed.

torchft 0.2.0 and torchft-nightly set up a process group through different
APIs (``configure`` against ``reconfigure``); PGTransport's methods must work
with either, on loopback and between lab hosts, and the report must name the
torchft distribution it measured.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from typing import Any

import pytest

from zmqtransport import lab

pytest.importorskip("torchft")

pytestmark = pytest.mark.torchft

TINY = ["--tensor", "4K", "--reps", "1", "--warmup", "0", "--settle", "0", "--timeout", "60", "--json"]


def _bench(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "zmqtransport.bench", *TINY, *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_process_group_methods_on_loopback_and_the_torchft_version() -> None:
    report = _bench("--total", "64K", "--methods", "pg-inplace,pg-fresh,http")
    (scenario,) = report["scenarios"]
    assert set(scenario["summary"]) == {"pg-inplace", "pg-fresh", "http"}
    # Which distribution put the `torchft` package here (torchft or torchft-nightly), by its files.
    (distribution,) = importlib.metadata.packages_distributions()["torchft"]
    assert report["machine"]["versions"][distribution] == importlib.metadata.version(distribution)


@pytest.mark.system
@pytest.mark.skipif(lab.unavailable_reason() is not None, reason=lab.unavailable_reason() or "")
def test_process_group_method_between_lab_hosts() -> None:
    # The receiver runs in another network namespace than the sender: the ranks must meet on the
    # sender's lab address, not on what this machine's hostname resolves to.
    report = _bench("--scenario", "lab-1to1", "--total", "256K", "--tensor", "64K", "--methods", "pg-inplace")
    (scenario,) = report["scenarios"]
    assert set(scenario["summary"]) == {"pg-inplace"}
