"""Every fetch request a receive sends, built in one place (docs/protocol.md, "Requests", "Spans", "Digests").

A receive sends four kinds of ``fetch``: the step (or its header alone), a
span of it, the digests of a span, and (over the swarm) a span from a peer.
Each carries how long the sender may wait for the step, counted from the
receive's deadline at the moment it is sent. Pure: bytes out, no sockets.
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


def fetch_request(
    xfer: int,
    step: int,
    deadline: float,
    now: float,
    credit: int,
    accept_pickle: bool = False,
    header_only: bool = False,
    *,
    span: tuple[int, int] | None = None,
    stage: int | None = None,
    relay: str | None = None,
    token: bytes | None = None,
    verify: Sequence[str] = (),
    inline: bool = False,
    digests_only: bool = False,
) -> bytes:
    """A ``fetch`` of ``step`` under transfer id ``xfer``, which the sender may wait for until ``deadline``."""
    wait_ms = max(0, int((deadline - now) * 1000))
    return wire.fetch_request(
        xfer,
        step,
        wait_ms,
        credit,
        accept_pickle,
        header_only,
        span=span,
        stage=stage,
        relay=relay,
        token=token,
        verify=verify,
        inline=inline,
        digests_only=digests_only,
    )


def span_request(xfer: int, first: int, stop: int, terms: SpanTerms, token: bytes | None, now: float) -> bytes:
    """The span fetch for messages [first, stop): to a peer with its ``token``; to the source, with
    digests if verify="all"."""
    inline = terms.inline and token is None and terms.algorithm is not None
    verify = [terms.algorithm.name] if inline and terms.algorithm is not None else []
    return fetch_request(
        xfer,
        terms.step,
        terms.deadline,
        now,
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
    return fetch_request(
        xfer, step, deadline, now, 1, span=(first, stop), stage=stage, verify=[algorithm.name], digests_only=True
    )
