"""ZMQTransport: the CheckpointTransport facade over the sending side (serve/) and the receiving side (fetch/).

Threading contract:

* construction binds one ROUTER socket and starts one serving thread that
  alone uses it (:mod:`zmqtransport.serve`);
* ``send_checkpoint`` and ``disallow_checkpoint`` may be called from any
  thread; they hand work to the serving thread and never touch its socket;
* ``recv_checkpoint`` runs in the calling thread with DEALER sockets of its
  own (:mod:`zmqtransport.fetch`); concurrent calls are independent;
* ``shutdown`` stops the serving thread and terminates the ZeroMQ context.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence, Sized
from datetime import timedelta
from typing import Any, TypeVar

import torch
import zmq

from . import security, sockets, wire
from .contract import CheckpointTransport, register_with_torchft
from .device import DeviceStaging, fresh_device
from .fetch import FetchOptions, ProgressCallback, Published, RelayOffer, fetch, fetch_digests, fetch_header
from .fetch.options import VERIFY_CHOICES
from .fetch.relaying import AfterReturn
from .fetch.streams import Configure
from .gcpause import paused_gc
from .net import PeerAddress, advertised_hosts, parse_metadata, paths_with_ports, split_hosts
from .serve import Server
from .serve.frames import QUEUED_COPIES
from .serve.staged import stage
from .stats import DisallowStats, TransferStats

T = TypeVar("T")

# Shutdowns started with wait=False that have not finished. A process that
# exits while one is still tearing down libzmq's sockets and threads can die
# in C++ (std::terminate, exit status -6) after its work succeeded; the exit
# waits for them instead, within a bound (each shutdown is bounded too).
_PENDING_SHUTDOWNS: set[threading.Thread] = set()
_PENDING_LOCK = threading.Lock()
EXIT_WAIT = 15.0  # seconds, for all of them together


@atexit.register
def _finish_pending_shutdowns() -> None:
    deadline = time.monotonic() + EXIT_WAIT
    with _PENDING_LOCK:
        pending = list(_PENDING_SHUTDOWNS)
    for thread in pending:
        thread.join(max(0.0, deadline - time.monotonic()))

logger = logging.getLogger(__name__)

DEFAULT_PACK_BELOW = 64 * 1024
DEFAULT_SEND_QUEUE_BYTES = QUEUED_COPIES
DEFAULT_WINDOW = 16
# Connections one receive may open: each is a socket and a monitor on both
# sides, and counts against the sender's per-peer and global transfer limits.
MAX_STREAMS = 16
AUTO_IO_THREADS_MAX = 4  # io_threads=None: one per four cores, at most this many
DIRECT_STREAMS = 4  # streams=None with several I/O threads: a receive that is no swarm member uses this many
# The stall bound's default, in seconds (docs/protocol.md, "Liveness" and "Dead
# and stalled sources"). Healthy transfers under load waited at most 0.33 s for a
# data message (3 receivers x 1 GiB fresh on 2 cores, scripts/stall_gaps.py);
# a receiver frozen for longer than this is dropped by its source. 5 s leaves a
# wide margin above both and stays far below torchft's usual 60 s timeouts.
DEFAULT_STALL_TIMEOUT = 5.0
# Seconds shutdown() waits for Context.term() once its own sockets are closed
# (linger 0). term() then waits only for sockets of other threads: a fetch in
# flight gets ETERM on its next call and closes its DEALER at once, so a
# socket still open after this is one its owner never closed (a leak), and
# the trainer's exit must not hang on it. The serving thread's own bound is
# serve.server.STOP_JOIN_TIMEOUT.
SHUTDOWN_TERM_TIMEOUT = 5.0


class ZMQTransport(CheckpointTransport[T]):
    """Serve and fetch training state over ZeroMQ, without pickle.

    Args:
        timeout: the transport timeout: bounds a whole receive, and
            ``disallow_checkpoint`` never waits longer than this for receivers
            to let go of the staged memory (nor serves a snapshot longer).
        stall_timeout: the stall bound (``timedelta`` or seconds; default 5 s;
            ``None``: no bound but ``timeout``), distinct from ``timeout``,
            which a large checkpoint on a slow link may need to be long. When
            receiving, once the header has arrived, a source that sends nothing
            for this long fails the receive with
            :class:`zmqtransport.StalledError` (a ``TimeoutError``); only time
            spent waiting for the source counts, and ZMTP heartbeats (off with
            ``None``) notice a host that vanished without closing its
            connection. A source whose connection ends mid-transfer fails the
            receive with :class:`zmqtransport.ConnectionLostError` at once,
            whatever this is (docs/protocol.md, "Dead and stalled sources"). When sending,
            a receiver that neither grants credit nor takes data for this long
            is stalled: its transfer is dropped (error ``stalled``), and the
            zero-copy frames queued for it are released by closing and
            rebinding the socket as soon as no progressing receiver would lose
            data, at the latest when ``disallow_checkpoint`` waits for them,
            which then does not wait longer. A receiver that makes progress, however
            slowly, is never cut. It must exceed the time one data message
            (``chunk_bytes``) takes on the slowest link. A receiver whose
            connection closes (process killed, connection reset) is dropped at
            once. See docs/protocol.md, "Liveness".
        snapshot_bytes: the most memory ``disallow_checkpoint`` may copy into
            so that receives running at the call finish without the caller's
            tensors (its snapshot; all snapshots alive together). ``None``
            (default): a quarter of the memory the system reports available at
            the call. When what the running receives may still ask for exceeds
            it, the call waits for them instead (as HTTPTransport's does),
            until what they still need fits, they end, or they stall; ``0``
            always waits. See docs/protocol.md, "Releasing staged memory".
        send_queue_bytes: the most memory this side's copies queued for
            sending may take, all connections together (packed small tensors,
            messages relayed onward, a disallow's snapshot; zero-copy frames of
            large tensors are not copies). Default 256 MiB. Whatever credit a
            peer grants, one connection also holds at most 32 MiB queued (one
            frame at least), and one that takes nothing for the stall bound
            is cut, which frees what was queued for it (docs/security.md,
            "Memory a peer can make this side hold").
        bind_host: interface to listen on; ``"*"`` (default) means all of them.
            A list (or a comma-separated string) listens on each address:
            one path per network (docs/protocol.md, "Paths").
        port: TCP port to listen on; 0 (default) picks a free one. With
            several bind hosts, every one listens on this port; with 0 the
            first picks one and the others take the same one where it is free
            (a free port of their own otherwise).
        advertise_host: the host put in :meth:`metadata`, or a comma-separated
            list (or list) of hosts: one advertised path each, in order of
            preference. Default: see :func:`zmqtransport.net.advertised_hosts`
            (the ``ZMQTRANSPORT_ADVERTISE_HOST`` environment variable, also
            comma-separated, else each bind host, a wildcard replaced by the
            default-route interface's address).
        chunk_bytes: the data frame size this side sends (storages are cut
            into frames of this size). ``None`` (default): 1 MiB, halved for a
            state under 256 MiB until it makes 256 frames, never below 256 KiB
            nor ``pack_below``: a fan-out's peers forward whole frames, and few
            large ones make its start slow (docs/protocol.md, "Data stream and
            the chunk plan"). A value set here is used as it is.
        pack_below: storages smaller than this are packed together into shared
            frames (one frame per tiny tensor would be slow).
        window: data messages this side lets a sender have in flight when
            receiving (the credit window); ``window * chunk_bytes`` bounds the
            memory queued per receiver.
        streams: connections one ``recv_checkpoint`` uses. ``None``
            (default): one per path the source advertises, so one path means
            one connection, and a source on several networks
            is read over all of them at once; with more than one I/O thread
            (``io_threads``), at least four, unless the source makes the
            receive a swarm member. ``1``: one connection, over the
            most preferred path that connects. ``N > 1``: N connections,
            spread over the paths that connect. With more than one, the data
            is fetched in spans handed to whichever connection has room (a
            faster path carries more), and a connection that is lost or
            stalls mid-transfer has its spans fetched over the others
            (docs/protocol.md, "Spans"). Needs a sender of this release; an
            older one is read over one connection.
        relay: when several receivers on other hosts fetch one step from one
            source at the same time, they form a swarm: each fetches from the
            source and from the others, every peer as fast as it delivers,
            and serves what it has received to them, so the source uploads
            the state about once rather than once per receiver and a slow
            receiver holds nobody back (docs/protocol.md, "Swarm"). On by
            default; it costs this receiver upload bandwidth while it
            receives, and ``recv_checkpoint`` returns at most
            ``zmqtransport.fetch.relaying.RELAY_TAIL`` (10 ms) after its own
            data is complete, never serving from the received memory after
            it returns, except as ``relay_after_return`` says. ``False``:
            never relay, and fetch from the source only.
        relay_after_return: a member whose receive was fresh (not in place)
            into host memory goes on serving the others from it after
            ``recv_checkpoint`` returns, until this transport's next
            ``disallow_checkpoint`` (torchft calls it in ``should_commit``,
            once the step's collectives, which wait for every healing
            replica, are done), send, receive or ``shutdown``, or the
            receive's own timeout, whichever comes first. The received
            memory stays allocated until then, and the caller should not
            change the returned tensors before: every downstream checks what
            it is sent against the source's digests, so a change costs the
            others time, never a wrong byte. The late members (slower links)
            then fetch from those done, not the source (docs/protocol.md,
            "Stopping"). ``False``: stop before returning, as a receive in
            place always does.
        verify: which received bytes are checked against the strong digests
            (SHA-256, or BLAKE3 with the ``blake3`` extra on both sides) that
            the source publishes over this receiver's own connection to it
            (docs/protocol.md, "Digests"). ``"relayed"`` (default): every
            message another receiver sends; a peer whose bytes do not match,
            or that answers anything but good data, is dropped for the
            receive (a WARNING names it) and its part is fetched again, so a
            modified peer that offered to relay changes nothing. ``"all"``:
            the source's own messages too (end-to-end, against corruption
            anywhere on the way; costs the source and the receiver one hash
            pass each, docs/performance.md, ``verify="all"``). A source that publishes no digests (an
            earlier release) is never relayed from; ``"all"`` refuses to
            receive from it.
        allow_pickle: send objects that have no pickle-free encoding as pickle,
            and accept pickled objects when receiving. Off by default: a peer's
            pickle can run arbitrary code. Both sides must opt in.
        state_dict: a callable returning the receiver's current structure; when
            set, ``recv_checkpoint`` writes each tensor into the tensor at the
            same key path when dtype and shape match and that tensor is a
            contiguous CPU or CUDA tensor (CUDA ones are filled through pinned
            bounce buffers, docs/cuda.md). A failed receive may leave those
            targets partly written (the error is still raised).
        checksum: when sending, attach a CRC32 to every data frame; receivers
            always verify checksums a sender attached.
        max_recv_bytes: refuse a header announcing more fresh memory than this
            (default: physical memory).
        io_threads: ZeroMQ I/O threads of this transport's context. ``None``
            (default): one per four cores this process may run on, at most
            four (one on fewer than eight cores). With more than one, a
            receive that is no swarm member and leaves ``streams`` at ``None``
            is read over four connections (in spans), which the I/O threads
            carry side by side: where the network outpaces one core
            (docs/performance.md, "Many cores").
        device: where ``recv_checkpoint`` allocates tensors that are not
            received in place: ``"cpu"`` (default, as torchft's other
            transports) or a CUDA device such as ``"cuda"`` / ``"cuda:1"``
            (``ValueError`` when this torch has no CUDA). Sending needs no
            option: CUDA tensors are staged through pinned memory (docs/cuda.md).
        staging: pinned staging buffers and look-ahead for CUDA memory
            (:class:`zmqtransport.device.DeviceStaging`; defaults suit most uses).
        prefault_threads: threads that fault freshly allocated receive memory
            in ahead of the data (0: let the copy take the page faults). See
            docs/performance.md.
        huge_pages: advise fresh receive storages of 2 MiB and more to use
            transparent huge pages. Faster where huge pages are cheap; slower
            on VMs whose host must back each one (docs/performance.md).
        progress: ``callback(bytes_done, bytes_total)`` called while receiving.
        curve_secret: turn on CurveZMQ encryption and authentication with this
            job secret (at least 16 bytes; default ``$ZMQTRANSPORT_CURVE_SECRET``).
            Every rank given the same secret derives the same client key and
            serves only that key; the server's public key travels in
            :meth:`metadata`. See docs/security.md.
        curve_allowed_clients: z85 client public keys this transport serves
            (in addition to the one derived from ``curve_secret``).
        curve_client_keypair: the ``(public, secret)`` z85 key pair this
            transport presents when fetching, instead of the derived one.
        curve_server_keypair: a fixed ``(public, secret)`` server key pair
            instead of a fresh random one.

    After each receive, :attr:`last_recv_stats` describes it; :attr:`last_send_stats`
    and :meth:`sent_since` describe the transfers this transport served.
    """

    def __init__(
        self,
        timeout: timedelta,
        *,
        stall_timeout: timedelta | float | None = DEFAULT_STALL_TIMEOUT,
        snapshot_bytes: int | None = None,
        send_queue_bytes: int = DEFAULT_SEND_QUEUE_BYTES,
        bind_host: str | Sequence[str] = "*",
        port: int = 0,
        advertise_host: str | Sequence[str] | None = None,
        chunk_bytes: int | None = None,
        pack_below: int = DEFAULT_PACK_BELOW,
        window: int = DEFAULT_WINDOW,
        streams: int | None = None,
        relay: bool = True,
        relay_after_return: bool = True,
        verify: str = "relayed",
        allow_pickle: bool = False,
        state_dict: Callable[[], T] | None = None,
        checksum: bool = False,
        max_recv_bytes: int | None = None,
        io_threads: int | None = None,
        device: str | torch.device = "cpu",
        staging: DeviceStaging | None = None,
        prefault_threads: int = 2,
        huge_pages: bool = False,
        progress: ProgressCallback | None = None,
        curve_secret: str | bytes | None = None,
        curve_allowed_clients: Iterable[str | bytes] | None = None,
        curve_client_keypair: security.KeyPair | tuple[bytes, bytes] | None = None,
        curve_server_keypair: security.KeyPair | tuple[bytes, bytes] | None = None,
    ) -> None:
        # Every option is checked before anything is acquired: a bad value costs nothing to undo.
        stall_seconds = _check_options(timeout, stall_timeout, chunk_bytes, pack_below, window, io_threads, port)
        _check_receiving(streams, relay, verify)
        if type(relay_after_return) is not bool:
            raise ValueError(f"relay_after_return={relay_after_return!r}: must be True or False")
        if snapshot_bytes is not None and (type(snapshot_bytes) is not int or snapshot_bytes < 0):
            raise ValueError(f"snapshot_bytes={snapshot_bytes!r}: must be None or an integer >= 0")
        if type(send_queue_bytes) is not int or send_queue_bytes < 1:
            raise ValueError(f"send_queue_bytes={send_queue_bytes!r}: must be an integer >= 1")
        bind_hosts = split_hosts(bind_host, "bind_host")
        # Chosen (and checked) before anything is acquired; the ports follow the binds.
        advertised = advertised_hosts(bind_hosts, advertise_host)
        fresh_on = fresh_device(device)
        self._timeout, self._chunk_bytes, self._pack_below = timeout, chunk_bytes, pack_below
        self._allow_pickle, self._state_dict = allow_pickle, state_dict
        self._checksum = "crc32" if checksum else None
        self._staging = staging if staging is not None else DeviceStaging()
        # Resolved before any socket exists, so a bad key fails construction cleanly.
        self._curve = security.CurveSettings.resolve(
            curve_secret, curve_allowed_clients, curve_client_keypair, curve_server_keypair
        )
        io_threads = auto_io_threads(available_cores()) if io_threads is None else io_threads
        self._context: zmq.Context[Any] = zmq.Context(io_threads=io_threads)
        self._shutdown_lock, self._shut_down = threading.Lock(), False
        self._after_return = AfterReturn()  # a finished receive still serving the others
        self._zap: security.ZapHandler | None = None
        params = self._start_server(bind_hosts, port, stall_seconds, (snapshot_bytes, send_queue_bytes))
        first, *more = paths_with_ports(advertised, [port for _, port in self._server.bound])
        self._address = PeerAddress(first.host, first.port, params, tuple(more))
        self._fetch_options = FetchOptions(
            allow_pickle=allow_pickle,
            window=window,
            max_bytes=max_recv_bytes,
            progress=progress,
            device=fresh_on,
            staging=self._staging,
            huge_pages=huge_pages,
            prefault_threads=prefault_threads,
            stall_timeout=stall_seconds,
            streams=streams,
            direct_streams=DIRECT_STREAMS if io_threads > 1 else 1,
            relay=RelayOffer(
                self._address.to_metadata(),
                self._server,
                self._peer_options,
                self._after_return.hold if relay_after_return else None,
            ) if relay else None,
            verify=verify,
        )
        self.last_recv_stats: TransferStats | None = None
        self.last_disallow_stats: DisallowStats | None = None

    def _start_server(
        self, bind_hosts: list[str], port: int, stall_seconds: float | None, caps: tuple[int | None, int]
    ) -> dict[str, str]:
        """Bind and start serving (the ZAP handler first, with CurveZMQ); the metadata parameters.

        On failure nothing stays open: the context is terminated before the error propagates.
        """
        params: dict[str, str] = {}
        try:
            configure = None
            if self._curve is not None:
                # The ZAP handler must answer before the ROUTER accepts anyone;
                # the Server applies `configure` again whenever it rebinds.
                self._zap = security.ZapHandler(self._context, self._curve.allowed_clients)
                configure = self._curve.configure_server
                params[security.METADATA_KEY] = self._curve.server.public.decode("ascii")
            self._server = Server(
                self._context,
                bind_hosts,
                port,
                self._timeout.total_seconds(),
                configure=configure,
                staging=self._staging,
                stall=stall_seconds,
                snapshot_bytes=caps[0],
                queue_bytes=caps[1],
                curve=self._curve is not None,
            )
        except BaseException:
            # The Server closed its own socket; the ZAP handler's thread and
            # sockets go next, then the context (term() would wait for them).
            if self._zap is not None:
                self._zap.close()
            sockets.terminate(self._context)
            raise
        return params

    # ------------------------------------------------------------------ contract

    def metadata(self) -> str:
        """``tcp://HOST:PORT`` of this transport's ROUTER socket, then its parameters.

        Several advertised paths: the first is ``HOST:PORT``, the others follow
        as ``?paths=HOST:PORT,...`` (docs/protocol.md, "Metadata string").
        """
        return self._address.to_metadata()

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta | None = None
    ) -> None:
        """Stage ``state_dict`` as ``step`` and return at once; receivers pull it.

        The tensors are not copied: do not mutate them until
        :meth:`disallow_checkpoint` returns. Raises ``TypeError`` naming the key
        path of any leaf that cannot be sent. ``timeout`` bounds nothing here
        (staging does not wait on a peer); ``None`` is accepted, as on receive.
        Of ``dst_ranks`` only their number counts: whether receivers that offer
        to relay form a swarm depends on how many share this side's uplink.
        One rank (one replica group healing, as torchft passes) is served
        directly while no other host asks: a swarm of one relays to nobody.
        Pass ``[]`` when the number is not known.
        """
        self._check_open()
        self._after_return.stop()
        with paused_gc():  # many tensors, no cycles: see gcpause
            staged = stage(
                state_dict,
                step,
                allow_pickle=self._allow_pickle,
                chunk_bytes=self._chunk_bytes,
                pack_below=self._pack_below,
                checksum=self._checksum,
                staging=self._staging,
                receivers=len(dst_ranks) if isinstance(dst_ranks, Sized) else 0,
            )
        self._server.stage(staged)

    def disallow_checkpoint(self) -> None:
        """Serve the staged step to no new receiver; the caller may mutate its tensors once this returns.

        Receives running at the call complete with the staged bytes, from a
        copy of what they may still ask for (at most ``snapshot_bytes``):
        this returns once that copy is taken and ZeroMQ no longer references
        the tensors, not once the receives are done. Beyond the cap it waits
        for them (within the stall bound for one that takes no data, and the
        timeout). :attr:`last_disallow_stats` says what it did.
        """
        if not self._shut_down:
            self._after_return.stop()  # a receive's relaying after it returned, too (relay_after_return)
            self.last_disallow_stats = self._server.disallow()

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta | None = None) -> T:
        """Fetch ``step`` from the transport whose :meth:`metadata` is ``metadata``.

        Raises ``TimeoutError`` (message says "timed out", names the peer and
        step) when any phase outlasts ``timeout`` (``None``: the constructor's,
        as torchft's PGTransport takes it); :class:`RemoteError` when the
        peer refuses (wrong step, disallowed, ...); :class:`ProtocolError` for a
        malformed reply. Never returns partial state.
        """
        self._check_open()
        self._after_return.stop()
        address = parse_metadata(metadata)
        targets = self._in_place_targets()
        result, stats = fetch(
            self._context,
            address,
            src_rank,
            step,
            self._seconds(timeout),
            self._fetch_options,
            self._peer_options(address),
            targets,
        )
        self.last_recv_stats = stats
        return result  # type: ignore[no-any-return]

    def shutdown(self, wait: bool = True) -> None:
        """Stop serving and release sockets; idempotent. ``wait=False`` returns at once."""
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
        if wait:
            self._close()
        else:
            thread = threading.Thread(target=self._close, name="zmqtransport-shutdown", daemon=True)
            with _PENDING_LOCK:
                _PENDING_SHUTDOWNS.add(thread)
            thread.start()

    # ------------------------------------------------------------------ extras

    def fetch_header(self, metadata: str, step: int, timeout: timedelta | None = None) -> wire.Header:
        """What the peer serves for ``step`` (tensor table, sizes), without the data (``timeout`` as on receive)."""
        self._check_open()
        address = parse_metadata(metadata)
        options, peer_options = self._fetch_options, self._peer_options(address)
        return fetch_header(self._context, address, step, self._seconds(timeout), options, peer_options)

    def fetch_digests(self, metadata: str, step: int, timeout: timedelta | None = None) -> Published:
        """The header of ``step`` and the source's digest of every data message (docs/protocol.md, "Digests").

        No tensor data moves; the source hashes what it has not hashed yet.
        Raises ``ProtocolError`` for a source that publishes no digests.
        ``timeout`` as on receive (``None``: the constructor's).
        """
        self._check_open()
        address = parse_metadata(metadata)
        options, peer_options = self._fetch_options, self._peer_options(address)
        return fetch_digests(self._context, address, step, self._seconds(timeout), options, peer_options)

    def _seconds(self, timeout: timedelta | None) -> float:
        """A call's timeout in seconds; ``None`` means the one this transport was built with."""
        return (self._timeout if timeout is None else timeout).total_seconds()

    def _peer_options(self, address: PeerAddress) -> Configure | None:
        """DEALER options for fetching from one peer: CURVE needs that peer's server key.

        Raises ``ValueError`` when the two sides disagree about CURVE: a transport
        with CURVE on never fetches in the clear, one without it cannot fetch
        from a CURVE peer.
        """
        server_key = address.params.get(security.METADATA_KEY)
        if self._curve is None:
            return security.client_configurator_without_settings(address.endpoint, server_key)
        return self._curve.client_configurator(address.endpoint, server_key)

    def _in_place_targets(self) -> Any:
        """The structure to receive into, or None: a failing callable costs speed, not the heal."""
        if self._state_dict is None:
            return None
        try:
            return self._state_dict()
        except Exception:
            logger.warning("state_dict callable failed; receiving into fresh memory", exc_info=True)
            return None

    @property
    def last_send_stats(self) -> TransferStats | None:
        """The last transfer this transport finished serving (peer, step, bytes, seconds), or None."""
        recent = self._server.sent_since(0)[1]
        return recent[-1] if recent else None

    def sent_since(self, cursor: int = 0) -> tuple[int, list[TransferStats]]:
        """Transfers finished serving after the first ``cursor`` ones, and the next cursor.

        Poll it as ``cursor, new = transport.sent_since(cursor)`` to see every
        served transfer once (the most recent 256 are kept). A striped
        receive is served as one transfer per span, and what this transport
        relays as a receiver is recorded too; :attr:`sent_bytes` sums them all.
        """
        return self._server.sent_since(cursor)

    @property
    def sent_bytes(self) -> int:
        """Data bytes this transport has uploaded in finished sends: transfers, spans and what it relayed."""
        return self._server.sent_bytes

    @property
    def address(self) -> PeerAddress:
        return self._address

    def _close(self) -> None:
        try:
            self._close_all()
        finally:
            with _PENDING_LOCK:
                _PENDING_SHUTDOWNS.discard(threading.current_thread())

    def _close_all(self) -> None:
        """Every wait bounded: a bound that is hit is logged (naming what was left open), never hung on."""
        self._after_return.stop()
        self._server.stop(wait=True)
        if self._zap is not None:
            self._zap.close()
        sockets.terminate(self._context, SHUTDOWN_TERM_TIMEOUT, level=logging.WARNING)

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError("this ZMQTransport has been shut down")

    def __enter__(self) -> ZMQTransport[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"ZMQTransport({self.metadata()!r})"


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the platform tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def auto_io_threads(cores: int) -> int:
    """``io_threads=None``: one I/O thread per four cores, at most :data:`AUTO_IO_THREADS_MAX`.

    Measured (docs/performance.md, "Many cores"): on 16 cores over unshaped links, three direct
    receivers of 256 MiB took 0.19 s with one I/O thread and one connection each, 0.12 s with two
    I/O threads and four connections, 0.09 s with four and four; four connections on one I/O thread
    0.18 s. On this project's two-core VM more of either made one receive slower: it keeps one.
    """
    return max(1, min(AUTO_IO_THREADS_MAX, cores // 4))


def _check_options(
    timeout: timedelta,
    stall_timeout: timedelta | float | None,
    chunk_bytes: int | None,
    pack_below: int,
    window: int,
    io_threads: int | None,
    port: int,
) -> float | None:
    """Refuse a bad option value with a ``ValueError`` naming it; the stall bound in seconds."""
    if chunk_bytes is None:
        if not 0 <= pack_below <= wire.LARGE_STATE_FRAME:
            raise ValueError(f"pack_below={pack_below}: must be in [0, {wire.LARGE_STATE_FRAME}] (or set chunk_bytes)")
    elif not wire.MIN_CHUNK_BYTES <= chunk_bytes <= wire.MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes={chunk_bytes}: must be in [{wire.MIN_CHUNK_BYTES}, {wire.MAX_CHUNK_BYTES}]")
    elif not 0 <= pack_below <= chunk_bytes:
        raise ValueError(f"pack_below={pack_below}: must be in [0, chunk_bytes={chunk_bytes}]")
    if not 1 <= window <= wire.MAX_CREDIT:
        raise ValueError(f"window={window}: must be in [1, {wire.MAX_CREDIT}]")
    if not timeout > timedelta(0):
        raise ValueError(f"timeout={timeout}: must be positive")
    stall_seconds = _seconds_or_none(stall_timeout)
    if stall_seconds is not None and not stall_seconds > 0:
        raise ValueError(f"stall_timeout={stall_timeout!r}: must be positive or None")
    if io_threads is not None and (type(io_threads) is not int or io_threads < 1):
        # libzmq accepts 0 and then fails every TCP bind with "No thread available".
        raise ValueError(f"io_threads={io_threads!r}: must be None or at least 1")
    sockets.check_port(port)
    return stall_seconds


def _check_receiving(streams: int | None, relay: bool, verify: str) -> None:
    if verify not in VERIFY_CHOICES:
        raise ValueError(f"verify={verify!r}: must be one of {', '.join(map(repr, VERIFY_CHOICES))}")
    if type(relay) is not bool:
        raise ValueError(f"relay={relay!r}: must be True or False")
    if streams is not None and (type(streams) is not int or not 1 <= streams <= MAX_STREAMS):
        raise ValueError(f"streams={streams!r}: must be None (one per path) or an integer in [1, {MAX_STREAMS}]")


def _seconds_or_none(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a timedelta, seconds or None, got {type(value).__name__}")
    return float(value)


register_with_torchft(ZMQTransport)
