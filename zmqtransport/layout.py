"""A state laid out as a source's header says its data messages are: to check it against that source's digests.

``zmqtransport inspect --digests --check FILE`` asks a source for the digest
of every data message of a step (docs/protocol.md, "Digests") and compares
them with a checkpoint on disk, such as one ``zmqtransport fetch`` saved. The
file's tensors are found by the key paths of the source's skeleton; each of
the source's storages is rebuilt from the tensors that view it, and cut into
data messages by the source's chunk plan. A storage that its tensors do not
cover entirely (a view of part of a larger storage: the source sends the
whole storage) cannot be rebuilt from the file: the messages that hold its
uncovered bytes are reported as not checkable, not as different.

Pure: the state and the header in, bytes out; no sockets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from . import wire
from .buffers import tensor_view
from .codec.keypaths import KeyPath, format_path
from .codec.skeleton import index_skeleton, iter_tensor_leaves
from .codec.tensors import TensorSpec, decode_tensor_table


@dataclass(frozen=True)
class Message:
    """Data message ``seq`` rebuilt from a local state: its bytes, or why it cannot be (``bytes`` None)."""

    seq: int
    payload: bytes | None
    tensors: list[str]  # key paths of the tensors whose bytes it carries
    problem: str = ""


def messages_of(header: wire.Header, state: Any) -> Iterator[Message]:
    """Every data message of ``header``'s chunk plan, rebuilt from ``state``."""
    specs = decode_tensor_table(header.tensors, header.storages)
    paths = index_skeleton(header.skeleton, len(specs), allow_pickle=True)
    leaves = dict(iter_tensor_leaves(state))
    users: dict[int, list[int]] = {}
    for index, spec in enumerate(specs):
        users.setdefault(spec.storage, []).append(index)
    rebuilt: tuple[int, bytes | None, str] = (-1, None, "")  # the last storage rebuilt: messages follow storage order
    plan = wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below)
    for seq, pieces in enumerate(plan):
        parts: list[bytes] = []
        problems: list[str] = []
        names: list[str] = []
        for piece in pieces:
            if rebuilt[0] != piece.storage:
                rebuilt = (piece.storage, *_storage(header, specs, paths, leaves, users, piece.storage))
            _, data, problem = rebuilt
            names += [format_path(paths[index]) for index in users.get(piece.storage, [])]
            if data is None:
                problems.append(problem)
            else:
                parts.append(data[piece.start : piece.start + piece.length])
        problem = "; ".join(dict.fromkeys(problems))
        yield Message(seq, None if problem else b"".join(parts), names, problem)


def _storage(
    header: wire.Header,
    specs: list[TensorSpec],
    paths: dict[int, KeyPath],
    leaves: dict[KeyPath, Any],
    users: dict[int, list[int]],
    storage: int,
) -> tuple[bytes | None, str]:
    """Storage ``storage``'s bytes from the local tensors that view it, or None and why not."""
    nbytes = header.storages[storage]
    buffer = torch.zeros(nbytes, dtype=torch.uint8)
    covered = torch.zeros(nbytes, dtype=torch.bool)
    for index in users.get(storage, []):
        spec, path = specs[index], paths[index]
        local = _local(leaves.get(path))
        if local is None:
            return None, f"{format_path(path)}: no tensor there"
        if local.dtype != spec.dtype or tuple(local.shape) != spec.shape:
            theirs = f"{spec.dtype} {list(spec.shape)}"
            return None, f"{format_path(path)}: {local.dtype} {list(local.shape)} here, {theirs} at the source"
        size = spec.dtype.itemsize
        byte_shape = (*spec.shape, size)
        byte_stride = (*(step * size for step in spec.stride), 1)
        target = buffer.as_strided(byte_shape, byte_stride, spec.offset * size)
        target.copy_(local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).reshape(byte_shape))
        covered.as_strided(byte_shape, byte_stride, spec.offset * size).fill_(True)
    if not bool(covered.all()):
        return None, f"storage {storage} is only partly viewed by its tensors (the source sends all of it)"
    return bytes(tensor_view(buffer)), ""


def _local(leaf: Any) -> torch.Tensor | None:
    """The tensor holding a leaf's bytes: itself, or a DTensor's local shard."""
    local = getattr(leaf, "_local_tensor", leaf)
    return local if isinstance(local, torch.Tensor) else None
