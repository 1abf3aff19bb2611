"""A checkpoint ready to serve: its header, packed once, and the memory it sends.

No sockets here: :class:`Staged` only turns a data message number of the chunk
plan into bytes (a view of tensor memory, or a packed copy of small storages).
"""

from __future__ import annotations

import ctypes
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import wire

if TYPE_CHECKING:
    from ..codec.tensors import EncodedTree
    from ..device import SendPlan


@dataclass
class Staged:
    """A checkpoint ready to serve: the header, packed once, and the memory to send."""

    step: int
    header_body: bytes
    tree: EncodedTree
    plan: list[list[wire.Piece]]
    checksum: str | None
    crcs: list[int | None] = field(default_factory=list)
    device_plan: SendPlan | None = None  # device memory to stage (None: host memory only)

    @property
    def total_bytes(self) -> int:
        return sum(ref.nbytes for ref in self.tree.storages)

    @property
    def messages(self) -> int:
        """Data messages in the chunk plan."""
        return len(self.plan)

    def payload(self, seq: int) -> tuple[Any, bool]:
        """The bytes of data message ``seq`` and whether they reference tensor memory."""
        pieces = self.plan[seq]
        storages = self.tree.storages
        if len(pieces) == 1:
            piece = pieces[0]
            return storages[piece.storage].view(piece.start, piece.start + piece.length), True
        buffer = bytearray(wire.chunk_length(pieces))
        # One memmove per small storage, straight between addresses: building a
        # memoryview per piece cost ~3 us each, 60 ms for 20,480 tensors of 4 KiB.
        at = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        for piece in pieces:
            ref = storages[piece.storage]
            if not ref.ptr:  # device memory goes through the stager, never through here
                raise RuntimeError(f"storage {piece.storage} has no host memory to pack")
            ctypes.memmove(at, ref.ptr + piece.start, piece.length)
            at += piece.length
        return buffer, False

    def crc(self, seq: int, payload: Any) -> int | None:
        if self.checksum is None:
            return None
        cached = self.crcs[seq]
        if cached is None:
            cached = self.crcs[seq] = zlib.crc32(payload)
        return cached
