"""The source's rule for whether a swarm pays (serve/uplink.py), and the scheduler's use of it."""

from __future__ import annotations

import pytest

from zmqtransport import wire
from zmqtransport.codec.tensors import EncodedTree
from zmqtransport.serve.actions import SendHeader
from zmqtransport.serve.scheduler import Scheduler
from zmqtransport.serve.staged import Staged
from zmqtransport.serve.uplink import IDLE_GAP, MIN_BYTES, SWARM_BELOW, Uplink

from .test_scheduler import STEP, TIMEOUT, credit, fetch, staged

MIB = 1 << 20


def feed(uplink: Uplink, rate: float, nbytes: int, now: float = 0.0, batch: int = 8) -> float:
    """Requests, each for ``batch`` MiB, as an uplink carrying ``rate`` bytes/s delivers them;
    libzmq takes each batch at once."""
    for _ in range(nbytes // (batch * MIB)):
        uplink.requested(now)
        uplink.sent(batch * MIB)
        now += batch * MIB / rate
    uplink.requested(now)
    return now


def test_nothing_measured_the_swarm_engages() -> None:
    assert Uplink().swarm_pays()


@pytest.mark.parametrize(
    ("rate", "pays"),
    [
        (400e6 / 8, True),  # a 400 Mbit/s uplink, however many receivers share it
        (2 * 400e6 / 8, True),  # two such NICs
        (SWARM_BELOW * 0.9, True),
        (SWARM_BELOW * 1.1, False),
        (0.8e9, False),  # unshaped: the CPUs, not the uplink, bound the receivers
    ],
)
def test_the_swarm_pays_where_the_uplink_carries_less_than_the_bound(rate: float, pays: bool) -> None:
    uplink = Uplink()
    feed(uplink, rate, 4 * MIN_BYTES)
    assert uplink.rate == pytest.approx(rate, rel=0.01)
    assert uplink.swarm_pays() is pays


def test_what_libzmq_takes_at_once_counts_only_once_the_next_request_pays_for_it_in_time() -> None:
    uplink = Uplink()
    uplink.requested(0.0)
    uplink.sent(MIN_BYTES)  # a burst into libzmq: no time has passed
    assert uplink.rate is None
    uplink.requested(MIN_BYTES / 50e6)  # the receiver asks again once it landed: 50 MB/s
    assert uplink.rate == pytest.approx(50e6)


def test_idle_time_is_not_counted() -> None:
    uplink = Uplink()
    now = feed(uplink, 1e9, 2 * MIN_BYTES)
    uplink.sent(MIN_BYTES)  # sent into libzmq, then nobody asked for a while
    feed(uplink, 1e9, 2 * MIN_BYTES, now + 10 * IDLE_GAP)
    assert uplink.rate == pytest.approx(1e9, rel=0.01)


def test_too_little_measured_keeps_the_last_judgement() -> None:
    uplink = Uplink()
    feed(uplink, 1e9, 4 * MIN_BYTES)
    uplink.new_step()  # settles: not link-bound
    assert uplink.rate is None and uplink.judged is False
    feed(uplink, 1e6, MIN_BYTES // 2)  # the next step, too little so far
    assert not uplink.swarm_pays()
    feed(uplink, 10e6, 2 * MIN_BYTES, 100.0)  # then measured link-bound
    assert uplink.swarm_pays()


def offer(scheduler: Scheduler, peer: bytes, host: str, xfer: int = 1) -> SendHeader:
    request = fetch(xfer=xfer, relay=f"tcp://{host}:1", verify=("sha256",))
    (header,) = scheduler.on_request(peer, request, host, 1000.0)
    assert isinstance(header, SendHeader)
    return header


@pytest.mark.parametrize("link_bound", [True, False])
def test_receivers_that_offer_to_relay_join_a_swarm_only_where_it_pays(link_bound: bool) -> None:
    scheduler = Scheduler(TIMEOUT)
    scheduler.stage(staged(), 1000.0)
    scheduler.uplink.judged = link_bound  # as a measured step left it
    first = offer(scheduler, b"a", "10.0.0.1")
    second = offer(scheduler, b"b", "10.0.0.2")
    if link_bound:
        # Members: the header alone, then spans from the source and the members they are named.
        assert first.relay is not None and first.header_only
        assert second.relay is not None and second.header_only
        assert second.relay.peers == (("tcp://10.0.0.1:1", first.relay.token),)
    else:
        # Served directly: the data follows the header, and nobody is a member.
        assert first.relay is None and not first.header_only
        assert second.relay is None and not second.header_only
        assert scheduler.swarm.members == []


def test_the_source_measures_its_steps_by_what_receivers_ask_for() -> None:
    scheduler = Scheduler(TIMEOUT)
    messages = 2 * MIN_BYTES // MIB
    plan = [[wire.Piece(0, i * MIB, MIB)] for i in range(messages)]
    scheduler.stage(Staged(STEP, b"header-body", EncodedTree(skeleton=None, has_pickle=False), plan, None), 0.0)
    scheduler.on_request(b"a", fetch(credit=16), "10.0.0.1", 0.0)
    now = 0.0
    for _ in range(messages // 8):
        for transfer in scheduler.next_round() * 8:
            scheduler.sent(transfer, now)
        now += 8 * MIB / 100e6  # 8 MiB land at 100 MB/s: the receiver grants credit for them
        scheduler.on_request(b"a", credit(1, 8), "10.0.0.1", now)
    assert scheduler.uplink.rate == pytest.approx(100e6, rel=0.15)
    assert scheduler.uplink.swarm_pays()
