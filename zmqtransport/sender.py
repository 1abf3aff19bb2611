"""The sending side: one ROUTER socket served by one thread.

Threading: :class:`Server` owns its ROUTER socket; only the serving thread ever
touches it. Other threads talk to it through :meth:`Server.stage`,
:meth:`Server.disallow` and :meth:`Server.stop`, which put a command on a queue
and wake the thread through a pipe that the poller watches.

Flow control (docs/protocol.md, "Flow control"): a receiver grants credit, one
unit per data message; the server sends while a transfer has credit, one
message per transfer per round so concurrent receivers share the link, and
never queues more than the granted window per receiver.

Zero copy: data frames that cover a single storage reference the tensor memory
(``copy=False``) and are tracked; :meth:`disallow` returns only once libzmq has
released every one of them. A receiver that stops reading cannot hold that up
past the timeout: the socket is then closed with ``linger=0`` (which frees every
queued frame) and bound again on the same port.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import sockets, wire
from .codec.tensors import EncodedTree
from .device import DeviceStaging, SendPlan, SendStager
from .errors import ProtocolError
from .stats import TransferStats

logger = logging.getLogger(__name__)

# Small data frames are copied by pyzmq anyway; keep libzmq's per-peer queue far
# above what credit allows so a send never hits the high-water mark.
_SNDHWM = 8 * wire.MAX_CREDIT
_MAX_TRANSFERS_PER_PEER = 4
_MAX_TRANSFERS = 64
_MAX_PENDING = 256
_BATCH = 64  # data messages per pump round before the poller is checked again
# After a forced rebind, how long a parked request whose receiver has not
# reconnected yet is kept for another try (DEALERs reconnect every 100 ms).
_REBIND_GRACE = 5.0
_STAGING_WAIT = 0.002  # seconds the pump waits for a device copy before polling again
_SENT_HISTORY = 256  # finished sends remembered for sent_since()


@dataclass
class Staged:
    """A checkpoint ready to serve: the header, packed once, and the memory to send."""

    step: int
    header_body: bytes
    tree: EncodedTree
    plan: list[list[wire.Piece]]
    checksum: str | None
    crcs: list[int | None] = field(default_factory=list)
    device_plan: SendPlan | None = None  # device memory to stage (None: host memory only)

    @property
    def total_bytes(self) -> int:
        return sum(ref.nbytes for ref in self.tree.storages)

    def payload(self, seq: int) -> tuple[Any, bool]:
        """The bytes of data message ``seq`` and whether they reference tensor memory."""
        pieces = self.plan[seq]
        storages = self.tree.storages
        if len(pieces) == 1:
            piece = pieces[0]
            return storages[piece.storage].view(piece.start, piece.start + piece.length), True
        buffer = bytearray(wire.chunk_length(pieces))
        # One memmove per small storage, straight between addresses: building a
        # memoryview per piece cost ~3 us each, 60 ms for 20,480 tensors of 4 KiB.
        at = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
        for piece in pieces:
            ref = storages[piece.storage]
            if not ref.ptr:  # device memory goes through the stager, never through here
                raise RuntimeError(f"storage {piece.storage} has no host memory to pack")
            ctypes.memmove(at, ref.ptr + piece.start, piece.length)
            at += piece.length
        return buffer, False

    def crc(self, seq: int, payload: Any) -> int | None:
        if self.checksum is None:
            return None
        cached = self.crcs[seq]
        if cached is None:
            cached = self.crcs[seq] = zlib.crc32(payload)
        return cached


@dataclass
class Transfer:
    peer: bytes
    xfer: int
    staged: Staged
    credit: int
    address: str
    next_seq: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)

    @property
    def done(self) -> bool:
        return self.next_seq >= len(self.staged.plan)


@dataclass
class Pending:
    peer: bytes
    request: wire.Request
    deadline: float
    address: str


@dataclass
class _Disallow:
    deadline: float
    done: threading.Event
    forced: bool = False


class Server:
    """Serves staged checkpoints on one ROUTER socket from one thread."""

    def __init__(
        self,
        context: zmq.Context[Any],
        bind_host: str,
        port: int,
        timeout: float,
        configure: Any = None,
        *,
        staging: DeviceStaging | None = None,
    ) -> None:
        self._context = context
        self._timeout = timeout
        self._configure = configure  # callable(socket) applying security options
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        # Guards the wake pipe: the thread closes it on exit, and a write to a
        # closed (and possibly reused) descriptor must never happen.
        self._wake_lock = threading.Lock()
        self._wake_closed = False
        self._wake_read, self._wake_write = os.pipe()
        try:
            self._bind_and_start(bind_host, port, staging)
        except BaseException:
            # Nothing half-built may outlive a failed construction: an open
            # socket would make the owner's Context.term() wait forever.
            self._release()
            raise

    def _bind_and_start(self, bind_host: str, port: int, staging: DeviceStaging | None) -> None:
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._router = self._make_router()
        self.port = sockets.bind(self._router, bind_host, port)  # closes the socket if it fails
        self._bind_endpoint = sockets.bind_endpoint(bind_host, self.port)
        self._staged: Staged | None = None
        self._transfers: dict[tuple[bytes, int], Transfer] = {}
        self._pending: list[Pending] = []
        self._rebound_at = float("-inf")  # when _rebind last replaced the socket
        self._trackers: list[zmq.MessageTracker] = []
        # Device memory goes out through the stager's pinned ring; the serving
        # thread alone uses it, its side streams included (device.py).
        self._stager = SendStager(staging if staging is not None else DeviceStaging())
        self._disallows: list[_Disallow] = []
        # Finished sends (newest last, bounded) and how many there were in all.
        # Written by the serving thread, read by any: the lock keeps the pair consistent.
        self._sent: deque[TransferStats] = deque(maxlen=_SENT_HISTORY)
        self._sent_count = 0
        self._sent_lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"zmqtransport-serve-{self.port}", daemon=True)
        self._thread.start()

    def _release(self) -> None:
        """Undo a construction that failed before the serving thread started."""
        router: zmq.Socket[Any] | None = getattr(self, "_router", None)
        if router is not None:
            router.close(linger=0)
        self._wake_closed = True
        os.close(self._wake_read)
        os.close(self._wake_write)

    # ------------------------------------------------------------------ called from any thread

    def stage(self, staged: Staged) -> None:
        self._command("stage", staged)

    def disallow(self) -> None:
        """Block until nothing staged is referenced by libzmq (at most ~timeout + a grace)."""
        done = threading.Event()
        self._command("disallow", done)
        # The thread forces the release at the timeout; the grace covers the rebind.
        deadline = time.monotonic() + self._timeout + 30.0
        while not done.wait(0.1):
            if not self._thread.is_alive():
                return  # it closed the socket and waited for its frames on the way out
            if time.monotonic() > deadline:
                raise TimeoutError("disallow_checkpoint timed out waiting for the serving thread")

    def stop(self, wait: bool) -> None:
        if self._thread.is_alive():
            self._command("stop")
        if wait:
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def sent_since(self, cursor: int) -> tuple[int, list[TransferStats]]:
        """Sends finished after the first ``cursor`` ones, and the cursor to pass next time."""
        with self._sent_lock:
            count, recent = self._sent_count, list(self._sent)
        fresh = max(0, count - max(cursor, 0))
        return count, recent[len(recent) - min(fresh, len(recent)) :]

    def _command(self, *command: Any) -> None:
        self._commands.put(command)
        with self._wake_lock:
            if not self._wake_closed:
                with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
                    os.write(self._wake_write, b"x")

    # ------------------------------------------------------------------ serving thread

    def _make_router(self) -> zmq.Socket[Any]:
        return sockets.new_socket(self._context, zmq.ROUTER, self._configure_router)

    def _configure_router(self, router: zmq.Socket[Any]) -> None:
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # raise instead of dropping frames
        router.setsockopt(zmq.SNDHWM, _SNDHWM)
        router.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        router.setsockopt(zmq.IPV6, 1)
        if self._configure is not None:
            self._configure(router)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_read, zmq.POLLIN)
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._wake_read in events:
                    self._drain_wake()
                    self._run_commands()
                    if self._stopping:
                        break
                if self._router in events:
                    self._read_requests()
                self._pump()
                if self._housekeeping(poller):
                    poller = zmq.Poller()
                    poller.register(self._router, zmq.POLLIN)
                    poller.register(self._wake_read, zmq.POLLIN)
        except Exception:
            logger.exception("zmqtransport serving thread failed")
        finally:
            self._shutdown_in_thread()

    def _poll_timeout_ms(self) -> int:
        if any(t.credit > 0 and not t.done for t in self._transfers.values()):
            return 0
        if self._disallows:
            return 5
        if self._staged is not None and self._pending:
            return 20  # re-parked requests after a rebind: retry soon
        deadlines = [p.deadline for p in self._pending]
        deadlines += [t.last_progress + self._timeout for t in self._transfers.values()]
        if not deadlines:
            return 1000
        return max(1, min(1000, int((min(deadlines) - time.monotonic()) * 1000) + 1))

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            name = command[0]
            if name == "stage":
                self._on_stage(command[1])
            elif name == "disallow":
                self._on_disallow(command[1])
            elif name == "stop":
                self._stopping = True

    def _on_stage(self, staged: Staged) -> None:
        self._staged = staged
        waiting, self._pending = self._pending, []
        for pending in waiting:
            self._start(pending.peer, pending.request, pending.address, parked=pending)

    def _on_disallow(self, done: threading.Event) -> None:
        self._staged = None
        for transfer in list(self._transfers.values()):
            self._abort(transfer, wire.ERR_DISALLOWED, f"step {transfer.staged.step} is no longer served")
        # Device tensors must not be read once disallow returns: drop every lane
        # and wait for the copies already issued (a few chunks at most).
        self._stager.retain(())
        self._stager.synchronize()
        self._disallows.append(_Disallow(time.monotonic() + self._timeout, done))

    def _read_requests(self) -> None:
        for _ in range(1000):  # bounded so a flood cannot starve the data pump
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes
            address = _peer_address(frames[-1])
            if len(frames) != 2:
                self._reply(peer, wire.error_reply(0, wire.ERR_BAD_REQUEST, "expected one envelope frame"))
                continue
            try:
                request = wire.decode_request(frames[1].buffer)
            except ProtocolError as exc:
                code = wire.ERR_VERSION if "version mismatch" in str(exc) else wire.ERR_BAD_REQUEST
                logger.warning("bad request from %s: %s", address, exc)
                self._reply(peer, wire.error_reply(0, code, str(exc)))
                continue
            self._on_request(peer, request, address)

    def _on_request(self, peer: bytes, request: wire.Request, address: str) -> None:
        key = (peer, request.xfer)
        if request.op == wire.OP_CREDIT:
            transfer = self._transfers.get(key)
            if transfer is not None:
                transfer.credit = min(wire.MAX_CREDIT, transfer.credit + request.credit)
                transfer.last_progress = time.monotonic()
            return
        if request.op == wire.OP_CANCEL:
            self._transfers.pop(key, None)
            self._pending = [p for p in self._pending if (p.peer, p.request.xfer) != key]
            return
        if key in self._transfers:
            self._reply(peer, wire.error_reply(request.xfer, wire.ERR_BUSY, "this transfer id is already running"))
            return
        if self._staged is None:
            if len(self._pending) >= _MAX_PENDING:
                self._reply(peer, wire.error_reply(request.xfer, wire.ERR_BUSY, "too many waiting requests"))
                return
            deadline = time.monotonic() + request.wait_ms / 1000
            self._pending.append(Pending(peer, request, deadline, address))
            return
        self._start(peer, request, address)

    def _start(
        self, peer: bytes, request: wire.Request, address: str, parked: Pending | None = None
    ) -> None:
        staged = self._staged
        assert staged is not None
        if request.step != staged.step:
            message = f"requested step {request.step} but this peer serves step {staged.step}"
            self._reply(peer, wire.error_reply(request.xfer, wire.ERR_WRONG_STEP, message))
            return
        if staged.tree.has_pickle and not request.accept_pickle:
            message = f"step {staged.step} holds pickled objects and the receiver does not accept pickle"
            self._reply(peer, wire.error_reply(request.xfer, wire.ERR_PICKLE, message))
            return
        # Checked here, not when a request is parked: requests parked while
        # nothing was staged all start at once when a step is staged.
        if sum(1 for k in self._transfers if k[0] == peer) >= _MAX_TRANSFERS_PER_PEER:
            self._reply(peer, wire.error_reply(request.xfer, wire.ERR_BUSY, "too many transfers from this peer"))
            return
        if len(self._transfers) >= _MAX_TRANSFERS:
            self._reply(peer, wire.error_reply(request.xfer, wire.ERR_BUSY, "too many concurrent transfers"))
            return
        if not self._send(peer, [wire.header_envelope(request.xfer), staged.header_body]):
            if parked is not None and time.monotonic() - self._rebound_at < _REBIND_GRACE:
                # Parked before a forced rebind: its receiver (whose DEALER keeps
                # its routing id) may not have reconnected yet. Try again soon.
                self._pending.append(parked)
            return
        if request.header_only:
            self._send(peer, [wire.end_reply(request.xfer)])
            return
        transfer = Transfer(peer, request.xfer, staged, request.credit, address)
        self._transfers[(peer, request.xfer)] = transfer
        if transfer.done:
            self._finish(transfer)

    def _pump(self) -> None:
        """Send data while transfers have credit, one message per transfer per round."""
        sent = 0
        while sent < _BATCH:
            ready = [t for t in self._transfers.values() if t.credit > 0 and not t.done]
            if not ready:
                return
            waiting = 0
            for transfer in ready:
                if not self._chunk_ready(transfer):
                    waiting += 1
                    continue
                self._send_chunk(transfer)
                sent += 1
            if waiting == len(ready):
                # Every transfer waits for a device copy or a free staging
                # buffer: wait briefly for one rather than spin through the poller.
                self._stager.wait(_STAGING_WAIT)
                return

    def _chunk_ready(self, transfer: Transfer) -> bool:
        """Whether the next message can go out; for device memory, issues copies ahead of it."""
        plan = transfer.staged.device_plan
        if plan is None:
            return True
        key = (transfer.peer, transfer.xfer)
        return self._stager.ready(key, plan, transfer.next_seq, transfer.credit)

    def _send_chunk(self, transfer: Transfer) -> None:
        staged = transfer.staged
        seq = transfer.next_seq
        key = (transfer.peer, transfer.xfer)
        staged_view = self._stager.take(key, seq) if staged.device_plan is not None else None
        if staged_view is not None:
            payload, references_tensor = staged_view, True  # a pinned staging buffer
        else:
            payload, references_tensor = staged.payload(seq)
        envelope = wire.data_envelope(transfer.xfer, seq, staged.crc(seq, payload))
        try:
            self._router.send(transfer.peer, zmq.SNDMORE | zmq.NOBLOCK)
            self._router.send(envelope, zmq.SNDMORE | zmq.NOBLOCK)
            tracker = self._router.send(payload, zmq.NOBLOCK, copy=False, track=references_tensor)
        except zmq.ZMQError as exc:
            # EHOSTUNREACH: the peer is gone; EAGAIN: it ignored flow control.
            logger.warning("dropping transfer to %s step %d: %s", transfer.address, staged.step, exc)
            self._transfers.pop((transfer.peer, transfer.xfer), None)
            return
        if references_tensor and tracker is not None:
            self._trackers.append(tracker)
        if staged_view is not None:
            self._stager.sent(key, seq, tracker)  # the buffer is reused once libzmq lets go
        transfer.next_seq += 1
        transfer.credit -= 1
        if transfer.done:
            self._finish(transfer)

    def _finish(self, transfer: Transfer) -> None:
        self._transfers.pop((transfer.peer, transfer.xfer), None)
        self._send(transfer.peer, [wire.end_reply(transfer.xfer)])
        seconds = max(time.monotonic() - transfer.started, 1e-9)
        nbytes = transfer.staged.total_bytes
        logger.info(
            "served step %d to %s: %d bytes in %.3f s (%.2f GB/s)",
            transfer.staged.step,
            transfer.address,
            nbytes,
            seconds,
            nbytes / seconds / 1e9,
        )
        stats = TransferStats(
            peer=transfer.address,
            step=transfer.staged.step,
            bytes=nbytes,
            tensors=len(transfer.staged.tree.tensors),
            messages=len(transfer.staged.plan),
            seconds=seconds,
        )
        with self._sent_lock:
            self._sent.append(stats)
            self._sent_count += 1

    def _abort(self, transfer: Transfer, code: str, message: str) -> None:
        self._transfers.pop((transfer.peer, transfer.xfer), None)
        logger.warning("aborting transfer of step %d to %s: %s", transfer.staged.step, transfer.address, message)
        self._reply(transfer.peer, wire.error_reply(transfer.xfer, code, message))

    def _reply(self, peer: bytes, envelope: bytes) -> None:
        self._send(peer, [envelope])

    def _send(self, peer: bytes, frames: list[Any]) -> bool:
        try:
            self._router.send_multipart([peer, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("could not reply to peer: %s", exc)
            return False
        return True

    def _housekeeping(self, poller: zmq.Poller) -> bool:
        """Expire waits and stalls, progress disallows. Returns True if the socket was rebuilt."""
        now = time.monotonic()
        if self._staged is not None and self._pending:
            # Only requests re-parked by _start after a forced rebind wait while
            # a step is staged: retry them now that their peer may be back.
            waiting, self._pending = self._pending, []
            for pending in waiting:
                self._start(pending.peer, pending.request, pending.address, parked=pending)
        if self._pending:
            expired = [p for p in self._pending if p.deadline <= now]
            if expired:
                self._pending = [p for p in self._pending if p.deadline > now]
                for pending in expired:
                    message = f"no checkpoint was staged for step {pending.request.step} in time"
                    self._reply(pending.peer, wire.error_reply(pending.request.xfer, wire.ERR_NOT_STAGED, message))
        for transfer in list(self._transfers.values()):
            if transfer.credit == 0 and now - transfer.last_progress > self._timeout:
                self._abort(transfer, wire.ERR_STALLED, f"receiver granted no credit for {self._timeout:.1f} s")
        self._stager.retain(self._transfers)
        if self._trackers:
            self._trackers = [t for t in self._trackers if not t.done]
        if not self._disallows:
            return False
        if not self._trackers:
            for disallow in self._disallows:
                disallow.done.set()
            self._disallows.clear()
            return False
        if any(d.deadline <= now and not d.forced for d in self._disallows):
            for disallow in self._disallows:
                disallow.forced = True
            self._rebind()
            return True
        return False

    def _rebind(self) -> None:
        """Drop every queued frame by closing the socket, then listen again on the same port."""
        logger.warning(
            "a receiver still holds %d zero-copy frames after %.1f s; closing the socket to release them",
            len(self._trackers),
            self._timeout,
        )
        # Requests already read by libzmq but not yet by us would die with the
        # socket: take them first (nothing is staged, so fetches are parked).
        self._read_requests()
        self._router.close(linger=0)
        self._rebound_at = time.monotonic()
        deadline = time.monotonic() + 10.0
        while True:
            router = self._make_router()
            try:
                router.bind(self._bind_endpoint)
            except zmq.ZMQError:
                router.close(linger=0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
                continue
            self._router = router
            return

    def _shutdown_in_thread(self) -> None:
        for transfer in list(self._transfers.values()):
            self._abort(transfer, wire.ERR_SHUTDOWN, "the serving transport is shutting down")
        for pending in self._pending:
            self._reply(pending.peer, wire.error_reply(pending.request.xfer, wire.ERR_SHUTDOWN, "shutting down"))
        self._pending.clear()
        self._router.close(linger=0)
        for tracker in self._trackers:
            try:
                tracker.wait(5.0)
            except zmq.NotDone:
                break
        try:
            self._stager.close()  # no device copy may outlive the thread
        except Exception:
            logger.exception("zmqtransport: synchronising device copies at shutdown failed")
        for disallow in self._disallows:
            disallow.done.set()
        self._staged = None
        with self._wake_lock:
            self._wake_closed = True
            os.close(self._wake_read)
            os.close(self._wake_write)


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError):
        return "unknown peer"


__all__ = ["Server", "Staged"]
