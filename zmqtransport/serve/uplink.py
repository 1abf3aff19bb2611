"""Whether a swarm pays: the source's measure of the rate its uplink delivers its steps at (issue 33).

A swarm (docs/protocol.md, "Swarm") spares the source's uplink: it uploads
the state about once however many receivers there are, and they exchange the
rest. That pays where the uplink is the bottleneck. Where the source can feed
its receivers faster than they can relay, it costs: a member spends about
2.5 times the CPU of a direct receive per byte (it verifies what peers send,
serves what it has landed, and runs the striped loop), so where the CPU is the
limit relaying makes every receiver slower (docs/fast-links.md: three
receivers over unshaped links, the swarm's slowest was 2.0-2.3x slower than
``relay=False``).

So the source measures, while receivers fetch its own staged steps, the rate
its uplink carries them at: data bytes over the time receivers were asking.
Time is counted between successive data requests of the step (a fetch, a
span fetch, credit: a receiver asks again as what it asked for lands), not
between sends: libzmq takes a span or a credit window far faster than any
link carries it, and the requests follow the link. The bytes counted are
those sent between two requests, in the time between them (what was sent
after the latest one has not been paid for in time yet); gaps over
:data:`IDLE_GAP` (nobody asking) count neither. The uplink bounds its
receivers, and the swarm engages, where it carries less than
:data:`SWARM_PER_RECEIVER` per receiver of the step (as many as the caller
said would fetch it, or the hosts that asked, if more): served directly, each
would get its share of the uplink, and a member on a core of its own relays
faster than that share, however fast the link (docs/sim.md, "Fast uplinks and
many receivers"). From that rate on, every receiver is served directly.
The judgement is the step's own once it has :data:`MIN_BYTES` over
:data:`MIN_SECONDS`, otherwise the last such step's, otherwise (nothing
measured yet) the swarm engages: where the uplink is slow it matters most.

That cadence has a blind spot: a step sent to a swarm is measured at the
swarm's rate, and where the links are fast the members' CPUs bound that
(relaying costs a member about 2.9 times a direct receive's CPU), so on a
loaded machine it reads below the bound and the swarm stays where it does not
pay. Where the kernel speaks (Linux TCP_INFO of this side's own data
connections, read by :mod:`.linkwatch`), it decides instead, from its own
estimate of each connection's delivery rate (``tcpi_delivery_rate``: the
bytes of the latest flight over the time they took to be acknowledged), where
that flight was not application-limited (``tcpi_delivery_rate_app_limited``:
the sender had less to send than the path would take, so the rate says
nothing of the path; a shaped link lets such a small flight through at line
rate, tbf's burst). Per reading, the connections that carried data since their
reading before (:data:`MOVED_BYTES`) are summed: connections that share the
uplink at once each see their share of it. A link-bound uplink gives its rate
so (400 Mbit/s, three receivers: 28-46 MB/s a reading in three of four); a
fast one gives the rate a flight crosses it at, even while the receivers'
CPUs hold the swarm to 100-140 MB/s (unshaped, loaded: 1.2-6.8 GB/s;
docs/fast-links.md, "The kernel's view"). The step's measure is the lower
quartile of its readings. Where the kernel's measure is not believed yet
(:data:`MIN_BYTES` over :data:`MIN_READINGS`), or nothing could be read (ipc or
inproc, not Linux, a kernel before 4.9 without the delivery rate), the cadence
decides as before.

Pure: the caller (the scheduler and the serving thread) passes the time and the
kernel's counters as numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

# Bytes per second of the source's uplink per receiver of the step from which it feeds
# them directly: 200 MB/s (1.6 Gbit/s) each, so 0.6 GB/s for three, 3.2 GB/s for 16.
# Served directly, N receivers share the uplink: on a 10 Gbit/s link a heal of 16
# takes 16 times one receive's ideal (the model: 16.6x). A member relaying on a core
# of its own carries 240-470 MB/s in the model (sim/model.py's CPU figures, from 64
# members down to 3), so a swarm there takes 3.3x (docs/sim.md, "Fast uplinks and
# many receivers"); staying below those rates keeps a margin for busier CPUs (the
# model ran 22-45% faster than the lab's unshaped runs). Measured in
# the lab: a shaped uplink carries at most 50 MB/s (400 Mbit/s; 100 with two NICs),
# so it always bounds; an unshaped one 0.8-2.3 GB/s to one receiver or to three
# direct ones, where on this two-core VM, its cores shared by every process, a swarm
# of three was 2.0-2.3x slower than direct (docs/fast-links.md): three stay direct.
# Until 2026-12-05 the bound was 150 MB/s whatever the number of receivers (then a
# heal of 64 over 10 Gbit/s links, once a step had been measured, went direct: 69x
# the ideal in the model, against 5.1x as a swarm).
SWARM_PER_RECEIVER = 200_000_000
# A silence between requests longer than this (seconds) is idle time, not transfer time (and what
# was sent meanwhile is not counted either). Above the time a credit batch of a direct receive (8 MiB)
# takes at 100 Mbit/s.
IDLE_GAP = 1.0
# What a measure needs before it is believed: bytes, and seconds of receivers asking.
MIN_BYTES = 32 << 20
MIN_SECONDS = 0.05
# Bytes a connection must have carried since its reading before for its delivery rate to count in a
# reading: a sample of data going out, not of a reply or a digest answer (those flights are small and
# their rate tells nothing of the link).
MOVED_BYTES = 64 << 10
# Readings a kernel measure needs before it is believed, besides MIN_BYTES acknowledged.
MIN_READINGS = 3


@dataclass(frozen=True)
class LinkReading:
    """One data connection's counters as the kernel keeps them (Linux ``struct tcp_info``)."""

    acked: int  # bytes the receiver acknowledged so far (tcpi_bytes_acked)
    delivery_rate: float  # bytes per second of the latest delivered flight (tcpi_delivery_rate)
    app_limited: bool = False  # that flight was smaller than the path would take (tcpi_delivery_rate_app_limited)


