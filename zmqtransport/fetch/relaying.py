"""A receiver's part in relaying (docs/protocol.md, "Relays").

When several receivers fetch one step from one source at the same time, the
source tells each receiver that offered to relay (option ``relay``, on by
default) a token to serve under and, from the second on, a relay to fetch
from: the receiver before it. So each receiver:

* fetches its spans from its upstream relay, keeping the source's connection
  as a standby that takes over when the relay is lost, stalls, or stops
  (:mod:`.striped`, :mod:`.spans`);
* serves the messages it has landed to its own downstream, through its own
  transport's ROUTER (:class:`~zmqtransport.relayed.Relayed`), copies of
  the bytes exactly as they landed, with the source's checksums;
* stops serving before ``recv_checkpoint`` returns: it keeps serving a
  bounded tail (:data:`RELAY_TAIL`) while its downstream still asks, then
  ends every transfer it still runs (``not_relaying``: the downstream fetches
  the rest from the source) and waits until its serving thread no longer reads
  the received memory. The caller may mutate its tensors at once.

A receive that lands any storage in device memory does not relay: its
downstream is refused (``not_relaying``) and fetches from the source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from .. import wire
from ..relayed import Relayed

logger = logging.getLogger("zmqtransport.fetch")

# After its own data is complete, a relay keeps serving its downstream at most
# this long (seconds), and stops as soon as every downstream connection that
# asked has closed (its receive ended): on equal links a downstream is a few
# messages behind, so the tail is a few message times.
RELAY_TAIL = 1.0
RELAY_POLL = 0.005  # seconds between looks at whether the downstream has gone
# How long the receive waits for the serving thread to stop reading the relayed memory.
STOP_BOUND = 5.0


class RelayHost(Protocol):
    """What relaying needs of the receiving transport's server (:class:`zmqtransport.serve.Server`)."""

    def relay(self, relayed: Relayed) -> None: ...

    def poke(self) -> None: ...

    def stop_relay(self, token: bytes, timeout: float) -> bool: ...


class RelayDuty:
    """Serving one receive's landed messages to its downstream, from start to a bounded stop."""

    def __init__(self, host: RelayHost, relayed: Relayed) -> None:
        self.host = host
        self.relayed = relayed
        self._stopped = False
        host.relay(relayed)

    @classmethod
    def start(cls, host: RelayHost, token: bytes, step: int, stage: int, plan: list[list[wire.Piece]]) -> RelayDuty:
        """Relay as the source ordered, under ``token``. Serves nothing until :meth:`attach`."""
        return cls(host, Relayed(step, stage, token, plan))

    def attach(self, views: Sequence[memoryview] | None) -> None:
        """The receive's memory is allocated: serve from it (None: device memory, which is not relayed)."""
        if views is None:
            self.stop()  # the downstream is refused and fetches from the source
        else:
            self.relayed.views = views

    @property
    def stopped(self) -> bool:
        return self._stopped

    def landed(self, seq: int, crc: int | None) -> None:
        """Message ``seq`` landed: the downstream may have it now."""
        self.relayed.landed_one(seq, crc)
        if self.relayed.served:
            self.host.poke()  # only a downstream waiting for it needs the serving thread awake

    def finish(self) -> None:
        """Own data complete: serve a bounded tail while the downstream still asks, then stop."""
        deadline = time.monotonic() + RELAY_TAIL
        relayed = self.relayed
        # Until every downstream that asked has gone: its receive ended and
        # closed its connection here (a receive closes its connections as soon
        # as its own data is complete, before its own tail, so a chain does not
        # wait for its last member). Idleness would end the tail too early
        # where a link's queue holds a span's worth of data still draining.
        while relayed.served and relayed.peers and time.monotonic() < deadline:
            time.sleep(RELAY_POLL)
        self.stop()

    def stop(self) -> None:
        """Stop relaying; once this returns nothing reads the received memory (its caller's now)."""
        if self._stopped:
            return
        self._stopped = True
        self.relayed.stop()  # from here on nothing reads the received memory
        # Then end the relay's transfers with a reply, so its downstream turns
        # to the source at once rather than after its own bounds.
        if not self.host.stop_relay(self.relayed.token, STOP_BOUND):
            logger.warning("zmqtransport: the serving thread did not end the relay's transfers in %.1f s", STOP_BOUND)
