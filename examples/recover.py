"""Kill a training worker with SIGKILL and heal it from a live peer through ZMQTransport.

Run it (no torchft needed)::

    python examples/recover.py                     # 3 workers, ~100 MB of state
    python examples/recover.py --workers 4 --width 2048 --kill-step 5

What happens:

1. N worker processes (``multiprocessing`` "spawn") build the same MLP and Adam
   optimizer from the same seed and train it in lockstep on the same
   deterministic batches, one thread each, so their states stay bit-identical.
   The coordinator (this process) drives the steps over pipes and compares the
   losses of every step bit for bit.
2. During step ``--kill-step`` the coordinator kills one worker with SIGKILL.
3. It starts a replacement, which builds a fresh model (step 0 weights) exactly
   as a restarted trainer would. A live peer stages its state with
   ``send_checkpoint``; the newcomer pulls it with ``recv_checkpoint`` from the
   peer's metadata string. Its transport was built with ``state_dict=``, so the
   model's bytes land directly in the parameters it already allocated.
4. Every worker hashes its whole state (model, optimizer, step: sha256 over the
   raw tensor bytes); the healed worker must match its peer bit for bit. Then
   all of them train the remaining steps and must still agree at the end.

It prints a short report (bytes moved, seconds, GB/s) and exits non-zero if any
check failed. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

# torch warns at import when numpy is missing; this demo never needs numpy, and
# the warning would repeat once per spawned worker (each re-imports this file).
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from zmqtransport import ZMQTransport  # noqa: E402

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Config:
    """Everything a worker needs to build the same model and data as its peers."""

    workers: int = 3
    width: int = 1024
    layers: int = 8
    batch: int = 64
    steps: int = 30
    kill_step: int = 15
    victim: int = 1
    seed: int = 1234
    lr: float = 1e-3
    timeout: float = 60.0
    verbose: bool = False
    corrupt: bool = False


# --------------------------------------------------------------------------- worker side


def build_model(config: Config) -> Any:
    """The MLP every worker trains; the seed makes every fresh build identical."""
    torch.manual_seed(config.seed)
    layers: list[nn.Module] = []
    for _ in range(config.layers):
        layers += [nn.Linear(config.width, config.width), nn.Tanh()]
    return nn.Sequential(*layers)


def batch_for_step(config: Config, step: int) -> tuple[Any, Any]:
    """The batch of ``step``: a function of the seed and the step only, so every worker sees it."""
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    inputs = torch.randn(config.batch, config.width, generator=generator)
    targets = torch.randn(config.batch, config.width, generator=generator).tanh()
    return inputs, targets


def _tensor_bytes(tensor: Any) -> Any:
    """A zero-copy byte view of a CPU tensor (no numpy needed), for hashing."""
    tensor = tensor.detach().contiguous()
    return (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())


def _hash_into(digest: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        digest.update(f"T{obj.dtype}{tuple(obj.shape)}".encode())
        if obj.nbytes:
            digest.update(_tensor_bytes(obj))
    elif isinstance(obj, dict):
        digest.update(b"{")
        for key, value in obj.items():
            digest.update(repr(key).encode())
            _hash_into(digest, value)
        digest.update(b"}")
    elif isinstance(obj, (list, tuple)):
        digest.update(b"[")
        for value in obj:
            _hash_into(digest, value)
        digest.update(b"]")
    else:
        digest.update(repr(obj).encode())


def state_digest(state: Any) -> str:
    """sha256 over every key, dtype, shape and raw tensor byte: equal digests mean bit-identical."""
    digest = hashlib.sha256()
    _hash_into(digest, state)
    return digest.hexdigest()


def flip_one_bit(tensor: Any) -> None:
    """Flip the lowest bit of a tensor's first byte (``--corrupt``: proves the check bites)."""
    first = _tensor_bytes(tensor[0])
    first[0] = bytes([first[0][0] ^ 1])


