"""Smoke runs of the benchmark (python -m zmqtransport.bench) with tiny sizes.

The benchmark is not a test: these only check that it runs end to end across
processes (a fresh receiver process per trial), prints its table or valid JSON,
and exits 0. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

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
    # Every table shows the CPU per GiB (issue 33).
    header = next(line for line in out.splitlines() if line.startswith("method "))
    for column in ("recv cpu s/GiB", "src cpu s/GiB", "all cpu s/GiB"):
        assert column in header
    assert "cpu s/GiB: CPU seconds (user + system, every thread) per GiB moved" in out


@pytest.mark.system
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
        assert len(trial["recv_cpu"]) == 2 and all(cpu > 0 for cpu in trial["recv_cpu"])  # CPU of each cold receive
        # Each receiver's process over the trial, and the source's.
        assert len(trial["recv_process_cpu"]) == 2 and all(cpu > 0 for cpu in trial["recv_process_cpu"])
        assert isinstance(trial["send_cpu"], float) and trial["send_cpu"] > 0
        assert trial["profiles"] == {}  # no --profile
    for method, entry in scenario["summary"].items():
        # CPU seconds per GiB moved, in every row, for every method.
        for field in ("recv_cpu_per_gib", "recv_cpu_per_gib_max", "send_cpu_per_gib", "cpu_per_gib"):
            assert isinstance(entry[field], float) and entry[field] > 0, (method, field)
        assert entry["recv_cpu_per_gib_max"] >= entry["recv_cpu_per_gib"]
        assert entry["cpu_per_gib"] >= entry["send_cpu_per_gib"]
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
    assert anchors == {"tcp-reused", "tcp-fresh", "tcp-reused-4", "zmq-bare", "http", "http-4"}


@pytest.mark.system
@pytest.mark.skipif(lab.unavailable_reason() is not None, reason=lab.unavailable_reason() or "")
def test_lab_scenario_reports_the_source_upload() -> None:
    done = _run("--scenario", "lab-1to1", "--total", "256K", "--tensor", "64K", "--methods", "zmq-fresh", "--json")
    assert done.returncode == 0, done.stderr
    (scenario,) = json.loads(done.stdout)["scenarios"]
    assert scenario["scenario"]["lab"] == {
        "nics": 1, "rate_mbit": 400.0, "host_rates": [], "shaped": True, "mtu": None
    }  # fmt: skip
    (sent,) = scenario["summary"]["zmq-fresh"]["source_sent"]
    assert 256 << 10 <= sent <= (256 << 10) * 1.1


def test_bad_arguments_fail_cleanly() -> None:
    with pytest.raises(SystemExit):
        bench.main(["--methods", "carrier-pigeon", *TINY])
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda"])


def _summary(method: str, ratios: dict[str, float]) -> bench.runner.MethodSummary:
    return bench.runner.MethodSummary(method, 1.0, 1.0, None, 1.0, 1.0, 0, 0, 0.0, 0, [], ratios=ratios)


def test_issue16_targets_follow_the_scenario_shape() -> None:
    from zmqtransport.bench.config import Scenario
    from zmqtransport.bench.report import format_targets
    from zmqtransport.bench.runner import ScenarioResult
    from zmqtransport.bench.targets import evaluate_targets

    large = ScenarioResult(
        Scenario("custom", 1 << 30, 4 << 20),
        [],
        {
            "zmq-inplace": _summary("zmq-inplace", {"zmq-bare": 0.95, "http-4": 1.1}),
            "zmq-fresh": _summary("zmq-fresh", {"http-4": 1.0, "http": 1.6}),
        },
        1.0,
        True,
    )
    small = ScenarioResult(
        Scenario("small", 80 << 20, 4 << 10), [], {"zmq-fresh": _summary("zmq-fresh", {"http": 9.0})}, 1.0, True
    )
    fanout = ScenarioResult(
        Scenario("fanout", 1 << 30, 4 << 20, receivers=3),
        [],
        {"zmq-fresh": _summary("zmq-fresh", {"http": 1.2, "http-4": 0.5})},
        1.0,
        True,
    )
    cold = [t for t in evaluate_targets([large, small, fanout]) if t.issue == 16]
    verdicts = {(t.scenario, t.text): (t.limit, t.holds) for t in cold}
    assert verdicts == {
        ("custom", "zmq-inplace speed / zmq-bare"): (0.9, True),
        ("custom", "zmq-inplace speed / http-4"): (1.2, False),
        ("custom", "zmq-fresh speed / http-4"): (1.0, True),
        ("custom", "zmq-fresh speed / http"): (1.5, True),
        ("small", "zmq-fresh speed / http"): (10.0, False),
        ("fanout", "zmq-fresh slowest / http slowest speed"): (1.0, True),
    }
    assert "targets (issue 16, measured cold):" in format_targets(cold)


def _timed(method: str, seconds: float, paths: dict[str, int] | None = None) -> bench.runner.MethodSummary:
    summary = bench.runner.MethodSummary(method, seconds, seconds, None, 1.0, 1.0, 0, 0, 0.0, 0, [0, 0])
    summary.recv_paths = paths or {}
    return summary


def test_issue12_targets_are_ratios_to_one_stream_in_the_same_lab() -> None:
    from zmqtransport.bench.config import LabSpec, Scenario
    from zmqtransport.bench.report import format_lab_result, format_targets
    from zmqtransport.bench.runner import ScenarioResult
    from zmqtransport.bench.targets import evaluate_targets

    both = {"tcp://10.77.0.1:5000": 64 << 20, "tcp://10.77.1.1:5000": 64 << 20}
    two_nics = ScenarioResult(
        Scenario("lab-paths", 128 << 20, 4 << 20, lab=LabSpec(nics=2)),
        [],
        {
            "zmq-inplace-1s": _timed("zmq-inplace-1s", 2.8, {"tcp://10.77.0.1:5001": 128 << 20}),
            "zmq-inplace": _timed("zmq-inplace", 1.5, both),
            "zmq-inplace-cut": _timed("zmq-inplace-cut", 3.9, {"tcp://10.77.1.1:5002": 128 << 20}),
            "http-4": _timed("http-4", 2.8),
        },
        1.0,
        True,
    )
    one_nic = ScenarioResult(
        Scenario("lab-streams", 128 << 20, 4 << 20, lab=LabSpec()),
        [],
        {"zmq-inplace-1s": _timed("zmq-inplace-1s", 2.8), "zmq-inplace-4s": _timed("zmq-inplace-4s", 2.9)},
        1.0,
        True,
    )
    loopback = ScenarioResult(  # no lab: no issue-12 target even with the same methods
        Scenario("custom", 128 << 20, 4 << 20),
        [],
        {"zmq-inplace-1s": _timed("zmq-inplace-1s", 1.0), "zmq-inplace": _timed("zmq-inplace", 1.0)},
        1.0,
        True,
    )
    targets = [t for t in evaluate_targets([two_nics, one_nic, loopback]) if t.issue == 12]
    verdicts = {(t.scenario, t.text.split(":")[0]): (round(t.measured, 3), t.limit, t.holds) for t in targets}
    assert verdicts == {
        ("lab-paths", "zmq-inplace seconds / zmq-inplace-1s (one NIC) seconds"): (0.536, 0.6, True),
        ("lab-paths", "zmq-inplace-cut seconds / zmq-inplace-1s (one NIC) seconds"): (1.393, 1.3, False),
        ("lab-streams", "zmq-inplace-4s seconds / zmq-inplace-1s (one NIC) seconds"): (1.036, 1.05, True),
    }
    assert "targets (issue 12, measured cold):" in format_targets(targets)
    table = format_lab_result(two_nics)
    # Bytes per path in address order, whatever port each method's source had; "-" for other transports.
    assert "on 10.77.0.1 / 10.77.1.1" in table
    rows = {line.split()[0]: line.split() for line in table.splitlines() if line.startswith(("zmq", "http"))}
    assert rows["zmq-inplace"][-2:] == ["64/64", "0"]
    assert rows["zmq-inplace-1s"][-2:] == ["128/0", "0"]
    assert rows["zmq-inplace-cut"][-2:] == ["0/128", "0"]
    assert rows["http-4"][-2:] == ["-", "-"]
    assert "zmq-inplace-cut: the source's NIC 1 went down never" in table


def test_a_cut_needs_a_lab_with_that_nic() -> None:
    from zmqtransport.bench.config import LabSpec, Scenario
    from zmqtransport.bench.runner import BenchError, _check_cuts

    _check_cuts(Scenario("two", 1 << 20, 1 << 20, methods=("zmq-inplace-cut",), lab=LabSpec(nics=2)))
    for lab_spec in (None, LabSpec(nics=1)):
        with pytest.raises(BenchError, match="zmq-inplace-cut cuts the source's NIC 1"):
            _check_cuts(Scenario("one", 1 << 20, 1 << 20, methods=("zmq-inplace-cut",), lab=lab_spec))


@pytest.mark.system
@pytest.mark.skipif(lab.unavailable_reason() is not None, reason=lab.unavailable_reason() or "")
def test_lab_paths_scenario_stripes_and_survives_the_cut() -> None:
    done = _run(
        "--scenario",
        "lab-paths",
        "--total",
        "32M",  # a striped receive asks for spans of 4 MiB, two at a time per connection
        "--tensor",
        "4M",
        "--rate",
        "1000",
        "--methods",
        "zmq-inplace-1s,zmq-inplace,zmq-inplace-cut",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    (scenario,) = json.loads(done.stdout)["scenarios"]
    summary = scenario["summary"]
    # Served on both NICs: the default receive lands bytes over both paths, one stream over one.
    assert len(summary["zmq-inplace"]["recv_paths"]) == 2
    assert all(nic > 0 for nic in summary["zmq-inplace"]["source_sent"])
    assert len(summary["zmq-inplace-1s"]["recv_paths"]) == 1
    # The cut trial completed (its content was checked) and restored the link for the trials after it.
    assert sum(summary["zmq-inplace-cut"]["recv_paths"].values()) == 32 << 20


def _relay_trial(method: str, seconds: list[float], paths: list[dict[str, int]], killed: list[int]) -> Any:
    return bench.runner.Trial(
        method,
        0,
        seconds,
        [],
        [0] * len(seconds),
        0,
        0.0,
        [0] * len(seconds),
        [64 << 20],
        recv_paths=paths,
        killed=killed,
    )


def _relay_result(name: str, receivers: int, times: dict[str, float], sent: float, kill: bool = False) -> Any:
    from zmqtransport.bench.config import Kill, LabSpec, Scenario
    from zmqtransport.bench.runner import ScenarioResult

    scenario = Scenario(name, 64 << 20, 4 << 20, receivers=receivers, lab=LabSpec(), kill=Kill() if kill else None)
    summary = {}
    for method, seconds in times.items():
        entry = _timed(method, seconds)
        entry.source_sent = [int(sent * (64 << 20))]
        summary[method] = entry
    src, r1, r3 = "tcp://10.77.0.1:5000", "tcp://10.77.0.2:6000", "tcp://10.77.0.4:6001"
    trials = []
    if kill:
        paths = [{r3: 64 << 20}, {src: 40 << 20, r1: 24 << 20}]
        trials.append(_relay_trial("zmq-fresh", [1.5, 1.6], paths, [1]))
    return ScenarioResult(scenario, trials, summary, 1.0, True)


def test_issue13_targets_compare_several_receivers_with_one_in_the_same_run() -> None:
    from zmqtransport.bench.relayreport import format_paths_detail, format_relay_summary, host_label
    from zmqtransport.bench.report import format_targets
    from zmqtransport.bench.targets import evaluate_targets

    one = _relay_result("lab-1to1", 1, {"zmq-fresh": 1.4, "http-4": 1.4}, 1.0)
    three = _relay_result("lab-1to3", 3, {"zmq-fresh": 1.68, "zmq-norelay": 4.2, "http-4": 4.2}, 1.02)
    seven = _relay_result("lab-1to7", 7, {"zmq-fresh": 2.2}, 1.1)
    killed = _relay_result("lab-kill", 3, {"zmq-fresh": 1.6}, 1.2, kill=True)
    other_rate = _relay_result("other", 3, {"zmq-fresh": 9.0}, 3.0)
    assert other_rate.scenario.lab is not None
    other_rate.scenario = bench.Scenario("other", 64 << 20, 4 << 20, receivers=3, lab=bench.LabSpec(rate_mbit=100))
    targets = [t for t in evaluate_targets([one, three, seven, killed, other_rate]) if t.issue == 13]
    verdicts = {(t.scenario, t.text): (round(t.measured, 2), t.limit, t.holds) for t in targets}
    assert verdicts == {
        ("lab-1to3", "zmq-fresh slowest / one-receiver seconds (3 receivers)"): (1.2, 1.3, True),
        ("lab-1to3", "zmq-fresh source upload / state (3 receivers)"): (1.02, 1.3, True),
        ("lab-1to7", "zmq-fresh slowest / one-receiver seconds (7 receivers)"): (1.57, 1.5, False),
        ("lab-kill", "zmq-fresh slowest / one-receiver seconds (3 receivers, 1 relay SIGKILLed mid-transfer)"): (
            1.14,
            2.0,
            True,
        ),
    }
    assert "targets (issue 13, measured cold):" in format_targets(targets)
    summary = format_relay_summary([one, three, seven, killed, other_rate])
    rows = {tuple(line.split()[:2]): line.split() for line in summary.splitlines()[2:]}
    # zmq-norelay has no one-receiver row of its own: it is compared with zmq-fresh's.
    assert rows[("lab-1to3", "zmq-norelay")][4:] == ["-", "4.200", "1.400", "(zmq-fresh)", "3.00", "1.02"]
    assert rows[("lab-1to3", "http-4")][4:] == ["-", "4.200", "1.400", "3.00", "1.02"]
    assert ("other", "zmq-fresh") not in rows  # no one-receiver row at its rate
    assert host_label("tcp://10.77.0.1:5000") == "src" and host_label("tcp://10.77.0.4:1") == "r3"
    assert host_label("tcp://127.0.0.1:5") == "127.0.0.1"
    detail = format_paths_detail([killed])
    assert "[lab-kill] zmq-fresh trial 0 (killed: r1): source sent 64.0 MiB" in detail
    assert "r2 1.50 s <- r3 64.0; r3 1.60 s <- src 40.0, r1 24.0" in detail


def test_issue21_targets_compare_a_rogue_relay_with_the_clean_fan_out() -> None:
    from zmqtransport.bench.config import Rogue
    from zmqtransport.bench.relayreport import format_relay_summary
    from zmqtransport.bench.targets import evaluate_targets

    one = _relay_result("lab-1to1", 1, {"zmq-fresh": 1.4}, 1.0)
    three = _relay_result("lab-1to3", 3, {"zmq-fresh": 1.6}, 1.02)
    flip = _relay_result("lab-rogue-flip", 3, {"zmq-fresh": 2.4}, 1.9)
    silent = _relay_result("lab-rogue-silent", 3, {"zmq-fresh": 3.5}, 2.0)
    for result, mode in ((flip, "flip"), (silent, "silent")):
        result.scenario = replace(result.scenario, rogue=Rogue(mode), lead_s=0.2)
    targets = [t for t in evaluate_targets([one, three, flip, silent]) if t.issue == 21]
    verdicts = {(t.scenario, t.text): (round(t.measured, 2), t.limit, t.holds) for t in targets}
    assert verdicts == {
        ("lab-rogue-flip", "zmq-fresh slowest honest / clean fan-out slowest (rogue relay: flip)"): (1.5, 2.0, True),
        ("lab-rogue-silent", "zmq-fresh slowest honest / clean fan-out slowest (rogue relay: silent)"): (
            2.19,
            2.0,
            False,
        ),
    }
    # Issue 13's targets leave the rogue rows alone; the relay table names the rogue's mode.
    assert not [t for t in evaluate_targets([one, three, flip]) if t.issue == 13 and "rogue" in t.scenario]
    rows = {line.split()[0]: line.split() for line in format_relay_summary([one, three, flip]).splitlines()[2:]}
    assert rows["lab-rogue-flip"][4] == "flip" and rows["lab-1to3"][4] == "-"


def test_rogue_presets_are_chosen_together() -> None:
    args = bench.build_parser().parse_args(["--scenario", "rogue"])
    scenarios = bench.scenarios_from_args(args, available=frozenset({"torchft"}))
    assert [(s.name, s.rogue.mode if s.rogue else None) for s in scenarios] == [
        ("lab-1to1", None),
        ("lab-1to3", None),
        ("lab-rogue-flip", "flip"),
        ("lab-rogue-error", "error"),
        ("lab-rogue-silent", "silent"),
        ("lab-rogue-shutdown", "shutdown"),
        ("lab-rogue-hoard", "hoard"),
        ("lab-rogue-liar", "liar"),
    ]


def test_relay_presets_are_chosen_together() -> None:
    args = bench.build_parser().parse_args(["--scenario", "relay"])
    scenarios = bench.scenarios_from_args(args, available=frozenset({"torchft"}))
    assert [s.name for s in scenarios] == ["lab-1to1", "lab-1to3", "lab-1to7", "lab-kill", "lab-mixed", "lab-2nic-1to3"]
    shapes = {s.name: (s.receivers, s.kill is not None, "zmq-norelay" in s.methods) for s in scenarios}
    assert shapes == {
        "lab-1to1": (1, False, False),
        "lab-1to3": (3, False, True),
        "lab-1to7": (7, False, True),
        "lab-kill": (3, True, True),
        "lab-mixed": (3, False, True),
        "lab-2nic-1to3": (3, False, True),
    }
    mixed = scenarios[-2]
    assert mixed.lab is not None and mixed.lab.mixed and mixed.lead_s > 0
    # The first to ask (receiver 1, host 1) is on a link 4x slower than the others'.
    assert [mixed.lab.rate_of(host) for host in range(4)] == [400.0, 100.0, 400.0, 400.0]


def test_issue22_targets_hold_each_receiver_to_its_own_link() -> None:
    from zmqtransport.bench.config import LabSpec, Scenario
    from zmqtransport.bench.relayreport import format_link_summary
    from zmqtransport.bench.runner import ScenarioResult
    from zmqtransport.bench.targets import evaluate_targets

    lab = LabSpec(host_rates=((1, 100.0),))
    scenario = Scenario("lab-mixed", 32 << 20, 4 << 20, receivers=3, lab=lab, lead_s=0.2)
    # Own ideals: 32 MiB at 100 Mbit/s 2.68 s (r1); at 400 Mbit/s 0.67 s (r2, r3).
    trials = [_relay_trial("zmq-fresh", [2.9, 0.8, 0.95], [{}, {}, {}], []) for _ in range(3)]
    trials += [_relay_trial("http-4", [2.8, 1.6, 1.7], [{}, {}, {}], []) for _ in range(3)]
    summary = {"zmq-fresh": _timed("zmq-fresh", 2.9), "http-4": _timed("http-4", 2.8)}
    summary["zmq-fresh"].source_sent = [int(1.5 * (32 << 20))]
    summary["http-4"].source_sent = [3 * (32 << 20)]
    result = ScenarioResult(scenario, trials, summary, 1.0, True)
    targets = {t.text: (round(t.measured, 2), t.holds) for t in evaluate_targets([result]) if t.issue == 22}
    assert targets == {
        "zmq-fresh r1 (100 Mbit/s) seconds / its own link's ideal": (1.08, True),
        "zmq-fresh r2 (400 Mbit/s) seconds / its own link's ideal": (1.19, True),
        "zmq-fresh r3 (400 Mbit/s) seconds / its own link's ideal": (1.42, False),
        "zmq-fresh source upload / state": (1.5, True),
    }
    # Two NICs per host and the swarm together, against one receiver over one NIC.
    two = ScenarioResult(
        Scenario("lab-2nic-1to3", 64 << 20, 4 << 20, receivers=3, lab=LabSpec(nics=2)),
        [],
        {"zmq-fresh": _timed("zmq-fresh", 0.8)},
        1.0,
        True,
    )
    one = ScenarioResult(
        Scenario("lab-1to1", 64 << 20, 4 << 20, lab=LabSpec()), [], {"zmq-fresh": _timed("zmq-fresh", 1.4)}, 1.0, True
    )
    (two_nics,) = [t for t in evaluate_targets([one, two]) if t.issue == 22]
    assert (round(two_nics.measured, 2), two_nics.limit, two_nics.holds) == (0.57, 0.6, True)
    table = format_link_summary([result])
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in table.splitlines()[2:]}
    assert rows[("lab-mixed", "http-4", "r2")] == ["400", "1.600", "0.671", "2.38", "3.00"]
    assert rows[("lab-mixed", "zmq-fresh", "r1")] == ["100", "2.900", "2.684", "1.08", "1.50"]


@pytest.mark.system
@pytest.mark.skipif(lab.unavailable_reason() is not None, reason=lab.unavailable_reason() or "")
def test_lab_kill_scenario_reports_the_survivors() -> None:
    done = _run("--scenario", "lab-kill", "--total", "8M", "--tensor", "1M", "--methods", "zmq-fresh", "--json")
    assert done.returncode == 0, done.stderr
    (scenario,) = json.loads(done.stdout)["scenarios"]
    (trial,) = scenario["trials"]
    # Receiver 1 headed the chain and died of SIGKILL at 40%; the two others completed (content checked).
    assert trial["killed"] == [1]
    assert len(trial["seconds"]) == len(trial["recv_paths"]) == 2
    assert all(sum(paths.values()) == 8 << 20 for paths in trial["recv_paths"])


def test_bytes_per_path_are_medians_by_address() -> None:
    from zmqtransport.bench.runner import Trial, path_host, summarize

    def trial(number: int, relay_port: int) -> Trial:
        # Two receivers: one from the source, one from a relaying receiver (a new process, a new port, each trial).
        paths = [{"tcp://10.77.0.1:5000": 6 << 20}, {f"tcp://10.77.0.2:{relay_port}": 4 << 20}]
        return Trial("zmq-fresh", number, [1.0, 1.0], [], [0, 0], 0, 0.0, [0, 0], [], [0.1, 0.1], paths, [0, 1])

    scenario = bench.Scenario("x", 10 << 20, 1 << 20, receivers=2, methods=("zmq-fresh",))
    entry = summarize(scenario, [trial(0, 6001), trial(1, 6002), trial(2, 6003)])["zmq-fresh"]
    assert entry.recv_paths == {"10.77.0.1": 6 << 20, "10.77.0.2": 4 << 20}
    assert entry.duplicates == 1
    assert path_host("tcp://10.77.1.1:41509") == "10.77.1.1" and path_host("10.77.1.1") == "10.77.1.1"


def test_disallow_scenario_checks_every_element_after_the_mutation() -> None:
    done = _run("--scenario", "disallow", "--total", "8M", "--tensor", "1M", "--methods", "zmq-fresh", "--json")
    assert done.returncode == 0, done.stderr
    (scenario,) = json.loads(done.stdout)["scenarios"]
    (trial,) = scenario["trials"]
    assert trial["errors"] == [""]  # bit-exact with the staged step (or it says why not)
    assert set(trial["disallow"]) == {"seconds", "needed_bytes", "snapshot_bytes", "memcpy_s"}
    summary = scenario["summary"]["zmq-fresh"]
    assert summary["exact_trials"] == 1 and summary["disallow_s"] is not None
    args = bench.build_parser().parse_args(["--scenario", "lab-disallow", "--warm"])
    with pytest.raises(SystemExit, match="--warm"):
        bench.scenarios_from_args(args, available=frozenset())


def test_issue23_targets_in_the_lab_and_on_loopback() -> None:
    from zmqtransport.bench.config import PRESETS
    from zmqtransport.bench.runner import ScenarioResult
    from zmqtransport.bench.targets import evaluate_targets

    def held(method: str, median: float, slowest: float, memcpy: float, exact: int) -> bench.runner.MethodSummary:
        summary = _summary(method, {})
        summary.disallow_s, summary.disallow_max_s, summary.memcpy_s = median, slowest, memcpy
        summary.exact_trials = exact
        return summary

    lab_run = ScenarioResult(PRESETS["lab-disallow"], [], {"zmq-fresh": held("zmq-fresh", 0.03, 0.2, 0.02, 3)}, 1, True)
    loopback = ScenarioResult(PRESETS["disallow"], [], {"zmq-inplace": held("zmq-inplace", 0.3, 0.4, 0.28, 2)}, 1, True)
    verdicts = {(t.scenario, t.text): t.holds for t in evaluate_targets([lab_run, loopback]) if t.issue == 23}
    assert verdicts == {
        ("lab-disallow", "zmq-fresh: trials in which the receiver got the staged bytes"): True,
        ("lab-disallow", "zmq-fresh: slowest disallow_checkpoint, seconds"): False,
        ("disallow", "zmq-inplace: trials in which the receiver got the staged bytes"): False,
        ("disallow", "zmq-inplace: disallow_checkpoint seconds beyond a memcpy of what the receive still needed"): True,
    }
    assert not [t for t in evaluate_targets([loopback]) if t.issue == 16]  # a disallow is not a speed run


def _mixed_result() -> Any:
    from zmqtransport.bench.config import LabSpec, Scenario
    from zmqtransport.bench.runner import ScenarioResult

    scenario = Scenario("lab-mixed", 32 << 20, 4 << 20, receivers=3, lab=LabSpec(host_rates=((1, 100.0),)),
                        lead_s=0.2, methods=("zmq-fresh",), reps=1)
    src, r1, r2, r3 = (f"tcp://10.77.0.{h}:{5000 + h}" for h in (1, 2, 3, 4))
    mib = 1 << 20
    paths = [{src: 24 * mib, r3: 8 * mib}, {src: 16 * mib, r3: 12 * mib, r1: 4 * mib}, {src: 20 * mib, r2: 12 * mib}]
    trial = _relay_trial("zmq-fresh", [2.9, 0.9, 0.85], paths, [])
    trial.timelines = [[(0.0, 0), (2.9, 32 * mib)], [(0.0, 0), (0.9, 32 * mib)], [(0.0, 0), (0.85, 32 * mib)]]
    return ScenarioResult(scenario, [trial], {"zmq-fresh": _timed("zmq-fresh", 2.9)}, 1.0, True)


def test_the_fan_out_picture_shows_who_served_whom(tmp_path: Path) -> None:
    from zmqtransport.bench.plot import edge_table, edges, plot_fanout

    result = _mixed_result()
    flows = edges(result, result.trials[0])
    assert flows[("src", "r1")] == 24 << 20 and flows[("r3", "r2")] == 12 << 20 and flows[("r1", "r2")] == 4 << 20
    table = edge_table([result])
    assert "src -> r1: 24.0 MiB" in table and "r2 -> r3: 12.0 MiB" in table
    pytest.importorskip("matplotlib")
    target = tmp_path / "fanout.png"
    drawn, what = plot_fanout([result], str(target))
    assert drawn and target.stat().st_size > 10_000, what


def test_without_matplotlib_the_picture_is_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from zmqtransport.bench.plot import plot_fanout

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    drawn, what = plot_fanout([_mixed_result()], str(tmp_path / "x.png"))
    assert not drawn and "zmqtransport[plot]" in what and not (tmp_path / "x.png").exists()
    assert plot_fanout([], str(tmp_path / "y.png"))[0] is False


def test_every_receiver_is_ready_before_any_receive_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A receiver's untimed preparation (a garbage collection and a heap trim) must not run on the shared
    cores while another receiver of the trial is being timed: the driver has every receiver answer
    "ready" before it tells any to "go"."""
    from zmqtransport.bench import runner

    log: list[tuple[str, str]] = []
    outcome = {"seconds": 1.0, "rss": 0, "in_place": 0, "resettable": True, "cpu": 0.1, "paths": {},
               "duplicates": 0, "timeline": []}

    class FakeChild:
        def __init__(self, name: str) -> None:
            self.name = name
            self.last = ""

        def send(self, *command: Any) -> None:
            self.last = command[0]
            log.append((self.name, command[0]))

        def reply(self, timeout: float) -> Any:
            answers = {"setup": {"zmq-fresh": "tcp://x:1"} if self.name == "bench-sender" else None,
                       "stage": 0.0, "go": [outcome], "finish": 0, "usage": {"cpu": 0.1, "profile": {}}}
            return answers.get(self.last)

        def call(self, timeout: float, *command: Any) -> Any:
            self.send(*command)
            return self.reply(timeout)

        def stop(self) -> None:
            pass

    monkeypatch.setattr(runner, "_spawn", lambda name, *args: FakeChild(name))
    scenario = replace(bench.config.PRESETS["fanout"], methods=("zmq-fresh",))
    run = runner._Run(scenario, bench.config.Knobs(), runner.Loopback())
    run.start()
    run.trial("zmq-fresh", 1, 0)
    commands = [command for _, command in log]
    readies = [i for i, (name, command) in enumerate(log) if command == "ready"]
    goes = [i for i, (name, command) in enumerate(log) if command == "go"]
    assert len(readies) == len(goes) == scenario.receivers, commands
    assert max(readies) < min(goes), commands


