"""The receiving side: fetch one step from a peer over DEALER sockets.

Threading: :func:`fetch` runs entirely in the calling thread and owns the
DEALERs it creates; they are closed before it returns or raises. Several
threads may fetch at once (each has its own sockets).

Order of work: request, header, validation and allocation (so a hostile or
buggy peer is refused before any large allocation; :mod:`.landing` decides,
:mod:`.landed` allocates), then data messages copied straight into their
destination storage, over one connection while credit is returned in
batches, or in spans over several (:mod:`.striped`), relaying what lands when
the source asks (:mod:`.relaying`), then the end marker. Only then is the
object built: nothing partial is ever returned.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import random
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from . import buffers, landing, liveness, relaying, striped, wire
from .connections import Connections
from .device import CPU, DeviceStaging, RecvUnstager
from .errors import ConnectionLostError, ProtocolError, RemoteError, StalledError
from .landed import Landed, build, discard_rest, expect_no_more, integrity_error, land, recv_exact
from .net import PeerAddress
from .stats import TransferStats

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]


@dataclass
class FetchOptions:
    allow_pickle: bool = False
    window: int = 16
    max_bytes: int | None = None  # refuse headers claiming more fresh memory than this
    progress: ProgressCallback | None = None
    configure: Callable[[zmq.Socket[Any]], None] | None = None  # security options
    device: torch.device = CPU  # where fresh (not in-place) tensors are allocated
    staging: DeviceStaging = field(default_factory=DeviceStaging)  # pinned bounce buffers
    huge_pages: bool = False  # advise fresh storages to use transparent huge pages
    prefault_threads: int = 2  # threads faulting fresh storage in ahead of the data
    # Fail a transfer whose source sends nothing for this long (seconds; None: only the timeout).
    stall_timeout: float | None = None
    # Connections per receive (docs/protocol.md, "Spans"): None, one per path
    # the source advertises; 1, a single connection as before spans existed.
    streams: int | None = None
    # Relaying (docs/protocol.md, "Relays"): where this receiver serves (its
    # transport's metadata; None: it does not relay), its server, and the
    # socket options for fetching from a relay the source names.
    relay_at: str | None = None
    relay_host: relaying.RelayHost | None = None
    configure_for: Callable[[PeerAddress], Callable[[zmq.Socket[Any]], None] | None] | None = None

    def striped(self, address: PeerAddress) -> bool:
        """Whether a receive from ``address`` asks for the header alone, then for spans on several connections."""
        if self.streams is None:
            return bool(address.more_paths)
        return self.streams > 1


class _Receiver:
    """One receive's DEALER socket and its phases: request, header, data messages, end marker."""

    def __init__(
        self,
        context: zmq.Context[Any],
        address: PeerAddress,
        src_rank: int | None,
        step: int,
        timeout: float,
        options: FetchOptions,
    ) -> None:
        self.address = address
        self.src_rank = src_rank  # None: the caller has no rank for the peer (fetch_header)
        self.step = step
        self.timeout = timeout
        self.options = options
        self.deadline = time.monotonic() + timeout
        self.xfer = random.getrandbits(63)
        self.stats = TransferStats(peer=address.endpoint, step=step)
        self.parsed: landing.ParsedHeader | None = None  # set once the header is validated
        self.stage: int | None = None  # the staging's id, from a sender that serves span fetches
        self.relay_order: wire.RelayOrder | None = None  # what the source said about relaying
        self.duty: relaying.RelayDuty | None = None  # serving what lands to the downstream
        self.bounce_bytes = 0  # size of each pinned bounce buffer (device receives only)
        self._chunks: tuple[wire.Header, list[list[wire.Piece]]] | None = None
        self.conns = Connections(context, address, options.stall_timeout, options.configure, options.configure_for)

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The connection the request and header go over (and the data, over one connection)."""
        return self.conns.socket

    @property
    def source(self) -> liveness.SourceWatch:
        return self.conns.watch

    # ----------------------------------------------------------------- socket helpers

    def _timed_out(self, waiting_for: str) -> TimeoutError:
        return TimeoutError(
            f"recv_checkpoint timed out after {self.timeout:.3g} s waiting for {waiting_for} from {self._where()}"
        )

    def _where(self) -> str:
        return f"{self._peer()} (step {self.step})"

    def _peer(self, at: bool = True) -> str:
        """How messages name the source: by its rank where the caller gave one."""
        who = "the peer" if self.src_rank is None else f"rank {self.src_rank}"
        return f"{who} at {self.endpoint}" if at else who

    def _wait(self, waiting_for: str, in_transfer: bool) -> None:
        """Block until a message is ready; raise at the deadline, on a stall or a lost connection."""
        outcome = self.source.wait(self.deadline, in_transfer)
        if outcome is liveness.Wait.LOST:
            raise ConnectionLostError(f"connection lost to {self._where()} while waiting for {waiting_for}")
        if outcome is liveness.Wait.STALLED:
            raise StalledError(
                f"recv_checkpoint stalled: nothing from {self._where()} for {self.source.stall_timeout:.3g} s "
                f"(stall_timeout) while waiting for {waiting_for}"
            )
        if outcome is liveness.Wait.DEADLINE:
            raise self._timed_out(waiting_for)

    def _recv_envelope(self, waiting_for: str, in_transfer: bool = False) -> dict[str, Any]:
        """Receive the first frame of the next message and check it is a valid reply."""
        try:
            frame = self.socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            self._wait(waiting_for, in_transfer)
            frame = self.socket.recv(zmq.NOBLOCK)
        message = wire.unpack(frame, wire.MAX_REQUEST_BYTES)
        wire.check_version(message, f"the sender at {self.endpoint}")
        op = message.get("op")
        if message.get("id") != self.xfer and op != wire.OP_ERROR:
            raise ProtocolError(f"reply for another transfer: {message.get('id')!r}")
        if op == wire.OP_ERROR:
            discard_rest(self.socket)
            code = str(message.get("code", "unknown"))
            text = str(message.get("msg", ""))
            if code == wire.ERR_NOT_STAGED:
                # The peer gave up waiting for the step on our behalf: same outcome
                # as our own deadline passing, so the same error type.
                raise self._timed_out(f"{waiting_for} (the peer staged nothing: {text})")
            raise RemoteError(code, f"{self._peer()}: {text}")
        if op not in wire.REPLY_OPS:
            raise ProtocolError(f"unknown reply op {op!r}")
        return message

    def _more(self) -> bool:
        return bool(self.socket.getsockopt(zmq.RCVMORE))


    # ----------------------------------------------------------------- phases

    @property
    def endpoint(self) -> str:
        """The path in use (the first until several are tried)."""
        return self.conns.path.endpoint

    def _connect(self, keep: bool) -> None:
        """Connect to the only path, or to the most preferred of several that connects (:mod:`.connections`)."""
        tried = self.conns.connect(self.deadline, keep)
        if tried is not None:
            raise TimeoutError(
                f"recv_checkpoint timed out after {self.timeout:.3g} s waiting for a connection to "
                f"{self._peer(at=False)} (step {self.step}); paths tried: {tried}"
            )
        self.stats.peer = self.endpoint
        if self.address.more_paths:
            logger.debug("%s: using path %s", self._peer(at=False), self.endpoint)

    def request(self, header_only: bool = False, keep_paths: bool = False) -> None:
        self._connect(keep_paths)
        self.send_request(header_only)

    def send_request(self, header_only: bool = False, relay: bool = True) -> None:
        wait_ms = max(0, int((self.deadline - time.monotonic()) * 1000))
        request = wire.fetch_request(
            self.xfer,
            self.step,
            wait_ms,
            self.options.window,
            self.options.allow_pickle,
            header_only,
            relay=self.options.relay_at if relay else None,
        )
        self.socket.send(request)

    def receive_header(self) -> landing.ParsedHeader:
        message = self._recv_envelope("the checkpoint header")
        if message["op"] != wire.OP_HEADER or not self._more():
            raise ProtocolError(f"expected a header, got {message['op']!r}")
        stage = message.get("stage")
        if stage is not None and (type(stage) is not int or not 0 <= stage < 2**64):
            raise ProtocolError(f"header field 'stage' must be an unsigned 64-bit integer, got {stage!r}")
        self.stage = stage
        self.relay_order = wire.decode_relay_order(message.get("relay")) if self.options.relay_at else None
        body = self.socket.recv()
        expect_no_more(self.socket, "the header")
        header = wire.decode_header(wire.unpack(body, wire.MAX_HEADER_BYTES))
        if header.step != self.step:
            raise ProtocolError(f"asked for step {self.step} but the peer sent step {header.step}")
        self.parsed = landing.parse_header(header, self.options.allow_pickle)
        return self.parsed

    def receive_data(self, header: wire.Header, landed: Landed, unstager: RecvUnstager | None = None) -> None:
        """Receive every data message into ``landed``, returning credit in batches."""
        chunks, duty = self._begin_data(header, landed, unstager)
        done = 0
        unacknowledged = 0
        batch = max(1, self.options.window // 2)
        progress = self.options.progress
        prefaulter = landed.prefaulter
        for seq, pieces in enumerate(chunks):
            message = self._recv_envelope(f"data message {seq} of {len(chunks)}", in_transfer=True)
            if message["op"] != wire.OP_DATA or message.get("seq") != seq or not self._more():
                raise ProtocolError(f"expected data message {seq}, got {message.get('op')!r} {message.get('seq')!r}")
            payload = self.land_message(self.socket, seq, message, landed, unstager, pieces)
            if duty is not None:
                duty.landed(seq, wire.data_crc(message))
            unacknowledged += 1
            if unacknowledged >= batch and seq + 1 < len(chunks):
                self.socket.send(wire.credit_request(self.xfer, unacknowledged))
                unacknowledged = 0
            done += len(payload)
            if prefaulter is not None:
                prefaulter.received = done  # its workers skip what the data has reached
            self.stats.messages += 1
            if progress is not None:
                progress(done, header.total_bytes)
        self.receive_end()
        if duty is not None:
            self.conns.close()  # done with the source; the tail is served by this side's own server
            duty.finish()

    def land_message(
        self,
        socket: zmq.Socket[Any],
        seq: int,
        envelope: dict[str, Any],
        landed: Landed,
        unstager: RecvUnstager | None,
        pieces: list[wire.Piece],
    ) -> memoryview:
        """Receive data message ``seq``'s payload (after ``envelope``) on ``socket`` where it belongs.

        Checks its size and checksum and queues its copies to device memory;
        returns the bytes received. Used by one stream or several (striped).
        """
        bounced = unstager is not None and unstager.wants(pieces)
        payload = self._receive_payload(socket, seq, pieces, landed, unstager if bounced else None)
        expect_no_more(socket, f"data message {seq}")
        assert self.parsed is not None  # data only follows a validated header
        if self.parsed.header.checksum is not None and envelope.get("crc") != zlib.crc32(payload):
            raise integrity_error(self.parsed, seq, pieces, self.endpoint, self.step)
        if unstager is not None and bounced:
            unstager.deliver(pieces)
        return payload

    def _receive_payload(
        self,
        socket: zmq.Socket[Any],
        seq: int,
        pieces: list[wire.Piece],
        landed: Landed,
        unstager: RecvUnstager | None,
    ) -> memoryview:
        """Receive data message ``seq``'s payload where it belongs; return the bytes received."""
        what = f"data message {seq}"
        expected = wire.chunk_length(pieces)
        if unstager is not None:
            # Device memory: into a pinned bounce buffer; its copies to the
            # device are queued after the checksum and overlap the next frames.
            return recv_exact(socket, unstager.buffer(expected, self.bounce_bytes), what, expected)
        destinations = landed.destinations
        if len(pieces) == 1:
            piece = pieces[0]
            view = destinations[piece.storage].view[piece.start : piece.start + piece.length]
            return recv_exact(socket, view, what, expected)
        run = landed.arena_run(pieces)
        if run is not None:
            # Packed storages that lie back to back in the arena: straight into place.
            return recv_exact(socket, run, what, expected)
        payload = recv_exact(socket, None, what, expected)
        at = 0
        for piece in pieces:
            destinations[piece.storage].view[: piece.length] = payload[at : at + piece.length]
            at += piece.length
        return payload

    def chunk_plan(self, header: wire.Header) -> list[list[wire.Piece]]:
        """The header's chunk plan, computed once per receive (milliseconds for many tensors)."""
        if self._chunks is None or self._chunks[0] is not header:
            self._chunks = (header, wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below))
        return self._chunks[1]

    def receive_end(self) -> None:
        message = self._recv_envelope("the end of the transfer", in_transfer=True)
        if message["op"] != wire.OP_END:
            raise ProtocolError(f"expected the end marker, got {message['op']!r}")
        expect_no_more(self.socket, "the end marker")

    def fall_back_to_one_stream(self) -> None:
        """The source serves no span fetches: drop the other paths, fetch everything on this connection."""
        self.conns.drop_spare()
        self.xfer = random.getrandbits(63)
        self.send_request(relay=False)  # it relays nothing either

    def receive_striped(self, header: wire.Header, landed: Landed, unstager: RecvUnstager | None) -> None:
        """Receive every data message in spans (:mod:`zmqtransport.striped`), relaying if the source said so."""
        chunks, duty = self._begin_data(header, landed, unstager)
        assert self.stage is not None  # only a sender that serves spans gets here
        request = striped.Request(
            self.step, self.stage, self.options.allow_pickle, self.deadline, self.options.stall_timeout
        )
        streams = self.conns.streams(self.options.streams, self.relay_order)
        run = striped.StripedReceive(
            streams,
            chunks,
            request,
            lambda socket, seq, envelope: self.land_message(socket, seq, envelope, landed, unstager, chunks[seq]),
            striped.span_messages(header.chunk_bytes),
            self.options.progress,
        )

        def on_landed(seq: int, crc: int | None) -> None:
            if landed.prefaulter is not None:
                landed.prefaulter.received = run.prefix_bytes()  # its workers skip what the data has reached
            if duty is not None:
                duty.landed(seq, crc)

        try:
            run.run(on_landed)
            if duty is not None:
                self.conns.close()  # done with every source: an upstream relay's tail ends now
                duty.finish()
        finally:
            self._record(streams, run)

    def _record(self, streams: list[striped.Stream], run: striped.StripedReceive) -> None:
        self.stats.streams = len(streams)
        self.stats.messages = sum(stream.messages for stream in streams)
        self.stats.duplicate_messages = run.duplicates
        for stream in streams:
            if stream.bytes:
                endpoint = stream.path.endpoint
                self.stats.paths[endpoint] = self.stats.paths.get(endpoint, 0) + stream.bytes

    def cancel(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # best effort: the peer may be gone
            self.socket.send(wire.cancel_request(self.xfer), zmq.NOBLOCK)

    def _begin_data(
        self, header: wire.Header, landed: Landed, unstager: RecvUnstager | None
    ) -> tuple[list[list[wire.Piece]], relaying.RelayDuty | None]:
        """Before the first data message (one stream or several): the chunk plan, and the relay duty
        serving from the landed memory (None when there is none or it cannot serve)."""
        chunks = self.chunk_plan(header)
        if unstager is not None:
            # Every bounce buffer is sized for the largest bounced message: none grows mid-receive.
            self.bounce_bytes = max((wire.chunk_length(p) for p in chunks if unstager.wants(p)), default=0)
        duty = self.duty
        if duty is None:
            return chunks, None
        duty.attach(None if unstager is not None else [d.view for d in landed.destinations])
        return chunks, None if duty.stopped else duty

    @property
    def sent_to_relay(self) -> bool:
        """The source named a relay to fetch from (and sent the header alone)."""
        return self.stage is not None and self.relay_order is not None and self.relay_order.upstream is not None

    def start_relaying(self, header: wire.Header) -> None:
        """Register as a relay as soon as the header is here, if the source asked (see :mod:`.relaying`)."""
        if self.stage is None or self.relay_order is None:
            return
        chunks = self.chunk_plan(header)
        self.duty = relaying.RelayDuty.start(self.options.relay_host, self.relay_order, self.step, self.stage, chunks)

    def close(self) -> None:
        if self.duty is not None:
            self.duty.stop()  # before anything is handed to the caller, whatever happened
        self.conns.close()


def fetch(
    context: zmq.Context[Any],
    address: PeerAddress,
    src_rank: int,
    step: int,
    timeout: float,
    options: FetchOptions,
    targets: Any = None,
) -> tuple[Any, TransferStats]:
    """Fetch ``step`` from the peer at ``address``; see :meth:`ZMQTransport.recv_checkpoint`."""
    buffers.settle_malloc_thresholds()  # once per process; see there
    with paused_gc():
        return _fetch(context, address, src_rank=src_rank, step=step, timeout=timeout, options=options, targets=targets)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Hold off Python's cyclic garbage collector for the duration.

    Decoding a header and building the tree create a few objects per tensor;
    with tens of thousands of tensors that triggers full collections, each of
    which walks every object the process holds (the model included): measured
    0.5 s of 0.55 s to unpack the header of 20,480 tensors. None of these
    objects form cycles, so collecting during the transfer finds nothing.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _landing_options(options: FetchOptions) -> landing.LandingOptions:
    return landing.LandingOptions(
        max_bytes=options.max_bytes,
        device=options.device,
        stages=options.staging.stages,
        huge_pages=options.huge_pages,
    )


def _fetch(
    context: zmq.Context[Any],
    address: PeerAddress,
    *,
    src_rank: int,
    step: int,
    timeout: float,
    options: FetchOptions,
    targets: Any,
) -> tuple[Any, TransferStats]:
    receiver = _Receiver(context, address, src_rank, step, timeout, options)
    started = time.monotonic()
    landed: Landed | None = None
    try:
        stripe = options.striped(address)
        # A striped receive asks for the header alone, then for spans on every connection.
        receiver.request(header_only=stripe, keep_paths=stripe)
        parsed = receiver.receive_header()
        if stripe or receiver.sent_to_relay:
            receiver.receive_end()  # the header came alone: spans follow (from a relay, maybe)
            if receiver.stage is None:
                # A sender from before span fetches: one connection, as it expects.
                receiver.fall_back_to_one_stream()
                parsed = receiver.receive_header()
            stripe = receiver.stage is not None
        receiver.start_relaying(parsed.header)
        receiver.stats.header_seconds = time.monotonic() - started
        # Refused (absurd sizes) before anything is allocated.
        plan = landing.plan_landing(parsed, targets, _landing_options(options))
        landed = land(plan, options.prefault_threads)
        unstager = RecvUnstager.borrow(options.staging, landed.destinations)
        try:
            if stripe:
                receiver.receive_striped(parsed.header, landed, unstager)
            else:
                receiver.receive_data(parsed.header, landed, unstager)
        finally:
            if unstager is not None:
                # Every copy to the device has landed (or, on error, stopped)
                # before this returns or raises.
                unstager.close()
        result = build(parsed, landed)
    except BaseException:
        receiver.cancel()
        raise
    finally:
        if landed is not None:
            landed.close()
        receiver.close()
    assert landed is not None
    stats = receiver.stats
    stats.seconds = time.monotonic() - started
    stats.bytes = parsed.header.total_bytes
    if not stats.paths:
        stats.paths = {receiver.endpoint: stats.bytes}
    stats.in_place_bytes = sum(
        n for n, d in zip(parsed.header.storages, landed.destinations, strict=True) if d.in_place is not None
    )
    stats.tensors = len(parsed.specs)
    logger.info(
        "received step %d from rank %d at %s: %d bytes (%d in place) in %.3f s (%.2f GB/s)",
        step,
        src_rank,
        receiver.endpoint,
        stats.bytes,
        stats.in_place_bytes,
        stats.seconds,
        stats.gbps,
    )
    return result, stats


def fetch_header(
    context: zmq.Context[Any],
    address: PeerAddress,
    step: int,
    timeout: float,
    options: FetchOptions,
) -> wire.Header:
    """Ask the peer for the header of ``step`` only (no tensor data moves)."""
    receiver = _Receiver(context, address, None, step, timeout, options)
    try:
        receiver.request(header_only=True)
        parsed = receiver.receive_header()
        receiver.receive_end()
        return parsed.header
    finally:
        receiver.close()
