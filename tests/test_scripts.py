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
