"""Smoke runs of the benchmark (python -m zmqtransport.bench) with tiny sizes.

The benchmark is not a test: these only check that it runs end to end across
processes (a fresh receiver process per trial), prints its table or valid JSON,
and exits 0. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zmqtransport import bench, lab

TINY = [
    "--total",
    "64K",
    "--tensor",
    "4K",
    "--reps",
    "1",
    "--warmup",
    "0",
    "--settle",
    "0",
    "--timeout",
    "60",
]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zmqtransport.bench", *TINY, *args],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_table_with_every_available_method() -> None:
    done = _run()
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "command: python -m zmqtransport.bench" in out
    assert "scenario custom: 64 KiB as 16 float32 tensor(s) of 4 KiB" in out
    assert "cold: the first receive in a fresh receiver process" in out
    for method in ("tcp-reused", "tcp-fresh", "zmq-bare", "zmq-inplace", "zmq-fresh"):
        assert f"\n{method} " in out
    if bench.torchft_available():
        assert "\nhttp " in out and "\nhttp-4 " in out


def test_json_with_two_receivers() -> None:
    done = _run("--receivers", "2", "--methods", "tcp-reused,zmq-bare,zmq-fresh,zmq-inplace", "--warm", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    (scenario,) = report["scenarios"]
    assert scenario["tensors"] == 16
    assert set(scenario["summary"]) == {"tcp-reused", "zmq-bare", "zmq-fresh", "zmq-inplace"}
    for trial in scenario["trials"]:
        assert len(trial["seconds"]) == 2  # one cold time per receiver
        assert len(trial["warm_seconds"]) == 2  # and one warm time (--warm)
    # Every tensor of an in-place receive landed in the receiver's own tensors.
    assert scenario["summary"]["zmq-inplace"]["in_place_tensors"] == 16
    assert scenario["summary"]["zmq-bare"]["in_place_tensors"] == 16
    assert report["machine"]["cpus"] >= 1


def test_sizes_and_presets() -> None:
    assert bench.parse_size("4K") == 4096
    assert bench.parse_size("1GiB") == 1 << 30
    assert bench.parse_size("1.5m") == 3 << 19
    assert bench.Scenario("x", 10 << 10, 4 << 10).tensor_sizes == [4096, 4096, 2048]
    args = bench.build_parser().parse_args(["--scenario", "all", "--total", "8K", "--skip", "pg-fresh"])
    scenarios = bench.scenarios_from_args(args, available=frozenset())
    assert [s.name for s in scenarios] == list(bench.LOOPBACK_PRESETS)
    for scenario in scenarios:
        assert scenario.total_bytes == 8192
        assert scenario.lab is None
        # Methods that need torchft (or numpy) are left out where it is missing.
        assert all(not bench.METHODS[m].requires for m in scenario.methods)
    args = bench.build_parser().parse_args(["--lab", "--rate", "100"])
    scenarios = bench.scenarios_from_args(args, available=frozenset({"torchft"}))
    assert [s.name for s in scenarios] == list(bench.LAB_PRESETS)
    assert {s.lab.rate_mbit for s in scenarios if s.lab} == {100.0}
    assert "http-4" in scenarios[0].methods and "pg-inplace" not in scenarios[0].methods


def test_every_method_is_one_object_with_the_interface() -> None:
    for name, method in bench.METHODS.items():
        assert method.name == name
        assert callable(method.serve) and callable(method.receiver)
    anchors = {name for name, method in bench.METHODS.items() if method.anchor}
    assert anchors == {"tcp-reused", "tcp-fresh", "zmq-bare", "http", "http-4"}


@pytest.mark.skipif(lab.unavailable_reason() is not None, reason=lab.unavailable_reason() or "")
def test_lab_scenario_reports_the_source_upload() -> None:
    done = _run("--scenario", "lab-1to1", "--total", "256K", "--tensor", "64K", "--methods", "zmq-fresh", "--json")
    assert done.returncode == 0, done.stderr
    (scenario,) = json.loads(done.stdout)["scenarios"]
    assert scenario["scenario"]["lab"] == {"nics": 1, "rate_mbit": 400.0}
    (sent,) = scenario["summary"]["zmq-fresh"]["source_sent"]
    assert 256 << 10 <= sent <= (256 << 10) * 1.1


def test_bad_arguments_fail_cleanly() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--methods", "carrier-pigeon", *TINY])
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda"])
