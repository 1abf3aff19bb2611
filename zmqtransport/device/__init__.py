"""Device (CUDA) staging: reusable pinned host buffers between GPU memory and ZeroMQ frames.

ZeroMQ moves host memory only. A CUDA storage therefore travels through a
small ring of page-locked ("pinned") host buffers, one data message at a time:

* **send** (:class:`SendStager`): the serving thread issues device-to-host
  copies of the next few data messages on a side stream, each into a free
  buffer of its ring, and sends a message as soon as its copy has completed;
  copies of later messages run while earlier ones are on the wire. Nothing is
  copied in ``send_checkpoint``, which only records where the caller's stream
  stands (:func:`prepare_send`).
* **receive** (:class:`RecvUnstager`): each data message for device memory is
  received into a free pinned bounce buffer, checked, and copied to the device
  on a side stream while the next messages arrive; the receive waits for every
  copy before it returns or raises.

A buffer is reused only when nothing can still touch it: no stager holds it,
its last copy has completed, and libzmq has released the last frame sent from
it (pyzmq ``MessageTracker``). The rings are allocated on first use and kept
for the transport's lifetime, so a step allocates no pinned memory.

Threading (who owns what):

* a :class:`SendStager` belongs to one ``serve.Server`` and is used only by
  its serving thread (the data pump, serve/pump.py), which thus owns the send
  ring and the side stream of each of the stager's copy engines. The only
  cross-thread input is the *producer marker* that ``send_checkpoint`` records
  on the calling thread's current stream, which the side stream waits for
  before its first copy of that step;
* a :class:`RecvUnstager` is borrowed from its :class:`DeviceStaging` by one
  receiving thread for one ``recv_checkpoint`` and given back when that call
  ends; while borrowed, that thread alone uses its ring and side streams;
* a :class:`DeviceStaging` (configuration plus the pool of idle receive kits)
  may be shared by threads; its pool is guarded by a lock.

Copy engines hide CUDA streams and events behind :class:`CopyEngine`, so the
decisions made here (chunk order, look-ahead, back-pressure, buffer reuse) run
unchanged on CPU with ``zmqtransport.testing.HostCopyEngine``, a deferred
fake that the tests and ``scripts/device_check.sh --cpu`` use. On a CPU-only
torch no CUDA API is called: nothing reaches :class:`CudaCopyEngine` without a
CUDA tensor, and ``device="cuda"`` is refused at construction.

The parts, one module each: :mod:`.engines` (the copy-engine protocol and the
CUDA engine), :mod:`.ring` (the pinned ring), :mod:`.staging` (configuration
and byte views), :mod:`.send` (the send stager), :mod:`.recv` (the receive
unstager). This package exports what the sending and receiving sides use.
"""

from __future__ import annotations

from .engines import CPU, CopyEngine, CopyEvent, CudaCopyEngine, capture_marker, cuda_engine, pinned_buffer
from .recv import RecvUnstager, UnstageTarget
from .ring import PinnedRing, Slot, Tracker
from .send import SendPlan, SendStager, prepare_send
from .staging import (
    DeviceStaging,
    RecvKit,
    can_fill,
    fresh_device,
    fresh_storage,
    storage_bytes,
    tensor_bytes,
)

__all__ = [
    "CPU",
    "CopyEngine",
    "CopyEvent",
    "CudaCopyEngine",
    "DeviceStaging",
    "PinnedRing",
    "RecvKit",
    "RecvUnstager",
    "SendPlan",
    "SendStager",
    "Slot",
    "Tracker",
    "UnstageTarget",
    "can_fill",
    "capture_marker",
    "cuda_engine",
    "fresh_device",
    "fresh_storage",
    "pinned_buffer",
    "prepare_send",
    "storage_bytes",
    "tensor_bytes",
]