class Trainer:
    """One worker's model, optimizer and transport."""

    def __init__(self, config: Config) -> None:
        # One intra-op thread: the workers share the cores, and a fixed thread
        # count keeps reductions in the same order in every process.
        torch.set_num_threads(1)
        self.config = config
        self.step = 0
        self.model = build_model(config)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.lr)
        self.transport: ZMQTransport[dict[str, Any]] = ZMQTransport(
            timeout=timedelta(seconds=config.timeout),
            bind_host=LOOPBACK,
            advertise_host=LOOPBACK,
            # A recovering worker receives into the tensors it already built.
            state_dict=self.state_dict,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optim": self.optimizer.state_dict(),
            "step": self.step,
        }

    def model_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())

    def train_step(self, step: int) -> str:
        """Train ``step``; returns the loss as float.hex() so the coordinator compares bits."""
        if step != self.step + 1:
            raise RuntimeError(f"asked to train step {step} but this worker is at step {self.step}")
        inputs, targets = batch_for_step(self.config, step)
        self.optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        self.step = step
        return float(loss.item()).hex()

    def heal(self, src_rank: int, metadata: str, step: int) -> dict[str, Any]:
        """Pull ``step`` from a peer, load it, and say whether the model was written in place."""
        pointers = [p.data_ptr() for p in self.model.parameters()]
        received = self.transport.recv_checkpoint(
            src_rank, metadata, step, timedelta(seconds=self.config.timeout)
        )
        # The model tensors already hold the bytes (they were the receive
        # targets); load_state_dict still runs so a mismatch would be loud.
        self.model.load_state_dict(received["model"])
        self.optimizer.load_state_dict(received["optim"])
        self.step = received["step"]
        if self.config.corrupt:
            flip_one_bit(next(iter(self.model.parameters())))
        stats = self.transport.last_recv_stats
        assert stats is not None
        same_memory = pointers == [p.data_ptr() for p in self.model.parameters()]
        return {
            "bytes": stats.bytes,
            "in_place_bytes": stats.in_place_bytes,
            "seconds": stats.seconds,
            "gbps": stats.gbps,
            "tensors": stats.tensors,
            "model_bytes": self.model_bytes(),
            "in_place_ok": same_memory and stats.in_place_bytes >= self.model_bytes(),
        }


def _handle(trainer: Trainer, command: tuple[Any, ...]) -> tuple[Any, ...]:
    """Run one coordinator command; returns the reply."""
    kind = command[0]
    if kind == "train":
        return ("trained", command[1], trainer.train_step(command[1]))
    if kind == "digest":
        return ("digest", trainer.step, state_digest(trainer.state_dict()))
    if kind == "serve":
        _, step, dst_rank = command
        if step != trainer.step:
            raise RuntimeError(
                f"asked to serve step {step} but this worker is at step {trainer.step}"
            )
        trainer.transport.send_checkpoint(
            [dst_rank], step, trainer.state_dict(), timedelta(seconds=trainer.config.timeout)
        )
        return ("serving", step)
    if kind == "release":
        trainer.transport.disallow_checkpoint()
        return ("released",)
    if kind == "heal":
        _, src_rank, metadata, step = command
        return ("healed", trainer.heal(src_rank, metadata, step))
    raise RuntimeError(f"unknown command {command!r}")


def worker_main(conn: Connection, rank: int, config: Config) -> None:
    """Entry point of a worker process: serve coordinator commands until told to stop."""
    if config.verbose:
        logging.basicConfig(level=logging.INFO, format=f"[worker {rank}] %(name)s: %(message)s")
    trainer = None
    try:
        trainer = Trainer(config)
        conn.send(("ready", os.getpid(), trainer.transport.metadata(), trainer.model_bytes()))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            conn.send(_handle(trainer, command))
    except EOFError:
        pass  # the coordinator went away; nothing left to do
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        if trainer is not None:
            trainer.transport.shutdown()
        conn.close()


# --------------------------------------------------------------------------- coordinator side


class WorkerError(RuntimeError):
    """A worker failed, died unexpectedly or did not answer in time."""


@dataclass
class Worker:
    rank: int
    process: Any
    conn: Connection
    pid: int = 0
    metadata: str = ""
    model_bytes: int = 0

    def send(self, *command: Any) -> None:
        self.conn.send(command)

    def receive(self, expected: str, timeout: float) -> tuple[Any, ...]:
        """The next reply, which must be of kind ``expected``; raises WorkerError otherwise."""
        try:
            if not self.conn.poll(timeout):
                raise WorkerError(f"worker {self.rank} did not answer within {timeout:.0f} s")
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise WorkerError(f"worker {self.rank} exited unexpectedly") from None
        if reply[0] == "error":
            raise WorkerError(f"worker {self.rank} failed:\n{reply[1]}")
        if reply[0] != expected:
            raise WorkerError(f"worker {self.rank} replied {reply[0]!r}, expected {expected!r}")
        return reply

    def request(self, expected: str, timeout: float, *command: Any) -> tuple[Any, ...]:
        self.send(*command)
        return self.receive(expected, timeout)


