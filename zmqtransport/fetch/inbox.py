"""Data messages landed where the landing plan put their storages.

One :class:`Inbox` per receive, used by the receiving thread for every data
message, whichever connection it came on (one stream, or several:
:mod:`.owner`): the payload frame is received straight into its
destination (a storage's memory, a run of the small-tensor arena, or a pinned
bounce buffer on its way to device memory), its size, checksum and digest are
checked, and its copies to the device are queued. A message from a relay is
hashed there and then (:meth:`Inbox.receive`), and counted only once the
receive has matched that digest with the source's (:mod:`.verify`). What
follows a landing is done here too, once for both kinds of receive
(:meth:`Inbox.count`): the prefault threads learn how far the data has
reached, a relay may serve the message, progress is reported.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable
from typing import Any

from .. import wire
from ..codec.keypaths import format_path
from ..device import RecvUnstager
from ..digests import Algorithm, digest_of
from ..errors import IntegrityError, ProtocolError
from .landed import Landed
from .landing import ParsedHeader
from .relaying import RelayDuty
from .streams import Stream


class Inbox:
    """Lands each data message of one receive's chunk ``plan`` into ``landed`` (and through ``unstager``).

    ``duty``: this receive relays, so each message may be served once it has
    landed. ``progress(bytes_landed, bytes_total)`` after each message.
    ``algorithm``: the source's digest algorithm (None: it publishes none);
    ``inline``: every message from the source carries its digest, checked here.
    """

    def __init__(
        self,
        parsed: ParsedHeader,
        plan: list[list[wire.Piece]],
        landed: Landed,
        unstager: RecvUnstager | None,
        duty: RelayDuty | None = None,
        progress: Callable[[int, int], None] | None = None,
        algorithm: Algorithm | None = None,
        inline: bool = False,
    ) -> None:
        self.parsed = parsed
        self.plan = plan
        self.landed = landed
        self.unstager = unstager
        self.duty = duty
        self.progress = progress
        self.algorithm = algorithm
        self.inline = inline and algorithm is not None
        self.checksum = parsed.header.checksum is not None
        # Every bounce buffer is sized for the largest bounced message: none grows mid-receive.
        self.bounce_bytes = 0
        if unstager is not None:
            self.bounce_bytes = max((wire.chunk_length(p) for p in plan if unstager.wants(p)), default=0)
        self.offsets = list(itertools.accumulate((wire.chunk_length(p) for p in plan), initial=0))
        self.done = bytearray(len(plan))  # 1 once message seq has landed
        self.prefix = 0  # messages from the first on that have all landed
        self.landed_bytes = 0

    def land(self, stream: Stream, reply: wire.Reply, source: str) -> int:
        """Receive data message ``reply.seq`` from the source, check it, and count it; returns its bytes."""
        nbytes = self.receive(stream, reply, source)[0]
        self.count(reply.seq, reply.crc)
        return nbytes

    def receive(
        self, stream: Stream, reply: wire.Reply, source: str, relayed: bool = False
    ) -> tuple[int, bytes | None]:
        """Receive the payload of data message ``reply.seq`` (its envelope just read) from ``stream``.

        From the source (``source`` names it in errors): its checksum and,
        inline, its digest are checked (``IntegrityError``). From a relay
        (``relayed``): its digest is computed, to be matched with the
        source's; nothing the relay says about it is believed. Its copies to
        device memory are queued either way. Returns its bytes and the digest
        computed (None from the source); :meth:`count` it once it is believed.
        """
        seq = reply.seq
        pieces = self.plan[seq]
        unstager = self.unstager
        bounced = unstager is not None and unstager.wants(pieces)
        payload = self._receive_payload(stream, seq, pieces, unstager if bounced else None)
        stream.ended(f"data message {seq}")
        digest = None
        if relayed:
            assert self.algorithm is not None  # a receive that cannot check relays does not use them
            digest = digest_of(self.algorithm, payload)
        else:
            if self.checksum and reply.crc != zlib.crc32(payload):
                raise self._integrity_error(seq, pieces, source, "checksum")
            if self.inline:
                self._check_inline(seq, pieces, reply.dg, payload, source)
        if bounced:
            assert unstager is not None
            unstager.deliver(pieces)  # a relayed message found forged later is overwritten by its re-fetch
        return len(payload), digest

    def _check_inline(self, seq: int, pieces: list[wire.Piece], dg: bytes | None, payload: Any, source: str) -> None:
        assert self.algorithm is not None
        if dg is None:
            raise ProtocolError(f"data message {seq} from {source} carries no digest, though this receive asked")
        if digest_of(self.algorithm, payload) != dg:
            raise self._integrity_error(seq, pieces, source, f"{self.algorithm.name} digest")

    def count(self, seq: int, crc: int | None) -> None:
        """Data message ``seq`` has landed (checked): tell the prefault threads, the relay duty, the progress callback.

        ``crc``: the source's checksum of it, forwarded by the relay duty (None for one that came from a relay).
        """
        self.done[seq] = 1
        self.landed_bytes += self.offsets[seq + 1] - self.offsets[seq]
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
        self, stream: Stream, seq: int, pieces: list[wire.Piece], unstager: RecvUnstager | None
    ) -> memoryview:
        """Receive data message ``seq``'s payload where it belongs; return the bytes received."""
        what = f"data message {seq}"
        expected = wire.chunk_length(pieces)
        if unstager is not None:
            # Device memory: into a pinned bounce buffer; its copies to the
            # device are queued after the checksum and overlap the next frames.
            return stream.receive(unstager.buffer(expected, self.bounce_bytes), what, expected)
        destinations = self.landed.destinations
        if len(pieces) == 1:
            piece = pieces[0]
            view = destinations[piece.storage].view[piece.start : piece.start + piece.length]
            return stream.receive(view, what, expected)
        run = self.landed.arena_run(pieces)
        if run is not None:
            # Packed storages that lie back to back in the arena: straight into place.
            return stream.receive(run, what, expected)
        payload = stream.receive(None, what, expected)
        at = 0
        for piece in pieces:
            destinations[piece.storage].view[: piece.length] = payload[at : at + piece.length]
            at += piece.length
        return payload

    def _integrity_error(self, seq: int, pieces: list[wire.Piece], source: str, what: str) -> IntegrityError:
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
            f"{what} mismatch in data message {seq} from {source} "
            f"(step {parsed.header.step}): storages {hit}, tensors {', '.join(names[:8]) or 'none'}{more}"
        )
