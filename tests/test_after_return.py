"""A swarm member serving on after its receive returned (``relay_after_return``), and what stops it.

On loopback, with receivers slowed down (a progress callback that sleeps per data message) so that one
finishes while another still fetches, as replicas on faster and slower links do.
"""

from __future__ import annotations

import functools
import gc
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from zmqtransport import ZMQTransport, relayed

from .conftest import TIMEOUT
from .test_relay import fetch_all, once_a_member, same, slow, state


@pytest.fixture(autouse=True)
def relay_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relayed, "RELAY_LOOPBACK", True)  # every receiver here is on loopback


def serving(transport: ZMQTransport[Any]) -> bool:
    """Whether a finished receive of ``transport`` still serves the others."""
    return transport._after_return.duty is not None


def relays_registered(transport: ZMQTransport[Any]) -> int:
    return len(transport._server._scheduler.relaying.steps)


def early_and_late(make_transport: Any, **early_options: Any) -> tuple[ZMQTransport[Any], list[Any], int, int]:
    """A source, a fast receiver and a slow one; returns the fast one, both results, and what the fast one
    had uploaded when its receive returned and when the slow one's did."""
    sender = make_transport(checksum=True)
    early = make_transport(progress=slow(0.001), **early_options)
    late = make_transport(progress=slow(0.03))
    want = state(16)
    sender.send_checkpoint([1, 2], 1, want, TIMEOUT)
    at_return: list[int] = []
    results: list[Any] = [None, None]

    def fetch_early() -> None:
        results[0] = early.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)
        at_return.append(early.sent_bytes)

    fetch_late = functools.partial(late.recv_checkpoint, 0, sender.metadata(), 1, TIMEOUT)
    results[1] = once_a_member(sender, fetch_early, fetch_late)
    assert same(results[0], want) and same(results[1], want)
    return early, results, at_return[0], early.sent_bytes


def test_a_member_that_finished_first_serves_the_late_one_after_its_receive_returned(make_transport: Any) -> None:
    # Up to three rounds: under load the late one may have been served all it needed before the early one
    # returned. Before relay_after_return, a member stopped serving as its receive returned: no round
    # could upload anything after it.
    for _ in range(3):
        early, _, at_return, at_end = early_and_late(make_transport)
        assert serving(early)  # until its disallow_checkpoint, send, receive or shutdown
        if at_end > at_return:
            break
    else:
        pytest.fail("in three rounds the early member uploaded nothing after its receive returned")
    early.disallow_checkpoint()
    assert not serving(early) and relays_registered(early) == 0


def test_relay_after_return_false_stops_serving_before_the_receive_returns(make_transport: Any) -> None:
    early, _, at_return, at_end = early_and_late(make_transport, relay_after_return=False)
    assert not serving(early) and relays_registered(early) == 0
    assert at_end == at_return


@pytest.mark.parametrize("then", ["recv", "send", "shutdown"])
def test_the_next_receive_send_or_shutdown_stops_a_member_serving_after_its_receive(
    make_transport: Any, then: str
) -> None:
    sender = make_transport(checksum=True)
    receivers = [make_transport(progress=slow(0.002)) for _ in range(2)]
    want = state(8)
    sender.send_checkpoint([1, 2], 1, want, TIMEOUT)
    results = fetch_all(receivers, sender.metadata(), 1)
    assert all(same(got, want) for got in results), results
    member = next(r for r in receivers if serving(r))
    first = member._after_return.duty
    assert first is not None
    if then == "recv":
        sender.send_checkpoint([1], 2, state(1, seed=2), TIMEOUT)
        member.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)  # a swarm of one: it may serve that one on
    elif then == "send":
        member.send_checkpoint([3], 5, state(1, seed=3), TIMEOUT)
    else:
        member.shutdown()
    assert first.stopped and first.relayed.token not in member._server._scheduler.relaying.steps
    assert member._after_return.duty is not first


def test_a_member_stops_serving_at_its_receives_deadline(make_transport: Any) -> None:
    sender = make_transport(checksum=True)
    receivers = [make_transport(progress=slow(0.002)) for _ in range(2)]
    want = state(8)
    sender.send_checkpoint([1, 2], 1, want, TIMEOUT)
    started = time.monotonic()
    results = fetch_all(receivers, sender.metadata(), 1, timeout=timedelta(seconds=4))
    assert all(same(got, want) for got in results), results
    assert any(serving(r) for r in receivers)
    # AfterReturn.stop lets go of the duty before it stops it (outside its lock): the duty's
    # registration goes a moment after serving() turns False (CI once read it in between).
    while (
        any(serving(r) or relays_registered(r) for r in receivers) and time.monotonic() < started + 15
    ):
        time.sleep(0.05)
    assert time.monotonic() - started >= 3.9  # not before the deadline ...
    assert not any(serving(r) for r in receivers)  # ... but at it
    assert all(relays_registered(r) == 0 for r in receivers)


def test_a_receive_in_place_never_serves_after_it_returns(make_transport: Any) -> None:
    sender = make_transport(checksum=True)
    mine = [state(8, seed=5), state(8, seed=6)]
    receivers = [make_transport(progress=slow(0.002), state_dict=lambda m=m: m) for m in mine]
    want = state(8)
    sender.send_checkpoint([1, 2], 1, want, TIMEOUT)
    results = fetch_all(receivers, sender.metadata(), 1)
    assert all(same(got, want) for got in results), results
    assert all(got["w"] is m["w"] for got, m in zip(results, mine, strict=True))  # in place
    assert not any(serving(r) for r in receivers)
    assert all(relays_registered(r) == 0 for r in receivers)


def test_the_memory_a_member_serves_after_returning_outlives_the_callers_tensors(make_transport: Any) -> None:
    sender = make_transport(checksum=True)
    receivers = [make_transport(progress=slow(0.002)) for _ in range(2)]
    want = state(8)
    sender.send_checkpoint([1, 2], 1, want, TIMEOUT)
    results = fetch_all(receivers, sender.metadata(), 1)
    member = next(i for i, r in enumerate(receivers) if serving(r))
    duty = receivers[member]._after_return.duty
    assert duty is not None
    results[member] = None  # the caller drops what it received: the member's memory stays its own
    gc.collect()
    views = duty.relayed.views
    assert views is not None and bytes(views[0][:16]) == bytes(want["w"].view(torch.uint8)[:16].tolist())
    receivers[member].disallow_checkpoint()
    assert not serving(receivers[member])