def start_worker(ctx: Any, rank: int, config: Config) -> Worker:
    """Spawn a worker process and wait until its transport is listening."""
    parent, child = ctx.Pipe()
    process = ctx.Process(target=worker_main, args=(child, rank, config), name=f"worker-{rank}")
    process.start()
    child.close()  # only the worker holds it now, so its death shows up as EOF here
    worker = Worker(rank, process, parent)
    _, worker.pid, worker.metadata, worker.model_bytes = worker.receive("ready", config.timeout)
    return worker


def train_all(workers: list[Worker], step: int, timeout: float) -> list[str]:
    """One lockstep step on every worker; returns their losses (hex floats)."""
    for worker in workers:
        worker.send("train", step)
    return [worker.receive("trained", timeout)[2] for worker in workers]


def digests(workers: list[Worker], timeout: float) -> list[str]:
    for worker in workers:
        worker.send("digest")
    return [worker.receive("digest", timeout)[2] for worker in workers]


def kill(worker: Worker) -> int | None:
    """SIGKILL the worker's process and reap it; returns its exit code."""
    os.kill(worker.pid, signal.SIGKILL)
    worker.process.join(30)
    worker.conn.close()
    return worker.process.exitcode  # type: ignore[no-any-return]


def stop_all(workers: list[Worker]) -> None:
    """Ask workers to exit; kill the ones that do not."""
    for worker in workers:
        with contextlib.suppress(OSError, ValueError):  # already gone
            worker.send("stop")
    for worker in workers:
        worker.process.join(10)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()


