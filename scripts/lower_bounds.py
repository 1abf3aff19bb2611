#!/usr/bin/env python3
"""Pin, or check, the lowest versions pyproject.toml declares for some dependencies (Python 3.11+).

The ``oldest`` tox environment uses this so that pyproject.toml stays the one
place a lower bound is written: ``--write FILE`` turns ``pyzmq>=26.4`` into the
constraint ``pyzmq==26.4`` for pip, and ``--verify`` checks afterwards that the
environment really holds those versions (a pin that silently lost to another
requirement would make the "oldest" run a lie).

Usage::

    lower_bounds.py --write FILE pyzmq msgpack
    lower_bounds.py --verify pyzmq msgpack
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

import tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# "name>=1.2.3" possibly followed by ",<2" or an environment marker.
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_lower_bounds() -> dict[str, str]:
    """``{normalised name: lower bound}`` for every ``>=`` requirement in [project] dependencies."""
    with PYPROJECT.open("rb") as handle:
        dependencies = tomllib.load(handle)["project"]["dependencies"]
    bounds: dict[str, str] = {}
    for requirement in dependencies:
        match = _REQUIREMENT.match(requirement)
        if match:
            bounds[_normalise(match.group(1))] = match.group(2)
    return bounds


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a plain version, zero-padding ignored: 26.4 == 26.4.0."""
    parts = [int(p) for p in re.findall(r"\d+", version.split("+", maxsplit=1)[0])]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="write a pip constraints file pinning the lower bounds")
    mode.add_argument("--verify", action="store_true", help="check the installed versions equal the lower bounds")
    parser.add_argument("packages", nargs="+", help="distribution names, as in pyproject.toml")
    args = parser.parse_args(argv)

    bounds = declared_lower_bounds()
    missing = [p for p in args.packages if _normalise(p) not in bounds]
    if missing:
        print(f"no '>=' lower bound in pyproject.toml for: {', '.join(missing)}", file=sys.stderr)
        return 2
    pins = {p: bounds[_normalise(p)] for p in args.packages}

    if args.write:
        Path(args.write).write_text("".join(f"{p}=={v}\n" for p, v in pins.items()))
        print("pinned " + ", ".join(f"{p}=={v}" for p, v in pins.items()))
        return 0

    wrong = []
    for package, lowest in pins.items():
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            installed = "not installed"
        status = "ok" if _release(installed) == _release(lowest) else "MISMATCH"
        print(f"{package}: declared >={lowest}, installed {installed} [{status}]")
        if status != "ok":
            wrong.append(package)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
