"""The bare-pyzmq anchor: what any ZeroMQ design can do on this machine.

A ROUTER/DEALER credit loop as in the ZeroMQ guide's file transfer, one frame
per tensor: the receiver asks for a step with a window of frames, the sender
sends while it has credit, and the receiver lands each frame with
``recv_into`` straight into its own (touched) tensor and hands credit back.
No header, no framing of tensors into chunks, no checks beyond sizes: the
floor a ZeroMQ transport pays, not a transport.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence

import zmq

_REQUEST = struct.Struct("<qI")  # step, window in frames
_CREDIT = struct.Struct("<I")
_POLL_MS = 100
_WINDOW_BYTES = 32 << 20  # frames in flight per receiver, in bytes
_COPY_BELOW = 64 << 10  # small frames: copying is cheaper than zero-copy bookkeeping


def window_frames(sizes: Sequence[int]) -> int:
    mean = max(1, sum(sizes) // max(1, len(sizes)))
    return max(2, min(4096, _WINDOW_BYTES // mean))


class BareServer:
    """The sending side: one thread owns the ROUTER and serves whatever step is staged."""

    def __init__(self, host: str, views: Sequence[memoryview]) -> None:
        self.views = list(views)
        self.context = zmq.Context(1)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.SNDHWM, 0)  # credit bounds what is queued
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.step = -1
        self.stopping = threading.Event()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._loop, name="bare-zmq-server", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        # peer identity -> [next frame index, credit]
        streams: dict[bytes, list[int]] = {}
        try:
            while not self.stopping.is_set():
                # Block for a message unless some stream still has credit to spend.
                ready = any(stream[1] > 0 for stream in streams.values())
                if self.router.poll(0 if ready else _POLL_MS):
                    self._on_message(streams, self.router.recv_multipart())
                self._send_some(streams)
        except Exception as exc:  # noqa: BLE001 - reported to the benchmark by errors
            self.errors.append(repr(exc))
        finally:
            self.router.close(0)

    def _on_message(self, streams: dict[bytes, list[int]], frames: list[bytes]) -> None:
        peer, body = frames[0], frames[-1]
        if len(body) == _REQUEST.size:
            step, window = _REQUEST.unpack(body)
            if step != self.step:
                self.router.send_multipart([peer, b""])  # empty frame: not staged
                return
            streams[peer] = [0, window]
        elif len(body) == _CREDIT.size and peer in streams:
            streams[peer][1] += _CREDIT.unpack(body)[0]

    def _send_some(self, streams: dict[bytes, list[int]]) -> None:
        for peer, stream in list(streams.items()):
            while stream[1] > 0 and stream[0] < len(self.views):
                view = self.views[stream[0]]
                self.router.send_multipart([peer, view], copy=len(view) < _COPY_BELOW)
                stream[0] += 1
                stream[1] -= 1
            if stream[0] == len(self.views):
                del streams[peer]

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(5.0)
        self.context.term()


def bare_receive(endpoint: str, step: int, views: Sequence[memoryview], timeout_s: float) -> None:
    """Fill every view from one frame each, handing credit back as frames land."""
    window = window_frames([len(view) for view in views])
    refill = max(1, window // 2)
    context = zmq.Context(1)
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, 0)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send(_REQUEST.pack(step, window))
        owed = 0
        for index, view in enumerate(views):
            if not dealer.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"no frame {index} within {timeout_s:g} s")
            size = dealer.recv_into(view)
            if size == 0 and len(view):
                raise ValueError(f"step {step} is not staged at {endpoint}")
            if size != len(view):
                raise ValueError(f"frame {index} has {size} bytes, expected {len(view)}")
            owed += 1
            if owed >= refill:
                dealer.send(_CREDIT.pack(owed))
                owed = 0
    finally:
        dealer.close(0)
        context.term()
