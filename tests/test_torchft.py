"""torchft heals real trainers through ZMQTransport.

A real ``LighthouseServer`` and two replica groups train a small model with
``torchft.Manager(checkpoint_transport=ZMQTransport(...))`` over
``ProcessGroupGloo``, with every replica group's ranks running as threads of
this process (as torchft's own manager_integ_test does). One replica group
fails at a chosen step and restarts with a freshly built model; torchft must
heal it from its peer, and the transfer must go through ZMQTransport (we count
the calls and read ``last_recv_stats``). At the end every replica's model and
optimizer state must be bit-identical.

Everything binds and connects on 127.0.0.1 only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torchft")

import torch
import torch.distributed as dist
from torch import nn
from torchft import Manager
from torchft._torchft import LighthouseServer
from torchft.ddp import DistributedDataParallel
from torchft.optim import OptimizerWrapper
from torchft.process_group import ProcessGroupGloo

from zmqtransport import ZMQTransport

pytestmark = [
    pytest.mark.torchft,
    pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning"),
]

LOOPBACK = "127.0.0.1"
TIMEOUT = timedelta(seconds=20)
FINAL_STEP = 4
SCENARIO_DEADLINE_S = 120.0  # a hung scenario fails instead of hanging the suite


@pytest.fixture(autouse=True)
def _loopback_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    # Gloo picks its interface from the hostname unless told; keep it on loopback.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")


class InjectedFailure(Exception):
    """Raised by a rank to simulate its replica group crashing."""


class RecordingTransport(ZMQTransport[Any]):
    """A ZMQTransport that remembers which steps it sent and received."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent_steps: list[int] = []
        self.received_steps: list[int] = []

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta
    ) -> None:
        self.sent_steps.append(step)
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        result = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self.received_steps.append(step)
        return result


@dataclass
class Scenario:
    """Who fails when, and what every attempt of every rank left behind."""

    use_async_quorum: bool
    world_size: int = 1
    replicas: int = 2
    # (replica, rank) -> the step after which that rank raises InjectedFailure, once.
    failures: dict[tuple[int, int], int] = field(default_factory=dict)
    lighthouse: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    # (replica, attempt, rank) -> the transport that attempt used
    transports: dict[tuple[int, int, int], RecordingTransport] = field(default_factory=dict)
    injected: list[tuple[int, int, int]] = field(default_factory=list)

    def maybe_fail(self, replica: int, rank: int, step: int) -> None:
        with self.lock:
            if self.failures.get((replica, rank)) != step:
                return
            del self.failures[(replica, rank)]
            self.injected.append((replica, rank, step))
        raise InjectedFailure(f"injected failure: replica {replica} rank {rank} after step {step}")


class Model(nn.Module):
    """Small, but its middle weight (1.3 MB) spans several data frames while the
    other tensors are packed together: both receive paths are exercised."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 640), nn.ReLU(), nn.Linear(640, 4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def loopback_address(server: LighthouseServer) -> str:
    """The lighthouse URL with the host replaced by 127.0.0.1 (it reports the hostname)."""
    port = server.address().rsplit(":", 1)[1]
    return f"http://{LOOPBACK}:{port}"


def run_threads(targets: list[Callable[[], Any]], name: str) -> list[Any]:
    """Run callables on daemon threads; return their results or raise the first error.

    Daemon threads (unlike a ThreadPoolExecutor's) let a scenario that hangs
    fail the test at the deadline instead of blocking the interpreter's exit.
    """
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException | None] = [None] * len(targets)

    def body(index: int) -> None:
        try:
            results[index] = targets[index]()
        except BaseException as error:
            errors[index] = error

    threads = [
        threading.Thread(target=body, args=(i,), name=f"{name}-{i}", daemon=True)
        for i in range(len(targets))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SCENARIO_DEADLINE_S)
        if thread.is_alive():
            raise TimeoutError(f"{thread.name} still running after {SCENARIO_DEADLINE_S} s")
    # An injected failure wins over the collateral errors it causes in sibling ranks.
    for error in sorted(
        (e for e in errors if e is not None), key=lambda e: not isinstance(e, InjectedFailure)
    ):
        raise error
    return results


def train_rank(
    scenario: Scenario, replica: int, attempt: int, rank: int, store_port: int
) -> dict[str, Any]:
    """One rank of one replica group: train to FINAL_STEP; returns its final state."""
    holder: dict[str, Any] = {}

    def user_state() -> dict[str, Any]:
        return {"model": holder["model"].state_dict(), "optim": holder["optim"].state_dict()}

    def load_user_state(state: dict[str, Any]) -> None:
        holder["model"].load_state_dict(state["model"])
        holder["optim"].load_state_dict(state["optim"])

    # The receive targets mirror what the Manager sends ({"user": {"default": ...}});
    # the model's tensors then receive in place.
    transport = RecordingTransport(
        timeout=TIMEOUT,
        bind_host=LOOPBACK,
        advertise_host=LOOPBACK,
        state_dict=lambda: {"user": {"default": user_state()}},
    )
    with scenario.lock:
        scenario.transports[(replica, attempt, rank)] = transport
    manager = Manager(
        pg=ProcessGroupGloo(timeout=TIMEOUT),
        min_replica_size=scenario.replicas,
        load_state_dict=load_user_state,
        state_dict=user_state,
        use_async_quorum=scenario.use_async_quorum,
        timeout=TIMEOUT,
        quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT,
        rank=rank,
        world_size=scenario.world_size,
        store_addr=LOOPBACK,
        store_port=store_port,
        lighthouse_addr=scenario.lighthouse,
        replica_id=str(replica),
        hostname=LOOPBACK,
        checkpoint_transport=transport,  # the Manager shuts it down with itself
    )
    try:
        torch.manual_seed(0)  # fresh, identical init; a restarted replica starts from it too
        model = DistributedDataParallel(manager, Model())
        optimizer = OptimizerWrapper(manager, torch.optim.Adam(model.parameters(), lr=0.01))
        holder.update(model=model, optim=optimizer)
        data = torch.Generator().manual_seed(1000 * replica + rank)
        while True:
            inputs = torch.rand(8, 16, generator=data)
            labels = torch.randint(4, (8,), generator=data)
            optimizer.zero_grad()  # starts the quorum; may heal
            loss = nn.functional.cross_entropy(model(inputs), labels)
            loss.backward()  # allreduces gradients across replica groups
            optimizer.step()  # commits only if the step succeeded everywhere
            if manager.current_step() >= FINAL_STEP:
                return {"user": user_state(), "step": manager.current_step()}
            scenario.maybe_fail(replica, rank, manager.current_step())
    finally:
        manager.shutdown(wait=False)


def run_replica(scenario: Scenario, replica: int, attempts: int = 3) -> list[dict[str, Any]]:
    """A replica group: its ranks as threads, restarted from scratch after a failure."""
    for attempt in range(attempts):
        # A fresh store per attempt, so restarted ranks never see the dead attempt's keys.
        store = dist.TCPStore(host_name=LOOPBACK, port=0, is_master=True, wait_for_workers=False)
        try:
            return run_threads(
                [
                    lambda rank=rank, attempt=attempt, port=store.port: train_rank(
                        scenario, replica, attempt, rank, port
                    )
                    for rank in range(scenario.world_size)
                ],
                name=f"replica{replica}-attempt{attempt}",
            )
        except InjectedFailure:
            continue
    raise RuntimeError(f"replica {replica} failed {attempts} times")


def run_scenario(scenario: Scenario) -> list[list[dict[str, Any]]]:
    """Lighthouse plus replica groups; returns each replica's per-rank final states."""
    lighthouse = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=scenario.replicas)
    scenario.lighthouse = loopback_address(lighthouse)
    try:
        return run_threads(
            [
                lambda replica=replica: run_replica(scenario, replica)
                for replica in range(scenario.replicas)
            ],
            name="replica",
        )
    finally:
        lighthouse.shutdown()


