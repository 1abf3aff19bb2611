"""A rogue relay for the benchmark (issue 21): a receiver whose relaying is modified, in its own process.

The receiver of rank :attr:`~.config.Rogue.rank` heads the source's relay
chain (it starts first) and, in its own process only, relays as ``mode`` says:

* ``flip``: flips bytes of every message it forwards and sends a CRC32 that
  matches the forgery;
* ``error``: answers every span fetch with an error reply (``stalled``);
* ``silent``: takes span fetches and sends nothing;
* ``shutdown``: an honest relay whose transport shuts down once half of its
  own data has landed;
* ``hoard``: claims every message from the source (the most a claim may
  ask for, again and again) and fetches none of what the source reserved for
  it; it serves what it lands honestly;
* ``liar`` (issue 34): claims every message from the source as ``hoard``
  does, answers every question about what it holds with "nothing, but I am
  fetching everything", serves nothing, and fetches nothing itself for
  :data:`LIE_SECONDS` (so it lies far longer than its own receive would take);
* ``freeze`` (tests only, not a benchmark row: its process stays stopped): an
  honest relay that stops itself (SIGSTOP) once half of its own data has
  landed, with reservations and claims outstanding.

Its own receive is not timed. The rows show what a rogue costs the honest
receivers chained behind it; tests/test_rogue_lab.py checks that they
complete bit-exact and name it.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import zlib
from collections.abc import Callable
from typing import Any

from .. import relayed, wire
from ..serve import actions, relayed_steps, scheduler

# Seconds the liar fetches nothing itself (lying all along), then finishes its own receive.
LIE_SECONDS = 12.0

MODES = ("flip", "error", "silent", "shutdown", "hoard", "liar", "freeze")


def become_rogue(mode: str) -> None:
    """Modify relaying in this process as ``mode`` says (``shutdown`` needs :func:`shutdown_halfway` too)."""
    if mode == "flip":
        honest = relayed.Relayed.payload

        def payload(self: relayed.Relayed, seq: int) -> tuple[bytes, bool]:
            data, referenced = honest(self, seq)
            forged = bytearray(data)
            forged[::997] = bytes(b ^ 0x5A for b in forged[::997])
            return bytes(forged), referenced

        def crc(self: relayed.Relayed, seq: int, payload: Any) -> int:
            return zlib.crc32(payload)  # a CRC32 that matches the forgery

        relayed.Relayed.payload = payload  # type: ignore[method-assign]
        relayed.Relayed.crc = crc  # type: ignore[method-assign]
    elif mode == "error":

        def refuse(self: scheduler.Scheduler, peer: bytes, request: wire.Request, address: str, now: float) -> Any:
            return [actions.Refuse(peer, request.xfer, wire.ERR_STALLED, "rogue")]

        scheduler.Scheduler._start_relayed = refuse  # type: ignore[method-assign]
    elif mode == "silent":
        relayed.Relayed.available = lambda self, seq: False  # type: ignore[method-assign]
    elif mode == "hoard":
        from ..fetch import planner, spans

        planner.CLAIM_MESSAGES = wire.MAX_CREDIT
        spans.Reservations.add = lambda self, first, stop: None  # type: ignore[method-assign]  # thrown away
    elif mode == "liar":
        from ..fetch import planner, spans

        planner.CLAIM_MESSAGES = wire.MAX_CREDIT
        spans.Reservations.add = lambda self, first, stop: None  # type: ignore[method-assign]  # thrown away
        relayed.Relayed.available = lambda self, seq: False  # type: ignore[method-assign]
        honest_assign = spans.SpanBook.assign

        began: list[float] = []

        def assign(
            self: spans.SpanBook, stream: int, xfer: int, now: float, takeovers: spans.Takeovers | None = None
        ) -> spans.Span | None:
            # A few messages (the source serves it and names it to the others), then nothing for
            # LIE_SECONDS: it lies far longer than an honest receive takes, not only until its own is
            # done, and still ends (a benchmark trial waits for it).
            if not began:
                began.append(now)
            if self.messages - self.missing < 8 or now - began[0] >= LIE_SECONDS:
                return honest_assign(self, stream, xfer, now, takeovers)
            return None

        spans.SpanBook.assign = assign  # type: ignore[method-assign]
        honest_have = relayed_steps.RelayedSteps.have

        def have(self: relayed_steps.RelayedSteps, peer: bytes, request: wire.Request) -> Any:
            answer = honest_have(self, peer, request)
            if answer is None:
                return None
            return dataclasses.replace(answer, bits=0, coming=(1 << answer.messages) - 1)

        relayed_steps.RelayedSteps.have = have  # type: ignore[method-assign]
    elif mode not in ("shutdown", "freeze"):
        raise ValueError(f"unknown rogue mode {mode!r}; known: {', '.join(MODES)}")


def shutdown_halfway(transport: list[Any]) -> Callable[[int, int], None]:
    """A progress callback that shuts ``transport[0]`` (made after it) down once half of its data has landed."""
    done_once: list[bool] = []

    def progress(done: int, total: int) -> None:
        if not done_once and done >= total // 2 and transport:
            done_once.append(True)
            transport[0].shutdown(wait=False)

    return progress


def freeze_halfway() -> Callable[[int, int], None]:
    """A progress callback that stops this process (SIGSTOP: every thread, its serving one too) once half
    of its data has landed; whoever started it kills it."""

    def progress(done: int, total: int) -> None:
        if done >= total // 2:
            os.kill(os.getpid(), signal.SIGSTOP)

    return progress
