"""What a receive is asked to do: one complete, immutable options object per transport.

:class:`FetchOptions` is built once, complete, by the transport (or a test)
and never changed; what differs per peer (the source's CurveZMQ server key)
is passed to :func:`zmqtransport.fetch.fetch` beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..device import CPU, DeviceStaging
from ..net import PeerAddress
from .landing import LandingOptions
from .relaying import RelayHost
from .streams import Configure

ProgressCallback = Callable[[int, int], None]
VERIFY_CHOICES = ("relayed", "all")


@dataclass(frozen=True)
class RelayOffer:
    """This receiver relays what it receives (docs/protocol.md, "Swarm")."""

    at: str  # where it serves: its transport's metadata, offered in the header fetch
    host: RelayHost  # its transport's server, which serves the relayed step
    # DEALER options for fetching from a relay the source names (its CurveZMQ key, from its metadata).
    options_for: Callable[[PeerAddress], Configure | None]


@dataclass(frozen=True)
class FetchOptions:
    allow_pickle: bool = False
    window: int = 16  # data messages in flight (credit) on a single-connection receive
    max_bytes: int | None = None  # refuse headers claiming more fresh memory than this
    progress: ProgressCallback | None = None
    device: torch.device = CPU  # where fresh (not in-place) tensors are allocated
    staging: DeviceStaging = field(default_factory=DeviceStaging)  # pinned bounce buffers
    huge_pages: bool = False  # advise fresh storages to use transparent huge pages
    prefault_threads: int = 2  # threads faulting fresh storage in ahead of the data
    # Fail a transfer whose source sends nothing for this long (seconds; None: only the timeout).
    stall_timeout: float | None = None
    # Connections per receive (docs/protocol.md, "Spans"): None, one per path
    # the source advertises; 1, a single connection (no span fetches).
    streams: int | None = None
    relay: RelayOffer | None = None  # None: this receiver does not relay
    # What is checked against the source's strong digests (docs/protocol.md, "Digests"):
    # "relayed", every message a relay sends; "all", every message, the source's own too.
    verify: str = "relayed"

    @property
    def verifies_all(self) -> bool:
        """Whether the source's own messages are checked against its digests too (``verify="all"``)."""
        return self.verify == "all"

    def striped(self, address: PeerAddress) -> bool:
        """Whether a receive from ``address`` asks for the header alone, then for spans on several connections."""
        if self.streams is None:
            return bool(address.more_paths)
        return self.streams > 1

    def landing(self) -> LandingOptions:
        """What the landing plan needs of these options."""
        return LandingOptions(
            max_bytes=self.max_bytes, device=self.device, stages=self.staging.stages, huge_pages=self.huge_pages
        )
