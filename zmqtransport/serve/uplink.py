"""Whether a swarm pays: the source's measure of what its uplink gives each receiver (issue 33).

A swarm (docs/protocol.md, "Swarm") spares the source's uplink: it uploads
the state about once however many receivers there are, and they exchange the
rest. That pays where the uplink is the bottleneck. Where the source can feed
every receiver faster than a receiver can relay, it costs: a member spends
about 2.5 times the CPU of a direct receive per byte (it verifies what peers
send, serves what it has landed, and runs the striped loop), so where the CPU
is the limit, relaying makes every receiver slower (docs/fast-links.md: three
receivers over unshaped links, the swarm's slowest was 2.0-2.3x slower than
``relay=False``).

So the source measures, while it sends its own staged steps, the rate it
delivers to each receiver: data bytes handed to libzmq over receiver-seconds
(the time integral of how many receivers it had data to send to: a transfer
runs from its request to its last message, waits for credit included, so a
swarm member between two span fetches, busy with its peers, does not count;
gaps longer than :data:`IDLE_GAP` are not counted either), from the step's
first :data:`WARMUP` bytes on (receivers grant credit ahead, and libzmq and the
kernel take a burst far faster than a link carries it). A receiver's share
of an uplink that is the bottleneck falls as receivers are added; a source
that is not link-bound delivers at what the receivers take. Where the rate
per receiver reaches :data:`SWARM_BELOW`, a newcomer is served directly;
below it, it joins the swarm. The judgement comes from the step being sent
once it has :data:`MIN_BYTES` over :data:`MIN_SECONDS` past the warm-up, otherwise from the last
step that had, otherwise (nothing measured yet) the swarm engages, as where
the uplink is slow it matters most.

Pure: the caller (the scheduler, in the serving thread) passes the time.
"""

from __future__ import annotations

# Bytes per second per receiver from which the source feeds receivers directly:
# 500 Mbit/s. Below it a member relays at the rate it receives at a small share
# of one core (a relaying receiver here costs about 2-2.5 CPU-s/GiB: 62.5 MB/s
# is a seventh of a core). The lab's shaped links (400 Mbit/s, shared by every
# receiver of the source) are below it; its unshaped veth links far above
# (direct: 0.3-1.5 GB/s per receiver). Not higher: measured in a swarm, where
# the members spend their CPU relaying, the source delivered only 190 MB/s per
# receiver of three over unshaped links (each took what its CPU left), and a
# bound near that would keep a CPU-bound swarm from stepping aside.
SWARM_BELOW = 62_500_000
# A silence longer than this (seconds) is idle time, not time a receiver waited for the uplink.
IDLE_GAP = 0.25
# Bytes of each step sent before its measure starts: a few receivers' credit windows.
WARMUP = 32 << 20
# What a measure needs before it is believed: bytes, and seconds of sending.
MIN_BYTES = 16 << 20
MIN_SECONDS = 0.02


class Uplink:
    """The source's delivered rate per receiver: this step's, and the judgement of the last measured one."""

    def __init__(self, swarm_below: float | None = None) -> None:
        self.swarm_below = SWARM_BELOW if swarm_below is None else swarm_below
        self.warm = 0  # bytes of this step sent before its measure started
        self.bytes = 0
        self.seconds = 0.0  # of sending
        self.receiver_seconds = 0.0
        self._last: float | None = None  # when the last message went out
        self._receivers = 0  # how many receivers were being sent to then
        self.judged: bool | None = None  # the last believed judgement: whether a swarm pays

    def new_step(self) -> None:
        """A new step is staged: a fresh measure (the last judgement stays until it has one)."""
        self._settle()
        self.warm, self.bytes, self.seconds, self.receiver_seconds = 0, 0, 0.0, 0.0
        self._last = None

    def sent(self, nbytes: int, receivers: int, now: float) -> None:
        """``nbytes`` of the source's own step went out; it has data for ``receivers`` receivers after it."""
        if self.warm < WARMUP:
            self.warm += nbytes
            self._last, self._receivers = now, receivers
            return
        if self._last is not None and self._receivers:
            gap = now - self._last
            if 0 < gap <= IDLE_GAP:
                self.seconds += gap
                self.receiver_seconds += gap * self._receivers
        self.bytes += nbytes
        self._last = now
        self._receivers = receivers

    @property
    def rate(self) -> float | None:
        """Bytes per second per receiver of this step so far (None: too little measured)."""
        if self.bytes < MIN_BYTES or self.seconds < MIN_SECONDS or self.receiver_seconds <= 0:
            return None
        return self.bytes / self.receiver_seconds

    def swarm_pays(self) -> bool:
        """Whether a receiver that comes while others receive should join the swarm."""
        self._settle()
        return True if self.judged is None else self.judged

    def _settle(self) -> None:
        rate = self.rate
        if rate is not None:
            self.judged = rate < self.swarm_below
