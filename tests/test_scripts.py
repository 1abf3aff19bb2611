"""The measuring tools scripts/README.md documents still run (tiny sizes; what they print is not judged)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def run_script(name: str, *args: str, timeout: float) -> str:
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ.copy(),
        cwd=ROOT,
    )
    assert result.returncode == 0, f"{name} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def test_every_script_the_readme_names_exists_and_every_script_is_named() -> None:
    readme = (SCRIPTS / "README.md").read_text()
    present = {path.name for path in SCRIPTS.iterdir() if path.name != "README.md"}
    named = {name for name in present if f"`{name}`" in readme}
    assert named == present, f"scripts/README.md does not name: {sorted(present - named)}"


@pytest.mark.system
def test_first_touch_measures_a_small_mapping() -> None:
    out = run_script("first_touch.py", "--size", "8M", "--trials", "1", "--settle", "0", timeout=120)
    assert "median" in out and "s/GiB" in out


@pytest.mark.system
@pytest.mark.slow
def test_stall_gaps_measures_two_small_receives() -> None:
    out = run_script("stall_gaps.py", "--receivers", "2", "--gib", "0.01", "--rounds", "1", timeout=300)
    assert "largest wait for a data message" in out


def test_tbf_backlog_reads_the_backlog_of_tbf_queues_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    # No scripts/__pycache__: every entry of scripts/ must be one its README names (the test above).
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    spec = importlib.util.spec_from_file_location("tbf_backlog", SCRIPTS / "tbf_backlog.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shown = (
        "qdisc noqueue 0: dev br0 root refcnt 2 \n"
        " Sent 0 bytes 0 pkt (dropped 0, overlimits 0 requeues 0) \n"
        " backlog 0b 0p requeues 0\n"
        "qdisc tbf 8001: dev h1n0 root refcnt 2 rate 100Mbit burst 256Kb lat 335.5ms \n"
        " Sent 71234567 bytes 48000 pkt (dropped 0, overlimits 9000 requeues 0) \n"
        " backlog 543210b 360p requeues 0\n"
        "qdisc tbf 8002: dev h2n0 root refcnt 2 rate 400Mbit burst 256Kb lat 83.9ms \n"
        " Sent 1000 bytes 1 pkt (dropped 0, overlimits 0 requeues 0) \n"
        " backlog 0b 0p requeues 0\n"
    )
    assert module.backlogs(shown) == {"h1n0": 543210, "h2n0": 0}
    lines = module.summary({"h1n0": [0, 100 << 10, 300 << 10, 200 << 10], "h2n0": [0, 0]})
    assert lines == [
        "h1n0: 4 samples, 3 with a queue: median 200 KiB, 90th percentile 300 KiB, largest 300 KiB",
        "h2n0: 2 samples, never a queue",
    ]


@pytest.mark.system
def test_source_questions_times_a_few_members_questions() -> None:
    out = run_script("source_questions.py", "--members", "3", "--rounds", "2", "--trials", "1", "--pattern", "burst",
                     timeout=120)
    assert "us/question" in out and "burst" in out
