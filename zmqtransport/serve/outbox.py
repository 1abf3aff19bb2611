"""Carrying out the scheduler's decisions on the ROUTER socket, and the record of finished sends.

Used only by the serving thread, except :meth:`SentLog.since`, which any thread may call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from .. import wire
from ..stats import TransferStats
from .actions import Abort, Action, Finish, Have, Refuse, SendHeader
from .notices import Notices
from .router import Router
from .transfers import Key, Transfer

if TYPE_CHECKING:
    from .scheduler import Scheduler

logger = logging.getLogger("zmqtransport.serve")

SENT_HISTORY = 256  # finished sends remembered for sent_since()


class SentLog:
    """Finished sends (newest last, bounded) and how many there were in all.

    Written by the serving thread, read by any: the lock keeps the pair consistent.
    """

    def __init__(self, history: int = SENT_HISTORY) -> None:
        self._recent: deque[TransferStats] = deque(maxlen=history)
        self._count = 0
        self._bytes = 0
        self._lock = threading.Lock()

    def record(self, stats: TransferStats) -> None:
        with self._lock:
            self._recent.append(stats)
            self._count += 1
            self._bytes += stats.bytes

    @property
    def total_bytes(self) -> int:
        """Data bytes of every finished send since the start (whole transfers, spans, relayed spans)."""
        with self._lock:
            return self._bytes

    def since(self, cursor: int) -> tuple[int, list[TransferStats]]:
        with self._lock:
            count, recent = self._count, list(self._recent)
        fresh = max(0, count - max(cursor, 0))
        return count, recent[len(recent) - min(fresh, len(recent)) :]


class Outbox:
    """Sends what the scheduler decided and tells it about messages that could not go out."""

    def __init__(self, router: Router, scheduler: Scheduler, sent: SentLog, notices: Notices) -> None:
        self._router = router
        self._scheduler = scheduler
        self._sent = sent
        self._notices = notices

    def execute(self, actions: list[Action]) -> None:
        """Carry out what the scheduler decided, telling it about messages that could not go out."""
        undelivered: set[Key] = set()  # headers that did not go out: nothing follows them
        for action in actions:
            match action:
                case SendHeader():
                    envelope = wire.header_envelope(
                        action.xfer, action.stage_id, action.relay, action.digest, action.digests_ahead
                    )
                    if not self._router.send(action.peer, [envelope, action.header_body]):
                        undelivered.add(action.key)
                        self._scheduler.undelivered(action, time.monotonic())
                    elif action.header_only:
                        self._router.send(action.peer, [wire.end_reply(action.xfer)])
                case Refuse():
                    reply = wire.error_reply(action.xfer, action.code, action.message)
                    if not self._router.send(action.peer, [reply]):
                        self._scheduler.undelivered(action, time.monotonic())
                case Abort(transfer, code, message):
                    step, address = transfer.staged.step, transfer.address
                    # A relay that stops is routine (its downstream turns to the source).
                    text = "aborting transfer of step %d to %s: %s"
                    if code == wire.ERR_NOT_RELAYING:
                        logger.info(text, step, address, message)
                    else:
                        kind = f"transfer ended ({code})"
                        self._notices.warn(address, kind, time.monotonic(), text, step, address, message)
                    self._router.send(transfer.peer, [wire.error_reply(transfer.xfer, code, message)])
                case Have(peer, xfer, bits, messages, peers, coming, claimed, alone):
                    self._router.send(peer, [wire.have_reply(xfer, bits, messages, peers, coming, claimed, alone)])
                case Finish(transfer):
                    if transfer.key not in undelivered:
                        self._finish(action)

    def _finish(self, finish: Finish) -> None:
        transfer = finish.transfer
        self._router.send(transfer.peer, [finish.envelope()])
        self._sent.record(_served(transfer, finish.seconds))


def _served(transfer: Transfer, seconds: float) -> TransferStats:
    """Log a finished transfer (one INFO line) and describe it."""
    seconds = max(seconds, 1e-9)
    staged = transfer.staged
    if transfer.span:
        # One span of a striped receive: its own bytes (the receiver asks for
        # the others on its other connections, each recorded likewise).
        nbytes = staged.span_bytes(transfer.first, transfer.stop)
        messages = transfer.stop - transfer.first
    else:
        nbytes, messages = staged.total_bytes, staged.messages
    logger.log(
        logging.DEBUG if transfer.span else logging.INFO,
        "served step %d to %s: %d bytes in %.3f s (%.2f GB/s)%s",
        staged.step,
        transfer.address,
        nbytes,
        seconds,
        nbytes / seconds / 1e9,
        f" (span {transfer.first}..{transfer.stop})" if transfer.span else "",
    )
    return TransferStats(
        peer=transfer.address,
        step=staged.step,
        bytes=nbytes,
        tensors=staged.tensor_count,
        messages=messages,
        seconds=seconds,
    )
