"""The sending side's socket owner: one ROUTER socket served by one thread.

Threading: :class:`Server` owns its ROUTER socket; only the serving thread ever
touches it. Other threads talk to it through :meth:`Server.stage`,
:meth:`Server.disallow` and :meth:`Server.stop`, which put a command (a small
dataclass) on a queue and wake the thread through a pipe that the poller watches.

What to send and when to give up is decided by the pure
:class:`~zmqtransport.serve.scheduler.Scheduler`; this module reads requests,
feeds them to it with the time, and carries out the actions it returns.

Zero copy: data frames that cover a single storage reference the tensor memory
(``copy=False``) while their receiver's queue drains fast (:mod:`.frames`); every
data frame is tracked. :meth:`disallow` keeps the contract without holding the
caller for the network: receives running at the call finish from a snapshot of
what they may still ask for (:mod:`.withdrawn`, :mod:`.snapshot`), taken in the
serving thread, and it returns once no transfer reads the caller's tensors and
libzmq has released every frame that references them. Beyond the snapshot cap
it waits for the running receives instead. A receiver that stops reading cannot
hold that up past the stall bound (or, if it keeps taking data, the timeout):
the socket is then closed with ``linger=0`` (which frees every queued frame) and
bound again on the same port. A receiver whose connection closes is dropped as
soon as the socket monitor reports it (:meth:`.router.Router.disconnected`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from .. import wire
from ..device import DeviceStaging, SendStager
from ..errors import ProtocolError
from ..relayed import Relayed
from ..stats import DisallowStats, TransferStats
from .actions import Refuse
from .digests import DigestWork
from .disallows import Disallows, SnapshotTaken
from .frames import QUEUED_COPIES, HeldFrames
from .linkwatch import LinkWatch
from .notices import Notices
from .outbox import Outbox, SentLog
from .pump import DataPump
from .router import Configure, Router
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .staged import Staged

# The sending side logs under one name (the receiving side: "zmqtransport.fetch").
logger = logging.getLogger("zmqtransport.serve")

# Seconds.
DISALLOW_POLL = 0.005  # how often a waiting disallow checks the zero-copy frames
DISALLOW_GRACE = 30.0  # beyond the timeout: the forced release and the rebind
SHUTDOWN_FRAME_WAIT = 5.0  # at shutdown, the wait for libzmq to release frames
# How long stop(wait=True) waits for the serving thread. Told to stop, it
# finishes the loop pass it is in (its sends do not block), closes the ROUTER
# with linger 0, waits at most SHUTDOWN_FRAME_WAIT for libzmq to let go of the
# frames (immediate once the socket is closed) and synchronises device copies
# (a few chunks). The margin covers that and a loaded machine; only a rebind
# of the port in progress (rare, up to router.REBIND_DEADLINE) can outlast it,
# and the owner's bounded Context.term() then makes its socket calls fail.
STOP_JOIN_TIMEOUT = SHUTDOWN_FRAME_WAIT + 5.0


@dataclass(frozen=True)
class StageCommand:
    staged: Staged


@dataclass(frozen=True)
class DisallowCommand:
    done: threading.Event  # set once no staged memory is referenced any more
    stats: DisallowStats  # filled by the serving thread before ``done`` is set


@dataclass(frozen=True)
class StopCommand:
    pass


@dataclass(frozen=True)
class RelayCommand:
    relayed: Relayed  # serve it to span fetches showing its token


@dataclass(frozen=True)
class StopRelayCommand:
    token: bytes
    done: threading.Event  # set once no transfer of it runs (nothing reads its memory any more)


Command = StageCommand | DisallowCommand | StopCommand | RelayCommand | StopRelayCommand | SnapshotTaken


class WakePipe:
    """A pipe the serving thread polls, so other threads can wake it."""

    def __init__(self) -> None:
        # Guards the pipe: the thread closes it on exit, and a write to a
        # closed (and possibly reused) descriptor must never happen.
        self._lock = threading.Lock()
        self._closed = False
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        with self._lock:
            if not self._closed:
                with contextlib.suppress(BlockingIOError):  # the pipe is full of wake-ups already
                    os.write(self._write, b"x")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            os.close(self.fd)
            os.close(self._write)


class Server:
    """Serves staged checkpoints on one ROUTER socket from one thread."""

    def __init__(
        self,
        context: zmq.Context[Any],
        bind_host: str | Sequence[str],
        port: int,
        timeout: float,
        configure: Configure | None = None,
        *,
        staging: DeviceStaging | None = None,
        stall: float | None = None,
        snapshot_bytes: int | None = None,
        queue_bytes: int = QUEUED_COPIES,
        curve: bool = False,
    ) -> None:
        self._timeout = timeout
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = WakePipe()
        try:
            hosts = [bind_host] if isinstance(bind_host, str) else list(bind_host)
            self._router = Router(context, hosts, port, configure)  # nothing open if it fails
        except BaseException:
            self._wake.close()
            raise
        try:
            self._start(timeout, stall, staging, snapshot_bytes, queue_bytes, curve)
        except BaseException:
            # Nothing half-built may outlive a failed construction: an open
            # socket would make the owner's Context.term() wait forever.
            self._router.close()
            self._wake.close()
            raise

    def _start(
        self,
        timeout: float,
        stall: float | None,
        staging: DeviceStaging | None,
        cap: int | None,
        queue_bytes: int,
        curve: bool,
    ) -> None:
        self.port = self._router.port
        self.bound = self._router.bound  # (bind host, port) of every address listened on
        # curve: relay offers are believed only with this side's own security (serve/swarm.py).
        self._scheduler = Scheduler(timeout, stall, curve=curve)
        self._held: HeldFrames[zmq.MessageTracker] = HeldFrames(self._scheduler.stall, copies=queue_bytes)
        # Device memory goes out through the stager's pinned ring; the serving
        # thread alone uses it, its side streams included (device/).
        staging = staging if staging is not None else DeviceStaging()
        self._stager = SendStager(staging)
        self._disallows = Disallows(self._scheduler, self._stager, staging, self._held, timeout, cap, self._command)
        self._notices = Notices(logger)  # WARNINGs about peers: one per peer and kind, repeats summed up
        self._pump = DataPump(self._scheduler, self._router, self._stager, self._held, self._notices)
        self._digests = DigestWork(self._scheduler, self._router, self._stager)
        self._hashing_due = False  # digest requests have bytes left to hash now
        self._sent = SentLog()
        self._outbox = Outbox(self._router, self._scheduler, self._sent, self._notices)
        self._links = LinkWatch(self._router, self._scheduler)  # the kernel's view of the uplink
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"zmqtransport-serve-{self.port}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ called from any thread

    def stage(self, staged: Staged) -> None:
        self._command(StageCommand(staged))

    def disallow(self) -> DisallowStats:
        """Block until no transfer reads the staged tensors and libzmq references none (at most ~timeout + a grace).

        Receives running now go on from a snapshot; see the module docstring.
        """
        command = DisallowCommand(threading.Event(), DisallowStats())
        started = time.monotonic()
        self._command(command)
        # The thread forces the release at the timeout; the grace covers the rebind.
        deadline = started + self._timeout + DISALLOW_GRACE
        while not command.done.wait(0.1):
            if not self._thread.is_alive():
                break  # it closed the socket and waited for its frames on the way out
            if time.monotonic() > deadline:
                raise TimeoutError("disallow_checkpoint timed out waiting for the serving thread")
        command.stats.seconds = time.monotonic() - started
        return command.stats

    def relay(self, relayed: Relayed) -> None:
        """Serve ``relayed`` (a step being received) to the downstream the source sends here."""
        self._command(RelayCommand(relayed))

    def poke(self) -> None:
        """More of a relayed step has landed: transfers waiting for it may send."""
        self._wake.wake()

    def stop_relay(self, token: bytes, timeout: float) -> bool:
        """Stop relaying; True once the serving thread will not read the relayed memory again."""
        done = threading.Event()
        self._command(StopRelayCommand(token, done))
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if not self._thread.is_alive():
                return True  # it is gone: it reads nothing
            if time.monotonic() > deadline:
                return False
        return True

    def stop(self, wait: bool, timeout: float = STOP_JOIN_TIMEOUT) -> bool:
        """Tell the serving thread to stop; with ``wait``, wait at most ``timeout`` s. False if it still runs."""
        if self._thread.is_alive():
            self._command(StopCommand())
        if not wait:
            return True
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(
                "zmqtransport: the serving thread %s did not stop within %.1f s; its ROUTER socket is still open",
                self._thread.name,
                timeout,
            )
            return False
        return True

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def sent_since(self, cursor: int) -> tuple[int, list[TransferStats]]:
        """Sends finished after the first ``cursor`` ones, and the cursor to pass next time."""
        return self._sent.since(cursor)

    @property
    def sent_bytes(self) -> int:
        return self._sent.total_bytes

    def _command(self, command: Command) -> None:
        self._commands.put(command)
        self._wake.wake()

    # ------------------------------------------------------------------ serving thread

    def _poller(self) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(self._router.socket, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        poller.register(self._router.monitor, zmq.POLLIN)
        return poller

    def _run(self) -> None:
        poller = self._poller()
        try:
            while not self._stopping:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._wake.fd in events:
                    self._wake.drain()
                    self._run_commands()
                    if self._stopping:
                        break
                if self._router.monitor in events:
                    self._drop_disconnected()
                if self._router.socket in events:
                    self._read_requests()
                self._links.run(time.monotonic())  # before the pump: a new transfer's baseline precedes its data
                # Before the pump too: a look that sees a paused connection's frame released sends its next
                # one in the same pass (after the pump, that took a second pass for each release).
                self._releases(time.monotonic())
                self._outbox.execute(self._pump.run())
                self._hashing_due = self._digests.run()
                if self._housekeeping():
                    poller = self._poller()  # the socket was rebuilt
        except Exception:
            logger.exception("zmqtransport serving thread failed")
        finally:
            self._shutdown_in_thread()

    def _poll_timeout_ms(self) -> int:
        self._scheduler.relaying.mark_awaited(self._scheduler.transfers.values())  # first: see RelayDuty.landed
        now = time.monotonic()
        seconds = 0.0 if self._hashing_due else min(self._scheduler.wakeup_in(now), self._links.wakeup_in(now))
        held = self._held.wakeup_in(now)
        if held is not None:
            seconds = min(seconds, held)
        if self._held.waiting:
            seconds = min(seconds, DISALLOW_POLL)
        return 0 if seconds <= 0 else max(1, int(seconds * 1000) + 1)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            match command:
                case StageCommand(staged):
                    self._notices.flush()  # what peers did while the step before was served
                    self._outbox.execute(self._scheduler.stage(staged, time.monotonic()))
                case DisallowCommand(done, stats):
                    self._notices.flush()
                    self._disallows.begin(done, stats)
                case StopCommand():
                    self._stopping = True
                case RelayCommand(relayed):
                    self._outbox.execute(self._scheduler.relay(relayed, time.monotonic()))
                case StopRelayCommand(token, done):
                    # Copies are sent, never references: once its transfers are
                    # ended here, nothing reads the relayed memory any more.
                    self._outbox.execute(self._scheduler.stop_relay(token))
                    done.set()
                case SnapshotTaken():
                    self._disallows.taken(command)

    def _read_requests(self) -> None:
        self._drop_disconnected()  # first: see Router.disconnected
        for peer, address, frames in self._router.read():
            if len(frames) != 1:
                self._outbox.execute([Refuse(peer, 0, wire.ERR_BAD_REQUEST, "expected one envelope frame")])
                continue
            try:
                request = wire.decode_request(frames[0].buffer)
            except ProtocolError as exc:
                self._notices.warn(address, "bad request", time.monotonic(), "bad request from %s: %s", address, exc)
                self._outbox.execute([Refuse(peer, 0, exc.code, str(exc))])
                continue
            self._outbox.execute(self._scheduler.on_request(peer, request, address, time.monotonic()))

    def _drop_disconnected(self) -> None:
        for peer in self._router.disconnected(busy=busy_peers(self._scheduler)):
            for transfer in self._scheduler.disconnected(peer):
                step, address = transfer.staged.step, transfer.address
                message = "dropping transfer of step %d to %s: its connection closed"
                self._notices.warn(address, "connection closed mid-transfer", time.monotonic(), message, step, address)
        for host, why in self._router.refusals():
            self._notices.warn(host, "connection refused", time.monotonic(), "closed a connection of %s: %s", host, why)

    def _releases(self, now: float) -> None:
        """Frames libzmq let go of since the last look: their transfers' progress, and paused sends resumed."""
        self._scheduler.progress(self._held.poll(now), now)
        if self._held.resumed():
            self._scheduler.resume()  # copies were released: transfers held back at the copy bound try again

    def _housekeeping(self) -> bool:
        """Expire waits and stalls, release frames. Returns True if the socket was rebuilt."""
        now = time.monotonic()
        self._releases(now)
        self._outbox.execute(self._scheduler.expire(now))
        self._cut_stuck(now)
        if self._notices.due(now):
            self._notices.flush()
        self._disallows.settle()
        self._stager.retain(self._disallows.device_transfers())
        self._held.retain({peer for peer, _ in self._scheduler.transfers})
        if not self._held.must_close(now, transfers_running=bool(self._scheduler.transfers)):
            return False
        # Requests already read by libzmq but not yet by us would die with the
        # socket: take them first (fetches with nothing staged are parked).
        self._read_requests()
        if self._scheduler.transfers and not self._held.waiting:
            return False  # one just started on this socket: close it once nothing runs
        logger.warning(
            "receivers that take no data hold %d zero-copy frames; closing the socket to release them",
            self._held.pinned,
        )
        self._held.socket_closed()
        self._router.rebind()
        self._scheduler.rebound(time.monotonic())
        return True

    def _cut_stuck(self, now: float) -> None:
        """Cut the connections that hold queued frames and took none for the stall bound (:func:`cut`)."""
        stuck = self._held.stuck(now)
        if stuck:
            self._drop_disconnected()  # first: a closed connection's descriptor may be reused
            cut(stuck, self._held, self._router, self._scheduler, self._notices, now)

    def _shutdown_in_thread(self) -> None:
        self._outbox.execute(self._scheduler.shutdown())
        self._notices.flush()
        self._router.close()
        for tracker in self._held.trackers():
            try:
                tracker.wait(SHUTDOWN_FRAME_WAIT)
            except zmq.NotDone:
                break
        try:
            self._stager.close()  # no device copy may outlive the thread
        except Exception:
            logger.exception("zmqtransport: synchronising device copies at shutdown failed")
        self._disallows.close(SHUTDOWN_FRAME_WAIT)
        self._held.release_waiters()
        self._wake.close()


def busy_peers(scheduler: Scheduler) -> set[bytes]:
    """Routing ids with something running here (a transfer, a parked request): never closed to make room."""
    waiting = scheduler.parked + scheduler.relaying.waiting
    return {peer for peer, _ in scheduler.transfers} | {parked.peer for parked in waiting}


def cut(
    stuck: list[bytes],
    held: HeldFrames[zmq.MessageTracker],
    router: Router,
    scheduler: Scheduler,
    notices: Notices,
    now: float,
) -> None:
    """Cut these connections: their peers asked (or granted credit) and do not read.

    Closing that one connection frees what libzmq queued for it, everyone
    else's untouched. Where its descriptor is not known, the socket-wide
    release (:meth:`HeldFrames.must_close`) still frees what references the tensors.
    """
    for peer in stuck:
        queued, address = held.queued(peer), router.address_of(peer)
        if not router.cut(peer):
            continue
        held.cutting(peer)
        gone = scheduler.disconnected(peer)
        message = "cut the connection of %s: %d bytes queued for it, it took none for %.1f s (%d transfers ended)"
        notices.warn(address, "connection cut", now, message, address, queued, scheduler.stall, len(gone))
