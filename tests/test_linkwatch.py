"""The kernel's counters of the source's data connections (serve/linkwatch.py): read right, read safely,
read only for the source's own step, and nothing where there is nothing to read."""

from __future__ import annotations

import os
import socket
import sys
import threading
from typing import Any

import pytest

from zmqtransport.serve.linkwatch import LINGER, READ_EVERY, TCP_INFO_LAYOUT, LinkWatch, parse_tcp_info, read_tcp_info
from zmqtransport.serve.scheduler import Scheduler
from zmqtransport.serve.uplink import LinkReading

from .test_scheduler import TIMEOUT, fetch, staged

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="TCP_INFO's chrono counters are Linux's")


def _connected() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


@linux
def test_the_kernels_counters_are_read_at_their_offsets_and_libzmqs_descriptor_stays_open() -> None:
    sender, receiver = _connected()
    nbytes = 8 << 20
    with sender, receiver:
        got = bytearray()

        def read() -> None:
            while len(got) < nbytes:
                got.extend(receiver.recv(1 << 20))

        reader = threading.Thread(target=read)
        reader.start()
        sender.sendall(b"x" * nbytes)
        reader.join(10)
        reading = read_tcp_info(sender.fileno())
        assert reading is not None
        # Everything the receiver read was acknowledged (what tcpi_bytes_acked counts, past the handshake),
        # and the delivery rate is a rate, not a neighbouring field: the latest flight's estimate, which on
        # a loaded CI machine was once 7 MB/s over loopback, so only its order of magnitude is checked.
        assert nbytes <= reading.acked <= nbytes + 1
        assert 1e5 < reading.delivery_rate < 1e13
        # The reading worked on a duplicate: the socket itself still sends.
        sender.sendall(b"y")
        assert receiver.recv(1) == b"y"


def test_what_is_not_a_tcp_connection_reads_as_nothing() -> None:
    left, right = socket.socketpair()  # a Unix socket: what an ipc endpoint's connection is
    with left, right:
        assert read_tcp_info(left.fileno()) is None
        left.send(b"z")  # still open
        assert right.recv(1) == b"z"
    read_end, write_end = os.pipe()
    os.close(write_end)
    os.close(read_end)
    assert read_tcp_info(read_end) is None  # closed since


def test_a_kernel_without_the_chrono_counters_gives_no_reading() -> None:
    assert parse_tcp_info(bytes(TCP_INFO_LAYOUT.size - 8)) is None  # Linux before 4.9: no delivery rate
    values = [0] * 7 + [0b101] + [0] * 24 + [0, 0, 12345, 0] + [0] * 6 + [7_000_000]
    reading = parse_tcp_info(TCP_INFO_LAYOUT.pack(*values) + bytes(112))  # later kernels append fields
    assert reading == LinkReading(acked=12345, delivery_rate=7e6, app_limited=True)


class FakeRouter:
    def __init__(self, fds: dict[bytes, int]) -> None:
        self.fds = fds

    def descriptor(self, peer: bytes) -> int | None:
        return self.fds.get(peer)


def test_the_watch_reads_the_connections_of_the_sources_own_step_and_a_while_after() -> None:
    scheduler = Scheduler(TIMEOUT)
    scheduler.stage(staged(messages=64), 0.0)
    read: list[tuple[float, int]] = []
    acked = {7: 0}

    def reader(fd: int) -> LinkReading:
        read.append((now, fd))
        return LinkReading(acked[fd], 1e9)

    router: Any = FakeRouter({b"a": 7})
    watch = LinkWatch(router, scheduler, read=reader)
    now = 0.0
    watch.run(now)
    assert read == [] and watch.wakeup_in(now) == float("inf")  # nothing goes out: nothing read
    scheduler.on_request(b"a", fetch(credit=64), "10.0.0.1", now)
    watch.run(now)
    assert read == [(0.0, 7)]  # new to the step: read at once (its baseline, before its data)
    now = READ_EVERY / 2
    watch.run(now)
    assert len(read) == 1 and watch.wakeup_in(now) == pytest.approx(READ_EVERY / 2)
    scheduler.transfers.clear()  # its last message went to libzmq
    now = READ_EVERY
    acked[7] = 64 << 20
    watch.run(now)
    assert read[-1] == (READ_EVERY, 7)  # what libzmq and the kernel still hold goes out: read on
    assert scheduler.uplink.link_bytes == 64 << 20
    now = READ_EVERY + LINGER + 0.01
    watch.run(now)
    assert read[-1] == (now, 7)  # one reading past the linger, then no more
    assert watch.wakeup_in(now) == float("inf")


def test_a_relayed_steps_connections_are_not_the_sources_uplink() -> None:
    scheduler = Scheduler(TIMEOUT)
    scheduler.stage(staged(), 0.0)
    scheduler.on_request(b"a", fetch(), "10.0.0.1", 0.0)
    (transfer,) = scheduler.transfers.values()
    transfer.staged = object()  # type: ignore[assignment]  # not a Staged: a step this side relays
    read: list[int] = []

    def reader(fd: int) -> LinkReading:
        read.append(fd)
        return LinkReading(0, 0.0)

    router: Any = FakeRouter({b"a": 7})
    LinkWatch(router, scheduler, read=reader).run(0.0)
    assert read == []


def test_the_watch_lets_the_serving_thread_sleep_once_its_receivers_are_gone() -> None:
    """A receiver whose connection closed (no descriptor) is dropped after LINGER like any other: a watch
    that kept it would have the serving thread wake at once, for ever (a version of this branch spun so)."""
    scheduler = Scheduler(TIMEOUT)
    scheduler.stage(staged(messages=64), 0.0)
    router = FakeRouter({b"a": 7})
    watch = LinkWatch(router, scheduler, read=lambda fd: LinkReading(0, 0.0))  # type: ignore[arg-type]
    scheduler.on_request(b"a", fetch(credit=64), "10.0.0.1", 0.0)
    watch.run(0.0)
    scheduler.transfers.clear()
    router.fds.clear()  # the receiver closed its connection
    now = 0.0
    while watch.wakeup_in(now) != float("inf"):
        now += max(watch.wakeup_in(now), 0.001)
        watch.run(now)
        assert now <= LINGER + 2 * READ_EVERY, "the watch still wakes the serving thread"
