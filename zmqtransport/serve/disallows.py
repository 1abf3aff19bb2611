"""The serving thread's side of ``disallow_checkpoint``: withdrawals, their snapshots, and when the caller may go.

Threading: :class:`Disallows` belongs to the serving thread (serve/server.py),
which calls every method. A snapshot is taken on a thread of its own
(:func:`.snapshot.take`, while the serving thread goes on sending); that thread
hands the result back through ``post`` (a command to the serving thread) and
touches nothing else here.

A disallow's caller goes once no transfer reads the caller's tensors (every
withdrawn staging serves from its snapshot, or its receives ended) and no copy
is still reading them; then it waits only for libzmq to release frames that
reference them (:class:`.frames.HeldFrames`). docs/protocol.md, "Releasing
staged memory".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..stats import DisallowStats
from . import snapshot
from .frames import HeldFrames
from .snapshot import Snapshot
from .transfers import Key

if TYPE_CHECKING:
    from ..device import DeviceStaging, SendStager
    from .scheduler import Scheduler
    from .withdrawn import Withdrawn

logger = logging.getLogger("zmqtransport.serve")


@dataclass(frozen=True)
class SnapshotTaken:
    """From a thread that took a snapshot to the serving thread."""

    withdrawn: Withdrawn
    snapshot: Snapshot | None  # None: taking it failed
    seconds: float
    thread: threading.Thread  # the one that took it (done)


@dataclass(frozen=True)
class _Pending:
    done: threading.Event  # set once the caller may mutate its tensors
    stats: DisallowStats  # filled before ``done`` is set
    deadline: float  # the transport timeout: frames still referencing the tensors are then freed by force


class Disallows:
    """Disallows waiting for their running receives' snapshot (or end), and the threads taking snapshots."""

    def __init__(
        self,
        scheduler: Scheduler,
        stager: SendStager,
        staging: DeviceStaging,
        held: HeldFrames[Any],
        timeout: float,
        cap: int | None,
        post: Callable[[SnapshotTaken], None],
    ) -> None:
        self._scheduler = scheduler
        self._withdrawals = scheduler.withdrawals
        self._stager = stager
        self._staging = staging  # a copy makes engines of its own: the stager's are the serving thread's
        self._held = held
        self._timeout = timeout
        self._cap = cap  # None: snapshot.default_cap() at each disallow
        self._post = post
        self._pending: list[_Pending] = []
        self._copies: set[threading.Thread] = set()  # taking snapshots: they read the caller's tensors

    def begin(self, done: threading.Event, stats: DisallowStats) -> None:
        """A ``disallow_checkpoint`` call: withdraw the staged step; ``done`` is set when the caller may go."""
        now = time.monotonic()
        cap = snapshot.default_cap() if self._cap is None else self._cap
        stats.receives, stats.needed_bytes = self._scheduler.disallow(now, cap)
        self._pending.append(_Pending(done, stats, now + self._timeout))
        self.settle()
        # Beyond the cap: served from the tensors until the receives end or what they need fits.
        stats.waited = self._withdrawals.reading_caller_memory and not self._copies

    def settle(self) -> None:
        """Start snapshots that fit their cap; once nothing reads the tensors, disallows wait for frames only."""
        transfers = self._scheduler.transfers.values()
        self._withdrawals.publish_floors(transfers)
        for withdrawn, seqs in self._withdrawals.due(transfers, time.monotonic()):
            copier = threading.Thread(
                target=self._take, args=(withdrawn, seqs), name="zmqtransport-snapshot", daemon=True
            )
            self._copies.add(copier)
            copier.start()
        if not self._pending or self._withdrawals.reading_caller_memory or self._copies:
            return
        # Device tensors must not be read once disallow returns: the copies already issued complete.
        self._stager.synchronize()
        for pending in self._pending:
            self._held.wait(pending.done, pending.deadline)
        self._pending.clear()

    def _take(self, withdrawn: Withdrawn, seqs: list[int]) -> None:
        """On a thread of its own, while the serving thread goes on sending (serve/snapshot.py)."""
        started = time.monotonic()
        taken: Snapshot | None = None
        try:
            taken = snapshot.take(withdrawn.staged, seqs, self._staging, lambda: withdrawn.floor)
        except Exception:
            logger.exception("zmqtransport: taking a snapshot failed; disallow_checkpoint waits for the receives")
        self._post(SnapshotTaken(withdrawn, taken, time.monotonic() - started, threading.current_thread()))

    def taken(self, message: SnapshotTaken) -> None:
        """A snapshot thread is done: its transfers read the copy from now on (or are waited for)."""
        self._copies.discard(message.thread)
        withdrawn, taken = message.withdrawn, message.snapshot
        if taken is None:
            self._withdrawals.copy_failed(withdrawn)
        elif self._withdrawals.find(withdrawn.staged.stage_id) is withdrawn:  # else its receives ended meanwhile
            self._withdrawals.snapshotted(withdrawn, taken, self._scheduler.transfers.values())
            step, nbytes, seconds = taken.step, taken.nbytes, message.seconds
            logger.info("step %d: running receives go on from a copy of %d bytes (%.3f s)", step, nbytes, seconds)
            for pending in self._pending:
                pending.stats.snapshot_bytes += nbytes
                pending.stats.snapshot_seconds += seconds
            # Lanes of transfers that now read the snapshot go (their copies complete).
            self._stager.retain(self.device_transfers())
        self.settle()

    def device_transfers(self) -> list[Key]:
        """Transfers that go through the device stager (the others' lanes may go)."""
        return [key for key, t in self._scheduler.transfers.items() if t.staged.device_plan is not None]

    def close(self, wait: float) -> None:
        """The serving thread stops: copies finish (they read the caller's tensors); every caller goes."""
        for copier in list(self._copies):
            copier.join(wait)
        for pending in self._pending:
            pending.done.set()  # nothing is served any more: nothing reads the tensors
        self._pending.clear()
