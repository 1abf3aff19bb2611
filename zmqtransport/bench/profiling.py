"""Where a benchmark process spends its CPU (issue 33): per thread, per phase of a receive, per function.

``python -m zmqtransport.bench --profile ...`` runs any scenario with every
trial's processes recording, beside the usual timings:

* **per thread** (the source and every receiver, from just before the receives
  start to the end of the trial): CPU seconds, user and system, of each thread,
  by name: a Python thread by its ``threading`` name (a trailing ``-<number>``,
  a port or a counter, dropped so trials compare), any other by its OS name
  (libzmq's I/O threads are ``ZMQbg/IO/<n>``, its reaper ``ZMQbg/Reaper``).
  Read from ``/proc/self/task/<tid>/stat``: clock ticks, 10 ms each here, so a
  thread's figure is good to about 0.01 s. Threads that ended before the end of
  the trial (prefault workers, a closed transport's) are no longer listed
  there: ``(ended threads)`` is the process's own CPU (``getrusage``, exact)
  less the threads still listed.
* **phases** of a ZMQTransport receive (wall seconds): ``header`` (from the
  call to the allocation: the request and the header), ``land`` (allocation,
  the prefault workers started), ``data`` (every data message: received,
  copied, verified where relayed, relayed onward), ``build`` (the state dict).
* **functions**: a cProfile of the receiving thread over its receive, timed
  by that thread's CPU clock (its own CPU, not the time it waited for the
  GIL or a socket; the I/O threads and the threads serving relays are not
  in it).

The profile costs CPU itself (cProfile slows Python-heavy code by tens of
per cent): time a scenario without ``--profile`` and read the profile for
proportions, not speed. ``--perf DIR`` adds ``perf record -g`` of the source
and of receiver 1 over each trial (``perf report -i DIR/<scenario>-<method>-
<trial>-r1.data``), where perf is installed.
"""

from __future__ import annotations

import contextlib
import cProfile
import os
import pstats
import re
import resource
import threading
import time
from typing import Any

# Functions kept per profiled receive (by their own time).
TOP_FUNCTIONS = 25
_TRAILING_NUMBER = re.compile(r"-\d+$")


def process_cpu_seconds() -> float:
    """User and system CPU of every thread of this process so far (libzmq's I/O threads included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_label(name: str) -> str:
    """A thread's name without a trailing number (a port, a counter), so the same thread matches across trials."""
    return _TRAILING_NUMBER.sub("", name)


def thread_cpu() -> dict[int, tuple[str, float]]:
    """``{tid: (label, CPU seconds so far)}`` for every thread of this process (see the module docstring)."""
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    found: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/self/task/{tid}/stat") as stat:
                text = stat.read()
            # The name (2nd field) may hold spaces and parentheses: the fields after it follow the last ")".
            os_name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text[text.rindex(")") + 2 :].split()
            seconds = (int(fields[11]) + int(fields[12])) / ticks  # utime and stime (fields 14 and 15)
            found[tid] = (thread_label(python_names.get(tid, os_name)), seconds)
    return found


class ThreadClock:
    """CPU seconds per thread label and in all over a region: :meth:`start`, then :meth:`stop`."""

    def __init__(self) -> None:
        self.threads = thread_cpu()
        self.total = process_cpu_seconds()

    def stop(self) -> dict[str, Any]:
        now, total = thread_cpu(), process_cpu_seconds() - self.total
        per_label: dict[str, float] = {}
        for tid, (label, seconds) in now.items():
            before = self.threads.get(tid, (label, 0.0))[1]
            per_label[label] = per_label.get(label, 0.0) + max(0.0, seconds - before)
        listed = sum(per_label.values())
        per_label["(ended threads)"] = max(0.0, total - listed)
        return {"total_s": total, "threads": dict(sorted(per_label.items(), key=lambda item: -item[1]))}


class Phases:
    """A ZMQTransport receive's phase boundaries (wall clock), recorded by wrapping its land and build steps.

    Installed once per fresh receiver process that profiles (the wrap is its alone).
    """

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        from ..fetch import receive  # the receiving wing, wrapped only in a profiling process

        # The receive module's own names: fetch() calls land and build through them.
        names = vars(receive)
        land, build = names["land"], names["build"]
        marks = self.marks

        def timed_land(*args: Any, **kwargs: Any) -> Any:
            marks["land0"] = time.perf_counter()
            try:
                return land(*args, **kwargs)
            finally:
                marks["land1"] = time.perf_counter()

        def timed_build(*args: Any, **kwargs: Any) -> Any:
            marks["build0"] = time.perf_counter()
            return build(*args, **kwargs)

        names["land"], names["build"] = timed_land, timed_build

    def start(self) -> None:
        self.marks.clear()
        self.marks["start"] = time.perf_counter()

    def seconds(self, ended: float) -> dict[str, float]:
        """Wall seconds per phase of the last receive ({} when it never allocated: not a ZMQTransport)."""
        marks = self.marks
        if "land1" not in marks or "build0" not in marks:
            return {}
        return {
            "header": marks["land0"] - marks["start"],
            "land": marks["land1"] - marks["land0"],
            "data": marks["build0"] - marks["land1"],
            "build": ended - marks["build0"],
        }


def thread_profiler() -> cProfile.Profile:
    """A cProfile timed by the calling thread's own CPU clock.

    cProfile's default clock is the wall: a function then owns the time the
    thread waited in it for the GIL while other threads ran (in a member of
    three, ``msgpack.packb`` read 0.7 ms a call against the 5 us it costs;
    docs/fast-links.md, "What a member must spend beyond a direct receive").
    Each reading of this clock costs about 0.23 us here (twice the wall
    clock's), one pair a call, so read the profile for proportions.
    """
    return cProfile.Profile(time.thread_time)


def top_functions(profiler: cProfile.Profile, count: int = TOP_FUNCTIONS) -> list[tuple[str, int, float, float]]:
    """``(function, calls, own seconds, cumulative seconds)`` of the ``count`` functions with the most own time."""
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, function), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = _short_path(filename)
        label = f"{where}:{line}({function})" if line else function
        rows.append((label, int(calls), float(own), float(cumulative)))
    rows.sort(key=lambda row: -row[2])
    return rows[:count]


def _short_path(filename: str) -> str:
    """A source path from its package on (``zmqtransport/fetch/inbox.py``), a builtin's ``~`` as it is."""
    for marker in ("/zmqtransport/", "/site-packages/", "/lib/python"):
        at = filename.rfind(marker)
        if at >= 0:
            return filename[at + 1 :]
    return filename