def test_split_views_cuts_the_bytes_into_equal_runs_in_order() -> None:
    from zmqtransport.bench.payload import split_views

    data = bytes(range(250)) * 4  # 1000 bytes
    views = [memoryview(data)[0:300], memoryview(data)[300:310], memoryview(data)[310:1000]]
    for parts in (1, 3, 4, 7):
        runs = split_views(views, parts)
        assert len(runs) == parts
        sizes = [sum(len(v) for v in run) for run in runs]
        assert sum(sizes) == 1000 and max(sizes) - min(sizes) <= 1
        assert b"".join(bytes(v) for run in runs for v in run) == data


def test_fast_presets_are_unshaped_with_an_mtu_option() -> None:
    args = bench.build_parser().parse_args(["--scenario", "fast"])
    scenarios = bench.scenarios_from_args(args, available=frozenset({"torchft"}))
    by_name = {s.name: s for s in scenarios}
    assert set(by_name) == {"fast-1to1", "fast-1to3", "fast-1to1-mtu9000", "fast-1to3-mtu9000"}
    for scenario in scenarios:
        assert scenario.lab is not None and not scenario.lab.shaped
        assert scenario.total_bytes == 256 << 20 and scenario.tensor_bytes == 4 << 20
        for method in ("tcp-reused", "tcp-reused-4", "zmq-inplace", "zmq-fresh", "zmq-norelay", "http-4"):
            assert method in scenario.methods
    assert by_name["fast-1to3"].receivers == 3 and by_name["fast-1to1"].receivers == 1
    assert by_name["fast-1to1"].lab.mtu is None and by_name["fast-1to1-mtu9000"].lab.mtu == 9000
    # Any lab preset unshaped, at another MTU; a rate shapes the links again.
    args = bench.build_parser().parse_args(["--scenario", "lab-1to3", "--unshaped", "--mtu", "9000"])
    (scenario,) = bench.scenarios_from_args(args, available=frozenset())
    assert scenario.lab == bench.LabSpec(shaped=False, mtu=9000)
    args = bench.build_parser().parse_args(["--scenario", "fast-1to1", "--rate", "400"])
    (scenario,) = bench.scenarios_from_args(args, available=frozenset())
    assert scenario.lab is not None and scenario.lab.shaped and scenario.lab.rate_mbit == 400
    args = bench.build_parser().parse_args(["--scenario", "lab-1to3", "--profile", "--no-cprofile"])
    (scenario,) = bench.scenarios_from_args(args, available=frozenset())
    assert scenario.profiling is not None and not scenario.profiling.functions
    for bad in (["--mtu", "40"], ["--perf", "/tmp/x"], ["--no-cprofile"]):
        with pytest.raises(SystemExit):
            bench.main([*bad, *TINY])


