"""The ``zmqtransport`` command: fetch, serve or inspect a checkpoint, or run the benchmark.

::

    zmqtransport fetch METADATA --step N -o FILE    pull a live checkpoint, torch.save it
    zmqtransport serve FILE --step N                serve a saved checkpoint to peers
    zmqtransport inspect METADATA --step N          what a peer serves, without the tensors
        [--digests [--check FILE]]                  its digests; a saved checkpoint checked against them
    zmqtransport bench [ARGS...]                    the benchmark (python -m zmqtransport.bench)

Output conventions: results go to stdout (``serve`` prints only its metadata
string there, and ``--metadata-file`` writes it to a file for scripts); progress
and notes go to stderr, as a progress bar when stderr is a terminal and tqdm is
installed, as timestamped log lines otherwise. Every failure is one line on
stderr and a non-zero exit status; ``--debug`` shows the traceback instead.

Exit status: 0 success, 1 failure, 2 bad usage, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import torch

from . import wire
from .codec import skeleton
from .codec.dtypes import dtype_name
from .codec.keypaths import format_path
from .codec.tensors import decode_tensor_table
from .digests import digest_of
from .errors import TransportError
from .fetch import Published
from .layout import messages_of
from .net import parse_metadata
from .transport import ZMQTransport

PROG = "zmqtransport"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
DEFAULT_TIMEOUT_S = 60.0
DEBUG_ENV = "ZMQTRANSPORT_DEBUG"

logger = logging.getLogger(__name__)


class CLIError(Exception):
    """A failure the command reports as one line, without a traceback."""


# ----------------------------------------------------------------------------- formatting


def human_bytes(nbytes: float) -> str:
    """``1.07 GB``: decimal units, the same ones the transfer rates use (GB/s)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def _one_line(text: str) -> str:
    """The first non-empty line of a message: some library errors span a screen."""
    for line in str(text).splitlines():
        if line.strip():
            return line.strip()
    return ""


# ----------------------------------------------------------------------------- progress


class Progress:
    """The ``progress=`` callback of a receive: a tqdm bar or plain log lines.

    ``mode`` is ``bar``, ``log`` or ``none``; :func:`choose_progress_mode`
    picks one for ``auto``. Log lines are written at most every ``interval``
    seconds, so a short transfer prints none and a long one shows it is alive.
    """

    def __init__(self, mode: str, label: str, stream: TextIO, interval: float = 2.0) -> None:
        self.mode = mode
        self.label = label
        self.stream = stream
        self.interval = interval
        self.started = time.monotonic()
        self._last_line = self.started
        self._lines = 0
        self._bar: Any = None
        self._shown = 0

    def __call__(self, done: int, total: int) -> None:
        if self.mode == "bar":
            if self._bar is None:
                from tqdm import tqdm  # optional dependency (the progress extra): only a bar needs it

                size = shutil.get_terminal_size((100, 24))
                # Decimal units so the bar's MB/s agrees with the GB/s of the summary.
                self._bar = tqdm(
                    total=total,
                    unit="B",
                    unit_scale=True,
                    unit_divisor=1000,
                    desc=self.label,
                    file=self.stream,
                    # A pseudo-terminal without a size (script, some CI runners)
                    # reports 0x0, and tqdm hides a bar that does not fit: use
                    # shutil's answer, which falls back to 100x24 for a 0x0 terminal.
                    ncols=size.columns,
                    nrows=size.lines,
                    leave=True,
                )
            self._bar.update(done - self._shown)
            self._shown = done
        elif self.mode == "log":
            now = time.monotonic()
            if now - self._last_line >= self.interval or (done == total and self._lines):
                self._last_line = now
                self._lines += 1
                percent = 100.0 * done / total if total else 100.0
                elapsed = now - self.started
                print(
                    f"{time.strftime('%H:%M:%S')} {self.label}: {human_bytes(done)} / {human_bytes(total)} "
                    f"({percent:.1f}%) at {_rate(done, elapsed)}",
                    file=self.stream,
                    flush=True,
                )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _tqdm_available() -> bool:
    try:
        importlib.import_module("tqdm")
    except ImportError:
        return False
    return True


