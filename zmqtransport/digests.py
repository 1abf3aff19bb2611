"""Strong digests of data messages: the algorithms both sides know, and how they agree on one.

The source publishes a digest of every data message of the chunk plan
(docs/protocol.md, "Digests"); a receiver checks each message it gets from a
relay (and, with ``verify="all"``, from the source too) against it before the
message counts as landed. A digest is a cryptographic hash: CRC32, which the
``checksum`` option adds, detects accidents, not a peer that rewrites bytes.

Algorithms, by name on the wire:

* ``sha256`` (``hashlib``): always available; about 1-2 GB/s per core.
* ``blake3``: when the optional ``blake3`` package is installed (the
  ``blake3`` extra); about 3-4 times faster per core.

A receiver names the ones it has, preferred first (:func:`offered`); the
source takes the first it has too (:func:`choose`), so two peers with the
``blake3`` package use it and any pair can fall back to SHA-256. Pure, and
used by both sides: hashing here reads the buffer it is given, nothing else.
``hashlib`` and ``blake3`` release the GIL while they hash a large buffer.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def digest(self) -> bytes: ...


class Algorithm(NamedTuple):
    name: str
    size: int  # bytes of one digest
    new: Callable[[], Hasher]


SHA256 = "sha256"
BLAKE3 = "blake3"
# Names a request may carry, and the longest name a peer may send.
MAX_OFFERED = 8
MAX_NAME_CHARS = 32


def _algorithms() -> dict[str, Algorithm]:
    """The algorithms this process has, fastest first."""
    found: dict[str, Algorithm] = {}
    try:
        import blake3  # the optional extra (pyproject.toml: blake3)
    except ImportError:
        pass
    else:
        found[BLAKE3] = Algorithm(BLAKE3, 32, blake3.blake3)
    found[SHA256] = Algorithm(SHA256, 32, hashlib.sha256)
    return found


ALGORITHMS = _algorithms()


def offered() -> list[str]:
    """The algorithms this side verifies with, preferred first (what a receiver offers)."""
    return list(ALGORITHMS)


def choose(names: Sequence[str]) -> Algorithm | None:
    """The first of a peer's ``names`` this side has, or None."""
    for name in names:
        algorithm = ALGORITHMS.get(name)
        if algorithm is not None:
            return algorithm
    return None


def algorithm(name: str) -> Algorithm:
    """The algorithm named ``name``; ``KeyError`` when this side does not have it."""
    return ALGORITHMS[name]


def digest_of(algorithm: Algorithm, data: Any) -> bytes:
    """The digest of one buffer (a data message's payload)."""
    hasher = algorithm.new()
    hasher.update(data)
    return hasher.digest()


def root_of(algorithm: Algorithm, digests: Sequence[bytes]) -> bytes:
    """One digest over a staging's message digests, in plan order: names the whole state's bytes."""
    hasher = algorithm.new()
    for one in digests:
        hasher.update(one)
    return hasher.digest()
