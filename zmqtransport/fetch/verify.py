"""Checking relayed data messages against the source's digests: the bookkeeping, without sockets.

A relay is any peer the source chained: it may send anything (docs/security.md).
So a receive that fetches from relays asks the source itself, over its own
connection, for the digest of every message of each span it asks a relay for
(a span fetch with ``digests_only``, docs/protocol.md "Digests"), hashes every
payload a relay sends right after it lands, and counts a message as landed
only once the two match. :class:`DigestBook` holds what that takes: the
digests the source published, the digest requests still out (and on which
connection), and the messages that arrived before their digest did.

Pure (explicit ``now``, no zmq); the receive's planner (:mod:`.planner`)
decides what to ask and when, and its requests live in the receive's one
:class:`~.registry.Registry`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .registry import Registry


@dataclass(frozen=True)
class DigestRequest:
    """Digests of messages [first, stop) asked of the source on ``stream`` under transfer id ``xfer``."""

    xfer: int
    stream: int
    first: int
    stop: int
    opened: float
    ahead: bool = False  # asked before any of its messages was fetched from a peer (read-ahead)


@dataclass(frozen=True)
class Verdict:
    """Message ``seq``, sent by ``stream``, matches the source's digest (``ok``) or not."""

    seq: int
    stream: int
    ok: bool


class DigestBook:
    """The source's digests of one receive's messages, and the relayed messages waiting for theirs.

    ``size`` is the chosen algorithm's digest size; its requests are kept in
    ``registry`` (the receive's; a fresh one by default).
    """

    def __init__(self, messages: int, size: int, registry: Registry | None = None) -> None:
        self.size = size
        self.expected: list[bytes | None] = [None] * messages
        self._asked = bytearray(messages)  # 1: known, or asked on a request still out
        self.registry = registry if registry is not None else Registry()
        self.pending: dict[int, tuple[bytes, int]] = {}  # seq -> (its payload's digest, the stream it came on)

    @property
    def requests(self) -> dict[int, DigestRequest]:
        """The requests still out, by transfer id (a copy)."""
        return {request.xfer: request for request in self.registry.of(DigestRequest)}

    # ------------------------------------------------------------------ asking

    def wanted(self, first: int, stop: int) -> list[tuple[int, int]]:
        """The runs of messages in [first, stop) whose digest is neither known nor asked for."""
        runs: list[tuple[int, int]] = []
        seq = first
        while seq < stop:
            if self._asked[seq]:
                seq += 1
                continue
            start = seq
            while seq < stop and not self._asked[seq]:
                seq += 1
            runs.append((start, seq))
        return runs

    def unverified_wanted(self) -> list[tuple[int, int]]:
        """Runs of messages that arrived and wait for a digest nobody is asked for (its request was lost)."""
        runs: list[tuple[int, int]] = []
        for seq in sorted(self.pending):
            if self._asked[seq]:
                continue
            if runs and runs[-1][1] == seq:
                runs[-1] = (runs[-1][0], seq + 1)
            else:
                runs.append((seq, seq + 1))
        return runs

    def ahead(self, start: int, run: int) -> tuple[int, int] | None:
        """The first run (at most ``run`` long) of messages from ``start`` on whose digest is neither
        known nor asked for; None: there is none."""
        first = self._asked.find(0, start)
        if first < 0:
            return None
        stop = self._asked.find(1, first, first + run)
        return first, (min(first + run, len(self._asked)) if stop < 0 else stop)

    def asking(self, xfer: int, stream: int, first: int, stop: int, now: float, ahead: bool = False) -> None:
        self.registry.add(DigestRequest(xfer, stream, first, stop, now, ahead))
        self._asked[first:stop] = b"\x01" * (stop - first)

    # ------------------------------------------------------------------ answers

    def on_digests(self, xfer: int, first: int, blob: bytes) -> list[Verdict] | None:
        """The source's answer to request ``xfer``; verdicts on the messages that waited for it.

        None: no such request (cancelled, or its stream was dropped: ignore it).
        Raises ``ValueError`` when the answer does not cover exactly the request.
        """
        request = self.registry.get(xfer, DigestRequest)
        if request is None:
            return None
        count = request.stop - request.first
        if first != request.first or len(blob) != count * self.size:
            raise ValueError(
                f"digests of messages {first}.. ({len(blob)} bytes) where {request.first}..{request.stop} were asked"
            )
        self.registry.pop(xfer)
        verdicts: list[Verdict] = []
        for index in range(count):
            seq = first + index
            digest = blob[index * self.size : (index + 1) * self.size]
            self.expected[seq] = digest
            held = self.pending.pop(seq, None)
            if held is not None:
                verdicts.append(Verdict(seq, held[1], held[0] == digest))
        return verdicts

    def check(self, seq: int, digest: bytes, stream: int) -> bool | None:
        """Message ``seq`` arrived from ``stream`` with this ``digest``: True/False once known; None: it waits."""
        expected = self.expected[seq]
        if expected is not None:
            return expected == digest
        self.pending[seq] = (digest, stream)
        return None

    # ------------------------------------------------------------------ losses

    def forget(self, stream: int) -> list[int]:
        """``stream`` was dropped as a relay: its messages still waiting are not believed. Returns them."""
        gone = [seq for seq, (_, by) in self.pending.items() if by == stream]
        for seq in gone:
            del self.pending[seq]
        return gone

    def lost(self, stream: int) -> list[DigestRequest]:
        """``stream`` (a connection to the source) is gone: its requests are asked again elsewhere. Returns them."""
        gone = [request for request in self.registry.of(DigestRequest) if request.stream == stream]
        for request in gone:
            self.withdraw(request.xfer)
        return gone

    def withdraw(self, xfer: int) -> DigestRequest | None:
        """Request ``xfer`` will not be answered (refused, or its stream is gone): its messages may be asked again."""
        request = self.registry.get(xfer, DigestRequest)
        if request is not None:
            self.registry.pop(xfer)
            for seq in range(request.first, request.stop):
                if self.expected[seq] is None:
                    self._asked[seq] = 0
        return request
