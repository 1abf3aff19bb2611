"""What fresh memory costs on this machine: first touch by size, threads and page size.

Each trial maps ``--size`` bytes of anonymous memory in a fresh process and
faults it in with ``MADV_POPULATE_WRITE`` from ``--threads`` threads (pieces
handed out in order, as :class:`zmqtransport.buffers.Prefaulter` does), with
4 KiB pages or, with ``--huge``, transparent huge pages (``MADV_HUGEPAGE``).
Prints wall seconds, seconds per GiB, the process's system CPU and minor
faults, and the machine's steal time over the trial, then the medians.

    python scripts/first_touch.py --size 1G --size 4G --threads 1 --threads 2 --trials 3
    python scripts/first_touch.py --size 4G --threads 2 --huge --trials 3

On a virtual machine whose guest reports free memory to its host (virtio
free page reporting), pages the guest freed recently are still backed by the
host and cheap to touch again; pages reported back must be backed anew, at a
much higher cost. ``--settle`` (seconds idle before each trial) lets the
reporting catch up, so each trial meets the memory a cold receiver meets.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import mmap
import resource
import statistics
import subprocess
import sys
import threading
import time

MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PIECE = 4 << 20


def _steal_ticks() -> int:
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    return int(fields[8])  # cpu user nice system idle iowait irq softirq steal


def child(size: int, threads: int, huge: bool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    if huge:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    pieces = [(base + at, min(PIECE, size - at)) for at in range(0, size, PIECE)]
    counter = itertools.count()

    def work() -> None:
        for index in counter:
            if index >= len(pieces):
                return
            pointer, length = pieces[index]
            if libc.madvise(pointer, length, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

    before = resource.getrusage(resource.RUSAGE_SELF)
    steal = _steal_ticks()
    started = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    stolen = (_steal_ticks() - steal) / 100
    system = after.ru_stime - before.ru_stime
    faults = after.ru_minflt - before.ru_minflt
    print(f"{seconds:.3f} {system:.3f} {faults} {stolen:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", action="append", default=[], help="bytes, e.g. 1G (repeatable)")
    parser.add_argument("--threads", action="append", type=int, default=[], help="repeatable")
    parser.add_argument("--huge", action="store_true")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), int(args.child[1]), args.child[2] == "1")
        return
    from zmqtransport.bench.config import parse_size

    sizes = [parse_size(s) for s in args.size or ["1G"]]
    print("size  threads  pages  wall s  s/GiB  sys s  faults  steal s")
    for size, threads in itertools.product(sizes, args.threads or [2]):
        rows = []
        for _ in range(args.trials):
            time.sleep(args.settle)
            command = [sys.executable, __file__, "--child", str(size), str(threads), "1" if args.huge else "0"]
            out = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout
            wall, system, faults, steal = out.split()
            rows.append((float(wall), float(system), int(faults), float(steal)))
            gib = size / (1 << 30)
            page = "2M" if args.huge else "4K"
            print(
                f"{gib:g}G  {threads}  {page}  {float(wall):.3f}  {float(wall) / gib:.3f}  {system}  {faults}  {steal}",
                flush=True,
            )
        median = statistics.median(row[0] for row in rows)
        print(f"median {size / (1 << 30):g}G x{threads}: {median:.3f} s, {median / (size / (1 << 30)):.3f} s/GiB")


if __name__ == "__main__":
    main()
