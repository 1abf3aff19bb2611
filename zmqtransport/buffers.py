"""Receive memory: raw views of tensor memory and huge-page-backed fresh storage.

On virtual machines the first touch of freshly allocated memory (one page fault
per 4 KiB page) can cost more than copying the bytes into it. Fresh storages of
at least :data:`HUGE_PAGE` bytes are therefore mapped separately and advised to
use transparent huge pages, which cuts the faults 512-fold where the kernel
allows it (``/sys/kernel/mm/transparent_hugepage/enabled`` = ``madvise`` or
``always``). Elsewhere this degrades to ordinary memory.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 * 1024 * 1024


def raw_view(ptr: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` at ``ptr``; the caller keeps the owner alive."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)).cast("B")


def tensor_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without copying."""
    assert tensor.device.type == "cpu" and tensor.is_contiguous()
    return raw_view(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def allocate(nbytes: int) -> torch.Tensor:
    """A fresh uint8 CPU tensor of ``nbytes``; large ones backed by huge pages if possible."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    # Over-map by one huge page so the tensor can start on a 2 MiB boundary,
    # which transparent huge pages need.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -base % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes - nbytes % HUGE_PAGE)
    except OSError:
        pass  # THP disabled or unsupported: ordinary pages still work
    # torch.frombuffer keeps a reference to the mapping; it is unmapped with the tensor.
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
