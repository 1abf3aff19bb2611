"""The event loop: a simulated clock and a heap of callbacks, nothing else."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class Loop:
    """Runs callbacks in time order (ties in the order they were scheduled)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self.events = 0

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (max(when, self.now), next(self._order), callback))

    def run(self, until: float, done: Callable[[], bool]) -> None:
        """Until ``done()`` or simulated time ``until`` (or nothing is left to do)."""
        while self._heap and not done():
            when, _, callback = heapq.heappop(self._heap)
            if when > until:
                self.now = until
                return
            self.now = when
            self.events += 1
            callback()