def choose_progress_mode(requested: str, stream: TextIO) -> str:
    """Resolve ``--progress``: a bar needs a terminal and tqdm (the ``progress`` extra)."""
    if requested in ("log", "none"):
        return requested
    terminal = stream.isatty()
    if requested == "bar" or (requested == "auto" and terminal):
        if _tqdm_available():
            return "bar"
        if requested == "bar":
            print(
                f"{PROG}: tqdm is not installed (pip install 'zmqtransport[progress]'); "
                "logging progress instead",
                file=stream,
            )
    return "log"


# ----------------------------------------------------------------------------- commands


def _timeout(args: argparse.Namespace) -> timedelta:
    if not args.timeout > 0:
        raise CLIError("--timeout must be a positive number of seconds")
    return timedelta(seconds=args.timeout)


def _write_atomic(path: Path, write: Callable[[str], object]) -> None:
    """``write(temporary)`` to a file beside ``path``, then rename: never a half-written file."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(handle)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def cmd_fetch(args: argparse.Namespace) -> int:
    """Pull ``--step`` from a live peer and save it with ``torch.save``."""
    output = Path(args.output)
    if output.exists() and not args.force:
        raise CLIError(f"{output} already exists (pass --force to overwrite it)")
    if not output.parent.is_dir():
        raise CLIError(f"directory {output.parent} does not exist")
    timeout = _timeout(args)
    if args.progress_interval < 0:
        raise CLIError("--progress-interval must be >= 0")
    progress = Progress(
        choose_progress_mode(args.progress, sys.stderr), f"step {args.step}", sys.stderr, args.progress_interval
    )
    if args.allow_pickle:
        print(f"{PROG}: warning: --allow-pickle lets the peer run code in this process", file=sys.stderr)
    # The transport binds a ROUTER of its own; a fetch never serves, so keep it
    # on loopback rather than opening a port on every interface.
    transport: ZMQTransport[Any] = ZMQTransport(
        timeout,
        bind_host="127.0.0.1",
        advertise_host="127.0.0.1",
        allow_pickle=args.allow_pickle,
        max_recv_bytes=args.max_bytes,
        progress=progress if progress.mode != "none" else None,
    )
    with transport:
        try:
            state = transport.recv_checkpoint(args.rank, args.metadata, args.step, timeout)
        finally:
            progress.close()
        stats = transport.last_recv_stats
    assert stats is not None  # set by every successful receive
    saving = time.monotonic()
    _write_atomic(output, lambda temporary: torch.save(state, temporary))
    saved_s = time.monotonic() - saving
    print(
        f"fetched step {args.step} from {stats.peer}: {stats.tensors} tensors, {human_bytes(stats.bytes)} "
        f"in {stats.seconds:.2f} s ({_rate(stats.bytes, stats.seconds)}); saved to {output} in {saved_s:.2f} s"
    )
    return EXIT_OK


def _load_checkpoint(path: Path) -> Any:
    """torch.load without pickle (``weights_only=True``), memory-mapped when the format allows."""
    if not path.is_file():
        raise CLIError(f"{path}: no such file")
    try:
        try:
            # mmap: the tensors stay backed by the page cache and are served
            # straight from it, instead of a private copy of the whole file.
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CLIError(
            f"{path}: torch.load(weights_only=True) refused it ({_weights_only_reason(str(exc))}); "
            "only tensors and plain containers load without pickle"
        ) from None
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CLIError(f"{path}: not a checkpoint torch.load can read: {_one_line(str(exc))}") from None


def _weights_only_reason(message: str) -> str:
    """The informative line of torch's multi-paragraph weights_only error."""
    marker = "WeightsUnpickler error:"
    if marker in message:
        detail = message.split(marker, 1)[1].split("Check the documentation", 1)[0]
        # Drop torch's advice to allowlist the class: serve exists to avoid pickle.
        detail = " ".join(detail.split()).split(" Please use", 1)[0].rstrip(".")
        if detail:
            return detail
    return _one_line(message)


