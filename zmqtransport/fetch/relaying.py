"""A receiver's part in a swarm (docs/protocol.md, "Swarm").

When several receivers fetch one step from one source at the same time, the
source makes each receiver that offered to relay (option ``relay``, on by
default) a member of the staging's swarm: a token to serve under, and the
members so far. So each member:

* fetches spans from the source and from every member it knows, each as fast
  as it delivers (:mod:`.striped`, :mod:`.spans`, :mod:`.peers`);
* serves the messages it has landed to the others, through its own
  transport's ROUTER (:class:`~zmqtransport.relayed.Relayed`), copies of
  the bytes exactly as they landed, with the source's checksums;
* stops serving before ``recv_checkpoint`` returns: it keeps serving a short
  tail (:data:`RELAY_TAIL`) while others still fetch from it, then ends every
  transfer it still runs (``not_relaying``: they fetch the rest from the
  source or another member) and waits until its serving thread no longer
  reads the received memory. The caller may mutate its tensors at once.

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

# After its own data is complete, a member keeps serving the others at most
# this long (seconds), and stops as soon as every connection that asked has
# closed (its receive ended). Short: the tail is part of this receive's own
# time, and what the others still want from it, the source and the other
# members serve as well (at worst a few spans per member are asked for again).
RELAY_TAIL = 0.01
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
        # Only a transfer waiting for it needs the serving thread awake. A downstream asks for what it
        # saw landed, so most landings wake nothing: waking the serving thread for each cost both threads
        # a pass and a hand-over of the GIL per message (docs/fast-links.md, "Relaying CPU"). Landed
        # first, then read: the serving thread publishes what it waits for before it looks at what
        # landed, so one side or the other sees a landing between the two (both under the GIL).
        if self.relayed.awaited >> seq & 1:
            self.host.poke()

    def fetching(self, coming: int) -> None:
        """What the receive is fetching now (a bit set): the others ask the source for something else."""
        self.relayed.coming = coming

    def finish(self) -> None:
        """Own data complete: serve a bounded tail while the downstream still asks, then stop."""
        deadline = time.monotonic() + RELAY_TAIL
        relayed = self.relayed
        # Until every member that asked has gone: its receive ended and closed
        # its connection here (a receive closes its connections as soon as its
        # own data is complete, before its own tail, so tails do not wait on
        # each other).
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
