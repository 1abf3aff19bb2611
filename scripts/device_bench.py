#!/usr/bin/env python3
"""Device-to-device checkpoint transfer benchmark (run by scripts/device_check.sh; docs/cuda.md).

Two processes, a sender and a receiver, each holding the state on ``--device``
(bf16 tensors of ``--tensor-bytes``, ``--total`` in all). For each method the
sender stages a step and the receiver fetches it into device memory:

* ``zmq-inplace``: ZMQTransport with ``state_dict`` targets already on the device;
* ``zmq-fresh``: ZMQTransport with ``device=`` (fresh device tensors);
* ``http``: torchft's HTTPTransport (it copies CUDA tensors to host memory in
  ``send_checkpoint``; the receiver moves what it loads onto the device);
* ``tcp-1`` / ``tcp-4``: the anchor, loopback's own ceiling on this machine:
  the same number of bytes as plain TCP between two processes, host memory to
  host memory, over one flow or four (each flow read with ``recv_into`` into a
  touched 256 MiB buffer, round and round; no device, no framing, no check).

Every received tensor is compared bit for bit with what the sender held (a
pattern that depends on the tensor and the step, regenerated on the receiver),
and one table is printed. Exit status 1 on any mismatch or failure.

``--device cpu --fake-staging`` runs the same thing on CPU, sending every
byte through the staging pipeline with the fake copy engine: the CPU smoke
mode of the script. Threading: each process drives its transports from its
main thread; the parent only sends commands and collects timings.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import statistics
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

METHODS = ("zmq-inplace", "zmq-fresh", "http", "tcp-1", "tcp-4")
TCP_BUFFER = 256 << 20  # each flow's send and receive buffer
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"8GiB"``, ``"256MiB"``, ``"4m"`` or a byte count (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    number, unit = match.groups()
    return int(float(number) * (1 << (10 * " kmg".index(unit.lower() or " "))))


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--total", type=parse_size, default=8 << 30, help="bytes of state (default 8GiB)")
    parser.add_argument("--tensor-bytes", type=parse_size, default=256 << 20, help="bytes per tensor")
    parser.add_argument("--chunk-bytes", type=parse_size, default=4 << 20, help="ZMQTransport chunk_bytes")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated: " + ", ".join(METHODS))
    parser.add_argument("--repeats", type=int, default=2, help="transfers per ZMQ method (best is reported)")
    parser.add_argument("--http-repeats", type=int, default=1, help="transfers through HTTPTransport")
    parser.add_argument("--fake-staging", action="store_true", help="CPU: stage through the fake copy engine")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds for any one step")
    parser.add_argument("--note", action="append", default=[], help="a line printed under the table")
    args = parser.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods: {sorted(unknown)}")
    if args.fake_staging and args.device != "cpu":
        parser.error("--fake-staging is for --device cpu")
    return args


# ----------------------------------------------------------------------------- payload


def _pattern(index: int, step: int, numel: int, device: Any) -> Any:
    """The int16 bit pattern of tensor ``index`` at ``step``: finite bf16 values, position-dependent."""
    import torch

    values = torch.arange(numel, dtype=torch.int32, device=device)
    return ((values * 7 + index * 131 + step * 17) & 0x3FFF).to(torch.int16)


def _make_state(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    count = max(1, args.total // args.tensor_bytes)
    numel = args.tensor_bytes // 2
    return {f"layer{i:04d}": torch.zeros(numel, dtype=torch.bfloat16, device=args.device) for i in range(count)}


def _stamp(state: dict[str, Any], step: int) -> None:
    for index, tensor in enumerate(state.values()):
        tensor.view(_int16()).copy_(_pattern(index, step, tensor.numel(), tensor.device))
    _sync(next(iter(state.values())).device)


def _verify(state: Any, step: int, device: Any) -> str | None:
    """None when every tensor holds step's pattern on ``device``; else what is wrong."""
    if not isinstance(state, dict):
        return f"got a {type(state).__name__}"
    for index, tensor in enumerate(state.values()):
        if tensor.device != device and not (device.index is None and tensor.device.type == device.type):
            return f"tensor {index} is on {tensor.device}, not {device}"
        if not _int16_equal(tensor, _pattern(index, step, tensor.numel(), tensor.device)):
            return f"tensor {index} differs"
    return None


def _int16() -> Any:
    import torch

    return torch.int16


def _int16_equal(tensor: Any, pattern: Any) -> bool:
    import torch

    return bool(torch.equal(tensor.view(torch.int16), pattern))


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _staging(args: argparse.Namespace) -> Any:
    if not args.fake_staging:
        return None
    from zmqtransport.testing import FakeDevice

    return FakeDevice().staging(slots=8, depth=4)


def _http_transport(timeout: timedelta) -> Any:
    from torchft.checkpointing.http_transport import HTTPTransport

    return HTTPTransport(timeout, num_chunks=0)


