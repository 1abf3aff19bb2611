"""What a transfer moved, as both sides report it; imports nothing from the package.

The receiving side fills one :class:`TransferStats` per ``recv_checkpoint``
(``ZMQTransport.last_recv_stats``); the sending side one per transfer it served
(``last_send_stats``, ``sent_since``). Kept apart so that neither side imports
the other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TransferStats:
    """What the last transfer moved; read it from :attr:`ZMQTransport.last_recv_stats`."""

    peer: str
    step: int
    bytes: int = 0
    in_place_bytes: int = 0
    tensors: int = 0
    messages: int = 0
    seconds: float = 0.0
    header_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
