"""The model's hosts: links (uplink, latency, downlink), CPU (threads on a pool of cores), and the
calibration constants, all in one place with their source.

Per-byte floors (docs/fast-links.md, "Results"; docs/performance.md, "Fast links"): the bare libzmq
receive loop about 0.45 CPU-s/GiB, the source's send about 0.5 CPU-s/GiB, SHA-256 of relayed bytes
0.53-0.56 CPU-s/GiB, a member's copy of a landed message and its send 0.35 CPU-s/GiB.

Per-message figures (recalibrated for issue 35's validation, 2026-12-03). The first calibration took a
member's CPU, 0.462 CPU-s per 64 MiB, from a ``--profile`` run (cProfile on the receiving thread, load
8.9) and charged all of its excess over a direct receive to relaying (1.6 ms a message), where the
serving thread itself measured 0.090; unprofiled, the validation's lab runs measure 0.38 per member of
three, and the model cost 1.5-1.7x the lab's CPU per member at 7 and 11 receivers. Each figure now
is from a measurement named here, 64 MiB as 256 KiB frames (256 data messages), CPU seconds:

* serve onward (a member): the relay-serving thread's own CPU, 0.090 for the ~170 messages a member of
  three serves (docs/fast-links.md, "Per thread": per thread, not under cProfile), less their copy
  (0.35 CPU-s/GiB): 0.44 ms a message;
* receive: ``scripts/sim_validate.py`` row ``unshaped-equal-3`` (zmqtransport/sim/lab_points.json), each
  receiver's process 0.20-0.23 CPU-s, less the floors, the relaying above and its control messages:
  0.2 ms a message;
* the source: the same row, the source's process 0.188 CPU-s for 64.6 MiB sent, less the floors, its
  hashing and its control messages: 0.36 ms a message;
* a control message: 0.03 ms on each side. Not measured apart: a pyzmq ``recv_multipart`` and a
  msgpack decode of a small message are tens of microseconds, and 0.03 ms keeps ``unshaped-equal-3``'s
  receivers at what the lab measured (0.1 ms, the first guess, put them 25% over);
* the lab's tbf-shaped veths (``tbf=True``: the validation's shaped rows only; no real NIC): the same
  cases shaped cost each receiver 0.16 CPU-s and the source 0.037 more than unshaped (rows
  ``shaped-equal-3`` against ``unshaped-equal-3``): 0.6 CPU-s/GiB sent (the source sends 64.6 MiB) and
  2.2 CPU-s/GiB received (a member receives 64 MiB and sends ~43 MiB). Packets at 400 Mbit/s come one
  MTU at a time, where an unshaped veth moves 64 KiB segments.

So the model reproduces the 3-receiver lab's CPU by construction; what it predicts is how that CPU and
the times grow with the number of receivers, mixed links and a killed member (docs/sim.md, "Validation
against the lab").
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30
MIB = 1 << 20

# CPU seconds per byte.
RECV_PER_BYTE = 0.45 / GIB  # the copy out of libzmq's buffers into place (bare loop floor)
HASH_PER_BYTE = 0.55 / GIB  # SHA-256 of a message a peer sent
RELAY_PER_BYTE = 0.35 / GIB  # a member's copy of a landed message, and its send
SOURCE_PER_BYTE = 0.50 / GIB  # the source's send of a staged message
SOURCE_HASH_PER_BYTE = 0.55 / GIB  # the source hashes each message once per staging (digest requests)
# CPU seconds per message.
RECV_PER_MESSAGE = 0.2e-3  # a data message received: wake-up, envelope, planner, bookkeeping
RELAY_PER_MESSAGE = 0.44e-3  # a data message a member serves onward: the serving thread's wake-up, its send
SOURCE_PER_MESSAGE = 0.36e-3  # a data message the source sends
CONTROL_PER_MESSAGE = 0.03e-3  # a control message, on each side (sent or received)
# A pass of the receive planner (tick and wake_at) walks its lanes: two per peer (data, questions) and
# the source's. Measured in this simulator (time.perf_counter around the real planner's tick and
# wake_at, 64 MiB, 2026-12-04): 85 us a pass at 6 lanes (3 receivers), 113 at 14, 119 at 22, 158 at 32,
# 240 at 64 (32 receivers): about 2.7 us a lane. The per-message figures above were calibrated at three
# receivers (6 lanes), where passes are part of RECV_PER_MESSAGE, so only the lanes past those are
# charged: nothing at 3 receivers, 0.32 ms a pass at 64 (126 lanes).
PASS_PER_LANE = 2.7e-6
CALIBRATED_LANES = 6
# The kernel's CPU per byte through one of the lab's tbf-shaped veths (only with ``tbf``; see above).
TBF_RECV_PER_BYTE = 2.2 / GIB
TBF_SEND_PER_BYTE = 0.6 / GIB

# Bytes in flight from one host to another at most (sent, not yet received): the stand-in for the
# kernel's socket buffers, libzmq's pipe and the server's copy bound. A slow receiver's sender waits.
WINDOW_BYTES = 8 * MIB
# Bytes a host lets wait for its uplink before its serving thread picks the next data message.
UPLINK_QUEUE_BYTES = 2 * MIB
# Bytes a message carries beyond its frames: TCP/IP and ZMTP framing, about 3% at MTU 1500.
WIRE_OVERHEAD = 1.03
FRAME_OVERHEAD = 64


# Cores are booked in slots this long: a task fills the capacity left in each slot from its start on,
# one core's worth at most (a thread runs on one core at a time), so threads share cores as a fair
# scheduler would, gaps included, without preemption bookkeeping.
SLOT = 0.5e-3


@dataclass
class Cores:
    """A pool of ``count`` cores, as capacity (core-seconds) per slot of time."""

    count: int
    used: dict[int, float] = field(default_factory=dict)  # slot -> core-seconds booked
    _floor: int = 0  # slots before this one are past and forgotten

    def take(self, ready: float, cost: float) -> float:
        """A task ready at ``ready`` taking ``cost`` CPU seconds: when it ends."""
        if cost <= 0:
            return ready
        slot = int(ready / SLOT)
        self._forget(slot)
        at = ready
        while True:
            end_of_slot = (slot + 1) * SLOT
            room = min(self.count * SLOT - self.used.get(slot, 0.0), end_of_slot - at)
            if room > 1e-12:
                portion = min(room, cost)
                self.used[slot] = self.used.get(slot, 0.0) + portion
                cost -= portion
                if cost <= 1e-12:
                    return at + portion
            slot += 1
            at = slot * SLOT

    def _forget(self, slot: int) -> None:
        # Tasks are booked at the loop's now or later: slots well before it are never booked again.
        if slot - self._floor > 4096:
            self.used = {k: v for k, v in self.used.items() if k >= slot - 16}
            self._floor = slot - 16


@dataclass
class Thread:
    """One thread of a process: its tasks run in order, each on a core of ``cores`` when one is free."""

    cores: Cores
    free_at: float = 0.0
    busy: float = 0.0  # CPU seconds spent

    def run(self, now: float, cost: float) -> float:
        end = self.cores.take(max(now, self.free_at), cost)
        self.free_at = end
        self.busy += cost
        return end


@dataclass
class Link:
    """One direction of a host's link: a FIFO at ``bps`` bits a second.

    ``cpu_per_byte`` on ``cores``: what the kernel spends per byte crossing it (a tbf-shaped veth:
    :data:`TBF_RECV_PER_BYTE`, :data:`TBF_SEND_PER_BYTE`), booked on the host's cores as the bytes
    enter the link (softirq work runs on a core, not on the process's threads, so it delays no thread's
    queue but takes the cores' capacity) and counted as the host's CPU.
    """

    bps: float
    free_at: float = 0.0
    cpu_per_byte: float = 0.0
    cores: Cores | None = None
    kernel_busy: float = 0.0

    def carry(self, now: float, size: int) -> float:
        """A message of ``size`` bytes ready at ``now``: when its last bit is through."""
        start = max(now, self.free_at)
        self.free_at = start + size * WIRE_OVERHEAD * 8 / self.bps
        if self.cpu_per_byte and self.cores is not None:
            cost = size * self.cpu_per_byte
            self.cores.take(start, cost)
            self.kernel_busy += cost
        return self.free_at


@dataclass
class Host:
    """A process on a host: its links, its latency to the others (one way), its threads."""

    name: str
    up: Link
    down: Link
    latency: float
    cores: Cores
    receiving: Thread = field(init=False)
    serving: Thread = field(init=False)
    dead: bool = False

    def __post_init__(self) -> None:
        self.receiving = Thread(self.cores)
        self.serving = Thread(self.cores)

    @property
    def cpu(self) -> float:
        return self.receiving.busy + self.serving.busy + self.up.kernel_busy + self.down.kernel_busy


def pass_cost(lanes: int) -> float:
    """CPU seconds one planner pass costs a receive with ``lanes`` lanes, over the calibration's own."""
    return PASS_PER_LANE * max(0, lanes - CALIBRATED_LANES)
