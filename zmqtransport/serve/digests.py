"""The source's digests of its data messages (docs/protocol.md, "Digests"): computed once, served on request.

A receiver that verifies asks the source, over its own connection, for the
digests of the spans it fetches from relays (a span fetch with
``digests_only``), and with ``verify="all"`` for a digest in every data
envelope (``inline``). The source hashes each data message of a staging at
most once per algorithm and keeps the digest with the staging
(:attr:`Staged.digests`):

* :func:`envelope_digest`, called by the data pump for a transfer that hashes
  what it sends (:class:`Hashing`): the digest of the payload it is sending,
  whatever memory it comes from (a staged tensor, a packed copy, a pinned
  buffer holding device memory);
* :class:`DigestWork`, called by the serving thread every round: answers the
  scheduler's digest transfers (``Transfer.digests_only``) by hashing the
  staged memory, at most :data:`ROUND_BYTES` per round so data keeps flowing,
  then sends one ``digests`` reply and forgets the transfer. A message whose
  bytes live in device memory is hashed from a copy in the stager's pinned
  ring, the path the pump sends it by (one message at a time per request;
  the pump may hash it first, as it sends it to a relay). So every staging
  hashes any message on request, sent or not, and its header says so
  (``ahead``): before, a device staging answered a run only once the pump had
  sent all of it, members cancelled their read-aheads and asked for every
  span's digests alone, and at a job start of 256 that made this thread the
  bound (docs/sim.md, "A source in device memory at job scale").

Only the serving thread uses these; they read staged memory only while the
scheduler still serves the staging (a disallow ends the digest transfers
first, like every other transfer).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import wire
from ..digests import Algorithm, Hasher
from .router import Router
from .snapshot import Snapshot
from .staged import Staged
from .transfers import Key, Transfer

if TYPE_CHECKING:
    from ..device import SendStager
    from .scheduler import Scheduler

# What digests are computed from: a staging, or the copy a disallow left its running receives.
Hashed = Staged | Snapshot

# Bytes hashed per serving round for digest requests: about 2-8 ms at 1-4 GB/s,
# so a request never holds up the data pump (or a disallow) for long.
ROUND_BYTES = 8 << 20
# Seconds the serving thread waits for a device message's copy to host memory
# when only digest work is due (the pump's STAGING_WAIT): no spin meanwhile.
COPY_WAIT = 0.002


def cached(staged: Hashed, algorithm: Algorithm, seq: int) -> bytes | None:
    table = staged.digests.get(algorithm.name)
    return None if table is None else table[seq]


def remember(staged: Hashed, algorithm: Algorithm, seq: int, digest: bytes) -> None:
    table = staged.digests.get(algorithm.name)
    if table is None:
        table = staged.digests[algorithm.name] = [None] * staged.messages
    table[seq] = digest


def envelope_digest(transfer: Transfer, seq: int, payload: Any) -> bytes | None:
    """Hash ``payload`` (data message ``seq``, being sent) once per staging; the envelope's ``dg``, if inline."""
    hashing = transfer.hashing
    staged = transfer.staged
    if hashing is None or not isinstance(staged, Staged | Snapshot):
        return None
    digest = cached(staged, hashing.algorithm, seq)
    if digest is None:
        hasher = hashing.algorithm.new()
        hasher.update(payload)
        digest = hasher.digest()
        remember(staged, hashing.algorithm, seq, digest)
    return digest if hashing.inline else None


def host_readable(staged: Hashed, seq: int) -> bool:
    """Whether message ``seq`` can be hashed from host memory (not built from device memory)."""
    plan = staged.device_plan
    return plan is None or not plan.chunks[seq]


@dataclass
class _Partial:
    """A message hashed over several rounds: the hasher, and how far it has read."""

    seq: int
    hasher: Hasher
    offset: int = 0


