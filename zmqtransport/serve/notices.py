"""WARNINGs about peers a human can read: one per peer and kind, repeats counted and summed up once.

A peer that misbehaves does it again and again: a flood of bad requests, a
fetch after fetch that it never reads, transfer after transfer cut short. One
WARNING per event buries the log (and costs the serving thread a formatted
line each time). :class:`Notices` logs the first event of a kind from one
peer address at WARNING, the repeats at DEBUG, and a single WARNING with their
count when the socket owner flushes it: when a new step is staged, at a
disallow, at shutdown, and at the latest :data:`SUMMARY_EVERY` seconds after a
repeat. Pure bookkeeping (no zmq, no threads); the serving thread owns it.
"""

from __future__ import annotations

import logging
from typing import Any

# Seconds: repeats are summed up at least this often while they go on.
SUMMARY_EVERY = 60.0


class Notices:
    """Counts of warnings per (peer address, kind) since the last summary."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._counts: dict[tuple[str, str], int] = {}
        self._first_repeat: float | None = None

    def warn(self, address: str, kind: str, now: float, message: str, *args: Any) -> None:
        """A WARNING the first time ``kind`` happens for ``address`` since the last summary; DEBUG after that."""
        key = (address, kind)
        seen = self._counts.get(key, 0)
        self._counts[key] = seen + 1
        if seen == 0:
            self._logger.warning(message, *args)
            return
        self._logger.debug(message, *args)
        if self._first_repeat is None:
            self._first_repeat = now

    def due(self, now: float) -> bool:
        """Whether repeats have waited :data:`SUMMARY_EVERY` for their summary."""
        return self._first_repeat is not None and now - self._first_repeat >= SUMMARY_EVERY

    def flush(self) -> None:
        """One WARNING per peer and kind that happened again since its first: how many times in all."""
        for (address, kind), count in sorted(self._counts.items()):
            if count > 1:
                summary = "%s: %s %d times in all (the first logged above, the rest at DEBUG)"
                self._logger.warning(summary, address, kind, count)
        self._counts.clear()
        self._first_repeat = None
