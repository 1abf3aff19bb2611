"""The warm server the lab tests start their Python children from (tests/warmstart.py): a child behaves as
``python -c`` would, as far as the tests can tell (streams, argv, environment, exit status, signals)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest

from .warmstart import WarmStarter


@pytest.fixture(scope="module")
def starter() -> Iterator[WarmStarter]:
    made = WarmStarter(preload=())  # nothing to import: these children need only the standard library
    yield made
    made.close()


def run(starter: WarmStarter, script: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    process = starter.popen("", script, args, env if env is not None else dict(os.environ))
    out, err = process.communicate("line one\n", timeout=30)
    return process.returncode or 0, out, err


def test_a_child_gets_its_streams_arguments_environment_and_exit_status(starter: WarmStarter) -> None:
    script = "import os, sys; print(sys.stdin.readline().strip(), sys.argv[1:], os.environ['ZW'], __name__)"
    code, out, _ = run(starter, script, "a", "b", env={"ZW": "here"})
    assert (code, out) == (0, "line one ['a', 'b'] here __main__\n")
    assert run(starter, "raise SystemExit(3)")[0] == 3
    code, _, err = run(starter, "def f():\n    raise ValueError('boom')\nf()")
    assert code == 1 and "ValueError: boom" in err and err.startswith("Traceback")


def test_a_child_ends_as_an_interpreter_does(starter: WarmStarter) -> None:
    """Its threads are joined and its atexit hooks run before it exits; output is flushed."""
    script = (
        "import atexit, threading, time\n"
        "atexit.register(lambda: print('atexit', flush=True))\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "print('main', end='')\n"
    )
    assert run(starter, script) == (0, "mainthread\natexit\n", "")


def test_a_child_is_its_own_process_to_signal_and_wait_for(starter: WarmStarter) -> None:
    process = starter.popen("", "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()", (), {})
    assert process.stdout is not None
    assert int(process.stdout.readline()) == process.pid != os.getpid()
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.1)
    process.kill()
    assert process.wait(10) == -signal.SIGKILL
    process.kill()  # once it is gone: nothing happens
