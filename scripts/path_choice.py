"""Measure what choosing among several advertised paths costs a receive (issue 12, item 4).

One source on loopback (127.0.0.1, plus 127.0.0.2 where a case needs a second
live address) serves a small state; a receiver fetches it again and again
with different metadata strings:

* ``one path``: the plain ``tcp://127.0.0.1:P`` (no choice at all, the baseline);
* ``two live paths``: both addresses listen, the first is kept;
* ``first refused``: the first path is 127.0.0.3, where nothing listens;
* ``first silent``: the first path is TEST-NET-1 (192.0.2.1) when this host
  routes it nowhere fast, else whatever that address does here (printed).

Each receive opens fresh DEALERs, so every round pays the connection set-up,
as a heal does. Median and max seconds per receive are printed.

    PYTHONPATH=$PWD python scripts/path_choice.py --rounds 20
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch

from zmqtransport import ZMQTransport
from zmqtransport.net import Path, PeerAddress

TIMEOUT = timedelta(seconds=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    state = {"w": torch.arange(1 << 16, dtype=torch.int64)}
    with (
        ZMQTransport(TIMEOUT, bind_host=["127.0.0.1", "127.0.0.2"]) as source,
        ZMQTransport(TIMEOUT, bind_host="127.0.0.1") as sink,
    ):
        port = source.address.port
        source.send_checkpoint([1], 1, state, TIMEOUT)
        cases = {
            "one path": PeerAddress("127.0.0.1", port),
            "two live paths": PeerAddress("127.0.0.1", port, {}, (Path("127.0.0.2", port),)),
            "first refused": PeerAddress("127.0.0.3", port, {}, (Path("127.0.0.1", port),)),
            "first silent": PeerAddress("192.0.2.1", port, {}, (Path("127.0.0.1", port),)),
        }
        for name, address in cases.items():
            seconds = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                got = sink.recv_checkpoint(0, address.to_metadata(), 1, TIMEOUT)
                seconds.append(time.perf_counter() - started)
                assert got["w"].equal(state["w"])
            stats = sink.last_recv_stats
            used = stats.peer if stats is not None else "?"
            print(
                f"{name:15s} median {statistics.median(seconds) * 1000:8.1f} ms  "
                f"max {max(seconds) * 1000:8.1f} ms  (used {used}, {args.rounds} rounds)"
            )


if __name__ == "__main__":
    main()
