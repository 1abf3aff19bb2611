"""The payload every method moves, its check, raw socket helpers, and memory accounting."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import resource
import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..buffers import tensor_view

_IOV_MAX = 1024  # buffers per sendmsg/recvmsg_into call (Linux UIO_MAXIOV)


def make_tensors(shapes: Sequence[tuple[int, ...]], fill: float) -> list[Any]:
    """float32 tensors of the given shapes, touched (every page written)."""
    return [torch.full(shape, fill, dtype=torch.float32) for shape in shapes]


def empty_float32(nbytes: int) -> Any:
    return torch.empty(max(1, nbytes // 4), dtype=torch.float32)


_EXACT = 1 << 24  # float32 holds every integer below this exactly


def stamp(tensors: Sequence[Any], step: int) -> None:
    """Give every tensor content that identifies both the tensor and the trial.

    The first element holds the tensor's index and the others the step; a
    one-element tensor (an optimizer's step count) holds both, summed.
    """
    for index, tensor in enumerate(tensors):
        flat = tensor.view(-1)
        if flat.numel() == 1:
            flat[0] = float((index + step) % _EXACT)
            continue
        flat.fill_(float(step))
        flat[0] = float(index % _EXACT)


def check(tensors: Sequence[Any], step: int, count: int) -> None:
    if len(tensors) != count:
        raise AssertionError(f"received {len(tensors)} tensors, expected {count}")
    for index, tensor in enumerate(tensors):
        flat = tensor.reshape(-1)
        if flat.numel() == 1:
            right = float(flat[0]) == float((index + step) % _EXACT)
        else:
            right = float(flat[0]) == float(index % _EXACT) and float(flat[-1]) == float(step)
        if not right:
            raise AssertionError(f"tensor {index} has wrong content after step {step}")


def check_every_element(tensors: Sequence[Any], step: int, count: int) -> None:
    """:func:`check`, and every element after the first: a mutation of any byte shows."""
    check(tensors, step, count)
    for index, tensor in enumerate(tensors):
        if not bool(torch.all(tensor.reshape(-1)[1:] == float(step))):
            raise AssertionError(f"tensor {index} has other bytes than step {step} staged")


def memcpy_seconds(tensors: Sequence[Any], nbytes: int) -> float:
    """Seconds to copy ``nbytes`` of these tensors into fresh memory, one memmove per tensor (the page
    faults of the new memory included, as any copy of that size pays them)."""
    if nbytes <= 0:
        return 0.0
    started = time.perf_counter()
    target = torch.empty(nbytes, dtype=torch.uint8)
    at = target.data_ptr()
    left = nbytes
    for tensor in tensors:
        size = min(left, tensor.numel() * tensor.element_size())
        ctypes.memmove(at, tensor.data_ptr(), size)
        at, left = at + size, left - size
        if not left:
            break
    seconds = time.perf_counter() - started
    del target
    return seconds




def views_of(tensors: Sequence[Any]) -> list[memoryview]:
    return [tensor_view(tensor) for tensor in tensors]


def _advance(pending: list[memoryview], done_bytes: int) -> list[memoryview]:
    """Drop the first ``done_bytes`` from the front of ``pending`` (views in order)."""
    done = 0
    while done < len(pending) and done_bytes >= len(pending[done]):
        done_bytes -= len(pending[done])
        done += 1
    rest = pending[done:]
    if done_bytes:
        rest[0] = rest[0][done_bytes:]
    return rest


def split_views(views: Sequence[memoryview], parts: int) -> list[list[memoryview]]:
    """``views`` as ``parts`` runs of about equal bytes, in order (a view may be cut between two runs)."""
    total = sum(len(view) for view in views)
    bounds = [total * part // parts for part in range(parts + 1)]
    runs: list[list[memoryview]] = [[] for _ in range(parts)]
    offset = 0
    for view in views:
        end = offset + len(view)
        for part in range(parts):
            low, high = max(offset, bounds[part]), min(end, bounds[part + 1])
            if low < high:
                runs[part].append(view[low - offset : high - offset])
        offset = end
    return runs


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send every view, in order, straight from its memory (gathered writes)."""
    pending = [view for view in views if len(view)]
    while pending:
        sent = sock.sendmsg(pending[:_IOV_MAX])
        pending = _advance(pending, sent)


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view, in order, straight from the socket (scattered reads)."""
    pending = [view for view in views if len(view)]
    while pending:
        got = sock.recvmsg_into(pending[:_IOV_MAX])[0]
        if got == 0:
            raise ConnectionError("the TCP sender closed early")
        pending = _advance(pending, got)


# ----------------------------------------------------------------------------- memory accounting


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


def reset_peak() -> bool:
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0); False if impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def release_free_memory() -> None:
    """Give freed heap memory back to the kernel (glibc ``malloc_trim``).

    glibc keeps freed blocks for reuse, so a second receive in one process (the
    warm column) would get its "fresh" tensors from pages the first receive
    already faulted in. Trimming makes its fresh memory as fresh as a new
    process's; what stays warm is everything else (imports, sockets, caches).
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class PeakMeter:
    """Peak RSS growth over a region, in bytes."""

    def __init__(self) -> None:
        release_free_memory()
        self.resettable = reset_peak()
        self.baseline = _status_kib("VmRSS") * 1024
        if not self.resettable:
            # Without clear_refs only the lifetime peak is known: an upper bound.
            self.baseline = min(self.baseline, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def growth(self) -> int:
        return max(0, _status_kib("VmHWM") * 1024 - self.baseline)
