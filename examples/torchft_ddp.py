"""Fault-tolerant DDP with torchft, healing restarted replica groups through ZMQTransport.

Needs torchft (``pip install 'zmqtransport[torchft]'``).

Each replica group trains the same MLP with torchft's ``DistributedDataParallel``
and ``OptimizerWrapper`` over ``ProcessGroupGloo``; its ``Manager`` is given
``checkpoint_transport=ZMQTransport(..., state_dict=...)``, so a replica group that
restarts pulls the live model and optimizer state from a healthy peer over
ZeroMQ, straight into the model it has just built.

One machine, one command
------------------------
::

    python examples/torchft_ddp.py                     # 2 groups; group 1 crashes after step 5
    python examples/torchft_ddp.py --replica-groups 3 --nproc-per-group 2 --fail-at 0
    python examples/torchft_ddp.py --lighthouse http://127.0.0.1:29510   # external lighthouse

Without ``--lighthouse`` (or ``TORCHFT_LIGHTHOUSE``) a ``LighthouseServer`` is
started in this process. The script then launches every rank of every replica
group as a child process on 127.0.0.1, and plays torchrun's part: when a rank
dies, the rest of its group is stopped and the group is started again (up to
``--max-restarts`` times). With ``--fail-at STEP`` (default 5) a rank of group
``--fail-group`` kills itself with SIGKILL once its group has committed STEP
steps, on the first attempt only. The script prints a report: who crashed, the
heal (bytes, seconds, GB/s, bytes received in place) and whether every replica
group ended bit-identical. Exit code 0 only if all of that held.

Several machines, with torchrun
-------------------------------
Under torchrun (``RANK`` and ``MASTER_PORT`` set) the script trains as one rank of
one replica group; one torchrun invocation is one replica group. Start a
lighthouse somewhere every machine can reach (the binary ships with torchft)::

    torchft_lighthouse --min_replicas 2 --quorum_tick_ms 100 --join_timeout_ms 10000 \
        --bind [::]:29510

then, on each machine (here one replica group per machine: ``REPLICA_GROUP_ID``
0 on the first, 1 on the second, ...)::

    export TORCHFT_LIGHTHOUSE=http://lighthouse-host:29510
    export REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2
    # The address other machines use to reach this one's ZMQTransport. Pick the
    # training network's address: hostnames often resolve to the management NIC.
    export ZMQTRANSPORT_ADVERTISE_HOST=10.0.0.11
    export GLOO_SOCKET_IFNAME=eth1          # the same network for gloo's allreduce
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
        examples/torchft_ddp.py --manager-host 10.0.0.11 --steps 1000 --fail-at 0

(A replica group spanning several machines uses torchrun's multi-node flags
instead of ``--standalone``: ``--nnodes=2 --rdzv-backend=c10d
--rdzv-endpoint=GROUP_HEAD:29400``.) torchrun provides ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` (the group's store) and
``TORCHELASTIC_RESTART_COUNT``; torchft's Manager also honours
``TORCHFT_MANAGER_PORT`` and ``TORCHFT_TIMEOUT_SEC``. ``--manager-host`` (default:
the hostname, as in torchft) is what other groups use to reach this group's
torchft manager. Kill a worker, or pass ``--fail-at N --fail-group G``, and watch
its group come back and heal; each rank prints one ``TORCHFT_DDP_RESULT`` JSON
line at the end (final step, sha256 of its state, the heal's figures).
``--min-replicas`` (default: ``NUM_REPLICA_GROUPS``) is how many groups must take
part to commit a step; lower it (and the lighthouse's ``--min_replicas``) to let
healthy groups keep training while one restarts.

A note on in-place receiving: with the default asynchronous quorum, torchft heals
during the recovering group's first forward pass, so the receive writes into
parameters that forward is reading. That is harmless here, because torchft
discards that step's gradients on a healing group, but a model whose forward
pass updates buffers in place (BatchNorm running statistics) would mix its own
update with the received bytes: use ``--sync-quorum`` for such models, or build
the transport without ``state_dict=``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

# torch warns at import when numpy is missing; nothing here needs numpy, and the
# warning would repeat in every child process.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
# torchft's lighthouse and managers log every quorum at INFO from Rust, configured
# once when torchft is imported; set RUST_LOG=info yourself to see them.
os.environ.setdefault("RUST_LOG", "warn")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torchft import Manager  # noqa: E402
from torchft._torchft import LighthouseServer  # noqa: E402
from torchft.ddp import DistributedDataParallel  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

from zmqtransport import ZMQTransport  # noqa: E402

LOOPBACK = "127.0.0.1"
RESULT_TAG = "TORCHFT_DDP_RESULT"
logger = logging.getLogger("torchft_ddp")


# --------------------------------------------------------------------------- one rank


def build_model(width: int, layers: int) -> nn.Module:
    """The MLP; the fixed seed makes every fresh build identical."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


