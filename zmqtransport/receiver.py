"""The receiving side: fetch one step from a peer over a DEALER socket.

Threading: :func:`fetch` runs entirely in the calling thread and owns the DEALER
it creates; the socket is closed before it returns or raises. Several threads
may fetch at once (each has its own socket).

Order of work: request, header, validation and allocation (so a hostile or
buggy peer is refused before any large allocation), then data messages copied
straight into their destination storage while credit is returned in batches,
then the end marker. Only then is the object built: nothing partial is ever
returned.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from . import buffers, sockets, tree, wire
from .device import CPU, DeviceStaging, RecvUnstager, can_fill, fresh_storage, landing_bytes
from .errors import IntegrityError, ProtocolError, RemoteError
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


@dataclass
class _Destination:
    """Where one storage's bytes land: target memory (in place) or a fresh buffer."""

    view: memoryview
    fresh: torch.Tensor | None  # the uint8 storage tensor when freshly allocated
    in_place: Any = None  # the caller's tensor (or DTensor) receiving the bytes
    # Device memory (flat uint8), filled through pinned bounce buffers; view is then empty.
    device_bytes: torch.Tensor | None = None
    # ``fresh`` was allocated with the dtype and shape of the storage's only
    # tensor, which _build then hands out as it is (no second tensor object).
    exact: bool = False
    arena_offset: int = -1  # where ``fresh`` lies in the receiver's arena, if there


@dataclass
class _Header:
    header: wire.Header
    specs: list[tree.TensorSpec]
    paths: dict[int, tree.KeyPath]
    dtensor_specs: dict[int, Any] = field(default_factory=dict)  # local tensor index -> spec
    target_leaves: dict[tree.KeyPath, Any] = field(default_factory=dict)  # in-place targets