def _loopback(metadata: str) -> str:
    """HTTPTransport advertises the host name, which a sandbox may not resolve; it listens everywhere."""
    scheme, rest = metadata.split("://", 1)
    _host, _, path = rest.partition("/")
    port = _host.rsplit(":", 1)[1]
    return f"{scheme}://127.0.0.1:{port}/{path}"


# ----------------------------------------------------------------------------- processes


def _quiet() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("RUST_LOG", "warn")
    # HTTPTransport's handler writes an access-log line per request to stderr.
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the life of the worker


def _sender(conn: Connection, args: argparse.Namespace) -> None:
    try:
        _quiet()
        import torch

        from zmqtransport import ZMQTransport

        timeout = timedelta(seconds=args.timeout)
        state = _make_state(args)
        transports: dict[str, Any] = {}
        zmq: ZMQTransport[Any] = ZMQTransport(
            timeout, bind_host="127.0.0.1", chunk_bytes=args.chunk_bytes, staging=_staging(args)
        )
        transports["zmq-inplace"] = transports["zmq-fresh"] = zmq
        info: dict[str, Any] = {"zmq": zmq.metadata(), "http": None, "http_error": None}
        if "http" in args.methods:
            try:
                transports["http"] = _http_transport(timeout)
                info["http"] = _loopback(transports["http"].metadata())
            except Exception as exc:  # noqa: BLE001 - reported in the table
                info["http_error"] = f"{type(exc).__name__}: {exc}"
        info["device_name"] = (
            torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu"
        )
        conn.send(("ok", info))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            _, method, step = command
            transport = transports[method]
            if command[0] == "stage":
                _stamp(state, step)
                started = time.perf_counter()
                transport.send_checkpoint([1], step, state, timeout)
                conn.send(("ok", time.perf_counter() - started))
            elif command[0] == "disallow":
                started = time.perf_counter()
                transport.disallow_checkpoint()
                conn.send(("ok", time.perf_counter() - started))
        for transport in {id(t): t for t in transports.values()}.values():
            transport.shutdown()
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - the parent prints it and fails
        conn.send(("error", traceback.format_exc()))


def _receiver(conn: Connection, args: argparse.Namespace, info: dict[str, Any]) -> None:
    try:
        _quiet()
        import torch

        from zmqtransport import ZMQTransport

        device = torch.device(args.device)
        timeout = timedelta(seconds=args.timeout)
        targets = _make_state(args)
        transports: dict[str, Any] = {
            "zmq-inplace": ZMQTransport(
                timeout, bind_host="127.0.0.1", state_dict=lambda: targets, staging=_staging(args)
            ),
            "zmq-fresh": ZMQTransport(timeout, bind_host="127.0.0.1", device=device, staging=_staging(args)),
        }
        if info["http"] is not None:
            transports["http"] = _http_transport(timeout)
        metadata = {"zmq-inplace": info["zmq"], "zmq-fresh": info["zmq"], "http": info["http"]}
        conn.send(("ok", None))
        while True:
            command = conn.recv()
            if command[0] == "stop":
                break
            _, method, step = command
            _sync(device)
            started = time.perf_counter()
            got = transports[method].recv_checkpoint(0, metadata[method], step, timeout)
            if method == "http":  # it loads into host memory; the state belongs on the device
                got = {key: value.to(device) for key, value in got.items()}
            _sync(device)
            seconds = time.perf_counter() - started
            problem = _verify(got, step, device)
            if problem is None and method == "zmq-inplace":
                same = all(got[k] is targets[k] for k in targets)
                problem = None if same else "not received in place"
            del got
            conn.send(("ok", (seconds, problem)))
        for transport in transports.values():
            transport.shutdown()
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - the parent prints it and fails
        conn.send(("error", traceback.format_exc()))


