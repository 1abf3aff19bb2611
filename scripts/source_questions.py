"""What a swarm's questions cost the source: its process's CPU per ``have`` question from its members.

Every swarm member asks the source who the other members are about twenty
times a second (``have`` with its own token; docs/protocol.md, "Swarm"), so
at a job start of N replica groups the source answers about 20 x (N - 1)
questions a second beside its data. This tool stages a state on a real
``ZMQTransport`` (loopback), makes ``--members`` swarm members of it from
one client process (each a DEALER from its own 127.0.x.y address, offering
to relay there, as a member on its own host would), and times what the
source's process spends (user + system, every thread) on ``--rounds`` rounds
of one question from each member, asked the way members ask
(``names=NAMES_SHORT``), in one of three arrival patterns:

* ``burst``: every member asks at once, the answers read after (a busy
  source: one wake-up of its serving thread reads many questions);
* ``one``: one question at a time, the next sent when the answer is in;
* ``gap``: one at a time with ``--gap`` seconds between (an idle source:
  every question wakes its serving thread).

The model charges each control message a fixed CPU cost on each side
(``zmqtransport/sim/model.py``, ``CONTROL_PER_MESSAGE``); this shows what a
question costs the real source by pattern and by N.

    PYTHONPATH=$PWD python scripts/source_questions.py --members 16 --members 255 --pattern burst --pattern one

The source makes loopback receivers members only for this measurement
(``zmqtransport.relayed.RELAY_LOOPBACK``, as the tests do) and keeps its
swarm whatever its uplink measures (as the benchmark's ``zmq-fresh-swarm``).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import time
from datetime import timedelta
from queue import Empty
from typing import Any

import torch
import zmq

TIMEOUT = timedelta(seconds=120)
STEP = 1
CHUNK_BYTES = 256 << 10


def member_address(k: int) -> str:
    """Member ``k``'s own loopback address: 127.0.1.1 on, fifty a block (the source caps connections per host)."""
    return f"127.0.{1 + k // 50}.{1 + k % 50}"


def ask(endpoint: str, members: int, rounds: int, pattern: str, gap: float, start: Any, queue: Any) -> None:
    """The members' side, in one process: join as members, then ask ``rounds`` rounds of questions.

    ``start`` carries the parent's word to start, ``queue`` this side's reports: one queue for both ways let
    the parent read back its own "go" (the child then waited for ever; CI, 2026-12-06)."""
    from zmqtransport import wire

    context = zmq.Context()
    sockets = []
    try:
        for k in range(members):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, int(TIMEOUT.total_seconds() * 1000))  # a lost answer fails, not hangs
            sock.connect(endpoint.replace("tcp://", f"tcp://{member_address(k)}:0;"))
            sockets.append(sock)
        tokens: list[bytes] = []
        stage = 0
        for k, sock in enumerate(sockets):
            offer = f"tcp://{member_address(k)}:{20000 + k}"
            sock.send(wire.fetch_request(k + 1, STEP, 60_000, 16, False, header_only=True, relay=offer,
                                         verify=["sha256"]))
            reply = wire.decode_reply(sock.recv(), True, "the source")
            sock.recv()  # the header body
            sock.recv()  # its end
            if reply.relay is None or reply.stage is None:
                raise SystemExit(f"member {k} was not made a member: {reply}")
            tokens.append(reply.relay.token)
            stage = reply.stage
        queue.put("ready")
        start.get(timeout=TIMEOUT.total_seconds())
        xfer, started = 1_000_000, time.perf_counter()
        for _ in range(rounds):
            if pattern == "burst":
                for k, sock in enumerate(sockets):
                    xfer += 1
                    sock.send(wire.have_request(xfer, stage, tokens[k], 0, wire.NAMES_SHORT))
                for sock in sockets:
                    sock.recv()
                continue
            for k, sock in enumerate(sockets):
                xfer += 1
                sock.send(wire.have_request(xfer, stage, tokens[k], 0, wire.NAMES_SHORT))
                sock.recv()
                if pattern == "gap":
                    time.sleep(gap)
        queue.put(time.perf_counter() - started)
    finally:
        for sock in sockets:
            sock.close()
        context.term()


def report(queue: Any, child: Any) -> Any:
    """The child's next report; SystemExit as soon as it has died without one, or after :data:`TIMEOUT`."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while time.monotonic() < deadline:
        try:
            return queue.get(timeout=0.5)
        except Empty:
            if not child.is_alive():
                raise SystemExit(f"the members' process ended (exit code {child.exitcode}) without a report") from None
    raise SystemExit(f"no report from the members' process in {TIMEOUT.total_seconds():.0f} s")


def measure(members: int, rounds: int, pattern: str, gap: float) -> tuple[float, float]:
    """(source CPU seconds per question, questions a second) for one case."""
    from zmqtransport import ZMQTransport, relayed

    relayed.RELAY_LOOPBACK = True  # loopback receivers become members (only for this measurement)
    transport: ZMQTransport[Any] = ZMQTransport(TIMEOUT, bind_host="127.0.0.1", chunk_bytes=CHUNK_BYTES)
    try:
        transport._server._scheduler.uplink.per_receiver = math.inf  # a swarm whatever the uplink measures
        state = {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(16)}  # 64 MiB
        transport.send_checkpoint(list(range(1, members + 1)), STEP, state, TIMEOUT)
        spawn = mp.get_context("spawn")
        start: Any = spawn.Queue()
        queue: Any = spawn.Queue()
        child = spawn.Process(
            target=ask, args=(transport.metadata(), members, rounds, pattern, gap, start, queue), daemon=True
        )
        child.start()
        try:
            if report(queue, child) != "ready":
                raise SystemExit("the members did not join")
            cpu = time.process_time()
            start.put("go")
            wall = report(queue, child)
            cpu = time.process_time() - cpu
            child.join(TIMEOUT.total_seconds())
        finally:
            if child.is_alive():
                child.kill()
                child.join()
        questions = members * rounds
        return cpu / questions, questions / wall
    finally:
        transport.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, action="append", help="swarm members (repeatable; default 16 and 255)")
    parser.add_argument("--rounds", type=int, default=20, help="questions from each member (default 20)")
    parser.add_argument("--pattern", choices=("burst", "one", "gap"), action="append",
                        help="how questions arrive (repeatable; default burst and one)")
    parser.add_argument("--gap", type=float, default=0.0002, help="seconds between questions with --pattern gap")
    parser.add_argument("--trials", type=int, default=3, help="trials per case; the median is printed")
    args = parser.parse_args()
    print("members  pattern  source CPU us/question (median, all trials)  questions/s (median)")
    for members in args.members or [16, 255]:
        for pattern in args.pattern or ["burst", "one"]:
            runs = sorted(measure(members, args.rounds, pattern, args.gap) for _ in range(args.trials))
            cpu = sorted(r[0] for r in runs)
            rate = sorted(r[1] for r in runs)
            trials = " ".join(f"{c * 1e6:.0f}" for c in cpu)
            median_cpu, median_rate = cpu[len(cpu) // 2] * 1e6, rate[len(rate) // 2]
            print(f"{members:7d}  {pattern:7s}  {median_cpu:8.1f} ({trials})  {median_rate:10.0f}")


if __name__ == "__main__":
    main()
