"""Issue 24's benchmark scenarios: the transformer-shaped state, the growth table, the memory guard.

Pure checks and a smoke run at tiny sizes; no timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from zmqtransport import bench
from zmqtransport.bench import command, layouts
from zmqtransport.bench.config import PRESETS, Scenario, settle_for
from zmqtransport.bench.report import format_growth, format_targets
from zmqtransport.bench.runner import MethodSummary, ScenarioResult
from zmqtransport.bench.targets import evaluate_targets

GIB = 1 << 30
MIB = 1 << 20


def test_the_transformer_preset_is_a_large_state_of_thousands_of_mixed_tensors() -> None:
    scenario = PRESETS["transformer"]
    sizes = scenario.tensor_sizes
    assert scenario.layout == layouts.TRANSFORMER and scenario.total_bytes == sum(sizes)
    assert 3 * GIB <= scenario.total_bytes <= 4 * GIB
    assert 2000 <= len(sizes) <= 5000
    assert min(sizes) == 4 and max(sizes) > 64 * MIB  # Adam's step counts to the embedding
    assert len({size for size in sizes}) >= 5
    paths = scenario.payload.paths
    assert len(set(paths)) == len(paths)
    assert ("model", "embed_tokens.weight") in paths and ("optim", "state", 0, "exp_avg_sq") in paths
    # Every parameter has its two moments, of its shape, and a 0-d step.
    payload = scenario.payload
    shapes = dict(zip(payload.paths, payload.shapes, strict=True))
    params = [path for path in paths if path[0] == "model"]
    for index, param in enumerate(params):
        assert shapes[("optim", "state", index, "exp_avg")] == shapes[param]
        assert shapes[("optim", "state", index, "exp_avg_sq")] == shapes[param]
        assert shapes[("optim", "state", index, "step")] == ()


def test_a_layout_builds_its_nested_state_and_finds_each_tensor_in_it() -> None:
    payload = layouts.transformer(2 * MIB)
    tokens = [object() for _ in payload.paths]
    state = payload.state(tokens)
    assert set(state) == {"model", "optim"}
    (group,) = state["optim"]["param_groups"]
    assert group["params"] == list(range(len([p for p in payload.paths if p[0] == "model"])))
    assert payload.tensors_in(state) == tokens
    uniform = layouts.uniform(10 * 1024, 4096)
    assert uniform.sizes == [4096, 4096, 2048] and uniform.paths[0] == ("layer000000.weight",)
    assert list(uniform.state([1, 2, 3])) == ["layer000000.weight", "layer000001.weight", "layer000002.weight"]
    with pytest.raises(ValueError, match="unknown layout"):
        layouts.layout_of("moe", GIB, MIB)


def test_settle_grows_with_the_state() -> None:
    assert settle_for(32 * MIB) == 0.0
    assert settle_for(80 * MIB) == settle_for(GIB) == 3.0
    assert settle_for(4 * GIB) == 12.0
    assert PRESETS["uniform-4g"].settle_s == 12.0 and PRESETS["uniform-1g"].settle_s == 3.0


def test_large_presets_stay_out_of_all_and_come_in_their_groups() -> None:
    def names(*argv: str) -> list[str]:
        args = bench.build_parser().parse_args(list(argv))
        return [s.name for s in bench.scenarios_from_args(args, available=frozenset({"torchft"}))]

    assert not {"transformer", "uniform-4g", "uniform-8g"} & set(names("--scenario", "all"))
    assert names("--scenario", "growth") == ["uniform-1g", "uniform-2g", "uniform-4g"]
    assert names("--scenario", "large") == ["transformer", "uniform-4g", "uniform-8g"]
    # A transformer of another size is still a whole transformer: its total is what it holds.
    args = bench.build_parser().parse_args(["--scenario", "transformer", "--total", "1M"])
    (small,) = bench.scenarios_from_args(args, available=frozenset())
    assert small.total_bytes == sum(small.tensor_sizes) and small.settle_s == 0.0


def _entry(method: str, seconds: float, recv_rss: int = 0, send_rss: int = 0) -> MethodSummary:
    return MethodSummary(method, seconds, seconds, None, 1.0, 1.0, send_rss, recv_rss, 0.0, 0, [])


def _result(scenario: Scenario, **seconds: float) -> ScenarioResult:
    summary = {m.replace("_", "-"): _entry(m.replace("_", "-"), s) for m, s in seconds.items()}
    for entry in summary.values():
        for anchor in ("tcp-fresh", "http-4"):
            if anchor in summary:
                entry.ratios[anchor] = summary[anchor].slowest_s / entry.slowest_s
    return ScenarioResult(scenario, [], summary, 1.0, True)


def test_growth_table_and_targets_compare_seconds_per_gib_across_sizes() -> None:
    one = _result(PRESETS["uniform-1g"], tcp_fresh=0.8, http_4=0.6, zmq_fresh=0.5, zmq_inplace=0.35)
    four = _result(PRESETS["uniform-4g"], tcp_fresh=4.0, http_4=3.0, zmq_fresh=2.4, zmq_inplace=1.4)
    four.summary["zmq-fresh"].recv_rss_max = 4 * GIB + 20 * MIB
    four.summary["zmq-fresh"].send_rss_max = 2 * MIB
    table = format_growth([one, four])
    assert "s/GiB at 1 GiB" in table and "s/GiB at 4 GiB" in table
    row = next(line for line in table.splitlines() if line.startswith("zmq-fresh"))
    assert row.split()[1:] == ["0.500", "0.600", "1.20"]
    targets = [t for t in evaluate_targets([one, four]) if t.issue == 24]
    verdicts = {t.text: (round(t.measured, 3), t.limit, t.holds) for t in targets}
    assert verdicts["zmq-fresh speed / http-4"] == (1.25, 1.1, True)
    assert verdicts["zmq-inplace speed / http-4"] == (2.143, 1.5, True)
    assert verdicts["zmq-fresh receiver peak RSS growth beyond the state, MiB"] == (20.0, 64, True)
    assert verdicts["zmq-fresh sender peak RSS growth, MiB"] == (2.0, 64, True)
    # Growth 1.2 holds against 1.25; plain TCP's growth (1.25 here) does not raise the limit.
    assert verdicts["zmq-fresh seconds per GiB, uniform-4g / uniform-1g"] == (1.2, 1.25, True)
    assert "targets (issue 24, measured cold):" in format_targets(evaluate_targets([one, four]))


def test_growth_target_allows_what_plain_tcp_into_fresh_memory_grows() -> None:
    one = _result(PRESETS["uniform-1g"], tcp_fresh=0.8, zmq_fresh=0.5)
    four = _result(PRESETS["uniform-4g"], tcp_fresh=6.4, zmq_fresh=3.2)  # tcp 2.0x per GiB, zmq 1.6x
    (growth,) = [t for t in evaluate_targets([one, four]) if "per GiB" in t.text]
    assert growth.limit == pytest.approx(2.0) and growth.measured == pytest.approx(1.6) and growth.holds
    assert "tcp-fresh's growth" in growth.text
    assert format_growth([one]) == "" and format_growth([four]) == ""  # one size: nothing to compare


def test_transformer_targets_are_the_shaped_state_ones() -> None:
    shaped = _result(PRESETS["transformer"], http_4=3.0, zmq_fresh=2.6, zmq_inplace=1.5)
    verdicts = {t.text: (t.limit, t.holds) for t in evaluate_targets([shaped]) if t.issue == 24}
    assert verdicts["zmq-fresh speed / http-4"] == (1.2, False)  # 1.15
    assert verdicts["zmq-inplace speed / http-4"] == (1.5, True)  # 2.0
    assert not [t for t in evaluate_targets([shaped]) if t.issue == 16]  # issue 16's are for uniform states


def test_a_scenario_both_sides_cannot_hold_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(command, "memory_available", lambda: 3 * GIB)
    assert command.main(["--scenario", "uniform-8g", "--methods", "zmq-fresh"]) == 0
    out = capsys.readouterr().out
    assert "skipped scenario uniform-8g: it needs 18.0 GiB of available memory" in out
    assert "3.0 GiB are available" in out
    assert PRESETS["uniform-4g"].memory_needed == 10 * GIB


def _bench(*argv: str) -> Any:
    done = subprocess.run(
        [sys.executable, "-m", "zmqtransport.bench", *argv, "--reps", "1", "--settle", "0", "--timeout", "60"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.system
def test_a_small_transformer_state_moves_fresh_and_in_place_checked_tensor_by_tensor() -> None:
    methods = "tcp-reused,tcp-fresh,zmq-fresh,zmq-inplace"
    report = _bench("--scenario", "transformer", "--total", "2M", "--methods", methods, "--json")
    (scenario,) = report["scenarios"]
    count = scenario["tensors"]
    assert scenario["scenario"]["layout"] == "transformer" and count > 50
    # Every tensor of the nested state (the model's, Adam's moments and 0-d steps) landed in place.
    assert scenario["summary"]["zmq-inplace"]["in_place_tensors"] == count
    assert scenario["summary"]["zmq-fresh"]["in_place_tensors"] == 0
