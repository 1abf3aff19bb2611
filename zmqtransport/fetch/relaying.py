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
* once its own data is complete, either goes on serving after
  ``recv_checkpoint`` returns (:class:`AfterReturn`: a fresh receive into host
  memory, with the transport's ``relay_after_return``, the default) until the
  transport's next ``disallow_checkpoint``, send, receive or ``shutdown``, or
  the receive's own deadline; or stops before it returns: it keeps serving a
  short tail (:data:`RELAY_TAIL`) while others still fetch from it, then ends
  every transfer it still runs (``not_relaying``: they fetch the rest from the
  source or another member) and waits until its serving thread no longer
  reads the received memory, so the caller may mutate its tensors at once.

A receive that lands any storage in device memory does not relay: its
downstream is refused (``not_relaying``) and fetches from the source.
"""

from __future__ import annotations

import functools
import logging
import threading
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


class AfterReturn:
    """The finished receive that goes on serving the others after ``recv_checkpoint`` returned.

    Why: in a swarm the members that finish first are the ones the late ones
    fetch from. A member that stops as it returns leaves the late (a slower
    link) to the source, which then uploads their part again: in the model,
    64 receivers with a quarter on slower links took the source 2.6 states
    against 1.4 with members serving on (docs/sim.md, "Serving after the
    receive returns"). torchft calls ``disallow_checkpoint`` on every replica
    in ``should_commit``, after the step's collectives, which wait for every
    healing replica: a member serving until then holds no one back.

    Only a fresh receive into host memory serves on (the memory is the
    receive's own, kept alive here whatever the caller drops); a receive in
    place does not (the caller's tensors may change under it at once). What it
    serves is checked by every downstream against the source's digests, so a
    caller that changes the returned tensors before ``disallow_checkpoint``
    costs the others time (they drop it), never a wrong byte.

    Threading: :meth:`hold` runs on the receiving thread, :meth:`stop` on any
    (the transport's calls, the deadline's timer). At most one is held: a new
    one stops the last.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._duty: RelayDuty | None = None
        self._keep: object = None  # the received memory's owner (fetch.landed.Landed)
        self._timer: threading.Timer | None = None

    @property
    def duty(self) -> RelayDuty | None:
        return self._duty

    def hold(self, duty: RelayDuty, keep: object, until: float) -> None:
        """Serve ``duty`` on, from memory that ``keep`` owns, at most until ``until`` (time.monotonic())."""
        self.stop()
        timer = threading.Timer(max(0.0, until - time.monotonic()), functools.partial(self._expire, duty))
        timer.daemon = True
        timer.name = "zmqtransport-relay-deadline"
        with self._lock:
            self._duty, self._keep, self._timer = duty, keep, timer
        timer.start()

    def stop(self, only: RelayDuty | None = None) -> None:
        """Stop serving (``only``: if that one is still held); once this returns nothing reads the memory,
        and it is released here."""
        with self._lock:
            if only is not None and self._duty is not only:
                return
            duty, keep, timer = self._duty, self._keep, self._timer
            self._duty, self._keep, self._timer = None, None, None
        if timer is not None:
            timer.cancel()
        if duty is not None:
            duty.stop()
        del keep  # only now: the serving thread may have been copying from it until duty.stop() returned

    def _expire(self, duty: RelayDuty) -> None:
        if self._duty is duty:
            logger.debug("zmqtransport: a relay that served after its receive returned reached its deadline")
        self.stop(only=duty)
