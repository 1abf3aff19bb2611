"""The benchmark's methods: one small object per way of moving a state dict.

A :class:`Method` has a name and two factories. ``serve`` runs once in the
long-lived sender process and returns its :class:`Serving` side; ``receiver``
runs in a fresh receiver process per trial and returns its :class:`Receiving`
side, whose ``receive`` is the one call the benchmark times. Nothing else in
the benchmark knows how a method works.

Sequence per trial: ``Serving.stage(step)``; fresh receivers start and build
their ``Receiving`` side while ``Serving.rendezvous(step)`` runs (process
groups need both at once); ``Serving.release(step, receives)``; each receiver
times ``receive(step)``; ``Serving.finish()``.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
import traceback
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch

from ..transport import ZMQTransport
from .barezmq import BareServer, bare_receive
from .config import Knobs
from .layouts import Layout
from .payload import empty_float32, recv_views, send_views, split_views, views_of

TORCHFT = "torchft"
NUMPY = "numpy"
_TCP_REQUEST = struct.Struct("<qII")  # the TCP anchor's request: step, which flow, of how many


@dataclass(frozen=True)
class Place:
    """Where a process runs: its network namespace (None: this one) and address(es)."""

    namespace: str | None = None
    host: str = "127.0.0.1"  # the address every method uses (a lab host's first NIC)
    interface: str = "lo"  # for gloo (GLOO_SOCKET_IFNAME)
    more_hosts: tuple[str, ...] = ()  # the host's other NICs' addresses: ZMQTransport serves on every one

    @property
    def hosts(self) -> list[str]:
        return [self.host, *self.more_hosts]


@dataclass
class SendEnv:
    """What the sender process offers every method's serving side."""

    tensors: list[Any]
    state: dict[Any, Any]  # the tensors in their layout's state dict
    knobs: Knobs
    place: Place
    receivers: int
    views: list[memoryview] = field(init=False)

    def __post_init__(self) -> None:
        self.views = views_of(self.tensors)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.knobs.timeout_s)


@dataclass
class RecvEnv:
    """What a fresh receiver process offers: sizes, its own touched targets, where the sender is."""

    layout: Layout
    targets: list[Any]  # empty unless the method receives into existing tensors
    knobs: Knobs
    place: Place
    rank: int
    world: int
    metadata: str
    step: int  # the step this trial stages (PGTransport names its group after it)
    # ZMQTransport's progress callback (issue 13's killed relay uses it); others ignore it.
    progress: Callable[[int, int], None] | None = None
    target_views: list[memoryview] = field(init=False)

    def __post_init__(self) -> None:
        self.target_views = views_of(self.targets)

    @property
    def sizes(self) -> list[int]:
        return self.layout.sizes

    @property
    def target_state(self) -> dict[Any, Any]:
        return self.layout.state(self.targets)

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.knobs.timeout_s)


class Serving(Protocol):
    def metadata(self) -> str: ...
    def stage(self, step: int) -> None: ...
    def rendezvous(self, step: int) -> None: ...
    def release(self, step: int, receives: int) -> None: ...
    # disallow_checkpoint mid-transfer; what the transport says of it: "needed" (bytes the running
    # receives could still ask for) and "copied" (bytes it copied for them); {} when it says nothing.
    def disallow(self) -> dict[str, int]: ...
    def finish(self) -> None: ...
    def close(self) -> None: ...


class Receiving(Protocol):
    def receive(self, step: int) -> list[Any]: ...
    def stats(self) -> dict[str, Any]: ...  # what the last receive reported about itself ({} if nothing)
    def close(self) -> None: ...


