"""Smoke runs of the examples, as a user would run them, with small sizes.

Each example is started with ``sys.executable`` as a subprocess; the tests check
its exit code and the figures of its report. Everything stays on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_TIMEOUT_S = 240  # generous: the machine may be shared; a hang still fails


# Variables that would switch torchft_ddp.py into torchrun mode or point it at
# someone else's lighthouse if the test runner happened to have them set.
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHFT_LIGHTHOUSE",
    "REPLICA_GROUP_ID",
    "NUM_REPLICA_GROUPS",
    "TORCHELASTIC_RESTART_COUNT",
)


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}


def run_example(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=clean_environ(),
        cwd=EXAMPLES.parent,
    )


def explain(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit code {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr[-4000:]}"
    )


# --------------------------------------------------------------------------- recover.py

RECOVER_SMALL = ("--width=256", "--layers=3", "--steps=6", "--kill-step=3")


def test_recover_heals_a_killed_worker_bit_for_bit() -> None:
    result = run_example(str(EXAMPLES / "recover.py"), *RECOVER_SMALL, "--workers=3")
    assert result.returncode == 0, explain(result)
    out = result.stdout
    assert "RESULT: OK" in out
    assert "MISMATCH" not in out
    assert "killed worker 1" in out and "with SIGKILL" in out and "exit code -9" in out
    assert "state differs from its peers'" in out  # the newcomer really started fresh
    assert "bit-identical to worker 0" in out
    assert "final state bit-identical on all 3 workers" in out

    # 3 Linear(256, 256) layers: 3 * (256*256 + 256) float32 parameters, and Adam
    # keeps two more tensors of the same size each (plus its 0-dim step counters).
    model_bytes = 3 * (256 * 256 + 256) * 4
    moved = re.search(
        r"moved ([\d.]+) MB .* in ([\d.]+) s = ([\d.]+) GB/s; ([\d.]+) MB written in place", out
    )
    assert moved, out
    total_mb, seconds, gbps, in_place_mb = (float(g) for g in moved.groups())
    assert total_mb == pytest.approx(3 * model_bytes / 1e6, abs=0.1)
    assert in_place_mb == pytest.approx(model_bytes / 1e6, abs=0.1)
    assert seconds > 0 and gbps > 0


def test_recover_exits_non_zero_when_the_state_does_not_match() -> None:
    # --corrupt flips one bit of the healed model: the bit-for-bit check must catch it.
    result = run_example(str(EXAMPLES / "recover.py"), *RECOVER_SMALL, "--workers=2", "--corrupt")
    assert result.returncode == 1, explain(result)
    assert "MISMATCH: the healed state differs from the peer's" in result.stdout
    assert "RESULT: FAILED" in result.stdout


def test_recover_rejects_bad_options() -> None:
    result = run_example(str(EXAMPLES / "recover.py"), "--workers", "1")
    assert result.returncode == 2
    assert "--workers must be at least 2" in result.stderr


# --------------------------------------------------------------------------- torchft_ddp.py

TORCHFT_SMALL = ("--width", "64", "--layers", "2", "--steps", "6", "--fail-at", "2")


def _check_ddp_report(out: str, groups: int, ranks: int, failed_group: int) -> None:
    assert "RESULT: OK" in out, out
    assert "MISMATCH" not in out
    assert f"group {failed_group} rank 0 died (SIGKILL) on attempt 0; restarted" in out
    for rank in range(ranks):
        healed = re.search(
            rf"group {failed_group} rank {rank} healed at step (\d+) from tcp://127\.0\.0\.1:\d+ "
            r"through ZMQTransport: ([\d.]+) MB in ([\d.]+) s = ([\d.]+) GB/s, "
            r"([\d.]+) MB received in place",
            out,
        )
        assert healed, out
        assert int(healed.group(1)) >= 2
        assert float(healed.group(2)) > 0
        assert f"rank {rank}: final state at step 6 bit-identical across all {groups} groups" in out


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """A lighthouse in this process, outside the example; yields its loopback URL."""
    extension = pytest.importorskip("torchft._torchft")
    server = extension.LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
    try:
        # It reports the hostname; stay on loopback whatever that resolves to.
        yield f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    finally:
        server.shutdown()


@pytest.mark.torchft
def test_torchft_ddp_local_run_heals_the_failed_group(tmp_path: Path) -> None:
    pytest.importorskip("torchft")
    result = run_example(
        str(EXAMPLES / "torchft_ddp.py"), *TORCHFT_SMALL, "--log-dir", str(tmp_path)
    )
    assert result.returncode == 0, explain(result)
    assert "in-process lighthouse http://127.0.0.1:" in result.stdout
    _check_ddp_report(result.stdout, groups=2, ranks=1, failed_group=1)


@pytest.mark.torchft
def test_torchft_ddp_two_rank_groups_external_lighthouse_sync_quorum(
    tmp_path: Path, lighthouse: str
) -> None:
    result = run_example(
        str(EXAMPLES / "torchft_ddp.py"),
        *TORCHFT_SMALL,
        "--nproc-per-group=2",
        "--fail-group=0",
        "--sync-quorum",
        f"--lighthouse={lighthouse}",
        f"--log-dir={tmp_path}",
    )
    assert result.returncode == 0, explain(result)
    assert f"external lighthouse {lighthouse}" in result.stdout
    _check_ddp_report(result.stdout, groups=2, ranks=2, failed_group=0)


def _torchrun_group(group: int, lighthouse: str, log: Path) -> subprocess.Popen[str]:
    """One replica group as torchrun runs it, with the environment the docstring asks for."""
    env = dict(
        clean_environ(),
        TORCHFT_LIGHTHOUSE=lighthouse,
        REPLICA_GROUP_ID=str(group),
        NUM_REPLICA_GROUPS="2",
        ZMQTRANSPORT_ADVERTISE_HOST="127.0.0.1",
        GLOO_SOCKET_IFNAME="lo",
    )
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "--max-restarts=1",
        str(EXAMPLES / "torchft_ddp.py"),
        *TORCHFT_SMALL,
        "--fail-group=1",
        "--manager-host=127.0.0.1",
        "--bind-host=127.0.0.1",
    ]
    with log.open("w") as stderr:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)


@pytest.mark.torchft
def test_torchft_ddp_under_torchrun_restarts_and_heals(tmp_path: Path, lighthouse: str) -> None:
    """The documented multi-machine recipe, on one machine: two torchrun invocations."""
    procs = [
        _torchrun_group(group, lighthouse, tmp_path / f"group{group}.err") for group in range(2)
    ]
    try:
        outputs = [proc.communicate(timeout=RUN_TIMEOUT_S)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = {p.name: p.read_text()[-3000:] for p in tmp_path.glob("*.err")}
    assert [proc.returncode for proc in procs] == [0, 0], (outputs, logs)
    results = [
        json.loads(line.split(" ", 1)[1])
        for out in outputs
        for line in out.splitlines()
        if line.startswith("TORCHFT_DDP_RESULT ")
    ]
    by_group = {r["replica_group"]: r for r in results}
    assert sorted(by_group) == [0, 1], outputs
    healthy, restarted = by_group[0], by_group[1]
    assert restarted["restart_count"] == 1  # torchrun restarted the killed group
    assert restarted["heal"] is not None and restarted["heal"]["step"] >= 2
    assert restarted["heal"]["bytes"] > restarted["heal"]["in_place_bytes"] > 0
    assert healthy["heal"] is None
    assert healthy["step"] == restarted["step"] == 6
    assert healthy["digest"] == restarted["digest"]
