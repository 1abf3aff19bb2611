"""Python children on lab hosts, forked from one process that has imported torch and zmqtransport.

``ip netns exec HOST python -c SCRIPT`` starts an interpreter that imports
torch before it does anything: about 3 s of CPU on this project's machine,
where a lab test starts two to five such children. A :class:`WarmStarter` runs
one *server* process that imports what the children need once; each
:meth:`WarmStarter.popen` forks it, moves the fork into the host's network
namespace (``setns``, as :func:`zmqtransport.lab.enter_namespace` does), gives
it the caller's pipes as stdin, stdout and stderr, and runs the script as
``python -c`` would (``__main__``, ``sys.argv``, the environment, exit status,
a traceback on stderr for an uncaught exception). What a test sees is a new
process on that host with its own pid, sockets and memory, which it can read,
write, stop, kill and wait for through :class:`WarmProcess` (the part of
``subprocess.Popen`` the lab tests use).

The server is forked while it has one thread and no socket of the child's
kind open (importing torch and zmqtransport starts no thread). It is not
``ip netns exec``: no mount namespace is made, so a child reading
``/sys/class/net`` sees the machine's; ``/proc/net`` and every socket are the
host's (what zmqtransport reads). Benchmarks never use it: they measure cold
processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import IO, Any

# The server's loop, run as ``python -c``: argv[1] is its end of the control
# socket, the rest the modules to import before it says it is ready.
_SERVER = r"""
import ctypes, json, os, select, signal, socket, sys, traceback

control = socket.socket(fileno=int(sys.argv[1]))
for name in sys.argv[2:]:
    __import__(name)
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)
children = {}


def send(message):
    control.send(json.dumps(message).encode())


def child(request, fds):
    control.close()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r)
    os.close(wake_w)
    for fd, into in zip(fds, (0, 1, 2)):
        os.dup2(fd, into)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    if request["netns"]:
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/var/run/netns/" + request["netns"], "rb") as handle:
            if libc.setns(handle.fileno(), 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns into " + request["netns"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["-c", *request["args"]]
    code = compile(request["script"], "<string>", "exec")
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1)
    # Leaves the loop below like an exception: the interpreter then joins the
    # script's threads, runs its atexit hooks and flushes, as after `python -c`.
    raise SystemExit(0)


send({"ready": os.getpid()})
while True:
    ready, _, _ = select.select([control, wake_r], [], [])
    if wake_r in ready:
        os.read(wake_r, 4096)
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        send({"id": children.pop(pid), "exit": os.waitstatus_to_exitcode(status)})
    if control not in ready:
        continue
    data, fds, _, _ = socket.recv_fds(control, 1 << 20, 3)
    if not data:
        break  # the tests are gone; the lab stops what still runs on its hosts
    request = json.loads(data)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        child(request, fds)
    for fd in fds:
        os.close(fd)
    children[pid] = request["id"]
    send({"id": request["id"], "pid": pid})
"""

START_TIMEOUT = 120.0  # the server's imports on a loaded machine


class WarmProcess:
    """A child of the warm server: the part of ``subprocess.Popen`` the lab tests use (text pipes)."""

    def __init__(self, pid: int, stdin: IO[str], stdout: IO[str], stderr: IO[str] | None) -> None:
        self.pid = pid
        self.stdin: IO[str] | None = stdin
        self.stdout: IO[str] | None = stdout
        self.stderr: IO[str] | None = stderr
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # once reaped its pid may be another process's
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str, str]:
        """Write ``input``, close stdin, read stdout and stderr to their end, wait (as ``Popen.communicate``)."""
        outputs: dict[str, str] = {}

        def drain(name: str, stream: IO[str] | None) -> None:
            outputs[name] = stream.read() if stream is not None else ""

        readers = [
            threading.Thread(target=drain, args=(name, stream), daemon=True)
            for name, stream in (("out", self.stdout), ("err", self.stderr))
        ]
        for reader in readers:
            reader.start()
        if self.stdin is not None and not self.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                if input:
                    self.stdin.write(input)
                self.stdin.close()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(f"warm child {self.pid}", timeout or 0.0)
        self.wait(timeout)
        return outputs["out"], outputs["err"]


class WarmStarter:
    """One warm server and its children (see the module docstring). :meth:`close` ends the server."""

    def __init__(self, preload: Iterable[str] = ("torch", "zmqtransport")) -> None:
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs:
            self._server = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
        self._lock = threading.Lock()
        self._next_id = 0
        self._started: dict[int, tuple[threading.Event, list[int]]] = {}
        self._children: dict[int, WarmProcess] = {}
        self._exits: dict[int, int] = {}  # exits reported before the child was registered
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read, name="warmstart", daemon=True)
        self._reader.start()
        if not self._ready.wait(START_TIMEOUT):
            self.close()
            raise RuntimeError(f"the warm server did not get ready within {START_TIMEOUT:.0f} s")

    def popen(
        self, namespace: str, script: str, args: Sequence[str], env: Mapping[str, str], stderr: bool = True
    ) -> WarmProcess:
        """Run ``python -c script args`` in network namespace ``namespace``: stdin and stdout piped, and
        stderr (else the caller's own), as text."""
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe() if stderr else (None, 2)
        request = {"netns": namespace, "script": script, "args": list(args), "env": dict(env), "cwd": os.getcwd()}
        with self._lock:
            ident = self._next_id
            self._next_id += 1
            started: tuple[threading.Event, list[int]] = (threading.Event(), [])
            self._started[ident] = started
            payload = json.dumps({**request, "id": ident}).encode()
            socket.send_fds(self._control, [payload], [stdin_r, stdout_w, stderr_w])
        for fd in (stdin_r, stdout_w, stderr_w if stderr else -1):
            if fd >= 0:
                os.close(fd)
        if not started[0].wait(START_TIMEOUT) or not started[1]:
            raise RuntimeError("the warm server did not start the child")
        # The pipes belong to the process object, as a Popen's do: the test reads and closes them.
        process = WarmProcess(
            started[1][0],
            open(stdin_w, "w", encoding="utf-8"),  # noqa: SIM115
            open(stdout_r, encoding="utf-8"),  # noqa: SIM115
            open(stderr_r, encoding="utf-8") if stderr_r is not None else None,  # noqa: SIM115
        )
        with self._lock:
            self._children[ident] = process
            code = self._exits.pop(ident, None)
        if code is not None:
            process._exit(code)
        return process

    def _read(self) -> None:
        while True:
            try:
                data = self._control.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            message: dict[str, Any] = json.loads(data)
            if "ready" in message:
                self._ready.set()
                continue
            ident = message["id"]
            with self._lock:
                if "pid" in message:
                    event, pid = self._started.pop(ident)
                    pid.append(message["pid"])
                    event.set()
                    continue
                child = self._children.pop(ident, None)
                if child is None:
                    self._exits[ident] = message["exit"]
            if child is not None:
                child._exit(message["exit"])
        # The server is gone: nothing more will be reported (its children were reparented).
        with self._lock:
            for event, _ in self._started.values():
                event.set()
            for child in self._children.values():
                child._exit(-signal.SIGKILL)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._control.shutdown(socket.SHUT_RDWR)
        self._control.close()
        try:
            self._server.wait(10)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait(10)
