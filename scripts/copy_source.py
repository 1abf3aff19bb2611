#!/usr/bin/env python3
"""Copy the project's source tree to DEST, without build outputs, caches and virtualenvs.

The ``oldest`` tox environment installs the package with pip from this copy
rather than from the checkout: pip builds a local directory in place (it
writes ``zmqtransport.egg-info`` there), and tox builds the other
environments' wheel from the checkout at the same time; two builds in one
tree removed each other's files.

Usage::

    copy_source.py DEST
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LEFT_OUT = (".git", ".tox", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    dest = Path(argv[0])
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*LEFT_OUT))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
