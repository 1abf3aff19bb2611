"""What a transfer moved, as both sides report it; imports nothing from the package.

The receiving side fills one :class:`TransferStats` per ``recv_checkpoint``
(``ZMQTransport.last_recv_stats``); the sending side one per transfer it served
(``last_send_stats``, ``sent_since``), and one :class:`DisallowStats` per
``disallow_checkpoint`` (``last_disallow_stats``). Kept apart so that neither
side imports the other.
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
    # Receiving side, how the data came: "direct" (one connection, the source sends it all),
    # "striped" (spans, from the source only) or "swarm" (spans, from the source and peers).
    path: str = "direct"

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class DisallowStats:
    """What the last ``disallow_checkpoint`` did; read it from :attr:`ZMQTransport.last_disallow_stats`."""

    seconds: float = 0.0  # the caller was held this long
    receives: int = 0  # receives of the step running at the call, finished since from the snapshot (or waited for)
    needed_bytes: int = 0  # what they could still ask for at the call (not sent yet; all of it for striped ones)
    snapshot_bytes: int = 0  # copied so that they could finish without the caller's tensors (the network
    # went on meanwhile: the copy stops where it has been)
    snapshot_seconds: float = 0.0  # of ``seconds``: taking that copy
    waited: bool = False  # what they needed exceeded the cap (``snapshot_bytes``): the call waited for them
