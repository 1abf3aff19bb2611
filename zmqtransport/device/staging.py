"""How device memory is staged (:class:`DeviceStaging`), and the byte views of tensors it moves."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .engines import CPU, CopyEngine, cuda_engine, pinned_buffer
from .ring import PinnedRing


@dataclass
class RecvKit:
    """What one receive borrows: a ring of bounce buffers and its engines, by device."""

    ring: PinnedRing
    engines: dict[torch.device, CopyEngine] = field(default_factory=dict)


@dataclass
class DeviceStaging:
    """How device memory is staged; one per transport, shared by its serving and receiving threads.

    Args:
        slots: pinned buffers in a ring (each as large as the largest data
            message it has carried). The serving thread has one ring; each
            concurrent receive borrows one. Pinned memory per ring is at most
            ``slots x chunk_bytes`` (on receive: the sender's ``chunk_bytes``).
        depth: device-to-host copies one transfer may have ahead of the
            network (never more than the receiver's credit allows, and fewer
            when several transfers share the ring).
        make_engine: the copy engine for a device; CUDA streams by default.
        host_buffer: allocates one ring buffer; pinned memory by default.
        stage_host: route host memory through the rings too. Slower; it exists
            so the tests exercise the staging pipeline on machines without GPUs.
    """

    slots: int = 8
    depth: int = 4
    make_engine: Callable[[torch.device], CopyEngine] = cuda_engine
    host_buffer: Callable[[int], torch.Tensor] = pinned_buffer
    stage_host: bool = False
    _idle: list[RecvKit] = field(default_factory=list, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError("slots must be at least 1")
        if not 1 <= self.depth <= self.slots:
            raise ValueError("depth must be in [1, slots]")

    def stages(self, device: torch.device) -> bool:
        """Whether memory on ``device`` travels through the rings."""
        return device.type == "cuda" or (self.stage_host and device.type == "cpu")

    def borrow(self) -> RecvKit:
        """A receive kit for the calling thread; give it back with :meth:`give_back`."""
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return RecvKit(PinnedRing(self.slots, self.host_buffer))

    def give_back(self, kit: RecvKit) -> None:
        """Return a kit whose copies have all completed (the caller synchronised its engines)."""
        with self._lock:
            self._idle.append(kit)


def fresh_device(value: str | torch.device) -> torch.device:
    """Validate the ``device=`` option: where freshly allocated received tensors go."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu' or a CUDA device, got {value!r}") from None
    if device.type == "cpu":
        return CPU
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={value!r}, but this torch build or machine has no CUDA")
        return device
    raise ValueError(f"device must be 'cpu' or a CUDA device, got {value!r}")


def can_fill(device: torch.device) -> bool:
    """Whether an in-place receive can write into a tensor on ``device``."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


def storage_bytes(owner: Any) -> torch.Tensor:
    """The whole storage of ``owner`` (a tensor or an UntypedStorage) as flat uint8, no copy."""
    storage = owner if isinstance(owner, torch.UntypedStorage) else owner.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as flat uint8 on its device, no copy.

    Through ``set_`` rather than ``view(torch.uint8)``, which refuses some
    dtypes and 0-dim tensors.
    """
    itemsize = tensor.element_size()
    flat = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    start = tensor.storage_offset() * itemsize
    return flat.set_(tensor.untyped_storage(), start, (tensor.numel() * itemsize,), (1,))


def fresh_storage(nbytes: int, device: torch.device) -> torch.Tensor:
    """Fresh uint8 memory for one received storage on a staged device."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)

