"""Time the receive-side Python phases of one cold receive, without sockets.

The sender's header for ``--count`` float32 tensors of ``--tensor`` bytes is
packed once; each trial is a fresh process that decodes it as a receive does
(unpack, validate, plan, land, chunk plan, build), with the cyclic collector
paused as during a receive, and then times freeing it all and the collection
that follows when the collector is switched back on. Prints each phase in ms
per trial and the medians.

    PYTHONPATH=$PWD python scripts/receive_phases.py --count 20480 --tensor 4096 --trials 5

The data itself is not received: ``scripts/cold_profile.py`` times whole receives.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("unpack", "header", "validate", "plan", "land", "chunks", "runs", "build", "free", "gc")


def child(path: str) -> None:
    import gc

    from zmqtransport import buffers, wire
    from zmqtransport.fetch import landed as landed_mod
    from zmqtransport.fetch import landing

    with open(path, "rb") as file:
        body = file.read()
    buffers.settle_malloc_thresholds()
    gc.disable()  # as gcpause.paused_gc does for a receive
    marks = [time.perf_counter()]
    message = wire.unpack(body, wire.MAX_HEADER_BYTES)
    marks.append(time.perf_counter())
    header = wire.decode_header(message)
    marks.append(time.perf_counter())
    parsed = landing.parse_header(header, False)
    marks.append(time.perf_counter())
    plan = landing.plan_landing(parsed, None, landing.LandingOptions())
    marks.append(time.perf_counter())
    landed = landed_mod.land(plan, 2)
    marks.append(time.perf_counter())
    chunks = wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below)
    marks.append(time.perf_counter())
    runs = [landed.arena_run(pieces) for pieces in chunks]
    marks.append(time.perf_counter())
    result = landed_mod.build(parsed, landed)
    marks.append(time.perf_counter())
    landed.close()
    del message, header, parsed, plan, landed, chunks, runs
    marks.append(time.perf_counter())
    gc.enable()
    gc.collect(0)  # what the first allocation after a receive triggers
    marks.append(time.perf_counter())
    assert result is not None
    print(" ".join(f"{(b - a) * 1000:.1f}" for a, b in itertools.pairwise(marks)), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=20480)
    parser.add_argument("--tensor", type=int, default=4096, help="bytes per float32 tensor")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    import torch

    from zmqtransport import wire
    from zmqtransport.codec.skeleton import encode_tree

    state = {f"layer{i:06d}.weight": torch.full((args.tensor // 4,), float(i)) for i in range(args.count)}
    encoded = encode_tree(state)
    header = wire.Header(
        step=1,
        skeleton=encoded.skeleton,
        tensors=encoded.tensors,
        storages=[ref.nbytes for ref in encoded.storages],
        chunk_bytes=1 << 20,
        pack_below=1 << 20,
        checksum=None,
    )
    rows = []
    with tempfile.NamedTemporaryFile(suffix=".msgpack") as file:
        file.write(header.body())
        file.flush()
        print("ms:", " ".join(PHASES), "total")
        for _ in range(args.trials):
            command = [sys.executable, __file__, "--child", file.name]
            out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=300).stdout
            row = [float(x) for x in out.split()]
            rows.append(row)
            print("trial:", " ".join(f"{x:.1f}" for x in row), f"{sum(row):.1f}", flush=True)
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    total = statistics.median(sum(row) for row in rows)
    print("median:", " ".join(f"{name}={x:.1f}" for name, x in zip(PHASES, medians, strict=True)), f"total={total:.1f}")


if __name__ == "__main__":
    main()