class _Worker:
    def __init__(self, name: str, target: Any, args: tuple[Any, ...]) -> None:
        context = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = context.Pipe()
        self.process = context.Process(target=target, args=(child, *args), name=name, daemon=True)
        self.process.start()
        child.close()

    def reply(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.name}: no reply within {timeout:.0f} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name} failed:\n{value}")
        return value

    def call(self, timeout: float, *command: Any) -> Any:
        self.conn.send(command)
        return self.reply(timeout)

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
            self.reply(30)
        except (OSError, RuntimeError, EOFError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


# ----------------------------------------------------------------------------- the anchor


def _tcp_sender(port: int, nbytes: int, flows: int) -> None:
    """Connect ``flows`` times, wait for a byte on each, then send each flow's share from one buffer."""
    import socket
    import threading

    buffer = memoryview(bytearray(b"\x5a" * TCP_BUFFER))
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(flows)]

    def flow(conn: socket.socket, share: int) -> None:
        with conn:
            conn.recv(1)
            while share > 0:
                share -= conn.send(buffer[: min(share, TCP_BUFFER)])

    shares = [nbytes // flows + (1 if i < nbytes % flows else 0) for i in range(flows)]
    threads = [threading.Thread(target=flow, args=pair) for pair in zip(conns, shares, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _tcp_seconds(nbytes: int, flows: int, timeout: float) -> float:
    """Seconds to move ``nbytes`` over ``flows`` loopback TCP connections, from the go to the last byte."""
    import socket
    import threading

    context = multiprocessing.get_context("spawn")
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(timeout)
        child = context.Process(target=_tcp_sender, args=(listener.getsockname()[1], nbytes, flows), daemon=True)
        child.start()
        try:
            conns = [listener.accept()[0] for _ in range(flows)]
            buffers = [memoryview(bytearray(TCP_BUFFER)) for _ in range(flows)]
            for buffer in buffers:
                buffer[:] = b"\x01" * TCP_BUFFER  # touched: no first-touch page faults in the timing
            got = [0] * flows

            def flow(index: int) -> None:
                conn, buffer = conns[index], buffers[index]
                conn.settimeout(timeout)
                while True:
                    n = conn.recv_into(buffer)  # lets go of the GIL: the flows' copies run side by side
                    if n == 0:
                        return
                    got[index] += n

            threads = [threading.Thread(target=flow, args=(i,)) for i in range(flows)]
            started = time.perf_counter()
            for conn in conns:
                conn.sendall(b"g")
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout)
            seconds = time.perf_counter() - started
            for conn in conns:
                conn.close()
        finally:
            child.join(timeout)
            if child.is_alive():
                child.kill()
    if sum(got) != nbytes:
        raise RuntimeError(f"plain TCP over {flows} flows moved {sum(got)} of {nbytes} bytes")
    return seconds


# ----------------------------------------------------------------------------- main


LABELS = {
    "zmq-inplace": "ZMQTransport, in place (state_dict)",
    "zmq-fresh": "ZMQTransport, fresh (device=)",
    "http": "HTTPTransport (torchft) + .to(device)",
    "tcp-1": "anchor: plain TCP over loopback, 1 flow",
    "tcp-4": "anchor: plain TCP over loopback, 4 flows",
}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    count = max(1, args.total // args.tensor_bytes)
    nbytes = count * (args.tensor_bytes // 2) * 2
    rows: list[list[str]] = []
    info: dict[str, Any] = {}
    failed = False
    sender = _Worker("sender", _sender, (args,))
    receiver: _Worker | None = None
    try:
        info = sender.reply(args.timeout)
        receiver = _Worker("receiver", _receiver, (args, info))
        receiver.reply(args.timeout)
        step = 0
        for method in args.methods:
            if method.startswith("tcp-"):
                flows = int(method.split("-")[1])
                seconds = [_tcp_seconds(nbytes, flows, args.timeout) for _ in range(max(1, args.repeats))]
                best = min(seconds)
                rows.append([LABELS[method], "-", f"{best:.3f}", f"{nbytes / best / 1e9:.2f}", "-", "host to host"])
                continue
            if method == "http" and info["http"] is None:
                rows.append([LABELS[method], "-", "-", "-", "-", f"skipped: {info['http_error']}"])
                continue
            sends, recvs, disallows, problems = [], [], [], []
            repeats = args.http_repeats if method == "http" else args.repeats
            for _ in range(max(1, repeats)):
                step += 1
                sends.append(sender.call(args.timeout, "stage", method, step))
                seconds, problem = receiver.call(args.timeout, "recv", method, step)
                recvs.append(seconds)
                problems.append(problem)
                disallows.append(sender.call(args.timeout, "disallow", method, step))
            bad = [p for p in problems if p is not None]
            failed |= bool(bad)
            best = min(recvs)
            rows.append(
                [
                    LABELS[method],
                    f"{statistics.median(sends):.3f}",
                    f"{best:.3f}",
                    f"{nbytes / best / 1e9:.2f}",
                    f"{statistics.median(disallows):.3f}",
                    "yes" if not bad else f"MISMATCH: {bad[0]}",
                ]
            )
    except RuntimeError as exc:
        failed = True
        rows.append(["(aborted)", "-", "-", "-", "-", str(exc).splitlines()[0]])
        print(exc, file=sys.stderr)
    finally:
        if receiver is not None:
            receiver.close()
        sender.close()
    _print_table(args, nbytes, count, info, rows)
    return 1 if failed else 0


def _print_table(
    args: argparse.Namespace, nbytes: int, count: int, info: dict[str, Any], rows: list[list[str]]
) -> None:
    header = ["method", "send_checkpoint s", "recv s (best)", "GB/s", "disallow s", "bit-exact"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = "+-" + "-+-".join("-" * w for w in widths) + "-+"
    staging = "fake copy engine (CPU smoke mode)" if args.fake_staging else "pinned ring, side streams"
    print(
        f"device {args.device} ({info.get('device_name', '?')}): {nbytes / 2**30:.2f} GiB of bf16 in "
        f"{count} tensors, chunk_bytes {args.chunk_bytes >> 10} KiB, staging: {staging}"
    )
    print(line)
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print(line)
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    print(line)
    for note in args.note:
        print(note)


if __name__ == "__main__":
    sys.exit(main())
