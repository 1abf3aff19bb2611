"""A step being received, served onward as it lands (docs/protocol.md, "Swarm").

Shared ground between the two sides: the receiving side (:mod:`zmqtransport.fetch.relaying`)
creates a :class:`Relayed` and marks each data message as it lands; the sending
side's serving thread (:mod:`zmqtransport.serve`) serves span fetches from it.
It serves a message only once it has landed, sends copies (no frame
references the receive's memory after it is sent, so the relay can stop at
any moment and hand its memory to its caller), and forwards the source's
checksums unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from . import wire

# Whether receivers on the source's own host (whatever address they connect
# over) take part in swarms. Not by default: a swarm trades the receivers'
# uplinks for the source's, and one host has one memory system, not several
# links. Measured on loopback, three fresh 1 GiB receivers at once: the
# slowest took 2.99 s relayed against 2.31 s for HTTPTransport. Both sides
# read it (the source does not make such a receiver a member; the receiver
# does not offer); tests turn it on to exercise swarms on one machine.
RELAY_LOOPBACK = False

class RelayStopped(Exception):
    """A relayed step's memory was handed back to its receiver's caller: nothing more is sent from it."""


@dataclass
class Relayed:
    """A step being received, served to downstream receivers as it lands.

    The receiving thread fills it (:meth:`landed_one`); the serving thread
    reads it. ``views`` are the host memory of each storage's destination.
    """

    step: int
    stage_id: int  # the source's staging id: span fetches must name it
    token: bytes
    plan: list[list[wire.Piece]]
    # Each storage's landed host memory; None until the receive has allocated
    # it (a relay is registered as soon as the header arrives, so a fast
    # downstream's first requests wait here instead of being refused).
    views: Sequence[memoryview] | None = None
    landed: bytearray = field(default_factory=bytearray)  # 1 once data message seq's bytes are in place
    have: int = 0  # the same, as a bit set (bit seq), for have replies
    coming: int = 0  # what the receive is fetching now (a bit set), for have replies
    # The messages a transfer of it waits for (a bit set, written by the serving thread before each of its
    # waits): only their landing wakes that thread; the others are sent from what a downstream saw landed.
    awaited: int = 0
    crcs: list[int | None] = field(default_factory=list)
    served: bool = False  # a downstream has asked (the relay's tail then waits for its downstream)
    # Downstream connections (routing ids) that asked and are still connected:
    # the relay's tail lasts while any is (set by the serving thread).
    peers: set[bytes] = field(default_factory=set)
    device_plan: None = None  # a relay serves host memory only
    # Held while a message is copied; stop() takes it, so once stop() returns
    # no copy is running and none will start: the memory is the caller's again.
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopped: bool = False

    def __post_init__(self) -> None:
        if not self.crcs:
            self.crcs = [None] * len(self.plan)
        if not self.landed:
            self.landed = bytearray(len(self.plan))

    @property
    def messages(self) -> int:
        return len(self.plan)

    @property
    def total_bytes(self) -> int:
        return wire.plan_bytes(self.plan)

    @property
    def tensor_count(self) -> int:
        return 0  # the relay does not know the tensor table's size here; statistics only

    def span_bytes(self, first: int, stop: int) -> int:
        return wire.plan_bytes(self.plan[first:stop])

    def available(self, seq: int) -> bool:
        return not self._stopped and bool(self.landed[seq])

    def stop(self) -> None:
        """No message is read from the relayed memory after this returns (any thread)."""
        with self._lock:
            self._stopped = True

    def landed_one(self, seq: int, crc: int | None) -> None:
        """Message ``seq`` has landed (receiving thread): its checksum first, then the flags."""
        self.crcs[seq] = crc
        self.landed[seq] = 1
        # A new int each time: the serving thread reads a whole one (a have reply), never half an update.
        self.have |= 1 << seq

    def payload(self, seq: int) -> tuple[bytes, bool]:
        """A copy of message ``seq``'s bytes as they landed (never a reference to the receive's memory).

        Raises :class:`RelayStopped` once :meth:`stop` was called.
        """
        pieces = self.plan[seq]
        with self._lock:
            if self._stopped or self.views is None:
                raise RelayStopped(f"relaying of step {self.step} has stopped")
            if len(pieces) == 1:
                piece = pieces[0]
                data = bytes(self.views[piece.storage][piece.start : piece.start + piece.length])
            else:
                data = b"".join(bytes(self.views[piece.storage][: piece.length]) for piece in pieces)
        return data, False

    def crc(self, seq: int, payload: object) -> int | None:
        return self.crcs[seq]  # the source's, forwarded unchanged
