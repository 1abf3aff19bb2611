"""Data messages landed where the landing plan put their storages.

One :class:`Inbox` per receive, used by the receiving thread for every data
message, whichever connection it came on (one stream, or several:
:mod:`.striped`): the payload frame is received straight into its
destination (a storage's memory, a run of the small-tensor arena, or a pinned
bounce buffer on its way to device memory), its size and checksum are
checked, and its copies to the device are queued. What follows a landing is
done here too, once for both kinds of receive: the prefault threads learn how
far the data has reached, a relay may serve the message, progress is reported.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable
from typing import Any

import zmq

from .. import wire
from ..codec.keypaths import format_path
from ..device import RecvUnstager
from ..errors import IntegrityError
from .landed import Landed
from .landing import ParsedHeader
from .relaying import RelayDuty
from .replies import expect_no_more, recv_exact


class Inbox:
    """Lands each data message of one receive's chunk ``plan`` into ``landed`` (and through ``unstager``).

    ``duty``: this receive relays, so each message may be served once it has
    landed. ``progress(bytes_landed, bytes_total)`` after each message.
    """

    def __init__(
        self,
        parsed: ParsedHeader,
        plan: list[list[wire.Piece]],
        landed: Landed,
        unstager: RecvUnstager | None,
        duty: RelayDuty | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.parsed = parsed
        self.plan = plan
        self.landed = landed
        self.unstager = unstager
        self.duty = duty
        self.progress = progress
        self.checksum = parsed.header.checksum is not None
        # Every bounce buffer is sized for the largest bounced message: none grows mid-receive.
        self.bounce_bytes = 0
        if unstager is not None:
            self.bounce_bytes = max((wire.chunk_length(p) for p in plan if unstager.wants(p)), default=0)
        self.offsets = list(itertools.accumulate((wire.chunk_length(p) for p in plan), initial=0))
        self.done = bytearray(len(plan))  # 1 once message seq has landed
        self.prefix = 0  # messages from the first on that have all landed
        self.landed_bytes = 0

    def land(self, socket: zmq.Socket[Any], reply: wire.Reply, source: str) -> int:
        """Receive the payload of data message ``reply.seq`` (its envelope just read) from ``socket``.

        Checks its size and checksum (``source`` names the sender in the
        error), queues its copies to device memory, then tells the prefault
        threads, the relay duty and the progress callback. Returns its bytes.
        """
        seq = reply.seq
        pieces = self.plan[seq]
        unstager = self.unstager
        bounced = unstager is not None and unstager.wants(pieces)
        payload = self._receive_payload(socket, seq, pieces, unstager if bounced else None)
        expect_no_more(socket, f"data message {seq}")
        if self.checksum and reply.crc != zlib.crc32(payload):
            raise self._integrity_error(seq, pieces, source)
        if bounced:
            assert unstager is not None
            unstager.deliver(pieces)
        self._landed(seq, reply.crc, len(payload))
        return len(payload)

    def _landed(self, seq: int, crc: int | None, nbytes: int) -> None:
        self.done[seq] = 1
        self.landed_bytes += nbytes
        prefaulter = self.landed.prefaulter
        if prefaulter is not None and seq == self.prefix:
            while self.prefix < len(self.done) and self.done[self.prefix]:
                self.prefix += 1
            prefaulter.received = self.offsets[self.prefix]  # its workers skip what the data has reached
        if self.duty is not None:
            self.duty.landed(seq, crc)
        if self.progress is not None:
            self.progress(self.landed_bytes, self.offsets[-1])

    def _receive_payload(
        self, socket: zmq.Socket[Any], seq: int, pieces: list[wire.Piece], unstager: RecvUnstager | None
    ) -> memoryview:
        """Receive data message ``seq``'s payload where it belongs; return the bytes received."""
        what = f"data message {seq}"
        expected = wire.chunk_length(pieces)
        if unstager is not None:
            # Device memory: into a pinned bounce buffer; its copies to the
            # device are queued after the checksum and overlap the next frames.
            return recv_exact(socket, unstager.buffer(expected, self.bounce_bytes), what, expected)
        destinations = self.landed.destinations
        if len(pieces) == 1:
            piece = pieces[0]
            view = destinations[piece.storage].view[piece.start : piece.start + piece.length]
            return recv_exact(socket, view, what, expected)
        run = self.landed.arena_run(pieces)
        if run is not None:
            # Packed storages that lie back to back in the arena: straight into place.
            return recv_exact(socket, run, what, expected)
        payload = recv_exact(socket, None, what, expected)
        at = 0
        for piece in pieces:
            destinations[piece.storage].view[: piece.length] = payload[at : at + piece.length]
            at += piece.length
        return payload

    def _integrity_error(self, seq: int, pieces: list[wire.Piece], source: str) -> IntegrityError:
        """Name the storages and the tensors (key paths) a corrupted data message carried."""
        parsed = self.parsed
        hit = sorted({piece.storage for piece in pieces})
        names = [
            format_path(parsed.paths[index])
            for index, spec in enumerate(parsed.specs)
            if spec.storage in hit and index in parsed.paths
        ]
        more = " ..." if len(names) > 8 else ""
        return IntegrityError(
            f"checksum mismatch in data message {seq} from {source} "
            f"(step {parsed.header.step}): storages {hit}, tensors {', '.join(names[:8]) or 'none'}{more}"
        )
