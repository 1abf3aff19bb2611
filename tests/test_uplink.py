"""The source's rule for whether a swarm pays (serve/uplink.py), and the scheduler's use of it."""

from __future__ import annotations

import pytest

from zmqtransport import wire
from zmqtransport.codec.tensors import EncodedTree
from zmqtransport.serve.actions import SendHeader
from zmqtransport.serve.scheduler import Scheduler
from zmqtransport.serve.staged import Staged
from zmqtransport.serve.uplink import IDLE_GAP, MIN_BYTES, SWARM_BELOW, WARMUP, Uplink

from .test_scheduler import STEP, TIMEOUT, fetch, staged

MIB = 1 << 20


def feed(uplink: Uplink, rate_per_receiver: float, receivers: int, nbytes: int, now: float = 0.0) -> float:
    """Messages of 1 MiB from ``receivers`` receivers' transfers, each fed at ``rate_per_receiver``."""
    gap = MIB / (rate_per_receiver * receivers)
    for _ in range(nbytes // MIB):
        now += gap
        uplink.sent(MIB, receivers, now)
    return now


def test_nothing_measured_the_swarm_engages() -> None:
    assert Uplink().swarm_pays()


@pytest.mark.parametrize(
    ("rate", "receivers", "pays"),
    [
        (400e6 / 8 / 3, 3, True),  # a 400 Mbit/s uplink shared by three receivers
        (400e6 / 8, 1, True),  # all of it to one
        (SWARM_BELOW * 0.9, 2, True),
        (SWARM_BELOW * 1.1, 2, False),
        (1.5e9 / 3, 3, False),  # an unshaped link: the CPUs, not the uplink, bound the receivers
    ],
)
def test_the_swarm_pays_where_the_uplink_gives_each_receiver_less_than_the_bound(
    rate: float, receivers: int, pays: bool
) -> None:
    uplink = Uplink()
    feed(uplink, rate, receivers, WARMUP + 16 * MIN_BYTES)
    assert uplink.rate == pytest.approx(rate, rel=0.05)
    assert uplink.swarm_pays() is pays


def test_the_warm_up_burst_is_not_measured() -> None:
    # Credit windows go into libzmq at once: far faster than the link carries them.
    uplink = Uplink()
    now = feed(uplink, 10e9, 1, WARMUP)
    assert uplink.rate is None
    feed(uplink, 20e6, 1, 2 * MIN_BYTES, now)
    assert uplink.rate == pytest.approx(20e6, rel=0.05)
    assert uplink.swarm_pays()


def test_idle_time_is_not_counted() -> None:
    uplink = Uplink()
    now = feed(uplink, 1e9, 1, WARMUP + 8 * MIN_BYTES)
    now = feed(uplink, 1e9, 1, 8 * MIN_BYTES, now + 10 * IDLE_GAP)  # nobody asked for a while
    assert uplink.rate == pytest.approx(1e9, rel=0.05)


def test_time_between_spans_is_not_counted() -> None:
    # A swarm member fetches a span from the source, then from its peers for a while: the source
    # delivers the span at its uplink's rate, and had nothing to send it meanwhile.
    uplink = Uplink()
    now, span = 0.0, 4
    for _ in range((WARMUP + 16 * MIN_BYTES) // MIB // span):
        for message in range(span):
            now += MIB / 1e9
            uplink.sent(MIB, 0 if message == span - 1 else 1, now)
        now += 0.1  # busy with its peers (counted, the rate would be 40 MB/s)
    rate = uplink.rate
    assert rate is not None and rate > 0.9e9  # (a span's first message counts no time)
    assert not uplink.swarm_pays()


def test_too_little_measured_keeps_the_last_judgement() -> None:
    uplink = Uplink()
    feed(uplink, 1e9, 3, WARMUP + 32 * MIN_BYTES)
    uplink.new_step()  # settles: not link-bound
    assert uplink.rate is None and uplink.judged is False
    feed(uplink, 1e6, 3, WARMUP)  # the next step, only its warm-up so far
    assert not uplink.swarm_pays()
    feed(uplink, 10e6, 3, 2 * MIN_BYTES, 1e6)  # then measured link-bound
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
    feed(scheduler.uplink, 20e6 if link_bound else 1e9, 2, WARMUP + 16 * MIN_BYTES)
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


def test_the_source_measures_what_it_sends_of_its_own_steps() -> None:
    scheduler = Scheduler(TIMEOUT)
    messages = (WARMUP + 2 * MIN_BYTES) // MIB
    plan = [[wire.Piece(0, i * MIB, MIB)] for i in range(messages)]
    scheduler.stage(Staged(STEP, b"header-body", EncodedTree(skeleton=None, has_pickle=False), plan, None), 0.0)
    scheduler.on_request(b"a", fetch(credit=messages), "10.0.0.1", 0.0)
    now = 0.0
    for transfer in scheduler.next_round() * messages:
        now += 0.01  # 1 MiB per 10 ms: 105 MB/s
        scheduler.sent(transfer, now)
    assert scheduler.uplink.rate == pytest.approx(MIB / 0.01, rel=0.05)
