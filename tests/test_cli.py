"""The ``zmqtransport`` command line, end to end in real processes.

Every subcommand runs as ``python -m zmqtransport ...`` in a subprocess against
peers that are themselves separate processes: a helper running a live
ZMQTransport (for fetch and inspect) or ``zmqtransport serve`` (for serve).
Contents are checked bit for bit; nothing here asserts on timing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import threading
from collections.abc import Iterator
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import IO, Any

import pytest
import torch

from zmqtransport import ZMQTransport, cli
from zmqtransport.codec import skeleton

from .conftest import assert_same

TIMEOUT_S = 120  # per subprocess: a hang fails the test instead of the suite
LOOPBACK = "127.0.0.1"
pytestmark = pytest.mark.system

# Shared verbatim by this process and the peer processes, so both build the
# same state from a seed: views sharing a storage, several dtypes, 0-dim and
# empty tensors, and the plain leaves an optimizer or torchft keeps.
STATE_SOURCE = textwrap.dedent(
    """
    def build_state(seed):
        import collections

        import torch

        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(512, 1024, generator=g)  # 2 MiB: several data messages
        return {
            "model": collections.OrderedDict(
                weight=weight,
                rows=weight[::2],  # a view: must keep sharing weight's storage
                bias=torch.arange(10, dtype=torch.int64) * seed,
            ),
            "extra": {
                "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
                "mask": torch.rand(17, generator=g) > 0.5,
                "scalar": torch.tensor(2.5 * seed, dtype=torch.float64),
                "empty": torch.empty(0, 3),
                "complex": torch.randn(4, dtype=torch.complex64, generator=g),
                "int8": torch.randint(-128, 127, (64,), dtype=torch.int8, generator=g),
            },
            "optim": {"param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1]}], "state": {}},
            "meta": {
                "step": seed,
                "big": 2**80 + seed,
                "nan": float("nan"),
                "name": "ckpt",
                "blob": bytes([0, 1, 255]),
                "none": None,
                "size": torch.Size([2, 3]),
                "dtype": torch.float16,
            },
        }
    """
)
_namespace: dict[str, Any] = {}
exec(STATE_SOURCE, _namespace)  # our own constant source, shared with the peers
build_state = _namespace["build_state"]

# A live peer: serves build_state(step) at step, prints its metadata, then
# answers "sent" with how many transfers it finished serving; stdin EOF stops it.
PEER_SOURCE = STATE_SOURCE + textwrap.dedent(
    """
    import sys
    from datetime import timedelta

    from zmqtransport import ZMQTransport

    step = int(sys.argv[1])
    timeout = timedelta(seconds=60)
    transport = ZMQTransport(timeout, bind_host="127.0.0.1", advertise_host="127.0.0.1")
    transport.send_checkpoint([1], step, build_state(step), timeout)
    print(transport.metadata(), flush=True)
    for line in sys.stdin:
        if line.strip() == "sent":
            print(transport.sent_since(0)[0], flush=True)
    transport.shutdown()
    """
)


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # No warning filter: stderr must hold what the CLI says and nothing else
    # (torch's NumPy warning is hidden by zmqtransport itself, _torch_import.py).
    env.pop("PYTHONWARNINGS", None)
    env.pop("ZMQTRANSPORT_DEBUG", None)
    return env


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zmqtransport", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_environment(),
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        check=False,
    )


class LineReader:
    """Collects a pipe's lines on a thread, so tests can wait for one without blocking forever."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))

    def next(self, timeout: float = TIMEOUT_S) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no output line within {timeout} s; seen so far: {self.seen}") from None
        self.seen.append(line)
        return line

    def wait_for(self, text: str, timeout: float = TIMEOUT_S) -> str:
        while True:
            line = self.next(timeout)
            if text in line:
                return line

    def rest(self) -> list[str]:
        self._thread.join(TIMEOUT_S)
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return self.seen


def _popen(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_environment(),
    )


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(TIMEOUT_S)


class Peer:
    """A helper process running a live ZMQTransport that serves one step."""

    def __init__(self, step: int) -> None:
        self.process = _popen([sys.executable, "-c", PEER_SOURCE, str(step)])
        assert self.process.stdout is not None
        self.stdout = LineReader(self.process.stdout)
        self.metadata = self.stdout.next()
        assert self.metadata.startswith("tcp://"), self.metadata

    def finished_sends(self) -> int:
        assert self.process.stdin is not None
        self.process.stdin.write("sent\n")
        self.process.stdin.flush()
        return int(self.stdout.next())

    def close(self) -> None:
        if self.process.stdin is not None and self.process.poll() is None:
            self.process.stdin.close()
        try:
            self.process.wait(30)
        finally:
            _stop(self.process)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    """One live peer for the module: each test counts the sends it causes, not the total."""
    live = Peer(step=3)
    yield live
    live.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def assert_checkpoint_file(path: Path, step: int) -> None:
    """The file loads without pickle and holds exactly build_state(step), aliasing included."""
    loaded = torch.load(path, weights_only=True)
    assert_same(loaded, build_state(step))
    model = loaded["model"]
    assert model["rows"].untyped_storage().data_ptr() == model["weight"].untyped_storage().data_ptr()


def _one_error_line(result: subprocess.CompletedProcess[str], command: str) -> str:
    """A failure is exactly one line on stderr, no traceback, and a non-zero status."""
    assert result.returncode == cli.EXIT_FAILURE, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"zmqtransport {command}: error: "), lines[0]
    assert "Traceback" not in result.stderr
    return lines[0]


