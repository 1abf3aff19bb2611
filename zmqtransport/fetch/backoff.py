"""A source at its limits says ``busy``: the receive asks it again later, it does not fail.

The source bounds what it runs at once (:class:`~zmqtransport.serve.admission.Limits`:
data transfers, digest requests). In a swarm of many members each keeps a span
or two out to the source, and at 64 members that bound is reached as a matter
of course (the model, docs/sim.md: half of 64 receives failed ``busy`` when a
refusal of a span ended the receive). ``busy`` is a refusal for now, not of
the receive: the refused request is asked again after a bounded backoff, and
meanwhile what peers hold is taken from them. The source's other refusals
(the step gone, not allowed, a bad request) still fail the receive.

Pure: an explicit ``now``. The backoff doubles while refusals follow each
other and starts over once the source has been quiet about it for a while; a
share of it is spread by the refused request's transfer id (random in
production, so members refused together do not all come back together).
"""

from __future__ import annotations

import math

# Seconds: the first wait after a ``busy`` (a few of a fast link's message
# times: what the source runs frees a slot about that often) ...
BUSY_FIRST = 0.02
# ... doubling while refusals follow each other, never above this (a fraction
# of a receive's quiet and stall bounds: the source is busy, not gone).
BUSY_MOST = 0.5
# A refusal this many times the current wait after the last one starts over.
BUSY_FORGET = 4.0


class Backoff:
    """When each kind of request (``spans``, ``digests``, ``questions``) may go to a busy source again."""

    def __init__(self) -> None:
        self._wait: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._until: dict[str, float] = {}

    def refused(self, kind: str, xfer: int | None, now: float) -> float:
        """A request of ``kind`` (transfer id ``xfer``) was refused ``busy`` at ``now``: until when to hold off."""
        wait = self._wait.get(kind)
        fresh = wait is None or now - self._last[kind] > BUSY_FORGET * wait
        wait = BUSY_FIRST if wait is None or fresh else min(BUSY_MOST, 2 * wait)
        self._wait[kind], self._last[kind] = wait, now
        spread = ((xfer or 0) % 1024) / 1024  # half the wait fixed, half spread over members
        self._until[kind] = max(self._until.get(kind, -math.inf), now + wait * (0.5 + spread / 2))
        return self._until[kind]

    def holds(self, kind: str, now: float) -> bool:
        """Whether requests of ``kind`` wait still."""
        return now < self._until.get(kind, -math.inf)

    def until(self, kind: str) -> float:
        """When requests of ``kind`` may go again (-inf: never refused)."""
        return self._until.get(kind, -math.inf)
