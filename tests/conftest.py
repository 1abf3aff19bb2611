"""Shared fixtures: transports that are always shut down, and a default timeout."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

from zmqtransport import ZMQTransport

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
