"""The model's hosts: links (uplink, latency, downlink), CPU (threads on a pool of cores), and the
calibration constants, all in one place with their source.

**Calibration (2026-12-06, this machine: 2 Intel Xeon vCPUs, quiet).** Four lab runs of the validation's
state (64 MiB as 256 data messages of 256 KiB, three receivers, cold processes; ``python -m
zmqtransport.bench --scenario fast-1to3 --total 64M --methods zmq-fresh-swarm,zmq-norelay --reps 5
--profile --no-cprofile``, and ``scripts/sim_validate.py lab``'s ``shaped-equal-3``), CPU seconds per
process from just before the receives to the trial's end, medians of 5 (3 shaped):

======================  =================  =============  ======================
run                     each receiver      the source     per thread (receiver)
======================  =================  =============  ======================
unshaped, direct        0.055              0.081          main 0.02-0.03, prefault 0.02, I/O 0.01
unshaped, a swarm       0.171-0.176        0.146          main 0.09-0.10, serve 0.02-0.03, I/O 0.02
shaped, a swarm         0.218-0.222        0.165
======================  =================  =============  ======================

(``zmq-fresh-swarm``: the source keeps the swarm whatever it measures, a benchmark-only method; over
unshaped links it would step aside. Shaped: the validation's first run of three trials; its second run of
five measured 0.23-0.26 and 0.19.) The figures below give 0.056 / 0.082 CPU-s for the direct receive and
its source, 0.167 / 0.148 for the unshaped swarm and 0.231 / 0.164 shaped (within 5%; 0.226 / 0.179
with the shaped queue of 4 MiB it was fitted with, below), and the unshaped times 0.332 s and 0.125 s
against 0.348 and 0.127 (shaped 1.46 s against 1.51; 1.58 with the 4 MiB queue), with the counts the
model gives for the same runs: a member of three receives about 590 control messages or sends them
(about 155 of them between members) and serves 170 messages onward; the source of the swarm handles 853
control messages, of the direct receives 108.

* per byte: the copy out of libzmq (``RECV_PER_BYTE``, the bare loop's floor) and a member's copy and
  send of what it serves (``RELAY_PER_BYTE``) as measured earlier (docs/fast-links.md); SHA-256 0.76
  CPU-s/GiB (``hashlib`` on 256 KiB buffers here; 0.55 on the AMD host of the first calibration); the
  source's send 0.30 CPU-s/GiB;
* a pass of the owner's loop (fetch/owner.py drains what is ready, then the planner ticks once): the
  planner's ``tick`` and ``wake_at``, 40 us and 2.7 us a lane (measured, below), and 15 us for the rest
  of the loop's turn (fitted with the data message's figure to the direct receive), on the receiving
  thread;
* a control message: 0.09 ms on each side (the rest of a member's swarm work, its receiving thread
  three to four times a direct receive's); a request that reaches a serving thread still busy with
  earlier work 0.01 ms (``QUEUED_REQUEST``: read in a turn of its loop already paid for; measured on a
  real source with ``scripts/source_questions.py``, 2026-12-06, docs/sim.md, "Questions to a busy
  source");
* a data message: received 0.08 ms beyond its pass and bytes; served onward 0.025 ms (the serving
  thread's 0.02-0.03 CPU-s, less its copies and its control messages); sent by the source 0.021 ms
  (its direct sends: 0.081 CPU-s, less its control messages, at 0.30 CPU-s/GiB);
* the lab's tbf-shaped veths (``tbf=True``: the validation's shaped rows only; no real NIC): a member
  of the shaped swarm spends 0.046 CPU-s more than unshaped, the source 0.019: 0.30 CPU-s/GiB sent (the
  source sends 64 MiB) and 0.53 CPU-s/GiB received (a member receives 64 MiB, sends ~43 MiB).

The first calibration (2026-12-03, on an AMD host shared with three other sessions, load 7-18)
charged 0.2 ms a data message received, 0.44 ms served onward, 0.36 ms sent by the source, 0.03 ms a
control message and 2.2 / 0.6 CPU-s/GiB through tbf; the code has since halved a member's CPU (issue
33's relaying and planner work) and the direct path's, and the machine changed. So the model
reproduces the 3-receiver lab's CPU by construction; what it predicts is how that CPU and the times
grow with the number of receivers, mixed links and a killed member (docs/sim.md, "Validation against
the lab").
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30
MIB = 1 << 20

# CPU seconds per byte.
RECV_PER_BYTE = 0.45 / GIB  # the copy out of libzmq's buffers into place (bare loop floor)
HASH_PER_BYTE = 0.76 / GIB  # SHA-256 of a message a peer sent
RELAY_PER_BYTE = 0.35 / GIB  # a member's copy of a landed message, and its send
SOURCE_PER_BYTE = 0.30 / GIB  # the source's send of a staged message
SOURCE_HASH_PER_BYTE = 0.76 / GIB  # the source hashes each message once per staging (digest requests)
# CPU seconds per message.
RECV_PER_MESSAGE = 0.08e-3  # a data message received: wake-up, envelope, bookkeeping (its pass: pass_cost)
RELAY_PER_MESSAGE = 0.025e-3  # a data message a member serves onward: the serving thread's wake-up, its send
SOURCE_PER_MESSAGE = 0.021e-3  # a data message the source sends
CONTROL_PER_MESSAGE = 0.09e-3  # a control message, on each side (sent or received)
# A request that reaches a serving thread still busy with earlier work: read in the same turn of its loop
# (no poll, no wake-up, no housekeeping of its own), so it costs its decoding and the scheduler's decision
# alone. Measured on a real source (scripts/source_questions.py, 2026-12-06): a member's question and its
# answer cost the source's process 0.12-0.2 ms where each question woke its serving thread (``--pattern
# gap``; the model: two control messages, 0.18 ms) and 0.04-0.07 ms where questions queued (``burst``,
# 16-255 members). The model keeps the answer's 0.09 ms, so a queued question and its answer cost 0.10
# ms here: twice what the source measured, on the side of caution.
QUEUED_REQUEST = 0.01e-3
# A pass of the receive planner (tick and wake_at) walks its lanes: two per peer (data, questions) and
# the source's. Measured in this simulator (time.perf_counter around the real planner's tick and wake_at,
# 64 MiB, shaped; 2026-12-06, this machine): 56 us a pass at 6 lanes (3 receivers), 92 at 22 (11), 214 at
# 64 (32): 40 us and 2.7 us a lane (the AMD host of 2026-12-04: 85 us at 6 lanes, 240 at 64). A pass of
# the owner's loop costs 15 us more (its poll and bookkeeping; fitted). Every pass is charged (until
# 2026-12-06 only the lanes past six were, the rest counted in a data message's cost).
PASS_PER_LANE = 2.7e-6
PASS_BASE = 55e-6
# The kernel's CPU per byte through one of the lab's tbf-shaped veths (only with ``tbf``; see above).
TBF_RECV_PER_BYTE = 0.53 / GIB
TBF_SEND_PER_BYTE = 0.30 / GIB
# A tbf link's bucket (lab.Shaping's burst), and the speed a veth moves what the bucket covers.
TBF_BURST_BYTES = 256 << 10
# Data messages in flight to a host whose downlink is shaped, from all senders together: what its tbf queue
# holds as TCP keeps it. Not tbf's limit (4 MiB), which the lab's flows never come near: its queues, read
# every 30 ms through a run (scripts/tbf_backlog.py, 2026-12-06), held a median of 0.14-0.78 MiB while not
# empty, at the 90th percentile 0.34-1.5 MiB and at most 0.56-2.3 MiB (lab-mixed's quarter-rate host;
# lab-1to7's seven and eleven; in 256 KiB and in 1 MiB frames alike: TCP knows no messages). The model
# queues whole messages where TCP interleaves the flows' packets, so its bound is in messages: three fit
# the lab in both frame sizes, every shaped validation case within 10% in 256 KiB frames (768 KiB; 4 MiB
# left the quarter-rate receiver of three at +26%, its planner timing its streams through a queue 0.34 s
# long and asking again what only waited there), and seven and eleven receivers and a quarter-rate one
# within 9% in 1 MiB frames (768 KiB there: 30-44% too slow, a message at a time); docs/sim.md, "The
# model's shaped queue, measured".
TBF_QUEUE_MESSAGES = 3
VETH_BPS = 10e9

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

    ``burst``: a tbf link's bucket (the lab's :class:`~zmqtransport.lab.Shaping`, 256 KiB). Tokens
    accrue at ``bps`` while the link is idle, up to the bucket, and bytes covered by tokens pass at the
    veth's own speed (:data:`VETH_BPS`): an idle gap of up to a bucket's time costs a shaped link no
    throughput. Without it (0: a NIC's line rate, which no burst exceeds) the link is a plain FIFO.
    Measured: the lab's three receivers of 64 MiB at 400 Mbit/s took 1.14x the ideal, the model
    without the bucket 1.34x (members' downlinks idle in gaps of a few milliseconds, 15% of the time),
    with it 1.18x (docs/sim.md, "Validation against the lab").
    """

    bps: float
    free_at: float = 0.0
    cpu_per_byte: float = 0.0
    cores: Cores | None = None
    kernel_busy: float = 0.0
    burst: float = 0.0
    _tokens: float = field(default=0.0, init=False)
    _tokens_at: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._tokens = self.burst

    def carry(self, now: float, size: int) -> float:
        """A message of ``size`` bytes ready at ``now``: when its last bit is through."""
        start = max(now, self.free_at)
        wire_bytes = size * WIRE_OVERHEAD
        rate = self.bps / 8
        if self.burst:
            tokens = min(self.burst, self._tokens + (start - self._tokens_at) * rate)
            covered = min(tokens, wire_bytes)
            self.free_at = start + covered * 8 / VETH_BPS + (wire_bytes - covered) / rate
            self._tokens, self._tokens_at = tokens - covered, self.free_at
        else:
            self.free_at = start + wire_bytes / rate
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
    """CPU seconds one planner pass costs a receive with ``lanes`` lanes."""
    return PASS_BASE + PASS_PER_LANE * lanes
