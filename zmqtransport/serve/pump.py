"""The data path of the serving thread: data messages for the transfers the scheduler offers.

Device memory goes out through the stager's pinned ring (:mod:`zmqtransport.device`):
a message is sent once its copy to host memory is complete. A message that
references the caller's tensors waits (its transfer pauses) while its
connection holds more than a disallow should wait for
(:meth:`.frames.HeldFrames.may_send`). Whatever credit a peer grants, what is
queued for its connection, and the copies of all connections together, stay
within bounds (:meth:`.frames.HeldFrames.may_queue`, :meth:`~.frames.HeldFrames.may_copy`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from .. import wire
from ..relayed import RelayStopped
from .actions import Action
from .digests import envelope_digest
from .frames import HeldFrames
from .notices import Notices
from .router import Router
from .transfers import Transfer

if TYPE_CHECKING:
    from ..device import SendStager
    from .scheduler import Scheduler

logger = logging.getLogger("zmqtransport.serve")

BATCH = 64  # data messages per call before the poller is checked again
STAGING_WAIT = 0.002  # seconds to wait for a device copy when no transfer can send


class DataPump:
    """Sends while transfers have credit, one message per transfer per round."""

    def __init__(
        self,
        scheduler: Scheduler,
        router: Router,
        stager: SendStager,
        held: HeldFrames[zmq.MessageTracker],
        notices: Notices,
    ) -> None:
        self._scheduler = scheduler
        self._router = router
        self._stager = stager
        self._held = held
        self._notices = notices

    def run(self) -> list[Action]:
        """Send up to :data:`BATCH` data messages; returns the actions of transfers that finished."""
        actions: list[Action] = []
        sent = 0
        while sent < BATCH:
            ready = self._scheduler.next_round()
            if not ready:
                break
            waiting = 0
            for transfer in ready:
                if not self._chunk_ready(transfer):
                    waiting += 1
                    continue
                actions += self._send_chunk(transfer)
                sent += 1
            if waiting == len(ready):
                # Every transfer waits for a device copy or a free staging
                # buffer: wait briefly for one rather than spin through the poller.
                self._stager.wait(STAGING_WAIT)
                break
        return actions

    def _chunk_ready(self, transfer: Transfer) -> bool:
        """Whether the next message can go out; for device memory, issues copies ahead of it."""
        plan = transfer.staged.device_plan
        if plan is None:
            return True
        return self._stager.ready(transfer.key, plan, transfer.next_seq, transfer.credit)

    def _send_chunk(self, transfer: Transfer) -> list[Action]:
        staged, seq, key = transfer.staged, transfer.next_seq, transfer.key
        # However much credit its peer granted, a connection holds at most so much (serve/frames.py):
        # a peer that asks and does not read pauses its transfer, and is cut after the stall bound.
        if not self._held.may_queue(key, staged.span_bytes(seq, seq + 1)):
            transfer.paused = True  # until a frame of its connection is released
            return []
        staged_view = self._stager.take(key, seq) if staged.device_plan is not None else None
        payload: Any
        if staged_view is not None:
            # The stager's own buffer, reused only once libzmq lets go of it: not the caller's memory.
            payload, references_tensor = staged_view, False
        else:
            try:
                payload, references_tensor = staged.payload(seq)
            except RelayStopped:
                self._scheduler.drop(transfer)  # the relay's receive returned; stop_relay tells its receiver
                return []
            if references_tensor and not self._held.may_send(key, len(payload)):
                transfer.paused = True  # until a frame of its connection is released
                return []
            if not references_tensor and not self._held.may_copy(len(payload)):
                # Copies of every connection together are at their bound: this side's
                # limit, not the receiver's doing, so its stall clock does not run meanwhile.
                transfer.paused = True  # until a copy is released (HeldFrames.resumed)
                transfer.last_progress = time.monotonic()
                return []
        digest = envelope_digest(transfer, seq, payload)
        envelope = wire.data_envelope(transfer.xfer, seq, staged.crc(seq, payload), digest)
        try:
            # Every frame is tracked: its release tells that the receiver takes data.
            tracker = self._router.send_data(transfer.peer, envelope, payload, track=True)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone; EAGAIN: it ignored flow control.
            address, message = transfer.address, "dropping transfer to %s step %d: %s"
            self._notices.warn(address, "transfer dropped", time.monotonic(), message, address, staged.step, exc)
            self._scheduler.drop(transfer)
            return []
        now = time.monotonic()
        if tracker is not None:
            copied = staged_view is None and not references_tensor
            self._held.track(key, tracker, pinned=references_tensor, now=now, nbytes=len(payload), copied=copied)
        if staged_view is not None:
            self._stager.sent(key, seq, tracker)  # the buffer is reused once libzmq lets go
        return self._scheduler.sent(transfer, now)
