"""The model's hosts: links (uplink, latency, downlink), CPU (threads on a pool of cores), and the
calibration constants, all in one place with their source.

Calibration (docs/fast-links.md, "Results" and "Per thread"; docs/performance.md,
"Fast links"): lab-1to3 at 400 Mbit/s, 64 MiB as 256 KiB frames (256 data
messages), CPU seconds per 64 MiB: a direct receive 0.169, a swarm member 0.462
(receiving thread 0.290, relay-serving thread 0.090, libzmq I/O 0.050); the
source in the swarm: serving thread 0.180 for 66 MiB uploaded. Unshaped links:
the bare libzmq receive loop about 0.5 CPU-s/GiB, the source about 0.5
CPU-s/GiB; SHA-256 of relayed bytes adds 0.53-0.56 CPU-s/GiB
(docs/performance.md). The per-byte figures are those floors; the per-message
figures are what is left of the lab's totals once they are taken out:

* receive: 0.169 - 64/1024*0.45 = 0.141 s over 256 messages -> 0.55 ms a message;
* serve onward (a member): (0.462 - 0.169 - hashing 0.023) / ~170 messages served
  (a member of three serves about 2/3 of 64 MiB) -> 1.6 ms a message less its
  copy (0.35 CPU-s/GiB: ``bytes(view)`` and the send);
* the source: (0.180 - 66/1024*0.5) / 264 messages -> 0.56 ms a message.

So the model reproduces the 3-receiver lab's CPU by construction; what it
predicts is how that CPU grows with the number of receivers.
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
RECV_PER_MESSAGE = 0.55e-3  # a data message received: wake-up, envelope, planner, bookkeeping
RELAY_PER_MESSAGE = 1.6e-3  # a data message a member serves onward: the serving thread's wake-up, GIL hand-off
SOURCE_PER_MESSAGE = 0.56e-3  # a data message the source sends
CONTROL_PER_MESSAGE = 0.1e-3  # a control message, on each side (sent or received)

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
    """One direction of a host's link: a FIFO at ``bps`` bits a second."""

    bps: float
    free_at: float = 0.0

    def carry(self, now: float, size: int) -> float:
        """A message of ``size`` bytes ready at ``now``: when its last bit is through."""
        start = max(now, self.free_at)
        self.free_at = start + size * WIRE_OVERHEAD * 8 / self.bps
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
        return self.receiving.busy + self.serving.busy
