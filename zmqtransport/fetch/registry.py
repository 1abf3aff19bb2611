"""What one receive asked of whom: every request it sent, by transfer id, in one table.

A striped receive sends span fetches, questions (``have``: to a peer about
what it holds, to the source about the members and claims), signs of life,
and digest requests, each under a transfer id of its own. Every reply names
its transfer id; :class:`Registry` tells what it answers with one look-up:
an outstanding request (a :class:`~.spans.Span`, a
:class:`~.verify.DigestRequest`, a :class:`Question`), or one settled
(:data:`CANCELLED`, :data:`KEEPALIVE`, :data:`FORGOTTEN`) whose late answers
are dropped. The span book, the digest book and the swarm's peers keep their
requests here, each its own kind. Pure: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

# Why a request's late answers are dropped.
CANCELLED = "cancelled"  # a span fetch told to stop
KEEPALIVE = "keepalive"  # a sign of life to the source: its answer means nothing
FORGOTTEN = "forgotten"  # a question to the source given up on (unanswered for too long)


class Asked(Protocol):
    """An outstanding request: what it answers to is named by ``xfer``."""

    @property
    def xfer(self) -> int: ...


@dataclass
class Question:
    """A ``have`` question under ``xfer`` to ``peer`` (the source: about the members, claiming with
    ``claim``), sent at ``sent``; ``turn_before`` is when its peer was due before it was asked."""

    xfer: int
    peer: int
    sent: float
    turn_before: float
    claim: bool = False


A = TypeVar("A")


class Registry:
    """Every request of one receive still out, by transfer id, and those settled (late answers dropped)."""

    def __init__(self) -> None:
        self.asked: dict[int, Asked] = {}
        self.settled: dict[int, str] = {}
        # The same requests by kind: the planner walks one kind (its spans, its questions) several times a
        # pass, and with 64 peers a receive has a hundred of each kind out at once.
        self._kinds: dict[type, dict[int, Asked]] = {}

    def add(self, request: Asked) -> None:
        self.pop(request.xfer)  # a transfer id names one request
        self.asked[request.xfer] = request
        self._kinds.setdefault(type(request), {})[request.xfer] = request

    def pop(self, xfer: int) -> Asked | None:
        request = self.asked.pop(xfer, None)
        if request is not None:
            del self._kinds[type(request)][xfer]
        return request

    def of(self, kind: type[A]) -> Iterator[A]:
        """The outstanding requests of one kind, oldest first."""
        yield from self._kinds.get(kind, {}).values()  # type: ignore[misc]

    def get(self, xfer: int | None, kind: type[A]) -> A | None:
        """The outstanding request ``xfer`` if it is of ``kind``."""
        request = self.asked.get(xfer) if xfer is not None else None
        return request if type(request) is kind else None

    def settle(self, xfer: int, why: str) -> None:
        """``xfer`` will not be followed: its answers, when they come, are dropped."""
        self.pop(xfer)
        self.settled[xfer] = why

    def settled_as(self, xfer: int | None) -> str | None:
        """Why answers to ``xfer`` are dropped (None: they are not)."""
        return self.settled.get(xfer) if xfer is not None else None