def state_digest(state: Any) -> str:
    """sha256 over keys, dtypes, shapes and raw tensor bytes: equal means bit-identical."""
    digest = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            tensor = obj.detach().contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            if tensor.nbytes:
                digest.update((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()))
        elif isinstance(obj, dict):
            for key, value in obj.items():
                digest.update(repr(key).encode())
                walk(value)
        elif isinstance(obj, (list, tuple)):
            digest.update(f"[{len(obj)}".encode())
            for value in obj:
                walk(value)
        else:
            digest.update(repr(obj).encode())

    walk(state)
    return digest.hexdigest()


@dataclass
class RankEnv:
    """What torchrun (or the local launcher) tells a rank through the environment."""

    rank: int
    world_size: int
    replica_group: int
    replica_groups: int
    restart_count: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            replica_group=int(os.environ.get("REPLICA_GROUP_ID", "0")),
            replica_groups=int(os.environ.get("NUM_REPLICA_GROUPS", "2")),
            restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )


def train(args: argparse.Namespace) -> int:
    """Train as one rank of one replica group; prints one result line at the end."""
    env = RankEnv.from_environ()
    if args.threads:
        torch.set_num_threads(args.threads)
    timeout = timedelta(seconds=args.timeout)
    lighthouse = args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        raise SystemExit("no lighthouse: pass --lighthouse ADDR or set TORCHFT_LIGHTHOUSE")
    holder: dict[str, Any] = {}

    def user_state() -> dict[str, Any]:
        return {"model": holder["model"].state_dict(), "optim": holder["optim"].state_dict()}

    def load_user_state(state: dict[str, Any]) -> None:
        holder["model"].load_state_dict(state["model"])
        holder["optim"].load_state_dict(state["optim"])

    # The Manager sends {"user": {"default": <user_state()>}, "torchft": ...}; giving
    # the transport the same layout lets the model's tensors receive in place.
    transport: ZMQTransport[Any] = ZMQTransport(
        timeout=timeout,
        bind_host=args.bind_host,
        state_dict=lambda: {"user": {"default": user_state()}},
    )
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=args.min_replicas or env.replica_groups,
        load_state_dict=load_user_state,
        state_dict=user_state,
        use_async_quorum=not args.sync_quorum,
        timeout=timeout,
        quorum_timeout=timedelta(seconds=args.quorum_timeout),
        connect_timeout=timeout,
        lighthouse_addr=lighthouse,
        replica_id=f"train_ddp_{env.replica_group}",
        hostname=args.manager_host,
        checkpoint_transport=transport,
    )
    try:
        model = DistributedDataParallel(manager, build_model(args.width, args.layers))
        optimizer = OptimizerWrapper(manager, torch.optim.Adam(model.parameters(), lr=1e-3))
        holder.update(model=model, optim=optimizer)
        data = torch.Generator().manual_seed(1_000 * env.replica_group + env.rank)
        while manager.current_step() < args.steps:
            inputs = torch.randn(args.batch, args.width, generator=data)
            targets = torch.randn(args.batch, args.width, generator=data).tanh()
            optimizer.zero_grad()  # starts the quorum; a recovering group heals here
            loss = nn.functional.mse_loss(model(inputs), targets)
            loss.backward()  # gradients are averaged across replica groups
            optimizer.step()  # applied only if every participant committed
            maybe_crash(args, env, manager.current_step())
        heal = transport.last_recv_stats
        result = {
            "replica_group": env.replica_group,
            "rank": env.rank,
            "restart_count": env.restart_count,
            "step": manager.current_step(),
            "batches_committed": manager.batches_committed(),
            "digest": state_digest(user_state()),
            # Step 0 transfers are torchft's initial weight sync, not a recovery.
            "heal": None
            if heal is None or heal.step == 0
            else {
                "step": heal.step,
                "bytes": heal.bytes,
                "in_place_bytes": heal.in_place_bytes,
                "seconds": heal.seconds,
                "gbps": heal.gbps,
                "peer": heal.peer,
            },
        }
        print(f"{RESULT_TAG} {json.dumps(result)}", flush=True)
    finally:
        manager.shutdown(wait=False)
    return 0


