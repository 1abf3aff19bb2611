"""The kernel's account of this side's own data connections (Linux TCP_INFO), for the uplink's judgement.

Whether a swarm pays depends on whether the source's uplink or its receivers'
CPUs bound a step (:mod:`.uplink`). The receivers' request cadence cannot tell
them apart while a swarm runs; the kernel can: per connection it counts the
bytes the receiver acknowledged (``tcpi_bytes_acked``) and estimates the rate
the latest flight was delivered at (``tcpi_delivery_rate``, and whether the
sender had too little to send for it to say anything of the path,
``tcpi_delivery_rate_app_limited``). While this side's
own staged step goes out, :class:`LinkWatch` reads them every
:data:`READ_EVERY` seconds for the connections it goes out over, and for
:data:`LINGER` after their transfers end, and hands them, as numbers, to the
scheduler's :class:`~.uplink.Uplink`.

The descriptors are libzmq's (the socket monitor and ``ZMQ_SRCFD`` name them,
:class:`~.router.Router`). Each reading works on a duplicate, closed at once:
libzmq's own descriptor is never closed here, and no duplicate outlives the
reading (one kept would hold the connection open after libzmq closed it). A
descriptor reused since by something that is not a TCP socket reads as
nothing; one reused by another TCP connection starts over (its count goes
down: :meth:`.uplink.Uplink.links`). Where nothing can be read (ipc or inproc
endpoints, not Linux, an older kernel) the watch gives no readings and the
uplink falls back to the receivers' cadence. CurveZMQ changes nothing here:
the kernel counts the encrypted bytes on the same connections.
"""

from __future__ import annotations

import logging
import math
import socket
import struct
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from .staged import Staged
from .uplink import LinkReading

if TYPE_CHECKING:
    from .router import Router
    from .scheduler import Scheduler

logger = logging.getLogger("zmqtransport.serve")

# Seconds between readings while a step of this side's goes out: short beside a step (a 400 Mbit/s
# link carries 2.5 MB in it), long beside a reading (three system calls per connection).
READ_EVERY = 0.05
# Seconds a connection is still read after its transfer of the step ended: what libzmq and the kernel
# hold for it (a credit window, socket buffers) goes out meanwhile (16 MiB take 0.34 s at 400 Mbit/s).
LINGER = 1.0

# struct tcp_info of include/uapi/linux/tcp.h, from its start to tcpi_delivery_rate (168 bytes, Linux
# 4.9 and later; later kernels append fields, never move them): 8 single bytes (tcpi_state ...
# tcpi_delivery_rate_app_limited), 24 u32 (tcpi_rto ... tcpi_total_retrans), 4 u64 (the pacing rates,
# tcpi_bytes_acked, tcpi_bytes_received), 6 u32 (tcpi_segs_out ... tcpi_data_segs_out), 1 u64
# (tcpi_delivery_rate). Every field lies at its natural alignment, so "=" (no padding) matches.
TCP_INFO_LAYOUT = struct.Struct("=8B24I4Q6IQ")
_APP_LIMITED = 7  # field indices in TCP_INFO_LAYOUT; this byte's lowest bit (the first bitfield)
_BYTES_ACKED = 8 + 24 + 2
_DELIVERY_RATE = 8 + 24 + 4 + 6
_TCP_INFO = getattr(socket, "TCP_INFO", None) if sys.platform.startswith("linux") else None


def parse_tcp_info(raw: bytes) -> LinkReading | None:
    """The counters the uplink needs from a ``struct tcp_info``; None if it is too short to hold them."""
    if len(raw) < TCP_INFO_LAYOUT.size:
        return None  # a kernel before 4.9: no delivery rate
    fields = TCP_INFO_LAYOUT.unpack_from(raw)
    return LinkReading(
        acked=fields[_BYTES_ACKED],
        delivery_rate=float(fields[_DELIVERY_RATE]),
        app_limited=bool(fields[_APP_LIMITED] & 1),
    )


def read_tcp_info(fd: int) -> LinkReading | None:
    """The kernel's counters of the TCP connection on ``fd`` (libzmq's: read through a duplicate); None if
    there are none (not TCP, not Linux, closed)."""
    if _TCP_INFO is None:
        return None
    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as duplicate:  # closes the duplicate only
            raw = duplicate.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, 2 * TCP_INFO_LAYOUT.size)
    except OSError:
        return None
    return parse_tcp_info(raw)


class LinkWatch:
    """Reads the kernel's counters of the connections this side's own step goes out over, for its uplink."""

    def __init__(
        self, router: Router, scheduler: Scheduler, read: Callable[[int], LinkReading | None] = read_tcp_info
    ) -> None:
        self._router = router
        self._scheduler = scheduler
        self._read = read
        self._due = 0.0
        self._step: Staged | None = None
        self._watched: dict[bytes, float] = {}  # receivers of the step read, and when they last had a transfer

    def run(self, now: float) -> None:
        """Read, if a reading is due (or a receiver is new) and this side's own step goes out."""
        scheduler = self._scheduler
        if scheduler.staged is not None and scheduler.staged is not self._step:
            # A new step (the uplink starts its measure afresh). A disallow is none: the step's last
            # bytes still count, as the connections carry them.
            self._step, self._watched = scheduler.staged, {}
            link, cadence = scheduler.uplink.measured
            if link is not None or cadence is not None:
                said = scheduler.staged.receivers
                bound = _rate(scheduler.uplink.bound(said))
                message = "the uplink carried the last step at %s (kernel), %s (requests): a swarm below %s (%d named)"
                logger.debug(message, _rate(link), _rate(cadence), bound, said)
        fresh = False  # a receiver new to the watch is read at once: its first reading is its baseline
        for transfer in scheduler.transfers.values():
            if isinstance(transfer.staged, Staged):  # the staged step's, not a relayed one's
                fresh = fresh or transfer.peer not in self._watched
                self._watched[transfer.peer] = now
        if not self._watched or (now < self._due and not fresh):
            return
        self._due = now + READ_EVERY
        descriptors = {fd for peer in self._watched if (fd := self._router.descriptor(peer)) is not None}
        readings = {fd: reading for fd in descriptors if (reading := self._read(fd)) is not None}
        scheduler.uplink.links(readings)
        # A transfer ends once its last message is handed to libzmq; its connection carries that after,
        # so it is read for LINGER more (one reading past it included).
        self._watched = {peer: seen for peer, seen in self._watched.items() if now - seen <= LINGER}

    def wakeup_in(self, now: float) -> float:
        """Seconds until the next reading is due (inf: nothing to read)."""
        return max(0.0, self._due - now) if self._watched else math.inf


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate / 1e6:.0f} MB/s"
