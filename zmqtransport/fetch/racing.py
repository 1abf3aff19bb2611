"""Choosing which of a source's advertised paths a receive uses.

A source may listen on several addresses (one per network) and advertise them
all, in order of preference (docs/protocol.md, "Paths"). Some of them may not
be reachable from the receiver: an address of a network it is not on, a link
that is down. A receive therefore connects one DEALER to every path at once
and keeps the most preferred one that connects:

* a path that connects is used as soon as every more preferred path is out:
  refused while the source was listening (so the refusal is final: the
  address has no listener of this source), or still silent
  :data:`CONNECT_BOUND` after a later path connected (a dead address or a
  dropped link answers nothing, ever). The source is known to have been
  listening since the race began when the path that connected first was never
  refused; otherwise (a receiver that started before its source) only since
  that first connection, and an earlier refusal is tried again;
* with one connection (``streams=1``) the other DEALERs are closed before the
  request is sent, so the source serves one connection per receive, as with a
  single path; a striped receive keeps them (``connect_first(keep=True)``)
  and stripes the data over every one that connects (:mod:`.striped`);
* while no path connects the receive keeps waiting (the source may not be
  listening yet, exactly as with one path), until the transfer timeout.

Only a metadata string with more than one path comes here: one path is
connected to directly: there is nothing to choose.

:class:`PathChoice` is the pure decision; :func:`connect_first` feeds it from
the DEALERs' socket monitors.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import zmq

from ..net import Path
from .liveness import CONNECT_BOUND
from .streams import SourceWatch


class PathChoice:
    """Which path to use, from the connection events of each path's DEALER."""

    def __init__(self, count: int, bound: float = CONNECT_BOUND) -> None:
        self.bound = bound
        self.connected_at: list[float | None] = [None] * count  # last successful handshake, while up
        self.refused_at: list[float | None] = [None] * count  # last failed connection attempt
        self.source_seen_at: float | None = None  # the first handshake on any path
        self.listening_since = math.inf  # refusals from then on are final (see the module docstring)

    def on_event(self, index: int, event: int, now: float) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.connected_at[index] = now
            if self.source_seen_at is None:
                self.source_seen_at = now
                self.listening_since = -math.inf if self.refused_at[index] is None else now
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected_at[index] = None
        elif event == zmq.EVENT_CONNECT_RETRIED:
            self.refused_at[index] = now

    def _out(self, index: int, now: float) -> bool:
        """Whether path ``index`` no longer holds up the less preferred ones."""
        seen = self.source_seen_at
        if seen is None:
            return False
        return self.refused(index) or now >= seen + self.bound

    def refused(self, index: int) -> bool:
        """Whether path ``index`` was refused while the source listened (no listener there: final)."""
        refused = self.refused_at[index]
        return refused is not None and refused >= self.listening_since

    def choice(self, now: float) -> int | None:
        """The path to use now, or None while it is too early to say."""
        for index, connected in enumerate(self.connected_at):
            if connected is not None:
                return index
            if not self._out(index, now):
                return None
        return None

    def wake_at(self) -> float:
        """When :meth:`choice` may change without a new event (the bound running out)."""
        return math.inf if self.source_seen_at is None else self.source_seen_at + self.bound

    def describe(self, paths: Sequence[Path]) -> str:
        """Each path with what became of it, for an error message."""
        states = []
        for path, connected, refused in zip(paths, self.connected_at, self.refused_at, strict=True):
            state = "connected" if connected is not None else "refused" if refused is not None else "no answer"
            states.append(f"{path.endpoint} ({state})")
        return ", ".join(states)


class Racer(Protocol):
    """A DEALER taking part in a race (:class:`zmqtransport.fetch.connection.Connection`)."""

    @property
    def path(self) -> Path: ...

    @property
    def socket(self) -> zmq.Socket[Any]: ...

    @property
    def watch(self) -> SourceWatch: ...

    def close(self) -> None: ...


R = TypeVar("R", bound=Racer)


def connect_first(
    candidates: Sequence[R], deadline: float, bound: float = CONNECT_BOUND, keep: bool = False
) -> tuple[R | None, list[R], str]:
    """Connect every candidate (one per path, most preferred first) and pick one with :class:`PathChoice`.

    Returns the winner (None if none was chosen by ``deadline``; then every
    candidate is closed), the others kept open (``keep``: every candidate not
    refused while the source listened, in order of preference, for a striped
    receive; they may still be connecting; else none) and a description of
    each path's fate. A candidate's socket must not be connected yet (its
    watch must report refusals); the caller owns the winner and the kept ones.
    """
    choice = PathChoice(len(candidates), bound)
    poller = zmq.Poller()
    for candidate in candidates:
        poller.register(candidate.watch.monitor, zmq.POLLIN)
    winner: R | None = None
    kept: list[R] = []
    try:
        for candidate in candidates:
            candidate.socket.connect(candidate.path.endpoint)
        while winner is None:
            now = time.monotonic()
            for index, candidate in enumerate(candidates):
                for event in candidate.watch.read_events(now):
                    choice.on_event(index, event, now)
            chosen = choice.choice(now)
            if chosen is not None:
                winner = candidates[chosen]
                if keep:
                    kept = [c for i, c in enumerate(candidates) if c is not winner and not choice.refused(i)]
                break
            if now >= deadline:
                break
            bound_at = choice.wake_at()  # in the past once the source was seen and a path dropped again
            wake = min(deadline, bound_at) if bound_at > now else deadline
            poller.poll(max(0, math.ceil((wake - now) * 1000)))
    finally:
        for candidate in candidates:
            if candidate is not winner and candidate not in kept:
                with contextlib.suppress(zmq.ZMQError):
                    candidate.close()
    return winner, kept, choice.describe([candidate.path for candidate in candidates])
