"""A peer that asks and never reads, for the attacker tests of the serving side's memory bounds
(test_appetite, test_relay_appetite, test_appetite_lab): its DEALERs, its loop that keeps granting
credit, and how the attacked process reads what it still has allocated."""

from __future__ import annotations

import contextlib
import inspect
import time

import zmq

from zmqtransport import wire

ARENA_HEAP = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's heap, whose free top stays resident


def allocated() -> int:
    """What malloc has handed out and not had back: all arenas and mmapped chunks (glibc 2.33 on).

    What the attacked process still has allocated once a cut freed the attacker's
    queues: RSS alone cannot say, because glibc's malloc_trim does not trim a
    thread arena's top chunk, and the serving or I/O thread's arena may keep up
    to one heap (:data:`ARENA_HEAP`) of free memory resident. Self-contained, so
    that the lab's scripts (``python -c`` on a host of their own) can define it
    from :data:`ALLOCATED`, its source.
    """
    import ctypes

    names = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    info_type = type("Mallinfo2", (ctypes.Structure,), {"_fields_": [(name, ctypes.c_size_t) for name in names]})
    mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    mallinfo2.restype = info_type
    info = mallinfo2()
    return int(info.uordblks + info.hblkhd)


ALLOCATED = inspect.getsource(allocated)


def unread_dealer(context: zmq.Context[zmq.Socket[bytes]], host: str, port: int) -> zmq.Socket[bytes]:
    """A DEALER that takes (almost) nothing off the wire: libzmq stops pulling from TCP almost at once."""
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, 1)
    dealer.setsockopt(zmq.RCVBUF, 4096)
    dealer.connect(f"tcp://{host}:{port}")
    return dealer


def keep_granting(dealers: list[zmq.Socket[bytes]], xfers: range, seconds: float) -> None:
    """Grant all the credit the protocol allows on ``xfers`` of every dealer, every 50 ms, for ``seconds``
    (bounded: it stops by itself). A connection that was cut (or is being re-made) is asked again next round."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for dealer in dealers:
            for xfer in xfers:
                with contextlib.suppress(zmq.ZMQError):
                    dealer.send(wire.credit_request(xfer, wire.MAX_CREDIT), zmq.NOBLOCK)
        time.sleep(0.05)
