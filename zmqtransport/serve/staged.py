"""A checkpoint ready to serve: its header, packed once, and the memory it sends.

No sockets here: :class:`Staged` only turns a data message number of the chunk
plan into bytes (a view of tensor memory, or a packed copy of small storages).
"""

from __future__ import annotations

import ctypes
import random
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .. import wire
from ..codec.skeleton import encode_tree
from ..device import prepare_send

if TYPE_CHECKING:
    from ..codec.tensors import EncodedTree
    from ..device import DeviceStaging, SendPlan


class Served(Protocol):
    """What a transfer sends from: a staged step (:class:`Staged`), a withdrawn one's copy, or a step this side relays.

    The scheduler and the data pump read only this, so a relayed step
    (:class:`zmqtransport.relayed.Relayed`) and the copy a disallow leaves
    running receives (:class:`zmqtransport.serve.snapshot.Snapshot`) are served
    by the same machinery.
    """

    @property
    def step(self) -> int: ...

    @property
    def messages(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

    @property
    def tensor_count(self) -> int: ...

    @property
    def device_plan(self) -> SendPlan | None: ...

    def available(self, seq: int) -> bool:
        """Whether data message ``seq`` can be sent now (a relay's only once it has landed)."""
        ...

    def span_bytes(self, first: int, stop: int) -> int: ...

    def payload(self, seq: int) -> tuple[Any, bool]:
        """The bytes of data message ``seq``, and whether they reference the served memory (zero-copy)."""
        ...

    def crc(self, seq: int, payload: Any) -> int | None: ...


def stage(
    state: Any,
    step: int,
    *,
    allow_pickle: bool,
    chunk_bytes: int | None,
    pack_below: int,
    checksum: str | None,
    staging: DeviceStaging,
    receivers: int = 0,
) -> Staged:
    """Encode ``state`` as ``step``: the header, the chunk plan and the memory to send.

    Pure preparation in the caller's thread (no socket, no copy of host tensors):
    raises ``TypeError`` naming the key path of a leaf that cannot be sent, and
    ``ValueError`` for a state receivers would refuse. ``chunk_bytes`` ``None``:
    the frame size follows the state's size (:func:`zmqtransport.wire.frame_bytes`).
    ``receivers``: how many the caller expects to fetch it (torchft's ``dst_ranks``; 0: not said).
    """
    if type(step) is not int or not 0 <= step <= wire.MAX_STEP:
        raise ValueError(f"step must be an integer in [0, {wire.MAX_STEP}], got {step!r}")
    encoded = encode_tree(state, allow_pickle)
    if len(encoded.tensors) > wire.MAX_TENSORS:
        # Receivers refuse such a header (wire.decode_header); say so here, once.
        raise ValueError(f"the state holds {len(encoded.tensors)} tensors; receivers accept at most {wire.MAX_TENSORS}")
    storages = [ref.nbytes for ref in encoded.storages]
    if chunk_bytes is None:
        chunk_bytes = wire.frame_bytes(sum(storages), pack_below)
    header = wire.Header(
        step=step,
        skeleton=encoded.skeleton,
        tensors=encoded.tensors,
        storages=storages,
        chunk_bytes=chunk_bytes,
        pack_below=pack_below,
        checksum=checksum,
    )
    plan = wire.plan_chunks(storages, chunk_bytes, pack_below)
    # CUDA storages are not copied here: the serving thread stages them
    # through pinned buffers; this only notes where the caller's stream is.
    device_plan = prepare_send(encoded, plan, staging)
    return Staged(
        step, header.body(), encoded, plan, checksum, [None] * len(plan), device_plan=device_plan, receivers=receivers
    )


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
    # Receivers the caller said would fetch it (torchft's dst_ranks; 0: not said): whether a swarm pays
    # depends on how many share the uplink (serve.uplink).
    receivers: int = 0
    # Names this staging in span fetches: a span asked of an earlier staging of
    # the same step (re-staged in between, maybe with other bytes) is refused.
    stage_id: int = field(default_factory=lambda: random.getrandbits(63))
    # Digests of the data messages, by algorithm name, each computed once (serve.digests).
    digests: dict[str, list[bytes | None]] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(ref.nbytes for ref in self.tree.storages)

    @property
    def messages(self) -> int:
        """Data messages in the chunk plan."""
        return len(self.plan)

    @property
    def tensor_count(self) -> int:
        return len(self.tree.tensors)

    def available(self, seq: int) -> bool:
        return True  # every message of a staged step can be sent at once (a relay's cannot)

    def span_bytes(self, first: int, stop: int) -> int:
        return wire.plan_bytes(self.plan[first:stop])

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
        return cached_crc(self.checksum, self.crcs, seq, payload)


def cached_crc(checksum: str | None, crcs: list[int | None], seq: int, payload: Any) -> int | None:
    """Data message ``seq``'s CRC32 (None without checksums), computed once into ``crcs``."""
    if checksum is None:
        return None
    cached = crcs[seq]
    if cached is None:
        cached = crcs[seq] = zlib.crc32(payload)
    return cached