class Method(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def anchor(self) -> bool: ...  # a reference the ratio columns divide by
    @property
    def into_targets(self) -> bool: ...  # the receiver lands data in its own touched tensors
    @property
    def requires(self) -> frozenset[str]: ...  # optional packages it needs
    def serve(self, env: SendEnv) -> Serving: ...
    def receiver(self, env: RecvEnv) -> Receiving: ...


class _QuietServing:
    """No-op defaults for the hooks most methods do not need."""

    def rendezvous(self, step: int) -> None:
        return None

    def release(self, step: int, receives: int) -> None:
        return None

    def disallow(self) -> dict[str, int]:
        raise NotImplementedError("this method has no disallow_checkpoint")


# ----------------------------------------------------------------------------- plain TCP


class _TcpServing(_QuietServing):
    """A listener; each connection asks for a step and one of N equal runs of the state's bytes, and gets them."""

    def __init__(self, env: SendEnv) -> None:
        self.env = env
        self.step = -1
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []
        self.listener = socket.create_server((env.place.host, 0), backlog=64)
        threading.Thread(target=self._accept, daemon=True).start()

    def metadata(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"{host}:{port}"

    def stage(self, step: int) -> None:
        self.step = step

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.env.knobs.timeout_s)
                request = b""
                while len(request) < _TCP_REQUEST.size:
                    chunk = conn.recv(_TCP_REQUEST.size - len(request))
                    if not chunk:
                        return
                    request += chunk
                step, flow, flows = _TCP_REQUEST.unpack(request)
                if step != self.step:
                    raise RuntimeError("TCP request for a step that is not staged")
                if not 0 <= flow < flows:
                    raise RuntimeError(f"TCP request for flow {flow} of {flows}")
                send_views(conn, split_views(self.env.views, flows)[flow])
        except (ConnectionResetError, BrokenPipeError):
            # The receiver went away mid-transfer (lab-kill SIGKILLs one): what that means for the run is
            # its own side's to report; the anchor serves the others on, as every other method does.
            return
        except BaseException:  # noqa: BLE001 - reported by finish()
            self.errors.append(traceback.format_exc())

    def finish(self) -> None:
        for thread in self.threads:
            thread.join(self.env.knobs.timeout_s)
        self.threads = [t for t in self.threads if t.is_alive()]
        if self.errors:
            errors, self.errors = self.errors, []
            raise RuntimeError("\n".join(errors))

    def close(self) -> None:
        self.listener.close()


class _TcpReceiving:
    def __init__(self, env: RecvEnv, reuse: bool, flows: int) -> None:
        self.env = env
        self.reuse = reuse
        self.flows = flows
        host, port = env.metadata.rsplit(":", 1)
        self.address = (host, int(port))

    def receive(self, step: int) -> list[Any]:
        if self.reuse:
            tensors, views = self.env.targets, self.env.target_views
        else:
            tensors = [empty_float32(n) for n in self.env.sizes]
            views = views_of(tensors)
        runs = split_views(views, self.flows)
        if self.flows == 1:
            self._flow(step, 0, runs[0])
            return list(tensors)
        # One thread per flow: recvmsg_into lets go of the GIL, so the flows' copies run side by side.
        errors: list[BaseException] = []

        def flow(index: int) -> None:
            try:
                self._flow(step, index, runs[index])
            except BaseException as exc:  # noqa: BLE001 - raised in the receiving thread below
                errors.append(exc)

        threads = [threading.Thread(target=flow, args=(i,), name=f"tcp-flow-{i}") for i in range(self.flows)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return list(tensors)

    def _flow(self, step: int, index: int, views: list[memoryview]) -> None:
        with socket.create_connection(self.address, timeout=self.env.knobs.timeout_s) as conn:
            conn.sendall(_TCP_REQUEST.pack(step, index, self.flows))
            recv_views(conn, views)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class TcpMethod:
    """Anchor: plain TCP, ``recvmsg_into`` straight into tensors; ``flows`` streams at once, each one
    equal run of the state's bytes in a thread of its own (issue 33: what parallel connections buy)."""

    name: str
    into_targets: bool  # True: existing touched tensors; False: freshly allocated ones
    anchor: bool = True
    requires: frozenset[str] = frozenset()
    flows: int = 1

    def serve(self, env: SendEnv) -> Serving:
        return _TcpServing(env)

    def receiver(self, env: RecvEnv) -> Receiving:
        return _TcpReceiving(env, self.into_targets, self.flows)


# ----------------------------------------------------------------------------- bare pyzmq


class _BareServing(_QuietServing):
    def __init__(self, env: SendEnv) -> None:
        self.server = BareServer(env.place.host, env.views)

    def metadata(self) -> str:
        return self.server.endpoint

    def stage(self, step: int) -> None:
        self.server.step = step

    def finish(self) -> None:
        if self.server.errors:
            raise RuntimeError("; ".join(self.server.errors))

    def close(self) -> None:
        self.server.close()


class _BareReceiving:
    def __init__(self, env: RecvEnv) -> None:
        self.env = env

    def receive(self, step: int) -> list[Any]:
        bare_receive(self.env.metadata, step, self.env.target_views, self.env.knobs.timeout_s)
        return list(self.env.targets)

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class BareZmqMethod:
    """Anchor: a bare ROUTER/DEALER credit loop, one frame per tensor (see barezmq)."""

    name: str = "zmq-bare"
    into_targets: bool = True
    anchor: bool = True
    requires: frozenset[str] = frozenset()

    def serve(self, env: SendEnv) -> Serving:
        return _BareServing(env)

    def receiver(self, env: RecvEnv) -> Receiving:
        return _BareReceiving(env)


# ----------------------------------------------------------------------------- checkpoint transports


class _TransportServing(_QuietServing):
    """Any ``CheckpointTransport`` whose send_checkpoint stages and returns (ZMQ, HTTP)."""

    def __init__(self, env: SendEnv, transport: Any, metadata: str) -> None:
        self.env = env
        self.transport = transport
        self._metadata = metadata

    def metadata(self) -> str:
        return self._metadata

    def stage(self, step: int) -> None:
        dst_ranks = list(range(1, self.env.receivers + 1))
        self.transport.send_checkpoint(dst_ranks, step, self.env.state, self.env.timeout)

    def disallow(self) -> dict[str, int]:
        self.transport.disallow_checkpoint()
        stats = getattr(self.transport, "last_disallow_stats", None)  # ZMQTransport's
        if stats is None:
            return {}
        return {"needed": int(stats.needed_bytes), "copied": int(stats.snapshot_bytes)}

    def finish(self) -> None:
        self.transport.disallow_checkpoint()

    def close(self) -> None:
        self.transport.shutdown(wait=False)


class _TransportReceiving:
    def __init__(self, env: RecvEnv, transport: Any) -> None:
        self.env = env
        self.transport = transport

    def receive(self, step: int) -> list[Any]:
        result = self.transport.recv_checkpoint(0, self.env.metadata, step, self.env.timeout)
        return self.env.layout.tensors_in(result)

    def stats(self) -> dict[str, Any]:
        """ZMQTransport's receive stats: bytes per path, connections, duplicates dropped, how the data came."""
        stats = getattr(self.transport, "last_recv_stats", None)
        if stats is None:
            return {}
        paths, duplicates = dict(stats.paths), stats.duplicate_messages
        return {"paths": paths, "streams": stats.streams, "duplicates": duplicates, "way": stats.path}

    def close(self) -> None:
        self.transport.shutdown(wait=False)


@dataclass(frozen=True)
class ZmqMethod:
    """ZMQTransport, into the receiver's own tensors (``state_dict``) or fresh ones.

    Every process serves on all of its host's addresses (one path per NIC in a
    lab). ``streams``: the receiver's option (None: one connection per path).
    """

    name: str
    into_targets: bool
    anchor: bool = False
    requires: frozenset[str] = frozenset()
    streams: int | None = None
    relay: bool = True  # the receiver's option (issue 13); False: fetch from the source only
    verify: str = "relayed"  # the receiver's option (issue 21); "all": every message checked against its digest
    # Options of this variant on both sides (issue 33's A/B rows: chunk_bytes, io_threads), over the run's knobs.
    options: tuple[tuple[str, Any], ...] = ()
    # The source keeps a swarm whatever its uplink measures (no user option: the model's calibration, docs/sim.md,
    # needs a swarm over unshaped links, where the source would serve its receivers directly).
    swarm_always: bool = False

    def _transport(self, env: SendEnv | RecvEnv, **extra: Any) -> ZMQTransport[Any]:
        hosts = env.place.hosts
        options = {**env.knobs.zmq_kwargs(), **dict(self.options), **extra}
        return ZMQTransport(env.timeout, bind_host=hosts, advertise_host=hosts, **options)

    def serve(self, env: SendEnv) -> Serving:
        transport = self._transport(env)
        if self.swarm_always:
            # Before any step is staged: the serving thread reads the bound only once receivers ask.
            transport._server._scheduler.uplink.per_receiver = math.inf
        return _TransportServing(env, transport, transport.metadata())

    def receiver(self, env: RecvEnv) -> Receiving:
        extra: dict[str, Any] = {} if self.streams is None else {"streams": self.streams}
        if not self.relay:
            extra["relay"] = False
        if self.verify != "relayed":
            extra["verify"] = self.verify
        if env.progress is not None:
            extra["progress"] = env.progress
        if self.into_targets:
            state = env.target_state
            extra["state_dict"] = lambda: state
        return _TransportReceiving(env, self._transport(env, **extra))


@dataclass(frozen=True)
class CutMethod:
    """Another method whose receive loses a path: the source's NIC ``nic`` goes down mid-transfer.

    The runner takes the link down ``after_fraction`` of the one-NIC ideal time
    (state bytes / one link's rate) into each timed receive, and up again after
    it (lab scenarios with more than one NIC only). The receiver's content
    check still runs: a row means the receive completed bit-exact.
    """

    name: str
    inner: Method
    nic: int = 1
    after_fraction: float = 0.3

    @property
    def anchor(self) -> bool:
        return False

    @property
    def into_targets(self) -> bool:
        return self.inner.into_targets

    @property
    def requires(self) -> frozenset[str]:
        return self.inner.requires

    def serve(self, env: SendEnv) -> Serving:
        return self.inner.serve(env)

    def receiver(self, env: RecvEnv) -> Receiving:
        return self.inner.receiver(env)


def _http_transport(timeout: timedelta, chunks: int) -> Any:
    # Optional dependency, imported only by the processes that run its methods.
    from torchft.checkpointing import HTTPTransport

    return HTTPTransport(timeout, num_chunks=chunks)


@dataclass(frozen=True)
class HttpMethod:
    """torchft's HTTPTransport with ``num_chunks`` (0 is its default)."""

    name: str
    chunks: int
    anchor: bool = True
    into_targets: bool = False
    requires: frozenset[str] = frozenset({TORCHFT})

    def serve(self, env: SendEnv) -> Serving:
        transport = _http_transport(env.timeout, self.chunks)
        # Its address names this machine's hostname; point it at the sender's own address.
        parts = urllib.parse.urlsplit(transport.metadata())
        metadata = parts._replace(netloc=f"{env.place.host}:{parts.port}").geturl()
        return _TransportServing(env, transport, metadata)

    def receiver(self, env: RecvEnv) -> Receiving:
        return _TransportReceiving(env, _http_transport(env.timeout, self.chunks))


# ----------------------------------------------------------------------------- process groups


def _process_group(store: str, step: int, rank: int, world: int, timeout: timedelta) -> Any:
    """A gloo group of ``world`` ranks that meet on the TCPStore at ``store`` (``HOST:PORT``, rank 0's).

    torchft has two APIs for this, told apart by what the group offers:
    0.2.0's ``configure(store_addr, replica_id, rank, world_size)``, and the
    nightly's ``reconfigure``, fed by ``reconfigure_with_store``.
    """
    from torchft.process_group import ProcessGroupGloo

    group = ProcessGroupGloo(timeout=timeout)
    # A fresh group per trial: the receivers are new processes every time.
    prefix = f"{store}/zmqtransport-bench-{step}"
    configure = getattr(group, "configure", None)
    if configure is not None:
        configure(prefix, "bench", rank, world)
        return group
    from torchft.process_group import reconfigure_with_store

    if rank == 0:
        # Rank 0's handle names the store the ranks rendezvous on by socket.gethostname(); that
        # resolves to an address of this machine, which another lab host's namespace does not
        # reach. The store listens on every interface: name it by the address the bench store has.
        handle = _handle_at(group.get_reconfigure_handle(), store.rpartition(":")[0])
        group.get_reconfigure_handle = lambda: handle
    reconfigure_with_store(group, prefix, rank, world, timeout)
    return group


def _handle_at(handle: str, host: str) -> str:
    """A torchft reconfigure handle (JSON) whose ``store`` (``HOST:PORT``) is on ``host`` instead."""
    fields = json.loads(handle)
    port = str(fields["store"]).rpartition(":")[2]
    fields["store"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return json.dumps(fields)


def _pg_transport(group: Any, timeout: timedelta, state_dict: Any) -> Any:
    from torchft.checkpointing.pg_transport import PGTransport

    return PGTransport(group, timeout, torch.device("cpu"), state_dict=state_dict)


class _PgServing:
    """PGTransport's send blocks until every receiver has its data: it runs in a thread."""

    def __init__(self, env: SendEnv) -> None:
        self.env = env
        self.store = torch.distributed.TCPStore(  # type: ignore[attr-defined]
            env.place.host, 0, is_master=True, timeout=env.timeout, wait_for_workers=False
        )
        self.transport: Any = None
        self.thread: threading.Thread | None = None
        self.errors: list[str] = []

    def metadata(self) -> str:
        return f"{self.env.place.host}:{self.store.port}"

    def stage(self, step: int) -> None:
        return None

    def disallow(self) -> dict[str, int]:
        raise NotImplementedError("PGTransport's send is synchronous: nothing runs to disallow")

    def rendezvous(self, step: int) -> None:
        group = _process_group(self.metadata(), step, 0, self.env.receivers + 1, self.env.timeout)
        self.transport = _pg_transport(group, self.env.timeout, None)

    def release(self, step: int, receives: int) -> None:
        def send() -> None:
            try:
                for _ in range(receives):
                    dst_ranks = list(range(1, self.env.receivers + 1))
                    self.transport.send_checkpoint(dst_ranks, step, self.env.state, self.env.timeout)
            except BaseException:  # noqa: BLE001 - reported by finish()
                self.errors.append(traceback.format_exc())

        self.thread = threading.Thread(target=send, daemon=True)
        self.thread.start()

    def finish(self) -> None:
        if self.thread is not None:
            self.thread.join(self.env.knobs.timeout_s)
        if self.errors:
            errors, self.errors = self.errors, []
            raise RuntimeError("\n".join(errors))

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class PgMethod:
    """torchft's PGTransport over ProcessGroupGloo, into existing tensors or fresh ones."""

    name: str
    into_targets: bool
    anchor: bool = False
    requires: frozenset[str] = frozenset({TORCHFT, NUMPY})

    def serve(self, env: SendEnv) -> Serving:
        return _PgServing(env)

    def receiver(self, env: RecvEnv) -> Receiving:
        group = _process_group(env.metadata, env.step, env.rank, env.world, env.timeout)
        state = env.target_state if self.into_targets else None  # a fresh receive has no targets to lay out
        transport = _pg_transport(group, env.timeout, (lambda: state) if state is not None else None)
        return _TransportReceiving(env, transport)


METHODS: dict[str, Method] = {
    method.name: method
    for method in (
        TcpMethod("tcp-reused", into_targets=True),
        TcpMethod("tcp-fresh", into_targets=False),
        TcpMethod("tcp-reused-4", into_targets=True, flows=4),
        BareZmqMethod(),
        ZmqMethod("zmq-inplace", into_targets=True),
        ZmqMethod("zmq-fresh", into_targets=False),
        ZmqMethod("zmq-inplace-1s", into_targets=True, streams=1),
        ZmqMethod("zmq-inplace-4s", into_targets=True, streams=4),
        ZmqMethod("zmq-norelay", into_targets=False, relay=False),
        ZmqMethod("zmq-fresh-swarm", into_targets=False, swarm_always=True),
        # A member stops serving as its receive returns (before relay_after_return, and as one in place does).
        ZmqMethod("zmq-fresh-tail", into_targets=False, options=(("relay_after_return", False),)),
        ZmqMethod("zmq-inplace-verify", into_targets=True, verify="all"),
        ZmqMethod("zmq-fresh-verify", into_targets=False, verify="all"),
        # Issue 33: what bounds one connection over a fast link (frames of 4 MiB; two I/O threads on each side).
        ZmqMethod("zmq-inplace-c4m", into_targets=True, options=(("chunk_bytes", 4 << 20),)),
        ZmqMethod("zmq-inplace-io2", into_targets=True, options=(("io_threads", 2),)),
        ZmqMethod("zmq-inplace-4s-io2", into_targets=True, streams=4, options=(("io_threads", 2),)),
        ZmqMethod("zmq-inplace-norelay", into_targets=True, relay=False),
        # Issue 33, direct receives (session direct3): I/O threads (both sides), frame size, credit, prefault threads.
        ZmqMethod("zmq-norelay-io1", into_targets=False, relay=False, options=(("io_threads", 1),)),
        ZmqMethod("zmq-norelay-io2", into_targets=False, relay=False, options=(("io_threads", 2),)),
        ZmqMethod("zmq-norelay-4s-io2", into_targets=False, relay=False, streams=4, options=(("io_threads", 2),)),
        ZmqMethod("zmq-fresh-io1", into_targets=False, options=(("io_threads", 1),)),
        ZmqMethod("zmq-norelay-c2m", into_targets=False, relay=False, options=(("chunk_bytes", 2 << 20),)),
        ZmqMethod("zmq-norelay-c4m", into_targets=False, relay=False, options=(("chunk_bytes", 4 << 20),)),
        ZmqMethod("zmq-norelay-w64", into_targets=False, relay=False, options=(("window", 64),)),
        ZmqMethod("zmq-norelay-pf0", into_targets=False, relay=False, options=(("prefault_threads", 0),)),
        ZmqMethod("zmq-norelay-pf1", into_targets=False, relay=False, options=(("prefault_threads", 1),)),
        # Issue 33 on a many-core host (the 16-core GPU machine): four I/O threads on each side, four streams,
        # four prefault threads.
        ZmqMethod("zmq-inplace-io1", into_targets=True, options=(("io_threads", 1),)),
        ZmqMethod("zmq-inplace-io4", into_targets=True, options=(("io_threads", 4),)),
        ZmqMethod("zmq-inplace-4s-io4", into_targets=True, streams=4, options=(("io_threads", 4),)),
        ZmqMethod("zmq-fresh-io4", into_targets=False, options=(("io_threads", 4),)),
        ZmqMethod("zmq-norelay-io4", into_targets=False, relay=False, options=(("io_threads", 4),)),
        ZmqMethod("zmq-norelay-4s-io4", into_targets=False, relay=False, streams=4, options=(("io_threads", 4),)),
        ZmqMethod("zmq-norelay-pf4", into_targets=False, relay=False, options=(("prefault_threads", 4),)),
        ZmqMethod(
            "zmq-norelay-io4-pf4", into_targets=False, relay=False, options=(("io_threads", 4), ("prefault_threads", 4))
        ),
        CutMethod("zmq-inplace-cut", ZmqMethod("zmq-inplace", into_targets=True)),
        HttpMethod("http", chunks=0),
        HttpMethod("http-4", chunks=4),
        PgMethod("pg-inplace", into_targets=True),
        PgMethod("pg-fresh", into_targets=False),
    )
}

# Variants of a method (another option, a fault): run only where named (a preset, --methods).
VARIANTS = frozenset(
    {
        "tcp-reused-4",
        "zmq-inplace-1s",
        "zmq-inplace-4s",
        "zmq-inplace-cut",
        "zmq-norelay",
        "zmq-fresh-swarm",
        "zmq-inplace-verify",
        "zmq-fresh-verify",
        "zmq-inplace-c4m",
        "zmq-inplace-io2",
        "zmq-inplace-4s-io2",
        "zmq-inplace-norelay",
        "zmq-norelay-io1",
        "zmq-norelay-io2",
        "zmq-norelay-4s-io2",
        "zmq-fresh-io1",
        "zmq-norelay-c2m",
        "zmq-norelay-c4m",
        "zmq-norelay-w64",
        "zmq-norelay-pf0",
        "zmq-norelay-pf1",
    }
)
