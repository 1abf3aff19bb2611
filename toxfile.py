"""tox inline plugin (loaded by tox 4 from this file; nothing to install).

It adds one per-environment setting, ``torch_must_be_local``. An environment
that sets it is *skipped, with the reason*, when the torch that
``constraints.txt`` pins cannot be installed from this machine's local wheel
sources for that environment's interpreter.

Why: tests and CI install the CPU build of torch, which lies on disk for
CPython 3.11 only. For any other interpreter pip would fetch torch from PyPI,
whose Linux wheel is the multi-GB CUDA build: too slow and too big to be a
test dependency. A plain ``commands_pre`` check cannot help, because tox
installs dependencies before it runs any command; this hook runs just before
the first installation and raises tox's own ``Skip``, so the summary line says
``SKIP`` (not ``OK``) and the log says why.

Set ``ZMQTRANSPORT_TOX_DOWNLOAD_TORCH=1`` to lift the gate on a machine where
that download is fine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tox.plugin import impl
from tox.tox_env.errors import Skip

if TYPE_CHECKING:
    from tox.config.sets import EnvConfigSet
    from tox.session.state import State
    from tox.tox_env.api import ToxEnv

SETTING = "torch_must_be_local"
OVERRIDE_ENV = "ZMQTRANSPORT_TOX_DOWNLOAD_TORCH"
CONSTRAINTS = Path(__file__).resolve().parent / "constraints.txt"

# Environments already checked in this tox run: the hook fires once per install step.
_checked: set[str] = set()


@impl
def tox_add_env_config(env_conf: EnvConfigSet, state: State) -> None:
    env_conf.add_config(
        keys=[SETTING],
        of_type=bool,
        default=False,
        desc="skip this environment unless the pinned torch installs from local wheel sources",
    )


def _torch_requirement() -> str:
    """The torch line of constraints.txt (``torch==2.13.0``), or plain ``torch``."""
    for line in CONSTRAINTS.read_text().splitlines():
        requirement = line.split("#", 1)[0].strip()
        if re.match(r"^torch\b", requirement):
            return requirement
    return "torch"


@impl
def tox_on_install(tox_env: ToxEnv, arguments: Any, section: str, of_type: str) -> None:
    name = tox_env.conf.name
    try:
        gated = bool(tox_env.conf[SETTING])
    except KeyError:  # packaging environments do not carry the setting
        return
    if not gated or name in _checked or os.environ.get(OVERRIDE_ENV) == "1":
        return
    _checked.add(name)
    python = tox_env.env_python()  # type: ignore[attr-defined]  # every Python env has it
    requirement = _torch_requirement()
    # --no-index keeps the configured find-links (local wheel folders) and drops
    # every remote index; --dry-run resolves without installing or copying.
    environment = {k: v for k, v in os.environ.items() if k != "PIP_CONSTRAINT"}
    probe = subprocess.run(
        [str(python), "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--quiet", requirement],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    if probe.returncode == 0:
        return
    version = subprocess.run(
        [str(python), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    raise Skip(
        f"{requirement} has no wheel for CPython {version} on {sys.platform} in this machine's local "
        f"wheel sources, and PyPI's is a multi-GB CUDA build; set {OVERRIDE_ENV}=1 to download it anyway"
    )
