"""Sets of data messages as Python integers (bit ``seq``), shared by the two wings.

The receiving side's span book (:mod:`zmqtransport.fetch.spans`) and the
source's reservations (:mod:`zmqtransport.serve.swarm`) keep which messages
are where as bit sets: a plan of 4 GiB in 1 MiB messages makes each
operation a few microseconds.
"""

from __future__ import annotations


def run(first: int, stop: int) -> int:
    """The messages [first, stop) (none when ``stop <= first``)."""
    return ((1 << (stop - first)) - 1) << first if stop > first else 0


def lowest(bits: int) -> int:
    """The lowest set bit's position (``bits`` > 0)."""
    return (bits & -bits).bit_length() - 1


def lowest_from(bits: int, start: int) -> int:
    """The lowest set bit at or after ``start``, or the lowest of all when none is (``bits`` > 0)."""
    after = bits >> start << start
    return lowest(after or bits)


def run_length(bits: int, start: int, limit: int) -> int:
    """How many set bits follow one another in ``bits`` from ``start`` on, at most ``limit``."""
    window = (bits >> start) & ((1 << limit) - 1)
    return ((window ^ (window + 1)).bit_length() - 1) if window else 0
