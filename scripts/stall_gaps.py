"""Measure how long healthy receivers wait for the source's next data message (issue 15).

The stall bound (``ZMQTransport(stall_timeout=...)``) fails a transfer when one
such wait lasts longer than it; its default must sit well above what healthy
transfers under load ever show. One sender process serves a checkpoint to
several receiver processes at once (fresh receives: every page is faulted in
during the transfer), round after round; each receiver records every wait for
a data message (or the end marker) and the gaps between arrivals.

    PYTHONPATH=$PWD python scripts/stall_gaps.py --receivers 3 --gib 1 --rounds 5
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import time
from datetime import timedelta
from typing import Any

TIMEOUT = timedelta(seconds=300)


def _sender(gib: float, rounds: int, receivers: int, barrier: Any, meta: Any, done: Any) -> None:
    import torch

    from zmqtransport import ZMQTransport

    tensor_count = max(1, int(gib * 256))
    state = {f"t{i}": torch.randn(2**20) for i in range(tensor_count)}  # 4 MiB each
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1")
    meta.put(transport.metadata())
    for step in range(1, rounds + 1):
        transport.send_checkpoint(list(range(receivers)), step, state, TIMEOUT)
        barrier.wait(timeout=600)  # the receivers start together, once the step is staged
        for _ in range(receivers):
            done.get(timeout=600)
        transport.disallow_checkpoint()
    transport.shutdown()


def _receiver(metadata: str, rounds: int, barrier: Any, done: Any, results: Any) -> None:
    from zmqtransport import ZMQTransport
    from zmqtransport.fetch import streams

    waits: list[float] = []
    arrivals: list[float] = []
    original = streams.SourceWatch.wait

    def timed(self: Any, deadline: float, in_transfer: bool) -> Any:
        started = time.monotonic()
        outcome = original(self, deadline, in_transfer)
        if in_transfer:
            waits.append(time.monotonic() - started)
        return outcome

    streams.SourceWatch.wait = timed  # type: ignore[method-assign]

    def progress(done_bytes: int, total: int) -> None:
        arrivals.append(time.monotonic())

    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1", progress=progress, stall_timeout=None)
    for step in range(1, rounds + 1):
        waits.clear()
        arrivals.clear()
        barrier.wait(timeout=600)
        started = time.monotonic()
        transport.recv_checkpoint(0, metadata, step, TIMEOUT)
        seconds = time.monotonic() - started
        gaps = [b - a for a, b in itertools.pairwise(arrivals)]
        results.put((step, seconds, max(waits, default=0.0), max(gaps, default=0.0), len(waits), sorted(waits)[-5:]))
        done.put(step)
        del gaps
    transport.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receivers", type=int, default=3)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    meta, done, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    barrier = ctx.Barrier(args.receivers + 1)
    sender = ctx.Process(target=_sender, args=(args.gib, args.rounds, args.receivers, barrier, meta, done))
    sender.start()
    metadata = meta.get(timeout=300)
    procs = [
        ctx.Process(target=_receiver, args=(metadata, args.rounds, barrier, done, results))
        for _ in range(args.receivers)
    ]
    for proc in procs:
        proc.start()
    rows = [results.get(timeout=300) for _ in range(args.receivers * args.rounds)]
    for proc in procs:
        proc.join(60)
    sender.join(60)
    print(f"{args.receivers} receivers x {args.rounds} rounds, {args.gib} GiB fresh each, {mp.cpu_count()} cores")
    print("step  seconds  longest wait  longest gap  waits  five longest waits")
    for step, seconds, wait, gap, count, top in sorted(rows):
        print(f"{step:4d}  {seconds:7.2f}  {wait:12.3f}  {gap:11.3f}  {count:5d}  {[round(w, 3) for w in top]}")
    print(f"largest wait for a data message: {max(r[2] for r in rows):.3f} s")
    print(f"largest gap between data messages: {max(r[3] for r in rows):.3f} s")
    print(f"median transfer: {statistics.median(r[1] for r in rows):.2f} s")


if __name__ == "__main__":
    main()
