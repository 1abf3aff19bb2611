"""What a receive is asked to do: one complete, immutable options object per transport.

:class:`FetchOptions` is built once, complete, by the transport (or a test)
and never changed; what differs per peer (the source's CurveZMQ server key)
is passed to :func:`zmqtransport.fetch.fetch` beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..codec.skeleton import iter_tensor_leaves
from ..device import CPU, DeviceStaging
from ..net import PeerAddress
from .landing import LandingOptions
from .relaying import RelayDuty, RelayHost
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
    # Takes over a finished fresh receive's relaying, to serve on after it returns (.relaying.AfterReturn.hold:
    # the duty, the owner of its memory, a deadline); None: stop before returning (``relay_after_return=False``).
    after_return: Callable[[RelayDuty, object, float], None] | None = None


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
    # With streams=None, the connections a receive that is no swarm member opens to the source on one
    # path (striped, in spans): 1 (the direct path, one connection), or more where the transport's
    # context has several I/O threads to carry them (docs/performance.md, "Many cores").
    direct_streams: int = 1
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
            return bool(address.more_paths) or self.direct_streams > 1
        return self.streams > 1

    def into(self, targets: Any) -> FetchOptions:
        """These options for one receive into ``targets`` (None: fresh memory on ``device``).

        No extra streams for a state that lands in device memory: their gain was measured in host
        memory, and a GPU heal, bound by its copies through pinned buffers, was not faster with them
        (docs/cuda.md).
        """
        if self.direct_streams <= 1:
            return self
        on_device = self.device.type != "cpu" or (targets is not None and _any_off_cpu(targets))
        return replace(self, direct_streams=1) if on_device else self

    def stream_count(self, paths: int, member: bool) -> int | None:
        """Connections to the source of a striped receive over ``paths`` paths; None: one per path.

        A swarm member keeps one per path with ``streams=None``: each more would be one more transfer
        at the source, whose limit a job-scale swarm already meets (docs/sim.md).
        """
        if self.streams is not None or member or self.direct_streams <= 1:
            return self.streams
        return max(self.direct_streams, paths)

    def landing(self) -> LandingOptions:
        """What the landing plan needs of these options."""
        return LandingOptions(
            max_bytes=self.max_bytes, device=self.device, stages=self.staging.stages, huge_pages=self.huge_pages
        )


def _any_off_cpu(targets: Any) -> bool:
    """Whether any tensor of an in-place receive's structure is in device memory."""
    return any(isinstance(leaf, torch.Tensor) and leaf.device.type != "cpu" for _, leaf in iter_tensor_leaves(targets))
