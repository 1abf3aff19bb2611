"""The recovery scenario across real processes, with bit-exact content checks."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from typing import Any

import torch

from .conftest import Processes

TIMEOUT = timedelta(seconds=60)


def build_state(seed: int) -> dict[str, Any]:
    """Deterministic state: every process can rebuild what the sender holds."""
    generator = torch.Generator().manual_seed(seed)
    model = {f"layer{i}.weight": torch.randn(256, 257, generator=generator) for i in range(6)}
    model["tiny"] = torch.arange(7, dtype=torch.int16)
    optim = {
        "state": {
            i: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(300, generator=generator)} for i in range(40)
        },
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": list(range(40))}],
    }
    return {"model": model, "optim": optim, "torchft": {"step": seed}}


def serve(steps: list[int], queue: Any, go: Any) -> None:
    """Sender process: stage each step, publish metadata, wait for the receivers."""
    from zmqtransport import ZMQTransport

    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1")
    try:
        for step in steps:
            transport.send_checkpoint([1, 2], step, build_state(step), TIMEOUT)
            queue.put(transport.metadata())
            go.wait(60)
            go.clear()
            transport.disallow_checkpoint()
    finally:
        transport.shutdown()


def receive(metadata: str, step: int, result: Any) -> None:
    """Receiver process: fetch, compare bit for bit with the rebuilt state, report."""
    from zmqtransport import ZMQTransport

    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1")
    try:
        got = transport.recv_checkpoint(0, metadata, step, TIMEOUT)
        want = build_state(step)
        same = got["torchft"] == want["torchft"] and got["optim"]["param_groups"] == want["optim"]["param_groups"]
        for key, tensor in want["model"].items():
            same = same and torch.equal(got["model"][key].view(torch.uint8), tensor.view(torch.uint8))
        for index, entry in want["optim"]["state"].items():
            same = same and all(torch.equal(got["optim"]["state"][index][k], v) for k, v in entry.items())
        result.put((step, same))
    finally:
        transport.shutdown()


def test_recovery_across_processes(processes: Processes) -> None:
    context = processes
    queue, results, go = context.Queue(), context.Queue(), context.Event()
    sender = context.Process(target=serve, args=([1, 2], queue, go))
    sender.start()
    try:
        metadata = queue.get(timeout=60)
        receivers = [context.Process(target=receive, args=(metadata, 1, results)) for _ in range(2)]
        for process in receivers:
            process.start()
        outcomes = [results.get(timeout=60) for _ in receivers]
        assert outcomes == [(1, True), (1, True)]
        go.set()
        metadata = queue.get(timeout=60)
        late = context.Process(target=receive, args=(metadata, 2, results))
        late.start()
        assert results.get(timeout=60) == (2, True)
        go.set()
        for process in [*receivers, late]:
            process.join(30)
            assert process.exitcode == 0
        sender.join(30)
        assert sender.exitcode == 0
    finally:
        for process in mp.active_children():
            process.kill()