def assert_bit_identical(a: Any, b: Any, path: str = "") -> None:
    """Same structure and, for tensors, same dtype, shape and bytes (not just close)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        a_bytes = a.detach().contiguous().reshape(-1).view(torch.uint8)
        b_bytes = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a_bytes, b_bytes), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for key in a:
            assert_bit_identical(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bit_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def check_outcome(
    scenario: Scenario, results: list[list[dict[str, Any]]], failed: int, fail_step: int
) -> None:
    """Failure injected, healed through ZMQTransport, and every replica bit-identical."""
    assert sorted(scenario.injected) == [
        (failed, rank, fail_step) for rank in range(scenario.world_size)
    ]

    healthy = next(r for r in range(scenario.replicas) if r != failed)
    for rank in range(scenario.world_size):
        # The restarted attempt healed from a live peer at a step past the failure
        # (step 0 transfers are torchft's initial sync, not a recovery).
        restarted = scenario.transports[(failed, 1, rank)]
        heal_steps = [step for step in restarted.received_steps if step > 0]
        assert heal_steps, f"rank {rank} of the restarted replica never healed through ZMQTransport"
        assert heal_steps[0] >= fail_step
        stats = restarted.last_recv_stats
        assert stats is not None and stats.step == heal_steps[-1]
        assert stats.bytes > 0 and stats.tensors > 0
        # The freshly built model's parameters were the receive targets.
        model_bytes = sum(p.nbytes for p in Model().parameters())
        assert stats.in_place_bytes >= model_bytes
        served = scenario.transports[(healthy, 0, rank)].sent_steps
        assert heal_steps[0] in served, f"the healthy replica never served step {heal_steps[0]}"

    for rank in range(scenario.world_size):
        states = [results[replica][rank] for replica in range(scenario.replicas)]
        for state in states:
            assert state["step"] == FINAL_STEP
            assert state["user"]["optim"]["state"], "the optimizer never stepped"
        for state in states[1:]:
            assert_bit_identical(states[0], state)


@pytest.mark.parametrize("use_async_quorum", [True, False], ids=["async_quorum", "sync_quorum"])
def test_replica_heals_through_zmqtransport(use_async_quorum: bool) -> None:
    fail_step = 2
    scenario = Scenario(use_async_quorum=use_async_quorum, failures={(1, 0): fail_step})
    results = run_scenario(scenario)
    check_outcome(scenario, results, failed=1, fail_step=fail_step)


@pytest.mark.parametrize("use_async_quorum", [True, False], ids=["async_quorum", "sync_quorum"])
def test_two_rank_replica_group_heals_through_zmqtransport(use_async_quorum: bool) -> None:
    fail_step = 2
    # Every rank of the group fails together, as when its node goes down.
    scenario = Scenario(
        use_async_quorum=use_async_quorum,
        world_size=2,
        failures={(0, 0): fail_step, (0, 1): fail_step},
    )
    results = run_scenario(scenario)
    check_outcome(scenario, results, failed=0, fail_step=fail_step)