class DigestWork:
    """Answers digest transfers with bounded hashing per round (the serving thread alone)."""

    def __init__(
        self, scheduler: Scheduler, router: Router, stager: SendStager, round_bytes: int = ROUND_BYTES
    ) -> None:
        self._scheduler = scheduler
        self._router = router
        self._stager = stager
        self._round_bytes = round_bytes
        self._partial: dict[Key, _Partial] = {}

    def run(self) -> bool:
        """Hash up to the round's budget and answer the transfers that are done. True: more hashing is due now."""
        jobs = [t for t in self._scheduler.transfers.values() if t.digests_only]
        for key in [key for key in self._partial if key not in self._scheduler.transfers]:
            del self._partial[key]  # cancelled, disallowed or dropped
        budget = self._round_bytes
        due = copying = False
        for transfer in jobs:
            budget = self._advance(transfer, budget)
            if transfer.done:
                self._answer(transfer)
            elif budget <= 0 or host_readable(self._staged(transfer), transfer.next_seq):
                due = True
            else:
                copying = True  # stopped at a device message: its copy to host memory is on its way
        if copying and not due:
            self._stager.wait(COPY_WAIT)  # for a copy (or a free buffer), rather than spin through the poller
            due = True
        return due

    def _staged(self, transfer: Transfer) -> Hashed:
        staged = transfer.staged
        assert isinstance(staged, Staged | Snapshot)  # the scheduler starts digest transfers for a staging only
        return staged

    def _advance(self, transfer: Transfer, budget: int) -> int:
        """Hash ``transfer``'s next messages within ``budget`` bytes; returns what is left of it."""
        staged = self._staged(transfer)
        hashing = transfer.hashing
        assert hashing is not None
        progressed = False
        while not transfer.done and budget > 0:
            seq = transfer.next_seq
            if cached(staged, hashing.algorithm, seq) is not None:
                self._stager.forget(transfer.key, seq)  # the pump hashed it meanwhile: a copy issued here goes
            elif host_readable(staged, seq):
                budget -= self._hash_some(transfer, staged, hashing.algorithm, budget)
                if cached(staged, hashing.algorithm, seq) is None:
                    break  # the budget ran out inside this message
            else:
                hashed = self._hash_device(transfer, staged, hashing.algorithm, seq)
                if hashed is None:
                    break  # its copy to host memory is on its way, or waits for a free buffer
                budget -= hashed
            transfer.next_seq += 1
            progressed = True
        if progressed:
            self._scheduler.progress({transfer.key}, time.monotonic())
        return budget

    def _hash_some(self, transfer: Transfer, staged: Hashed, algorithm: Algorithm, budget: int) -> int:
        """Hash up to ``budget`` bytes of message ``transfer.next_seq``; returns the bytes hashed."""
        seq = transfer.next_seq
        partial = self._partial.get(transfer.key)
        if partial is None or partial.seq != seq:
            partial = self._partial[transfer.key] = _Partial(seq, algorithm.new())
        payload, referenced = staged.payload(seq)
        view = memoryview(payload).cast("B")
        # A packed message is built anew by every payload() call: hash it whole (at most chunk_bytes).
        take = min(budget, len(view) - partial.offset) if referenced else len(view)
        partial.hasher.update(view[partial.offset : partial.offset + take])
        partial.offset += take
        if partial.offset >= len(view):
            remember(staged, algorithm, seq, partial.hasher.digest())
            del self._partial[transfer.key]
        return take

    def _hash_device(self, transfer: Transfer, staged: Hashed, algorithm: Algorithm, seq: int) -> int | None:
        """Hash device message ``seq`` from its copy in the stager's ring; returns the bytes hashed (None: not
        copied yet). One message at a time for ``transfer``: a request never holds more than one buffer."""
        plan = staged.device_plan
        assert plan is not None  # not host_readable
        if not self._stager.ready(transfer.key, plan, seq, 1):
            return None
        view = self._stager.take(transfer.key, seq)
        if view is None:
            return None
        hasher = algorithm.new()
        hasher.update(view)
        remember(staged, algorithm, seq, hasher.digest())
        self._stager.sent(transfer.key, seq, None)  # nothing else reads that buffer: free at once
        return len(view)

    def _answer(self, transfer: Transfer) -> None:
        staged = self._staged(transfer)
        hashing = transfer.hashing
        assert hashing is not None
        blob = b"".join(cached(staged, hashing.algorithm, seq) or b"" for seq in range(transfer.first, transfer.stop))
        self._scheduler.drop(transfer)
        self._router.send(transfer.peer, [wire.digests_reply(transfer.xfer, transfer.first, blob)])
