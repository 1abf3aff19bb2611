"""The CheckpointTransport contract, the same five methods as torchft's.

torchft is optional. When it is installed, :func:`register_with_torchft` makes a
transport class a virtual subclass of ``torchft.checkpointing.CheckpointTransport``
so that ``isinstance`` checks (and ``torchft.Manager``) accept it; torchft is
only imported if it is installed, and only when a transport class asks.
"""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckpointTransport(Generic[T], ABC):
    """Moves a training state from a healthy peer to a recovering one.

    Mirrors ``torchft.checkpointing.transport.CheckpointTransport``: ``metadata``
    describes how to reach this transport, ``send_checkpoint`` makes a step
    available (it may return before anyone received it), ``disallow_checkpoint``
    ends that availability so the caller may mutate the state again,
    ``recv_checkpoint`` pulls a step from a peer, and ``shutdown`` releases
    everything.
    """

    @abstractmethod
    def metadata(self) -> str:
        """A string a remote transport passes to ``recv_checkpoint`` to reach this one."""

    @abstractmethod
    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta) -> None:
        """Make ``state_dict`` at ``step`` available to ``dst_ranks``; may return early."""

    def disallow_checkpoint(self) -> None:  # not abstract: optional in torchft's contract too
        """Stop serving; once this returns the state dict may be mutated."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Receive ``step`` from the transport described by ``metadata``."""

    def shutdown(self, wait: bool = True) -> None:  # not abstract: optional in torchft's contract too
        """Release sockets and threads; ``wait=False`` returns at once."""


def register_with_torchft(cls: type) -> None:
    """Register ``cls`` as a virtual subclass of torchft's CheckpointTransport, if installed."""
    if importlib.util.find_spec("torchft") is None:
        return
    try:
        from torchft.checkpointing.transport import CheckpointTransport as TorchftTransport
    except ImportError:
        return
    TorchftTransport.register(cls)