class _StopSignal:
    """Turns SIGINT and SIGTERM into an event for the serve loop; restores the old handlers."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum).name
        self.event.set()

    def __enter__(self) -> _StopSignal:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _peer_name(address: str) -> str:
    """``::ffff:10.0.0.7`` (an IPv4 peer on a dual-stack socket) reads better as ``10.0.0.7``."""
    return address.removeprefix("::ffff:")


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve a checkpoint file at ``--step`` until SIGINT or SIGTERM."""
    timeout = _timeout(args)
    path = Path(args.file)
    if not path.is_file():
        raise CLIError(f"{path}: no such file")
    # Listen first: a port in use or a wrong --bind is reported at once, not
    # after loading a checkpoint of many gigabytes.
    transport: ZMQTransport[Any] = ZMQTransport(
        timeout,
        bind_host=args.bind,
        port=args.port,
        advertise_host=args.advertise_host,
        checksum=args.checksum,
    )
    metadata_file = Path(args.metadata_file) if args.metadata_file else None
    wrote_metadata = False
    try:
        loading = time.monotonic()
        state = _load_checkpoint(path)
        loaded_s = time.monotonic() - loading
        try:
            transport.send_checkpoint([], args.step, state, timeout)
        except TypeError as exc:
            raise CLIError(f"{path}: cannot serve it without pickle: {_one_line(str(exc))}") from None
        metadata = transport.metadata()
        served = transport.sent_since(0)[0]
        with _StopSignal() as stop:
            if metadata_file is not None:
                _write_atomic(metadata_file, lambda temporary: Path(temporary).write_text(metadata + "\n"))
                wrote_metadata = True
            # stdout carries the metadata alone, for scripts; the rest goes to stderr.
            print(metadata, flush=True)
            print(
                f"{time.strftime('%H:%M:%S')} serving step {args.step} from {path} (loaded in {loaded_s:.2f} s) "
                f"at {metadata}; stop with Ctrl-C or SIGTERM",
                file=sys.stderr,
                flush=True,
            )
            _report_served_until(stop.event, transport, served)
            print(f"{time.strftime('%H:%M:%S')} {stop.received}: stopping", file=sys.stderr, flush=True)
    finally:
        try:
            transport.disallow_checkpoint()
        finally:
            transport.shutdown()  # even when the disallow failed
            if metadata_file is not None and wrote_metadata:
                # A stale metadata file would send the next reader to a dead port.
                metadata_file.unlink(missing_ok=True)
    return EXIT_OK


def _report_served_until(stop: threading.Event, transport: ZMQTransport[Any], served: int) -> None:
    """Print a line on stderr for each transfer ``transport`` finishes, until ``stop`` is set."""
    stopping = False
    while not stopping:
        # One more look after the signal: a transfer that finished just
        # before it is still reported.
        stopping = stop.wait(0.2)
        served, finished = transport.sent_since(served)
        for stats in finished:
            print(
                f"{time.strftime('%H:%M:%S')} served step {stats.step} to {_peer_name(stats.peer)}: "
                f"{stats.tensors} tensors, {human_bytes(stats.bytes)} in {stats.seconds:.2f} s "
                f"({_rate(stats.bytes, stats.seconds)})",
                file=sys.stderr,
                flush=True,
            )