class Report:
    """Collects what happened and what failed, then prints it."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.problems: list[str] = []

    def say(self, line: str) -> None:
        self.lines.append(line)

    def check(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok

    def print(self) -> None:
        for line in self.lines:
            print(line)
        for problem in self.problems:
            print(f"  MISMATCH: {problem}")
        print(
            "RESULT: " + ("OK" if not self.problems else f"FAILED ({len(self.problems)} problems)")
        )


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB"


def _train_range(
    workers: list[Worker], first: int, last: int, config: Config, report: Report
) -> None:
    """Train steps ``first..last`` on all workers, checking the losses agree bit for bit."""
    for step in range(first, last + 1):
        losses = train_all(workers, step, config.timeout)
        report.check(len(set(losses)) == 1, f"step {step}: losses differ across workers: {losses}")


def kill_during_step(workers: list[Worker], victim: Worker, config: Config, report: Report) -> None:
    """SIGKILL ``victim`` while every worker trains the kill step; the survivors finish it."""
    survivors = [w for w in workers if w is not victim]
    for worker in [*survivors, victim]:
        worker.send("train", config.kill_step)
    exit_code = kill(victim)
    losses = [w.receive("trained", config.timeout)[2] for w in survivors]
    report.check(len(set(losses)) == 1, f"step {config.kill_step}: survivors' losses differ")
    report.say(
        f"  step {config.kill_step}: killed worker {victim.rank} (pid {victim.pid}) with SIGKILL "
        f"mid-step; exit code {exit_code}"
    )
    report.check(exit_code == -signal.SIGKILL, f"victim exit code {exit_code}, expected -9")


def heal(newcomer: Worker, peer: Worker, config: Config, report: Report) -> None:
    """The peer stages its state, the newcomer pulls it in place, the peer lets go; then compare."""
    step = config.kill_step
    peer_digest = digests([peer], config.timeout)[0]
    fresh_digest = digests([newcomer], config.timeout)[0]
    differs = fresh_digest != peer_digest
    report.say(
        f"  restarted worker {newcomer.rank} (pid {newcomer.pid}) with a fresh model at step 0: "
        f"state {'differs from' if differs else 'EQUALS'} its peers'"
    )
    report.check(differs, "the fresh worker already had the peers' state")

    peer.request("serving", config.timeout, "serve", step, newcomer.rank)
    stats = newcomer.request("healed", config.timeout, "heal", peer.rank, peer.metadata, step)[1]
    peer.request("released", config.timeout, "release")
    healed_digest = digests([newcomer], config.timeout)[0]
    report.say(
        f"  healed worker {newcomer.rank} from worker {peer.rank} at step {step} "
        f"through ZMQTransport ({peer.metadata}):"
    )
    report.say(
        f"    moved {_mb(stats['bytes'])} ({stats['tensors']} tensors, model and Adam state) "
        f"in {stats['seconds']:.3f} s = {stats['gbps']:.2f} GB/s; "
        f"{_mb(stats['in_place_bytes'])} written in place into the fresh model"
    )
    report.check(stats["in_place_ok"], "the model was not received in place")
    same = healed_digest == peer_digest
    report.say(
        f"    state after healing: {'bit-identical to' if same else 'DIFFERENT from'} "
        f"worker {peer.rank} (sha256 {healed_digest[:16]}...)"
    )
    report.check(same, "the healed state differs from the peer's")


def run(config: Config) -> Report:
    """The whole scenario; returns the report (the caller prints it)."""
    report = Report()
    ctx = mp.get_context("spawn")
    params = config.layers * (config.width * config.width + config.width)
    report.say(
        f"zmqtransport recovery demo: {config.workers} workers, MLP {config.layers}x{config.width} "
        f"({params / 1e6:.1f} M parameters), Adam, {config.steps} steps, all on {LOOPBACK}"
    )
    started = time.monotonic()
    workers: list[Worker] = []
    try:
        for rank in range(config.workers):
            workers.append(start_worker(ctx, rank, config))
        report.say(f"  started {config.workers} workers in {time.monotonic() - started:.1f} s")
        _train_range(workers, 1, config.kill_step - 1, config, report)

        victim = workers[config.victim]
        kill_during_step(workers, victim, config, report)
        newcomer = start_worker(ctx, victim.rank, config)
        workers[config.victim] = newcomer
        peer = next(w for w in workers if w is not newcomer)
        heal(newcomer, peer, config, report)

        _train_range(workers, config.kill_step + 1, config.steps, config, report)
        final = digests(workers, config.timeout)
        agree = len(set(final)) == 1
        report.say(
            f"  trained steps {config.kill_step + 1}..{config.steps} in lockstep; final state "
            f"{'bit-identical on all' if agree else 'DIFFERS across the'} {config.workers} workers "
            f"(sha256 {final[0][:16]}...)"
        )
        report.check(agree, f"final states differ: {final}")
        report.say(f"  total {time.monotonic() - started:.1f} s")
    finally:
        stop_all(workers)
    return report


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers", type=int, default=Config.workers, help="worker processes (>= 2)"
    )
    parser.add_argument("--width", type=int, default=Config.width, help="hidden width of the MLP")
    parser.add_argument(
        "--layers", type=int, default=Config.layers, help="linear layers in the MLP"
    )
    parser.add_argument("--batch", type=int, default=Config.batch, help="batch size")
    parser.add_argument("--steps", type=int, default=Config.steps, help="training steps in total")
    parser.add_argument(
        "--kill-step",
        type=int,
        default=Config.kill_step,
        help="step during which a worker is killed",
    )
    parser.add_argument(
        "--victim", type=int, default=Config.victim, help="rank of the worker to kill"
    )
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument(
        "--timeout", type=float, default=Config.timeout, help="seconds to wait for any one reply"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show the transport's INFO log lines"
    )
    parser.add_argument(
        "--corrupt",
        action="store_true",
        help="flip one bit of the healed model after receiving it, to see the check fail",
    )
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2 (someone has to survive)")
    if not 0 <= args.victim < args.workers:
        parser.error("--victim must be a worker rank")
    if not 1 <= args.kill_step <= args.steps:
        parser.error("--kill-step must be in [1, --steps]")
    if args.width < 1 or args.layers < 1 or args.batch < 1:
        parser.error("--width, --layers and --batch must be positive")
    return Config(**vars(args))


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        report = run(config)
    except WorkerError as error:
        print(f"RESULT: FAILED ({error})")
        return 2
    report.print()
    return 0 if not report.problems else 1


if __name__ == "__main__":
    sys.exit(main())