def maybe_crash(args: argparse.Namespace, env: RankEnv, step: int) -> None:
    """The injected failure: die abruptly (SIGKILL), on the first attempt only."""
    if (
        args.fail_at
        and step == args.fail_at
        and env.replica_group == args.fail_group
        and env.rank == args.fail_rank
        and env.restart_count == 0
    ):
        logger.warning(
            "injected failure: group %d rank %d after step %d", env.replica_group, env.rank, step
        )
        os.kill(os.getpid(), signal.SIGKILL)


# --------------------------------------------------------------------------- local launcher


@dataclass
class Group:
    """One replica group's ranks, as child processes, and its restarts."""

    index: int
    attempt: int = 0
    store: Any = None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    results: list[dict[str, Any]] = field(default_factory=list)


def start_group(group: Group, args: argparse.Namespace, lighthouse: str, log_dir: Path) -> None:
    """Start every rank of ``group`` with the environment torchrun would give it."""
    # A fresh store per attempt, as torchrun's rendezvous gives: restarted ranks
    # never read the dead attempt's manager address.
    group.store = dist.TCPStore(host_name=LOOPBACK, port=0, is_master=True, wait_for_workers=False)
    group.procs, group.logs = [], []
    for rank in range(args.nproc_per_group):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.nproc_per_group),
            MASTER_ADDR=LOOPBACK,
            MASTER_PORT=str(group.store.port),
            REPLICA_GROUP_ID=str(group.index),
            NUM_REPLICA_GROUPS=str(args.replica_groups),
            TORCHELASTIC_RESTART_COUNT=str(group.attempt),
            TORCHFT_LIGHTHOUSE=lighthouse,
            ZMQTRANSPORT_ADVERTISE_HOST=LOOPBACK,
            GLOO_SOCKET_IFNAME="lo",
        )
        log = log_dir / f"group{group.index}-rank{rank}-attempt{group.attempt}.log"
        argv = [sys.executable, __file__, "--worker", *worker_flags(args)]
        with log.open("w") as stderr:
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        group.procs.append(proc)
        group.logs.append(log)


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The command line a child rank gets: the same run, pinned to loopback."""
    flags = [
        f"--steps={args.steps}",
        f"--width={args.width}",
        f"--layers={args.layers}",
        f"--batch={args.batch}",
        f"--timeout={args.timeout}",
        f"--quorum-timeout={args.quorum_timeout}",
        f"--fail-at={args.fail_at}",
        f"--fail-group={args.fail_group}",
        f"--fail-rank={args.fail_rank}",
        f"--min-replicas={args.min_replicas}",
        f"--bind-host={LOOPBACK}",
        f"--manager-host={LOOPBACK}",
        "--threads=1",  # the ranks share the machine's cores
    ]
    if args.sync_quorum:
        flags.append("--sync-quorum")
    if args.verbose:
        flags.append("--verbose")
    return flags


def stop_group(group: Group) -> None:
    for proc in group.procs:
        if proc.poll() is None:
            proc.kill()
    for proc in group.procs:
        proc.wait()


def poll_group(group: Group, args: argparse.Namespace, lighthouse: str, log_dir: Path) -> bool:
    """Advance one group: restart it after a crash; True once all its ranks exited cleanly."""
    codes = [proc.poll() for proc in group.procs]
    failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
    if failed:
        rank, code = failed[0]
        how = "SIGKILL" if code == -signal.SIGKILL else f"exit code {code}"
        group.crashes.append(
            f"group {group.index} rank {rank} died ({how}) on attempt {group.attempt}"
        )
        stop_group(group)
        if group.attempt >= args.max_restarts:
            raise RuntimeError(
                f"group {group.index} failed {group.attempt + 1} times; logs in {log_dir}"
            )
        group.attempt += 1
        start_group(group, args, lighthouse, log_dir)
        return False
    if any(code is None for code in codes):
        return False
    if not group.results:
        for proc in group.procs:
            out = proc.stdout.read() if proc.stdout else ""
            lines = [line for line in out.splitlines() if line.startswith(RESULT_TAG)]
            if not lines:
                raise RuntimeError(
                    f"group {group.index} exited without a result; logs in {log_dir}"
                )
            group.results.append(json.loads(lines[-1].split(" ", 1)[1]))
    return True


def launch(args: argparse.Namespace) -> int:
    """Local mode: lighthouse (unless given), all groups as child processes, then the report."""
    min_replicas = args.min_replicas or args.replica_groups
    server = None
    lighthouse = args.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
    if not lighthouse:
        server = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=min_replicas)
        # It reports the hostname; stay on loopback whatever that resolves to.
        lighthouse = f"http://{LOOPBACK}:{server.address().rsplit(':', 1)[1]}"
    started = time.monotonic()
    groups = [Group(index) for index in range(args.replica_groups)]
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="torchft_ddp_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for group in groups:
            start_group(group, args, lighthouse, log_dir)
        deadline = started + args.deadline
        while not all([poll_group(group, args, lighthouse, log_dir) for group in groups]):
            if time.monotonic() > deadline:
                raise RuntimeError(f"not finished after {args.deadline:.0f} s; logs in {log_dir}")
            time.sleep(0.1)
    except RuntimeError as error:
        print(f"RESULT: FAILED ({error})")
        print_log_tails(log_dir)
        return 2
    finally:
        for group in groups:
            stop_group(group)
        if server is not None:
            server.shutdown()
    lighthouse_kind = "in-process" if server is not None else "external"
    problems = report(groups, args, f"{lighthouse_kind} lighthouse {lighthouse}", log_dir, started)
    return 0 if not problems else 1


def print_log_tails(log_dir: Path, lines: int = 15) -> None:
    for log in sorted(log_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.name}")
        print("\n".join(tail))


def report(
    groups: list[Group], args: argparse.Namespace, lighthouse: str, log_dir: Path, started: float
) -> list[str]:
    """Print what happened; returns the problems found (empty: all good)."""
    print(
        f"torchft DDP with ZMQTransport: {args.replica_groups} replica groups x "
        f"{args.nproc_per_group} ranks, MLP {args.layers}x{args.width}, {args.steps} steps, "
        f"{lighthouse}"
    )
    for group in groups:
        for crash in group.crashes:
            print(f"  {crash}; restarted")
    results = [result for group in groups for result in group.results]
    for result in results:
        heal = result["heal"]
        if heal is not None:
            print(
                f"  group {result['replica_group']} rank {result['rank']} healed at step "
                f"{heal['step']} from {heal['peer']} through ZMQTransport: "
                f"{heal['bytes'] / 1e6:.1f} MB in {heal['seconds']:.3f} s "
                f"= {heal['gbps']:.2f} GB/s, "
                f"{heal['in_place_bytes'] / 1e6:.1f} MB received in place"
            )
    problems = heal_problems(groups, results, args) + agreement_problems(results, args)
    print(f"  total {time.monotonic() - started:.1f} s; logs in {log_dir}")
    for problem in problems:
        print(f"  MISMATCH: {problem}")
    print("RESULT: " + ("OK" if not problems else f"FAILED ({len(problems)} problems)"))
    return problems


def heal_problems(
    groups: list[Group], results: list[dict[str, Any]], args: argparse.Namespace
) -> list[str]:
    """With a failure requested: it happened, and every restarted rank healed over ZeroMQ."""
    if not args.fail_at:
        return []
    crashed = [group for group in groups if group.crashes]
    if not crashed:
        return ["the injected failure never happened"]
    return [
        f"group {r['replica_group']} rank {r['rank']} restarted but never healed "
        "through ZMQTransport"
        for r in results
        if r["restart_count"] > 0 and r["heal"] is None
    ]


def agreement_problems(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Every rank finished all steps, bit-identical to the same rank of every other group."""
    problems = []
    for rank in range(args.nproc_per_group):
        finals = {r["digest"] for r in results if r["rank"] == rank}
        steps = {r["step"] for r in results if r["rank"] == rank}
        if len(finals) != 1 or steps != {args.steps}:
            problems.append(
                f"rank {rank}: final states differ across groups (steps {sorted(steps)})"
            )
        else:
            print(
                f"  rank {rank}: final state at step {args.steps} bit-identical across all "
                f"{args.replica_groups} groups (sha256 {next(iter(finals))[:16]}...)"
            )
    return problems


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="torchft DDP training that heals restarted replica groups through ZMQTransport",
        epilog="See the module docstring for running it with torchrun on several machines.",
    )
    parser.add_argument(
        "--lighthouse",
        help="external lighthouse URL (default: $TORCHFT_LIGHTHOUSE, "
        "else start one in this process)",
    )
    parser.add_argument("--replica-groups", type=int, default=2, help="local mode: replica groups")
    parser.add_argument(
        "--nproc-per-group", type=int, default=1, help="local mode: ranks per group"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=1, help="local mode: restarts per group"
    )
    parser.add_argument(
        "--deadline", type=float, default=300.0, help="local mode: give up after this (s)"
    )
    parser.add_argument("--log-dir", help="local mode: where ranks log (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=20, help="steps to commit")
    parser.add_argument("--width", type=int, default=1024, help="MLP width")
    parser.add_argument("--layers", type=int, default=4, help="MLP layers")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fail-at", type=int, default=5, help="crash after this step (0: never)")
    parser.add_argument("--fail-group", type=int, default=1, help="replica group that crashes")
    parser.add_argument("--fail-rank", type=int, default=0, help="rank in that group that crashes")
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=0,
        help="replica groups needed to commit (default: all of them)",
    )
    parser.add_argument("--sync-quorum", action="store_true", help="use_async_quorum=False")
    parser.add_argument(
        "--timeout", type=float, default=30.0, help="torchft and transport timeout (s)"
    )
    parser.add_argument("--quorum-timeout", type=float, default=120.0, help="quorum timeout (s)")
    parser.add_argument("--bind-host", default="*", help="interface ZMQTransport listens on")
    parser.add_argument(
        "--manager-host",
        default=None,
        help="host other groups use to reach this group's torchft manager (default: the hostname)",
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per rank (0: default)"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="Python INFO logs (torchft, zmqtransport)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.fail_at and not 0 < args.fail_at < args.steps:
        parser.error("--fail-at must be in [1, --steps) or 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    if args.worker or ("RANK" in os.environ and "MASTER_PORT" in os.environ):
        if args.manager_host is None:
            args.manager_host = socket.gethostname()  # torchft's own default
        return train(args)
    with contextlib.suppress(KeyboardInterrupt):
        return launch(args)
    return 130


if __name__ == "__main__":
    sys.exit(main())
