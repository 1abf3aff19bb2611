"""Shared fixtures: transports that are always shut down, and a default timeout."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from zmqtransport import RemoteError, ZMQTransport, wire

TIMEOUT = timedelta(seconds=20)

# torchft sets up its Rust logging on first import; keep its INFO lines out of test output.
os.environ.setdefault("RUST_LOG", "warn")


@pytest.fixture
def make_transport() -> Iterator[Callable[..., ZMQTransport[Any]]]:
    """Build transports bound to loopback; all are shut down when the test ends."""
    made: list[ZMQTransport[Any]] = []

    def make(**options: Any) -> ZMQTransport[Any]:
        options.setdefault("bind_host", "127.0.0.1")
        transport: ZMQTransport[Any] = ZMQTransport(options.pop("timeout", TIMEOUT), **options)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.shutdown()


def fetch_racing_disallow(
    sender: ZMQTransport[Any],
    receivers: list[ZMQTransport[Any]],
    step: int,
    after_disallow: Callable[[], None],
) -> list[Any]:
    """Start every receiver fetching ``step``, disallow mid-transfer, then run
    ``after_disallow`` (which typically mutates the staged tensors).

    Returns each receiver's outcome: the state it got, or the ``disallowed``
    RemoteError. A receiver must never get a mix of old and mutated bytes.
    """
    outcomes: list[Any] = []

    def fetch(receiver: ZMQTransport[Any]) -> None:
        try:
            outcomes.append(receiver.recv_checkpoint(0, sender.metadata(), step, TIMEOUT))
        except RemoteError as exc:
            assert exc.code == wire.ERR_DISALLOWED, exc
            outcomes.append(exc)

    threads = [threading.Thread(target=fetch, args=(receiver,)) for receiver in receivers]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    sender.disallow_checkpoint()
    after_disallow()
    for thread in threads:
        thread.join(60)
    assert len(outcomes) == len(receivers), "a receiver neither finished nor failed"
    return outcomes
