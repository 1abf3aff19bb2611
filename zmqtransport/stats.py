"""What a transfer moved, as both sides report it; imports nothing from the package.

The receiving side fills one :class:`TransferStats` per ``recv_checkpoint``
(``ZMQTransport.last_recv_stats``); the sending side one per transfer it served
(``last_send_stats``, ``sent_since``). Kept apart so that neither side imports
the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # Receiving side: bytes landed per path (endpoint) and connections used;
    # several with a striped receive (docs/protocol.md, "Spans").
    paths: dict[str, int] = field(default_factory=dict)
    streams: int = 1
    duplicate_messages: int = 0  # striped: messages that arrived twice (a span taken over); dropped

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