# ----------------------------------------------------------------------------- fetch


def test_fetch_from_live_peer(peer: Peer, tmp_path: Path) -> None:
    output = tmp_path / "step3.pt"
    sends_before = peer.finished_sends()
    result = run_cli(
        "fetch", peer.metadata, "--step", "3", "-o", str(output), "--progress", "log", "--progress-interval", "0"
    )
    assert result.returncode == 0, result.stderr
    assert f"fetched step 3 from {peer.metadata}" in result.stdout
    # Not a terminal: progress comes as plain log lines, ending at 100%.
    progress = [line for line in result.stderr.splitlines() if "step 3:" in line]
    assert progress and "(100.0%)" in progress[-1], result.stderr
    assert_checkpoint_file(output, 3)
    assert not list(tmp_path.glob(".*partial")), "temporary file left behind"
    assert peer.finished_sends() == sends_before + 1


def test_fetch_progress_bar(peer: Peer, tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    output = tmp_path / "bar.pt"
    result = run_cli("fetch", peer.metadata, "--step", "3", "-o", str(output), "--progress", "bar")
    assert result.returncode == 0, result.stderr
    # tqdm's line: label, percentage, bytes done/total and a rate.
    assert "step 3: 100%" in result.stderr and "B/s" in result.stderr, result.stderr
    assert_checkpoint_file(output, 3)


def test_fetch_errors_are_one_line(peer: Peer, tmp_path: Path) -> None:
    output = tmp_path / "out.pt"
    wrong = run_cli("fetch", peer.metadata, "--step", "4", "-o", str(output))
    line = _one_error_line(wrong, "fetch")
    assert "wrong_step" in line and "4" in line and "3" in line
    assert not output.exists()

    output.write_bytes(b"keep me")
    forced = run_cli("fetch", peer.metadata, "--step", "3", "-o", str(output), "--force", "--progress", "none")
    assert forced.returncode == 0, forced.stderr
    assert_checkpoint_file(output, 3)


def test_fetch_refusals_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Checks that fail before any connection, run in this process to save interpreter starts."""
    output = tmp_path / "out.pt"
    output.write_bytes(b"keep me")
    assert cli.main(["fetch", "tcp://127.0.0.1:1", "--step", "3", "-o", str(output)]) == cli.EXIT_FAILURE
    assert output.read_bytes() == b"keep me"
    assert "already exists (pass --force" in capsys.readouterr().err
    bad = ["fetch", "localhost:1234", "--step", "3", "-o", str(tmp_path / "x.pt"), "--timeout", "1"]
    assert cli.main(bad) == cli.EXIT_FAILURE
    assert capsys.readouterr().err.startswith("zmqtransport fetch: error: bad zmqtransport metadata")
    assert cli.main(["fetch", "tcp://h:1", "--step", "1", "-o", str(tmp_path / "y.pt"), "--timeout", "0"]) == 1
    assert "--timeout must be a positive" in capsys.readouterr().err


def test_fetch_times_out_when_nobody_serves(tmp_path: Path) -> None:
    output = tmp_path / "none.pt"
    result = run_cli("fetch", f"tcp://{LOOPBACK}:{_free_port()}", "--step", "1", "-o", str(output), "--timeout", "1")
    assert "timed out" in _one_error_line(result, "fetch")
    assert not output.exists()


# ----------------------------------------------------------------------------- serve


def test_serve_file_then_fetch_and_recv(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ckpt.pt"
    torch.save(build_state(5), checkpoint)
    metadata_file = tmp_path / "serve.meta"
    server = _popen(
        [
            sys.executable, "-m", "zmqtransport", "serve", str(checkpoint), "--step", "5",
            "--bind", LOOPBACK, "--advertise-host", LOOPBACK, "--metadata-file", str(metadata_file),
        ]
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stderr is not None
        stdout, stderr = LineReader(server.stdout), LineReader(server.stderr)
        metadata = stdout.next()
        assert metadata.startswith(f"tcp://{LOOPBACK}:"), metadata
        assert metadata_file.read_text().strip() == metadata

        # Through the command line ...
        output = tmp_path / "fetched.pt"
        result = run_cli("fetch", metadata, "--step", "5", "-o", str(output), "--progress", "none")
        assert result.returncode == 0, result.stderr
        assert_checkpoint_file(output, 5)
        stderr.wait_for("served step 5")

        # ... and the cold start a job would do: recv_checkpoint from the file's server.
        timeout = timedelta(seconds=60)
        receiver: ZMQTransport[Any] = ZMQTransport(timeout, bind_host=LOOPBACK, advertise_host=LOOPBACK)
        with receiver:
            state = receiver.recv_checkpoint(0, metadata, 5, timeout)
            assert_same(state, build_state(5))
        stderr.wait_for("served step 5")

        server.send_signal(signal.SIGTERM)
        assert server.wait(TIMEOUT_S) == 0
        assert any("SIGTERM: stopping" in line for line in stderr.rest())
        assert not metadata_file.exists(), "a stale metadata file would point at a dead port"
    finally:
        _stop(server)


def test_serve_stops_on_sigint(tmp_path: Path) -> None:
    checkpoint = tmp_path / "small.pt"
    torch.save({"w": torch.arange(6.0)}, checkpoint)
    server = _popen([sys.executable, "-m", "zmqtransport", "serve", str(checkpoint), "--step", "0", "--bind", LOOPBACK])
    try:
        assert server.stdout is not None and server.stderr is not None
        stderr = LineReader(server.stderr)
        assert LineReader(server.stdout).next().startswith("tcp://")
        stderr.wait_for("serving step 0")
        server.send_signal(signal.SIGINT)
        assert server.wait(TIMEOUT_S) == 0
        assert not any("Traceback" in line for line in stderr.rest())
    finally:
        _stop(server)


def test_serve_refuses_what_needs_pickle(tmp_path: Path) -> None:
    checkpoint = tmp_path / "pickled.pt"
    torch.save({"w": torch.zeros(2), "ratio": Fraction(1, 3)}, checkpoint)
    line = _one_error_line(run_cli("serve", str(checkpoint), "--step", "1", "--bind", LOOPBACK), "serve")
    assert "weights_only" in line and "Fraction" in line



def test_serve_refusals_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.pt"
    garbage.write_text("not a checkpoint")
    assert cli.main(["serve", str(garbage), "--step", "1", "--bind", LOOPBACK]) == cli.EXIT_FAILURE
    assert capsys.readouterr().err.startswith(f"zmqtransport serve: error: {garbage}: torch.load(weights_only=True)")
    assert cli.main(["serve", str(tmp_path / "missing.pt"), "--step", "1"]) == cli.EXIT_FAILURE
    assert "missing.pt: no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- inspect


def test_inspect_describes_without_transferring(peer: Peer) -> None:
    sends_before = peer.finished_sends()
    result = run_cli("inspect", peer.metadata, "--step", "3", "--json", "--tensors")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    state = build_state(3)
    encoded = skeleton.encode_tree(state)
    assert info["step"] == 3
    assert info["peer"] == peer.metadata
    assert info["tensors"] == len(encoded.tensors) == 9
    assert info["storages"] == len(encoded.storages) == 8  # rows shares weight's storage
    assert info["bytes"] == sum(ref.nbytes for ref in encoded.storages)
    assert set(info["dtypes"]) == {"float32", "int64", "bfloat16", "bool", "float64", "complex64", "int8"}
    assert info["pickled_leaves"] == 0
    assert info["top_level_keys"] == ["model", "extra", "optim", "meta"]
    by_path = {item["path"]: item for item in info["tensor_list"]}
    assert by_path["state['model']['rows']"]["shape"] == [256, 1024]
    assert by_path["state['extra']['scalar']"] == {
        "path": "state['extra']['scalar']", "dtype": "float64", "shape": [], "bytes": 8,
    }  # fmt: skip
    # The peer served headers only: no transfer of tensor data was completed.
    assert peer.finished_sends() == sends_before

    text = run_cli("inspect", peer.metadata, "--step", "3")
    assert text.returncode == 0, text.stderr
    assert "step            3" in text.stdout
    assert "tensors         9 (in 8 storages)" in text.stdout
    assert "bfloat16 x1" in text.stdout


def test_inspect_digests_checks_a_fetched_checkpoint_against_the_source(peer: Peer, tmp_path: Path) -> None:
    output = tmp_path / "step3.pt"
    assert run_cli("fetch", peer.metadata, "--step", "3", "-o", str(output), "--progress", "none").returncode == 0
    result = run_cli("inspect", peer.metadata, "--step", "3", "--digests", "--check", str(output), "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["algorithm"] in ("sha256", "blake3") and len(info["root"]) == 64
    assert info["check"]["same"] == info["data_messages"] and not info["check"]["different"]
    # One changed number in one tensor: the message carrying it differs, and is named.
    state = torch.load(output, weights_only=True)
    state["model"]["rows"][7, 3] += 1
    torch.save(state, output)
    text = run_cli("inspect", peer.metadata, "--step", "3", "--digests", "--check", str(output))
    assert text.returncode == 1, text.stderr
    assert "DIFFERS from the source" in text.stdout and "state['model']['rows']" in text.stdout, text.stdout
    assert run_cli("inspect", peer.metadata, "--step", "3", "--check", str(output)).returncode == 1  # needs --digests


def test_inspect_errors_are_one_line(peer: Peer) -> None:
    wrong = run_cli("inspect", peer.metadata, "--step", "9")
    line = _one_error_line(wrong, "inspect")
    assert "wrong_step" in line
    # inspect has no rank for the peer: no placeholder rank in its words.
    assert "rank" not in line and f"the peer at {peer.metadata.split('?')[0]}" in line, line
    nobody = run_cli("inspect", f"tcp://{LOOPBACK}:{_free_port()}", "--step", "1", "--timeout", "1")
    assert "timed out" in _one_error_line(nobody, "inspect")


# ----------------------------------------------------------------------------- bench, usage, entry points


def test_bench_smoke() -> None:
    if importlib.util.find_spec("zmqtransport.bench") is None:
        pytest.skip("zmqtransport.bench is not in this tree yet")
    result = run_cli(
        "bench", "--total", "256K", "--tensor", "64K", "--methods", "zmq-fresh",
        "--reps", "1", "--warmup", "0", "--settle", "0", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert isinstance(report, dict) and report
    bad = run_cli("bench", "--no-such-option")
    assert bad.returncode == cli.EXIT_USAGE and "Traceback" not in bad.stderr


def _usage_status(argv: list[str]) -> int | str | None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    return exited.value.code


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert _usage_status([]) == cli.EXIT_USAGE
    assert _usage_status(["fetch", "tcp://127.0.0.1:1", "--step", "1", "-o", "x.pt", "--bogus"]) == cli.EXIT_USAGE
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err
    assert _usage_status(["fetch", "tcp://127.0.0.1:1", "--step", "-1", "-o", "x.pt"]) == cli.EXIT_USAGE
    assert _usage_status(["serve", "x.pt"]) == cli.EXIT_USAGE  # --step is required
    assert _usage_status(["--help"]) == 0
    helped = capsys.readouterr().out
    for command in ("fetch", "serve", "inspect", "bench"):
        assert command in helped


def test_console_script_is_installed() -> None:
    scripts = sysconfig.get_path("scripts")
    executable = shutil.which("zmqtransport", path=scripts)
    if executable is None:
        pytest.skip(f"the zmqtransport console script is not installed in {scripts}")
    result = subprocess.run(
        [executable, "inspect", "--help"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=_environment(),
        check=False,
    )
    assert result.returncode == 0 and "--step" in result.stdout, result.stderr


# ----------------------------------------------------------------------------- progress, in process


def test_progress_log_lines(capsys: pytest.CaptureFixture[str]) -> None:
    progress = cli.Progress("log", "step 7", sys.stderr, interval=0)
    for done in (0, 500_000, 1_000_000):
        progress(done, 1_000_000)
    progress.close()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    assert lines[1].endswith("step 7: 500.00 kB / 1.00 MB (50.0%) at " + lines[1].rsplit(" at ", 1)[1])
    assert "(100.0%)" in lines[-1]


def test_progress_mode_choice(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    class Terminal:
        def __init__(self, tty: bool) -> None:
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

        def write(self, text: str) -> int:
            sys.stderr.write(text)
            return len(text)

    monkeypatch.setattr(cli, "_tqdm_available", lambda: True)
    assert cli.choose_progress_mode("auto", Terminal(True)) == "bar"  # type: ignore[arg-type]
    assert cli.choose_progress_mode("auto", Terminal(False)) == "log"  # type: ignore[arg-type]
    assert cli.choose_progress_mode("none", Terminal(True)) == "none"  # type: ignore[arg-type]
    monkeypatch.setattr(cli, "_tqdm_available", lambda: False)
    assert cli.choose_progress_mode("auto", Terminal(True)) == "log"  # type: ignore[arg-type]
    assert cli.choose_progress_mode("bar", Terminal(True)) == "log"  # type: ignore[arg-type]
    assert "tqdm is not installed" in capsys.readouterr().err


def test_human_bytes() -> None:
    assert cli.human_bytes(0) == "0 B"
    assert cli.human_bytes(999) == "999 B"
    assert cli.human_bytes(1_500_000) == "1.50 MB"
    assert cli.human_bytes(1 << 30) == "1.07 GB"