def describe_header(header: Any, peer: str) -> dict[str, Any]:
    """What a peer serves, from its header alone (see :meth:`ZMQTransport.fetch_header`)."""
    specs = decode_tensor_table(header.tensors, header.storages)
    paths = skeleton.index_skeleton(header.skeleton, len(specs), True)
    by_dtype: dict[str, dict[str, int]] = {}
    for spec in specs:
        entry = by_dtype.setdefault(dtype_name(spec.dtype), {"tensors": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["bytes"] += spec.nbytes
    plan = wire.plan_chunks(header.storages, header.chunk_bytes, header.pack_below)
    top = header.skeleton
    top_keys: list[str] = []
    if isinstance(top, list) and top and top[0] in (skeleton.TAG_DICT, skeleton.TAG_ORDERED_DICT):
        top_keys = [str(key) for key, _ in top[1]]
    return {
        "peer": peer,
        "step": header.step,
        "tensors": len(specs),
        "storages": len(header.storages),
        "bytes": header.total_bytes,
        "dtypes": dict(sorted(by_dtype.items(), key=lambda item: -item[1]["bytes"])),
        "data_messages": len(plan),
        "chunk_bytes": header.chunk_bytes,
        "checksum": header.checksum,
        "pickled_leaves": sum(tag == skeleton.TAG_PICKLE for tag, _ in skeleton.walk(header.skeleton)),
        "top_level_keys": top_keys,
        "tensor_list": [
            {
                "path": format_path(paths[index]),
                "dtype": dtype_name(spec.dtype),
                "shape": list(spec.shape),
                "bytes": spec.nbytes,
            }
            for index, spec in enumerate(specs)
        ],
    }


def cmd_inspect(args: argparse.Namespace) -> int:
    """Print what the peer serves for ``--step``; no tensor data is transferred."""
    if args.check and not args.digests:
        raise CLIError("--check needs --digests")
    if args.digests:
        return _inspect_digests(args)
    timeout = _timeout(args)
    peer = parse_metadata(args.metadata).endpoint
    # allow_pickle only lets the header through when it has pickled leaves:
    # inspect never builds the object, so nothing is ever unpickled here.
    transport: ZMQTransport[Any] = ZMQTransport(
        timeout, bind_host="127.0.0.1", advertise_host="127.0.0.1", allow_pickle=True
    )
    with transport:
        try:
            header = transport.fetch_header(args.metadata, args.step, timeout)
        except TimeoutError:
            raise CLIError(
                f"timed out after {args.timeout:g} s waiting for {peer} to describe step {args.step} "
                "(nothing serving there, or that step is not staged yet)"
            ) from None
    info = describe_header(header, peer)
    if args.json:
        if not args.tensors:
            del info["tensor_list"]
        print(json.dumps(info, indent=2))
        return EXIT_OK
    print(f"peer            {info['peer']}")
    print(f"step            {info['step']}")
    print(f"tensors         {info['tensors']} (in {info['storages']} storages)")
    print(f"bytes           {info['bytes']} ({human_bytes(info['bytes'])})")
    dtypes = ", ".join(
        f"{name} x{entry['tensors']} ({human_bytes(entry['bytes'])})" for name, entry in info["dtypes"].items()
    )
    print(f"dtypes          {dtypes or '-'}")
    print(f"data messages   {info['data_messages']} of up to {human_bytes(info['chunk_bytes'])}")
    print(f"checksum        {info['checksum'] or 'none'}")
    needs = " (fetch needs --allow-pickle)" if info["pickled_leaves"] else ""
    print(f"pickled leaves  {info['pickled_leaves']}{needs}")
    if info["top_level_keys"]:
        print(f"top-level keys  {', '.join(info['top_level_keys'])}")
    if args.tensors:
        for item in info["tensor_list"]:
            shape = "x".join(str(n) for n in item["shape"]) or "scalar"
            print(f"  {item['path']}  {item['dtype']}  [{shape}]  {human_bytes(item['bytes'])}")
    return EXIT_OK


def _inspect_digests(args: argparse.Namespace) -> int:
    """Print the source's digests of ``--step`` (their root); with ``--check``, compare a saved checkpoint."""
    timeout = _timeout(args)
    peer = parse_metadata(args.metadata).endpoint
    state = _load_checkpoint(Path(args.check)) if args.check else None  # a bad file fails before any request
    transport: ZMQTransport[Any] = ZMQTransport(timeout, bind_host="127.0.0.1", advertise_host="127.0.0.1")
    with transport:
        published = transport.fetch_digests(args.metadata, args.step, timeout)
    summary: dict[str, Any] = {
        "peer": peer,
        "step": args.step,
        "algorithm": published.algorithm.name,
        "data_messages": len(published.digests),
        "root": published.root.hex(),
    }
    failed = False
    if state is not None:
        checked = _check_against(published, state)
        summary["check"] = {"file": args.check, **checked}
        failed = bool(checked["different"] or checked["not_checkable"])
    if args.json:
        summary["digests"] = [digest.hex() for digest in published.digests] if args.tensors else None
        print(json.dumps(summary, indent=2))
        return EXIT_FAILURE if failed else EXIT_OK
    print(f"peer            {peer}")
    print(f"step            {args.step}")
    print(f"digests         {len(published.digests)} data messages, {published.algorithm.name}")
    print(f"root            {summary['root']}")
    if state is not None:
        check = summary["check"]
        verdict = "identical to the source" if not failed else "DIFFERS from the source"
        print(f"check           {args.check}: {check['same']} of {len(published.digests)} messages match: {verdict}")
        for item in check["different"][:20]:
            print(f"  message {item['seq']} differs: {', '.join(item['tensors'][:4]) or '-'}")
        for item in check["not_checkable"][:20]:
            print(f"  message {item['seq']} not checkable: {item['why']}")
    return EXIT_FAILURE if failed else EXIT_OK


def _check_against(published: Published, state: Any) -> dict[str, Any]:
    """Each data message of ``state``, laid out by the source's header, against the source's digest."""
    same = 0
    different: list[dict[str, Any]] = []
    unknown: list[dict[str, Any]] = []
    for message in messages_of(published.header, state):
        if message.payload is None:
            unknown.append({"seq": message.seq, "why": message.problem})
        elif digest_of(published.algorithm, message.payload) == published.digests[message.seq]:
            same += 1
        else:
            different.append({"seq": message.seq, "tensors": message.tensors})
    return {"same": same, "different": different, "not_checkable": unknown}


def cmd_bench(argv: Sequence[str]) -> int:
    """Run ``zmqtransport.bench.main``, imported only now (it is large and optional)."""
    try:
        bench = importlib.import_module(f"{__package__}.bench")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.bench":
            raise
        raise CLIError("the benchmark (zmqtransport.bench) is not part of this installation") from None
    try:
        status = bench.main(list(argv))
    except SystemExit as exc:  # argparse and the benchmark's own checks exit this way
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or EXIT_OK
        raise CLIError(str(exc.code)) from None
    return int(status or EXIT_OK)


# ----------------------------------------------------------------------------- parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Fetch, serve or inspect zmqtransport checkpoints; run the benchmark.",
        epilog="Exit status: 0 success, 1 failure, 2 bad usage, 130 interrupted.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the library's INFO log lines")
    parser.add_argument("--debug", action="store_true", help=f"show tracebacks (also: {DEBUG_ENV}=1)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_fetch(commands)
    _add_serve(commands)
    _add_inspect(commands)
    commands.add_parser(
        "bench",
        help="benchmark ZMQTransport (arguments go to python -m zmqtransport.bench; try: bench --help)",
        add_help=False,
    )
    return parser


def _timeout_option(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"transport timeout (default {DEFAULT_TIMEOUT_S:g})",
    )


def _add_fetch(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fetch = commands.add_parser(
        "fetch",
        help="pull a live checkpoint from a peer and torch.save it",
        description="Pull --step from the ZMQTransport whose metadata() is METADATA and save it with "
        "torch.save. Pickled leaves are refused unless --allow-pickle; the file is written atomically.",
    )
    fetch.add_argument("metadata", metavar="METADATA", help="the peer's metadata string, tcp://HOST:PORT")
    fetch.add_argument("--step", type=_positive_int, required=True, help="the step to fetch")
    fetch.add_argument("-o", "--output", required=True, metavar="FILE", help="where to torch.save the checkpoint")
    fetch.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    fetch.add_argument("--rank", type=int, default=0, help="the peer's rank, for messages (default 0)")
    fetch.add_argument("--allow-pickle", action="store_true", help="accept pickled leaves (runs the peer's code)")
    fetch.add_argument("--max-bytes", type=_positive_int, help="refuse a checkpoint larger than this")
    fetch.add_argument(
        "--progress",
        choices=["auto", "bar", "log", "none"],
        default="auto",
        help="auto (default): a bar on a terminal, log lines otherwise",
    )
    fetch.add_argument(
        "--progress-interval",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between progress log lines (default 2)",
    )
    _timeout_option(fetch)
    fetch.set_defaults(handler=cmd_fetch)


def _add_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve a checkpoint file to peers until SIGINT/SIGTERM",
        description="Load FILE with torch.load(weights_only=True) and serve it as --step over the "
        "ZMQTransport protocol, so a job can cold-start from disk through recv_checkpoint. Prints the "
        "metadata string on stdout, then serves until SIGINT or SIGTERM.",
    )
    serve.add_argument("file", metavar="FILE", help="a checkpoint written by torch.save (or zmqtransport fetch)")
    serve.add_argument("--step", type=_positive_int, required=True, help="the step to serve it as")
    serve.add_argument(
        "--bind", default="*", metavar="HOST", help="interface to listen on, or several, comma-separated (default: all)"
    )
    serve.add_argument("--port", type=_positive_int, default=0, help="TCP port (default: any free one)")
    serve.add_argument(
        "--advertise-host", metavar="HOST", help="host to put in the metadata string, or several, comma-separated"
    )
    serve.add_argument("--checksum", action="store_true", help="attach a CRC32 to every data frame")
    serve.add_argument("--metadata-file", metavar="PATH", help="also write the metadata string to PATH")
    _timeout_option(serve)
    serve.set_defaults(handler=cmd_serve)


def _add_inspect(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    inspect = commands.add_parser(
        "inspect",
        help="show what a peer serves (step, tensors, bytes, dtypes) without transferring tensors",
        description="Ask the peer for the header of --step only and describe it. No tensor data moves "
        "and nothing is unpickled.",
    )
    inspect.add_argument("metadata", metavar="METADATA", help="the peer's metadata string, tcp://HOST:PORT")
    inspect.add_argument("--step", type=_positive_int, required=True, help="the step to inspect")
    inspect.add_argument("--tensors", action="store_true", help="also list every tensor (key path, dtype, shape)")
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument(
        "--digests",
        action="store_true",
        help="ask for the source's digest of every data message and print their root (the source hashes the state "
        "once if it has not yet); with --json and --tensors, every digest",
    )
    inspect.add_argument(
        "--check",
        metavar="FILE",
        help="with --digests: compare a saved checkpoint (zmqtransport fetch -o FILE) with the source, message by "
        "message, naming the tensors of any that differ; exit status 1 if any differs",
    )
    _timeout_option(inspect)
    inspect.set_defaults(handler=cmd_inspect)


# ----------------------------------------------------------------------------- entry point


def _describe_error(exc: BaseException) -> str:
    if isinstance(exc, CLIError | TimeoutError | TransportError | ValueError | TypeError):
        return _one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror or _one_line(str(exc))}{where}"
    return f"{type(exc).__name__}: {_one_line(str(exc))}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.command != "bench" and extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    debug = args.debug or os.environ.get(DEBUG_ENV) == "1"
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    try:
        if args.command == "bench":
            return cmd_bench(extra)
        assert handler is not None
        return handler(args)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:  # the one place where every failure becomes one line
        if debug:
            raise
        print(f"{PROG} {args.command}: error: {_describe_error(exc)}", file=sys.stderr)
        return EXIT_FAILURE