def default_max_bytes() -> int:
    """Physical memory: a header claiming more than this cannot be honest."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 2**40


class _Receiver:
    def __init__(
        self,
        context: zmq.Context[Any],
        address: PeerAddress,
        src_rank: int,
        step: int,
        timeout: float,
        options: FetchOptions,
    ) -> None:
        self.address = address
        self.src_rank = src_rank
        self.step = step
        self.timeout = timeout
        self.options = options
        self.deadline = time.monotonic() + timeout
        self.xfer = random.getrandbits(63)
        self.stats = TransferStats(peer=address.endpoint, step=step)
        self.parsed: _Header | None = None  # set once the header is validated
        self.prefaulter: buffers.Prefaulter | None = None  # faults fresh storage in ahead of the data
        self.arena: buffers.Arena | None = None  # small fresh storages, in one mapping
        # Closed again if configuring it fails (a bad key, say): a socket left
        # open would make the transport's shutdown wait forever in Context.term().
        self.socket = sockets.new_socket(context, zmq.DEALER, self._configure)

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_HEADER_BYTES)
        # An explicit routing id survives a reconnect, so a sender that had to
        # rebuild its ROUTER (forced release of a stalled receiver) can still
        # answer a request it parked before. Ids must not start with a zero byte.
        sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))
        if self.options.configure is not None:
            self.options.configure(sock)

    # ----------------------------------------------------------------- socket helpers

    def _timed_out(self, waiting_for: str) -> TimeoutError:
        return TimeoutError(
            f"recv_checkpoint timed out after {self.timeout:.3g} s waiting for {waiting_for} "
            f"from rank {self.src_rank} at {self.address.endpoint} (step {self.step})"
        )

    def _wait(self, waiting_for: str) -> None:
        while not self.socket.poll(max(0, int((self.deadline - time.monotonic()) * 1000)) or 0):
            if time.monotonic() >= self.deadline:
                raise self._timed_out(waiting_for)

    def _recv_envelope(self, waiting_for: str) -> dict[str, Any]:
        """Receive the first frame of the next message and check it is a valid reply."""
        try:
            frame = self.socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            self._wait(waiting_for)
            frame = self.socket.recv(zmq.NOBLOCK)
        message = wire.unpack(frame, wire.MAX_REQUEST_BYTES)
        wire.check_version(message, f"the sender at {self.address.endpoint}")
        op = message.get("op")
        if message.get("id") != self.xfer and op != wire.OP_ERROR:
            raise ProtocolError(f"reply for another transfer: {message.get('id')!r}")
        if op == wire.OP_ERROR:
            self._drain_rest()
            code = str(message.get("code", "unknown"))
            text = str(message.get("msg", ""))
            if code == wire.ERR_NOT_STAGED:
                # The peer gave up waiting for the step on our behalf: same outcome
                # as our own deadline passing, so the same error type.
                raise self._timed_out(f"{waiting_for} (the peer staged nothing: {text})")
            raise RemoteError(code, f"rank {self.src_rank} at {self.address.endpoint}: {text}")
        if op not in wire.REPLY_OPS:
            raise ProtocolError(f"unknown reply op {op!r}")
        return message

    def _more(self) -> bool:
        return bool(self.socket.getsockopt(zmq.RCVMORE))

    def _drain_rest(self) -> None:
        while self._more():
            self.socket.recv()

    def _expect_no_more(self, what: str) -> None:
        if self._more():
            self._drain_rest()
            raise ProtocolError(f"{what} carries unexpected extra frames")

    # ----------------------------------------------------------------- phases

    def request(self, header_only: bool = False) -> None:
        self.socket.connect(self.address.endpoint)
        wait_ms = max(0, int((self.deadline - time.monotonic()) * 1000))
        request = wire.fetch_request(
            self.xfer, self.step, wait_ms, self.options.window, self.options.allow_pickle, header_only
        )
        self.socket.send(request)

    def receive_header(self) -> _Header:
        message = self._recv_envelope("the checkpoint header")
        if message["op"] != wire.OP_HEADER or not self._more():
            raise ProtocolError(f"expected a header, got {message['op']!r}")
        body = self.socket.recv()
        self._expect_no_more("the header")
        header = wire.decode_header(wire.unpack(body, wire.MAX_HEADER_BYTES))
        if header.step != self.step:
            raise ProtocolError(f"asked for step {self.step} but the peer sent step {header.step}")
        specs = tree.decode_tensor_table(header.tensors, header.storages)
        dtensor_specs: dict[int, Any] = {}
        paths = tree.index_skeleton(header.skeleton, len(specs), self.options.allow_pickle, dtensor_specs)
        self.parsed = _Header(header, specs, paths, dtensor_specs)
        return self.parsed

    def destinations(self, parsed: _Header, targets: Any) -> list[_Destination]:
        """Decide where each storage lands, refusing absurd sizes before allocating."""
        header, specs = parsed.header, parsed.specs
        users: dict[int, list[int]] = {}
        for index, spec in enumerate(specs):
            users.setdefault(spec.storage, []).append(index)
        leaves = dict(tree.iter_tensor_leaves(targets)) if targets is not None else {}
        parsed.target_leaves = leaves
        chosen: dict[int, Any] = {}
        # Without targets (a fresh receive) nothing can be chosen: skip the walk.
        for storage, nbytes in enumerate(header.storages if leaves else ()):
            tensor_indices = users.get(storage, [])
            if len(tensor_indices) != 1:
                continue
            index = tensor_indices[0]
            spec = specs[index]
            target = leaves.get(parsed.paths[index])
            local = _local_tensor(target)
            if local is None or not _fits(local, spec, nbytes):
                continue
            # A DTensor shard goes only into a DTensor with the same spec: other
            # placements or another mesh would describe bytes it does not hold.
            dtensor_spec = parsed.dtensor_specs.get(index)
            if dtensor_spec is not None or local is not target:
                from . import dtensor_codec

                if dtensor_spec is None or not dtensor_codec.spec_matches(target, dtensor_spec):
                    continue
            chosen[storage] = target
        fresh_bytes = sum(n for i, n in enumerate(header.storages) if i not in chosen)
        limit = self.options.max_bytes if self.options.max_bytes is not None else default_max_bytes()
        if fresh_bytes > limit:
            raise ProtocolError(
                f"the peer announced {fresh_bytes} bytes of tensors, more than the limit of {limit}"
            )
        staged = self._staged_destinations(header, chosen)
        result: list[_Destination] = []
        fresh_regions: list[tuple[int, int, int]] = []  # (stream offset, pointer, bytes)
        # The storages that travel packed (plan_chunks) and land in fresh memory.
        small = [
            i
            for i, n in enumerate(header.storages)
            if 0 < n < header.pack_below and i not in chosen and i not in staged
        ]
        arena = buffers.Arena([header.storages[i] for i in small]) if len(small) >= buffers.ARENA_MIN_STORAGES else None
        in_arena = dict(zip(small, arena.offsets, strict=True)) if arena is not None else {}
        self.arena = arena
        offset = 0
        for storage, nbytes in enumerate(header.storages):
            target = chosen.get(storage)
            landing = staged.get(storage)
            at = in_arena.get(storage, -1)
            if landing is not None:
                result.append(landing)
            elif target is not None:
                local = _local_tensor(target)
                assert local is not None
                result.append(_Destination(buffers.tensor_view(local), None, target))
            elif arena is not None and at >= 0:
                if at == 0:
                    fresh_regions.append((offset, arena.pointer, arena.nbytes))
                exact = _exact_spec(specs, users.get(storage), nbytes)
                if exact is not None:
                    fresh = arena.tensor(at, nbytes, exact.dtype, exact.shape)
                else:
                    fresh = arena.tensor(at, nbytes, torch.uint8)
                view = arena.view[at : at + nbytes]
                result.append(_Destination(view, fresh, exact=exact is not None, arena_offset=at))
            else:
                exact = _exact_spec(specs, users.get(storage), nbytes)
                if exact is not None and not (self.options.huge_pages and nbytes >= buffers.HUGE_PAGE):
                    # The storage's only tensor, allocated as itself: building it
                    # later through set_() cost ~10 us per tensor, 0.2 s for 20,480.
                    fresh = torch.empty(exact.shape, dtype=exact.dtype)
                    result.append(_Destination(buffers.tensor_view(fresh), fresh, exact=True))
                else:
                    fresh = buffers.allocate(nbytes, self.options.huge_pages)
                    result.append(_Destination(buffers.tensor_view(fresh), fresh))
                if nbytes >= buffers.PREFAULT_PIECE:
                    fresh_regions.append((offset, fresh.data_ptr(), nbytes))
            offset += nbytes
        # Page faults of fresh memory would otherwise be taken one by one inside
        # the copy loop below, after the network, on one core (buffers.py).
        self.prefaulter = buffers.Prefaulter.start(fresh_regions, self.options.prefault_threads)
        return result

    def _staged_destinations(self, header: wire.Header, chosen: dict[int, Any]) -> dict[int, _Destination]:
        """Destinations in device memory (in place, or fresh on ``options.device``), by storage."""
        staging = self.options.staging
        fresh_staged = staging.stages(self.options.device)
        staged: dict[int, _Destination] = {}
        for storage, nbytes in enumerate(header.storages):
            target = chosen.get(storage)
            if target is not None:
                local = _local_tensor(target)
                assert local is not None
                flat = landing_bytes(local, staging)
                if flat is not None:
                    staged[storage] = _Destination(memoryview(b""), None, target, flat)
            elif fresh_staged:
                fresh = fresh_storage(nbytes, self.options.device)
                staged[storage] = _Destination(memoryview(b""), fresh, None, fresh)
        return staged

    def receive_data(
        self, header: wire.Header, destinations: list[_Destination], unstager: RecvUnstager | None = None
    ) -> None:
        plan = wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below)
        total = header.total_bytes
        done = 0
        unacknowledged = 0
        batch = max(1, self.options.window // 2)
        progress = self.options.progress
        prefaulter = self.prefaulter
        for seq, pieces in enumerate(plan):
            message = self._recv_envelope(f"data message {seq} of {len(plan)}")
            if message["op"] != wire.OP_DATA or message.get("seq") != seq or not self._more():
                raise ProtocolError(f"expected data message {seq}, got {message.get('op')!r} {message.get('seq')!r}")
            expected = wire.chunk_length(pieces)
            bounced = unstager is not None and unstager.wants(pieces)
            if unstager is not None and bounced:
                # Device memory: into a pinned bounce buffer; its copies to the
                # device are queued after the checksum and overlap the next frames.
                payload: Any = unstager.buffer(expected)
                received = self.socket.recv_into(payload)
                if received != expected:
                    raise ProtocolError(f"data message {seq} has {received} bytes, expected {expected}")
            elif len(pieces) == 1:
                piece = pieces[0]
                target = destinations[piece.storage].view[piece.start : piece.start + piece.length]
                received = self.socket.recv_into(target)
                if received != expected:
                    raise ProtocolError(f"data message {seq} has {received} bytes, expected {expected}")
                payload = target
            elif (run := self._arena_run(pieces, destinations)) is not None:
                # Packed storages that lie back to back in the arena: straight into place.
                payload = run
                received = self.socket.recv_into(run)
                if received != expected:
                    raise ProtocolError(f"data message {seq} has {received} bytes, expected {expected}")
            else:
                frame = self.socket.recv(copy=False)
                payload = frame.buffer
                if len(payload) != expected:
                    raise ProtocolError(f"data message {seq} has {len(payload)} bytes, expected {expected}")
                at = 0
                for piece in pieces:
                    destinations[piece.storage].view[: piece.length] = payload[at : at + piece.length]
                    at += piece.length
            self._expect_no_more(f"data message {seq}")
            crc = message.get("crc")
            if header.checksum is not None and crc != zlib.crc32(payload):
                raise self._integrity_error(seq, pieces)
            if unstager is not None and bounced:
                unstager.deliver(pieces)
            unacknowledged += 1
            if unacknowledged >= batch and seq + 1 < len(plan):
                self.socket.send(wire.credit_request(self.xfer, unacknowledged))
                unacknowledged = 0
            done += expected
            if prefaulter is not None:
                prefaulter.received = done  # its workers skip what the data has reached
            self.stats.messages += 1
            if progress is not None:
                progress(done, total)
        message = self._recv_envelope("the end of the transfer")
        if message["op"] != wire.OP_END:
            raise ProtocolError(f"expected the end marker, got {message['op']!r}")
        self._expect_no_more("the end marker")

    def _arena_run(self, pieces: list[wire.Piece], destinations: list[_Destination]) -> memoryview | None:
        """The arena bytes a packed message fills, when its storages lie there back to back."""
        arena = self.arena
        if arena is None:
            return None
        start = at = destinations[pieces[0].storage].arena_offset
        if start < 0:
            return None
        for piece in pieces:
            if destinations[piece.storage].arena_offset != at or piece.start:
                return None
            at += piece.length
        return arena.view[start:at]

    def _integrity_error(self, seq: int, pieces: list[wire.Piece]) -> IntegrityError:
        """Name the storages and the tensors (key paths) a corrupted data message carried."""
        hit = sorted({piece.storage for piece in pieces})
        parsed = self.parsed
        assert parsed is not None  # data only follows a validated header
        names = [
            tree.format_path(parsed.paths[index])
            for index, spec in enumerate(parsed.specs)
            if spec.storage in hit and index in parsed.paths
        ]
        more = " ..." if len(names) > 8 else ""
        return IntegrityError(
            f"checksum mismatch in data message {seq} from {self.address.endpoint} "
            f"(step {self.step}): storages {hit}, tensors {', '.join(names[:8]) or 'none'}{more}"
        )

    def cancel(self) -> None:
        with contextlib.suppress(zmq.ZMQError):  # best effort: the peer may be gone
            self.socket.send(wire.cancel_request(self.xfer), zmq.NOBLOCK)

    def close(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.close()  # before the fresh memory can be freed
        self.socket.close(linger=0)


def _local_tensor(target: Any) -> torch.Tensor | None:
    if target is None:
        return None
    local = getattr(target, "_local_tensor", None)  # DTensor: write into its shard
    if isinstance(local, torch.Tensor):
        return local
    return target if isinstance(target, torch.Tensor) else None


def _exact_spec(
    specs: list[tree.TensorSpec], users: list[int] | None, nbytes: int
) -> tree.TensorSpec | None:
    """The spec of a storage's only tensor when that tensor is exactly the whole storage."""
    if users is None or len(users) != 1:
        return None
    spec = specs[users[0]]
    return spec if _whole(spec, nbytes) else None