class Uplink:
    """The rate the source's uplink carries its step at: this step's, and the last believed judgement."""

    def __init__(self, per_receiver: float | None = None) -> None:
        self.per_receiver = SWARM_PER_RECEIVER if per_receiver is None else per_receiver
        self.sent_bytes = 0  # of this step, handed to libzmq
        self.bytes = 0  # of those, sent before the latest request
        self.seconds = 0.0  # between requests
        self._last: float | None = None  # the latest request
        self._sent_then = 0  # what had been sent at the latest request
        self.link_bytes = 0  # of this step, acknowledged, as the kernel counts
        self.link_rates: list[float] = []  # per reading of this step: the sum of the moving connections' rates
        self._links: dict[int, LinkReading] = {}  # the latest reading per connection, of this step
        self.judged_rate: float | None = None  # the rate of the last step measured enough to believe
        self.measured: tuple[float | None, float | None] = (None, None)  # the last step's (link, cadence) rates
        self.blind = True  # this step was staged with nothing measured before it (new_step)

    def new_step(self) -> None:
        """A new step is staged: a fresh measure (the last judgement stays until it has one)."""
        self._settle()
        self.measured = (self.link_rate, self.cadence_rate)
        self.blind = self.judged_rate is None  # nothing measured before this step: its members are made blind
        self.sent_bytes, self.bytes, self.seconds, self._last, self._sent_then = 0, 0, 0.0, None, 0
        self.link_bytes, self.link_rates, self._links = 0, [], {}

    def requested(self, now: float) -> None:
        """A receiver asked for data of the step (a fetch, a span fetch, credit)."""
        if self._last is not None:
            gap = now - self._last
            if 0 < gap <= IDLE_GAP:
                self.seconds += gap
                self.bytes += self.sent_bytes - self._sent_then
        self._last, self._sent_then = now, self.sent_bytes

    def sent(self, nbytes: int) -> None:
        """``nbytes`` of the step went out (to libzmq)."""
        self.sent_bytes += nbytes

    def links(self, readings: Mapping[int, LinkReading]) -> None:
        """The kernel's counters of connections the step goes out over, by connection (descriptor), read now.

        What changed since the connection's reading before, within this step,
        counts: its first reading is its baseline, and a count that went down is
        a new connection on a reused descriptor (a new baseline). A connection
        need not be read every time (a swarm member's span fetches come and go).
        """
        rates = []
        for key, reading in readings.items():
            before = self._links.get(key)
            self._links[key] = reading
            if before is None or reading.acked < before.acked:
                continue
            moved = reading.acked - before.acked
            self.link_bytes += moved
            if moved >= MOVED_BYTES and not reading.app_limited:
                rates.append(reading.delivery_rate)
        if rates:
            self.link_rates.append(sum(rates))

    @property
    def link_rate(self) -> float | None:
        """Bytes per second the uplink delivers this step's flights at, as the kernel estimates (the lower
        quartile of the readings' sums); None: too little measured."""
        if self.link_bytes < MIN_BYTES or len(self.link_rates) < MIN_READINGS:
            return None
        return sorted(self.link_rates)[len(self.link_rates) // 4]

    @property
    def cadence_rate(self) -> float | None:
        """Bytes per second the uplink carried this step at so far, by the receivers' requests."""
        if self.bytes < MIN_BYTES or self.seconds < MIN_SECONDS:
            return None
        return self.bytes / self.seconds

    @property
    def rate(self) -> float | None:
        """The rate this step's judgement follows (None: too little measured): the kernel's once believed,
        otherwise the receivers' cadence."""
        link = self.link_rate
        return link if link is not None else self.cadence_rate

    def bound(self, receivers: int) -> float:
        """The rate below which the uplink bounds ``receivers`` receivers of one step (bytes/s)."""
        return max(1, receivers) * self.per_receiver

    def swarm_pays(self, receivers: int = 1) -> bool:
        """Whether receivers that offer to relay should form a swarm, ``receivers`` fetching the step."""
        self._settle()
        return self.judged_rate is None or self.judged_rate < self.bound(receivers)

    def step_pays(self, receivers: Callable[[], int]) -> bool | None:
        """Whether a swarm pays for ``receivers()`` receivers by this step's own measure, for a step staged
        with nothing measured before it (:attr:`blind`); None: too little measured yet, or an earlier
        judgement made its members. ``receivers`` is called only where it decides.

        A judgement made blind is revised as soon as the step measures; one
        made on a measured step stands for the step. Over links shaped with
        tbf at 2 Gbit/s the kernel's readings of a swarm scatter (7 MB/s to
        21 GB/s, docs/sim.md, "Fast uplinks and many receivers"), and a few
        of them, early in a step, read fast: revising measured swarms on
        them sent 4 of 6 later steps of seven receivers partly to the source
        (1.4-4.3 states, up to 1.74 s against 0.9-1.2 s as a swarm; one
        round, docs/fast-links.md, "The first step steps aside"). A wrong
        "fast" sends every member to the source, a wrong "slow" costs a
        swarm on a fast link: the measure that made the members is trusted.
        """
        if not self.blind or self.rate is None:
            return None
        return self.swarm_pays(receivers())  # the step's rate, now its judgement

    def _settle(self) -> None:
        rate = self.rate
        if rate is not None:
            self.judged_rate = rate
