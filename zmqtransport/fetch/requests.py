"""Every fetch request a receive sends, built in one place (docs/protocol.md, "Requests", "Spans", "Digests").

A receive sends three kinds of ``fetch``: the step (or its header alone), a
span of it (from the source or, over the swarm, from a peer), and the digests
of a span. Each carries how long the sender may wait for the step, counted
from the receive's deadline at the moment it is sent (:func:`wait_ms`).
Pure: bytes out, no sockets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import wire
from ..digests import Algorithm


@dataclass(frozen=True)
class SpanTerms:
    """What every span fetch of one receive shares."""

    step: int
    stage: int
    accept_pickle: bool
    deadline: float
    stall_timeout: float | None
    algorithm: Algorithm | None = None  # the source's digest algorithm (None: it publishes none)
    inline: bool = False  # verify="all": the source's spans carry a digest per message
    digests_ahead: bool = False  # the source hashes any message on request, sent or not (its header said so)


def wait_ms(deadline: float, now: float) -> int:
    """How long a sender may wait for the step, in a request sent at ``now`` by a receive that ends at
    ``deadline``."""
    return max(0, int((deadline - now) * 1000))


def step_request(
    xfer: int,
    step: int,
    deadline: float,
    now: float,
    window: int,
    accept_pickle: bool,
    header_only: bool,
    relay: str | None,
    verify: Sequence[str],
    inline: bool,
) -> bytes:
    """The fetch of ``step`` (or its header alone), with ``window`` data messages of credit; ``relay``:
    where this receiver offers to serve others."""
    wait = wait_ms(deadline, now)
    return wire.fetch_request(
        xfer, step, wait, window, accept_pickle, header_only, relay=relay, verify=verify, inline=inline
    )


def span_request(xfer: int, first: int, stop: int, terms: SpanTerms, token: bytes | None, now: float) -> bytes:
    """The span fetch for messages [first, stop): to a peer with its ``token``; to the source, with
    digests if verify="all"."""
    inline = terms.inline and token is None and terms.algorithm is not None
    verify = [terms.algorithm.name] if inline and terms.algorithm is not None else []
    return wire.fetch_request(
        xfer,
        terms.step,
        wait_ms(terms.deadline, now),
        stop - first,
        terms.accept_pickle,
        span=(first, stop),
        stage=terms.stage,
        token=token,
        verify=verify,
        inline=inline,
    )


def digest_request(
    xfer: int, step: int, stage: int, algorithm: Algorithm, first: int, stop: int, deadline: float, now: float
) -> bytes:
    """A request for the digests of messages [first, stop) of the staging ``stage`` (``digests_only``)."""
    return wire.fetch_request(
        xfer,
        step,
        wait_ms(deadline, now),
        1,
        False,
        span=(first, stop),
        stage=stage,
        verify=[algorithm.name],
        digests_only=True,
    )