def _whole(spec: tree.TensorSpec, nbytes: int) -> bool:
    """Whether ``spec`` is exactly its ``nbytes``-byte storage: contiguous, from byte 0 to the end."""
    if spec.offset:
        return False
    shape = spec.shape
    if len(shape) == 1:  # the common case, without computing a contiguous stride
        return spec.stride == (1,) and shape[0] * spec.dtype.itemsize == nbytes
    return spec.covers_whole_storage and spec.nbytes == nbytes


def _fits(target: torch.Tensor, spec: tree.TensorSpec, storage_nbytes: int) -> bool:
    return (
        _whole(spec, storage_nbytes)  # first: no torch attribute access
        and target.dtype == spec.dtype
        and target.shape == spec.shape  # torch.Size compares equal to the tuple
        and can_fill(target.device)
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
        and target.layout == torch.strided
    )


def _build(parsed: _Header, destinations: list[_Destination]) -> Any:
    tensors: dict[int, Any] = {}

    def plain(index: int) -> torch.Tensor:
        spec = parsed.specs[index]
        destination = destinations[spec.storage]
        if destination.in_place is not None:
            return _local_tensor(destination.in_place)  # type: ignore[return-value]
        assert destination.fresh is not None
        if destination.exact:
            tensor = destination.fresh
        else:
            tensor = torch.empty(0, dtype=spec.dtype, device=destination.fresh.device).set_(
                destination.fresh.untyped_storage(), spec.offset, spec.shape, spec.stride
            )
        if spec.is_param:
            return torch.nn.Parameter(tensor, requires_grad=spec.requires_grad)
        if spec.requires_grad:
            tensor.requires_grad_(True)
        return tensor

    def leaf(index: int) -> Any:
        if index not in tensors:
            spec = parsed.specs[index]
            destination = destinations[spec.storage]
            # In place: hand back the caller's own tensor object, not a new view.
            in_place = destination.in_place
            tensors[index] = in_place if isinstance(in_place, torch.Tensor) and not hasattr(
                in_place, "_local_tensor"
            ) else plain(index)
        return tensors[index]

    def make_dtensor(index: int, spec_obj: Any, requires_grad: bool) -> Any:
        from . import dtensor_codec

        # The caller's DTensor at this path, even when its bytes were not a
        # match: its live mesh is still worth reusing when the specs agree.
        like = parsed.target_leaves.get(parsed.paths[index])
        return dtensor_codec.make_dtensor(plain(index), spec_obj, requires_grad, like=like)

    return tree.build_tree(parsed.header.skeleton, leaf, make_dtensor)


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
    try:
        receiver.request()
        parsed = receiver.receive_header()
        receiver.stats.header_seconds = time.monotonic() - started
        destinations = receiver.destinations(parsed, targets)
        unstager = RecvUnstager.borrow(options.staging, destinations)
        try:
            receiver.receive_data(parsed.header, destinations, unstager)
        finally:
            if unstager is not None:
                # Every copy to the device has landed (or, on error, stopped)
                # before this returns or raises.
                unstager.close()
        result = _build(parsed, destinations)
    except BaseException:
        receiver.cancel()
        raise
    finally:
        receiver.close()
    stats = receiver.stats
    stats.seconds = time.monotonic() - started
    stats.bytes = parsed.header.total_bytes
    stats.in_place_bytes = sum(
        n for n, d in zip(parsed.header.storages, destinations, strict=True) if d.in_place is not None
    )
    stats.tensors = len(parsed.specs)
    logger.info(
        "received step %d from rank %d at %s: %d bytes (%d in place) in %.3f s (%.2f GB/s)",
        step,
        src_rank,
        address.endpoint,
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
    receiver = _Receiver(context, address, -1, step, timeout, options)
    try:
        receiver.request(header_only=True)
        parsed = receiver.receive_header()
        message = receiver._recv_envelope("the end marker")
        if message["op"] != wire.OP_END:
            raise ProtocolError(f"expected the end marker, got {message['op']!r}")
        return parsed.header
    finally:
        receiver.close()
