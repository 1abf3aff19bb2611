"""The serving thread's wake-up pipe: one byte per wake-up it has not drained yet."""

from __future__ import annotations

import os

from zmqtransport.serve.server import WakePipe


def pending_bytes(pipe: WakePipe) -> int:
    try:
        data = os.read(pipe.fd, 4096)
    except BlockingIOError:
        return 0
    return len(data)


def test_wake_ups_before_a_drain_write_one_byte_and_one_after_it_writes_again() -> None:
    pipe = WakePipe()
    try:
        for _ in range(100):  # a relaying receive pokes per landed message
            pipe.wake()
        assert pending_bytes(pipe) == 1
        pipe.drain()
        pipe.wake()  # what happens after a drain wakes the thread again
        assert pending_bytes(pipe) == 1
    finally:
        pipe.close()