@pytest.mark.system
@pytest.mark.skipif(lab.unavailable_reason() is not None, reason=lab.unavailable_reason() or "")
def test_unshaped_lab_rows_with_cpu_and_a_profile() -> None:
    methods = "tcp-reused,tcp-reused-4,zmq-fresh"
    done = _run("--scenario", "fast-1to1-mtu9000", "--total", "1M", "--tensor", "64K", "--methods", methods,
                "--profile", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    (scenario,) = json.loads(done.stdout)["scenarios"]
    assert scenario["scenario"]["lab"]["shaped"] is False and scenario["scenario"]["lab"]["mtu"] == 9000
    for method in methods.split(","):
        entry = scenario["summary"][method]
        assert entry["recv_cpu_per_gib"] > 0 and entry["send_cpu_per_gib"] > 0
        assert 1 << 20 <= sum(entry["source_sent"]) <= (1 << 20) * 1.1
    for trial in scenario["trials"]:
        profiles = trial["profiles"]
        assert set(profiles) == {"source", "r1"}
        for profile in profiles.values():
            assert profile["total_s"] > 0
            assert "(ended threads)" in profile["threads"]
            assert all(seconds >= 0 for seconds in profile["threads"].values())
        receiver = profiles["r1"]
        assert receiver["receive_s"] > 0 and receiver["receive_cpu_s"] > 0 and receiver["functions"]
        if trial["method"] == "zmq-fresh":  # a ZMQTransport receive has phases; the receiving thread is listed
            assert set(receiver["phases"]) == {"header", "land", "data", "build"}
            assert "MainThread" in receiver["threads"]
        else:
            assert receiver["phases"] == {}


def test_issue33_targets_fast_links_and_the_relaying_cpu() -> None:
    from zmqtransport.bench.config import LabSpec, Scenario
    from zmqtransport.bench.runner import ScenarioResult
    from zmqtransport.bench.targets import evaluate_targets

    def result(name: str, receivers: int, spec: LabSpec, rows: dict[str, tuple[float, float]]) -> ScenarioResult:
        summary = {}
        for method, (seconds, cpu) in rows.items():
            entry = _timed(method, seconds)
            entry.recv_cpu_per_gib = cpu
            summary[method] = entry
        for entry in summary.values():
            for anchor in ("http-4", "tcp-reused-4"):
                if anchor in summary:
                    entry.ratios[anchor] = summary[anchor].slowest_s / entry.slowest_s
        return ScenarioResult(Scenario(name, 256 << 20, 4 << 20, receivers=receivers, lab=spec), [], summary, 1.0, True)

    fast = LabSpec(shaped=False)
    one = result("fast-1to1", 1, fast, {"zmq-inplace": (0.2, 1), "zmq-fresh": (0.3, 1), "http-4": (0.25, 1),
                                        "tcp-reused-4": (0.11, 1)})  # fmt: skip
    three = result("fast-1to3", 3, fast, {"zmq-fresh": (1.4, 1), "http-4": (0.6, 1)})
    three.summary["zmq-fresh"].first_step_s = 2.0  # the source's first step, beside the median
    shaped = result("lab-1to3", 3, LabSpec(), {"zmq-fresh": (1.0, 2.9), "zmq-norelay": (2.0, 1.0)})
    targets = [t for t in evaluate_targets([one, three, shaped]) if t.issue == 33]
    verdicts = {(t.scenario, t.text): (round(t.measured, 2), t.holds) for t in targets}
    assert verdicts == {
        ("fast-1to1", "zmq-inplace speed / http-4"): (1.25, True),
        ("fast-1to1", "zmq-fresh speed / http-4"): (0.83, False),
        ("fast-1to1", "zmq-inplace speed / tcp-reused-4"): (0.55, False),
        ("fast-1to3", "zmq-fresh speed / http-4 (slowest receivers)"): (0.43, False),
        ("fast-1to3", "zmq-fresh speed on its source's first step / http-4 (slowest receivers)"): (0.3, False),
        ("lab-1to3", "zmq-fresh receiver CPU per GiB (mean) / zmq-norelay's"): (2.9, False),
    }
    # Issue 13's shaped-link targets leave the unshaped rows alone.
    assert not [t for t in evaluate_targets([one, three]) if t.issue in (13, 22)]


def test_the_tcp_anchor_serves_on_when_a_receiver_dies_mid_transfer() -> None:
    # lab-kill SIGKILLs a receiver mid-transfer: its connection resets under the anchor's send. That was
    # reported as the anchor's own failure and ended the whole benchmark run; a request the anchor
    # cannot serve still is one.
    import socket
    import struct

    import torch

    from zmqtransport.bench.config import Knobs
    from zmqtransport.bench.methods import _TCP_REQUEST, Place, SendEnv, TcpMethod

    tensors = [torch.ones(16 << 20, dtype=torch.uint8) for _ in range(4)]  # 64 MiB: more than a socket buffers
    env = SendEnv(tensors, {"t": tensors}, Knobs(timeout_s=10.0), Place(), receivers=1)
    serving = TcpMethod("tcp-reused", into_targets=True).serve(env)
    try:
        serving.stage(1)
        host, port = serving.metadata().rsplit(":", 1)
        with socket.create_connection((host, int(port))) as victim:
            victim.sendall(_TCP_REQUEST.pack(1, 0, 1))
            assert victim.recv(1 << 16)  # the state is on its way
            victim.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # dies: a reset
        serving.finish()  # the others would be served on: no failure of the anchor's own
        with socket.create_connection((host, int(port))) as wrong:
            wrong.sendall(_TCP_REQUEST.pack(2, 0, 1))  # a step that is not staged
            assert wrong.recv(1) == b""
        with pytest.raises(RuntimeError, match="not staged"):
            serving.finish()
    finally:
        serving.close()


def test_the_first_step_of_each_method_is_reported_beside_the_medians() -> None:
    """A job start meets a source's first step (nothing measured: a swarm that steps aside once measured),
    and medians over trials hide it: the lab table and the JSON give each method's first trial's slowest
    receiver; with a warm-up no trial is a first step."""
    from zmqtransport.bench.config import LabSpec, Scenario
    from zmqtransport.bench.report import format_lab_result
    from zmqtransport.bench.runner import ScenarioResult, Trial, summarize

    def trial(method: str, number: int, seconds: list[float]) -> Trial:
        return Trial(method, number, seconds, [], [0, 0], 0, 0.0, [0, 0], [0])

    scenario = Scenario("fast-1to3", 256 << 20, 4 << 20, receivers=2, methods=("zmq-fresh", "http-4"),
                        lab=LabSpec(shaped=False))
    trials = [trial(m, n, [s, s / 2]) for n, s in enumerate((0.9, 0.4, 0.5)) for m in ("zmq-fresh", "http-4")]
    summary = summarize(scenario, trials)
    assert summary["zmq-fresh"].first_step_s == 0.9 and summary["zmq-fresh"].slowest_s == 0.5
    table = format_lab_result(ScenarioResult(scenario, trials, summary, 1.0, True))
    header = next(line for line in table.splitlines() if line.startswith("method "))
    assert "1st step s" in header
    row = next(line for line in table.splitlines() if line.startswith("zmq-fresh "))
    assert row.split()[1:4] == ["0.500", "0.250", "0.900"]
    warmed = Scenario("fast-1to3", 256 << 20, 4 << 20, receivers=2, methods=("zmq-fresh",), warmup=1,
                      lab=LabSpec(shaped=False))
    assert summarize(warmed, trials)["zmq-fresh"].first_step_s is None


def test_the_receiving_threads_profile_charges_a_function_its_cpu_not_its_wait_for_the_gil() -> None:
    """A function that waits (asleep, while another thread runs Python) owns none of its wait (with cProfile's
    default wall clock, ``waiting`` below owned the whole 0.3 s)."""
    import threading
    import time

    from zmqtransport.bench.profiling import thread_profiler, top_functions

    done = threading.Event()

    def spin() -> None:
        while not done.is_set():
            sum(range(1000))

    def waiting() -> None:
        time.sleep(0.3)

    other = threading.Thread(target=spin)
    other.start()
    profiler = thread_profiler()
    try:
        profiler.enable()
        waiting()
        profiler.disable()
    finally:
        done.set()
        other.join()
    own = {label: seconds for label, _, seconds, _ in top_functions(profiler, 100)}
    charged = sum(seconds for label, seconds in own.items() if "waiting" in label or "sleep" in label)
    assert charged < 0.05, own
