"""The source's rule for whether a swarm pays (serve/uplink.py), and the scheduler's use of it."""

from __future__ import annotations

import msgpack
import pytest

from zmqtransport import wire
from zmqtransport.codec.tensors import EncodedTree
from zmqtransport.errors import ProtocolError
from zmqtransport.serve.actions import Have, SendHeader
from zmqtransport.serve.scheduler import Scheduler
from zmqtransport.serve.staged import Staged
from zmqtransport.serve.uplink import IDLE_GAP, MIN_BYTES, SWARM_PER_RECEIVER, LinkReading, Uplink

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
        (3 * SWARM_PER_RECEIVER * 0.9, True),
        (3 * SWARM_PER_RECEIVER * 1.1, False),
        (0.8e9, False),  # unshaped: the CPUs, not the uplink, bound the receivers
    ],
)
def test_the_swarm_pays_where_the_uplink_carries_less_than_the_bound(rate: float, pays: bool) -> None:
    uplink = Uplink()
    feed(uplink, rate, 4 * MIN_BYTES)
    assert uplink.rate == pytest.approx(rate, rel=0.01)
    assert uplink.swarm_pays(3) is pays


@pytest.mark.parametrize(
    ("receivers", "pays"),
    [(0, False), (1, False), (3, False), (6, False), (7, True), (16, True), (64, True)],
)
def test_a_fast_uplink_that_many_receivers_share_still_bounds_them(receivers: int, pays: bool) -> None:
    # 10 Gbit/s: up to six receivers are fed faster than members relay; seven or more each get a share
    # under what a member carries, and a swarm pays (docs/sim.md, "Fast uplinks and many receivers").
    uplink = Uplink()
    feed(uplink, 1.25e9, 4 * MIN_BYTES)
    assert uplink.rate == pytest.approx(1.25e9, rel=0.01)
    assert uplink.swarm_pays(receivers) is pays
    assert uplink.bound(receivers) == max(1, receivers) * SWARM_PER_RECEIVER


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
    assert uplink.rate is None and uplink.judged_rate == pytest.approx(1e9, rel=0.01)
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
    scheduler.uplink.judged_rate = 50e6 if link_bound else 1e9  # as a measured step left it
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


@pytest.mark.parametrize("told", [0, 16])
def test_the_source_counts_the_receivers_it_was_told_of_or_the_hosts_that_asked(told: int) -> None:
    # A 10 Gbit/s uplink: a swarm pays from 7 receivers (1.4 GB/s at 200 MB/s each) on.
    scheduler = Scheduler(TIMEOUT)
    step = staged()
    step.receivers = told  # torchft's dst_ranks, as send_checkpoint passes their number
    scheduler.stage(step, 1000.0)
    scheduler.uplink.judged_rate = 1.25e9
    headers = [offer(scheduler, f"r{i}".encode(), f"10.0.0.{i}") for i in range(1, 9)]
    joined = [header.relay is not None for header in headers]
    if told:
        assert joined == [True] * 8
    else:
        # The first six are served directly; the seventh host to ask makes it seven, and a swarm pays.
        assert joined == [False] * 6 + [True] * 2
        assert [h.header_only for h in headers] == joined


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


# ----------------------------------------------------------------------------- the kernel's measure (TCP_INFO)


def read_links(uplink: Uplink, readings: int, rates: list[float], acked_per_reading: int = 4 * MIB) -> None:
    """``readings`` readings of ``len(rates)`` connections that each carried ``acked_per_reading`` since
    the reading before, the kernel estimating the delivery rates ``rates`` (a baseline reading first)."""
    for tick in range(readings + 1):
        uplink.links({fd: LinkReading(tick * acked_per_reading, rate) for fd, rate in enumerate(rates)})


# Readings of the source's connections in the lab while a swarm of three ran (docs/fast-links.md, "The
# kernel's view"), in round numbers: at 400 Mbit/s each connection delivers a third of the uplink's
# 50 MB/s; unshaped with the machine loaded, a flight crosses the veth at GB/s, though the members'
# CPUs hold the swarm's cadence under the bound.
SHAPED = [16e6, 16e6, 17e6]
UNSHAPED_LOADED = [0.9e9, 1.4e9, 0.6e9]


def test_the_kernel_tells_a_link_bound_uplink_from_cpu_bound_receivers_where_the_cadence_cannot() -> None:
    shaped, fast = Uplink(), Uplink()
    feed(shaped, 48e6, 4 * MIN_BYTES)
    feed(fast, 114e6, 4 * MIN_BYTES)  # what the cadence measured of such a swarm: under the bound
    assert fast.cadence_rate is not None and fast.cadence_rate < SWARM_PER_RECEIVER
    read_links(shaped, 10, SHAPED)
    read_links(fast, 10, UNSHAPED_LOADED)
    # Connections that share the uplink at once each see their share: summed, they give the uplink's rate.
    assert shaped.link_rate == pytest.approx(49e6)
    assert shaped.swarm_pays(3)
    assert fast.link_rate == pytest.approx(2.9e9)
    assert not fast.swarm_pays(3)


def test_flights_too_small_to_fill_the_path_say_nothing_of_it() -> None:
    uplink = Uplink()
    read_links(uplink, 12, SHAPED)
    # tbf lets a small flight through at line rate: the kernel marks such samples application-limited.
    for _ in range(20):
        uplink.links({0: LinkReading(uplink._links[0].acked + MIB, 2.4e9, app_limited=True)})
    assert uplink.link_rate == pytest.approx(49e6)
    assert uplink.swarm_pays()


def test_a_few_fast_readings_do_not_make_a_slow_link_fast() -> None:
    uplink = Uplink()
    read_links(uplink, 12, SHAPED)
    for _ in range(3):  # fewer than a quarter of the readings
        uplink.links({0: LinkReading(uplink._links[0].acked + MIB, 2.4e9)})
    assert uplink.link_rate is not None and uplink.link_rate < 60e6
    assert uplink.swarm_pays()


def test_connections_that_carried_no_data_since_their_reading_before_do_not_count() -> None:
    uplink = Uplink()
    # Connection 1 carries the data at 45 MB/s; 2 carried a digest answer (a small flight's rate).
    for tick in range(8):
        uplink.links({1: LinkReading(tick * 8 * MIB, 45e6), 2: LinkReading(tick * 1000, 400e6)})
    assert uplink.link_rate == pytest.approx(45e6)


def test_the_kernels_measure_once_believed_judges_before_the_cadence() -> None:
    uplink = Uplink()
    feed(uplink, 100e6, 4 * MIN_BYTES)  # the cadence alone engages the swarm
    uplink.links({3: LinkReading(0, 0.0)})  # a baseline: nothing measured by the kernel yet
    assert uplink.rate == pytest.approx(100e6)
    assert uplink.swarm_pays()
    read_links(uplink, 8, [2e9])
    assert uplink.rate == pytest.approx(2e9)
    assert not uplink.swarm_pays()


def test_too_few_readings_or_bytes_keep_the_last_judgement_and_a_new_step_measures_afresh() -> None:
    uplink = Uplink()
    read_links(uplink, 10, SHAPED)
    uplink.new_step()
    assert uplink.judged_rate == pytest.approx(49e6) and uplink.measured[0] == pytest.approx(49e6)
    assert uplink.link_rates == [] and uplink.link_bytes == 0
    read_links(uplink, 2, [5e9], acked_per_reading=MIN_BYTES)  # enough bytes, too few readings
    assert uplink.link_rate is None and uplink.swarm_pays()
    uplink.new_step()
    read_links(uplink, 6, [5e9], acked_per_reading=MIB)  # enough readings, too few bytes
    assert uplink.link_rate is None and uplink.swarm_pays()


def test_a_reused_descriptor_starts_a_new_baseline() -> None:
    uplink = Uplink()
    uplink.links({5: LinkReading(500 * MIB, 1e9)})  # a connection of an earlier step
    uplink.links({5: LinkReading(10 * MIB, 40e6)})  # closed; a new one got its descriptor
    assert uplink.link_bytes == 0 and uplink.link_rates == []
    uplink.links({5: LinkReading(20 * MIB, 40e6)})
    assert uplink.link_bytes == 10 * MIB and uplink.link_rates == [40e6]


def test_a_connection_read_only_now_and_then_is_counted_from_its_reading_before() -> None:
    uplink = Uplink()
    uplink.links({1: LinkReading(0, 0.0), 2: LinkReading(0, 0.0)})
    uplink.links({1: LinkReading(50 * MIB, 30e6)})  # connection 2 had no transfer running
    uplink.links({1: LinkReading(100 * MIB, 20e6), 2: LinkReading(100 * MIB, 25e6)})
    assert uplink.link_bytes == 200 * MIB
    assert uplink.link_rates == [30e6, 45e6]


# ----------------------------------------------------------------------------- stepping aside within a step


def ask(scheduler: Scheduler, peer: bytes, header: SendHeader, host: str, now: float, claim: int = 0) -> Have:
    """The member ``header`` made asks the source, with its own token, who the others are (and to claim)."""
    assert header.relay is not None
    request = wire.Request(wire.OP_HAVE, 9, stage=header.stage_id, token=header.relay.token, claim=claim)
    (answer,) = scheduler.on_request(peer, request, host, now)
    assert isinstance(answer, Have)
    return answer


@pytest.mark.parametrize("rates", [SHAPED, UNSHAPED_LOADED], ids=["400mbit", "unshaped"])
def test_members_made_before_anything_was_measured_fetch_alone_once_the_step_measures_a_fast_uplink(
    rates: list[float],
) -> None:
    """A job's first step: every receiver asks at once, nothing is measured, all are made members. Where
    the step's own measure then shows an uplink that feeds them faster than they relay, the source tells
    each member, in its next answer, to fetch the rest from it alone: no members named, nothing claimed,
    and first copies no longer go first. Before 2026-12-06 the first step stayed a swarm to its end."""
    scheduler = Scheduler(TIMEOUT)
    step = staged()
    step.receivers = 3
    scheduler.stage(step, 1000.0)
    headers = [offer(scheduler, f"r{i}".encode(), f"10.0.0.{i}") for i in (1, 2, 3)]
    assert all(h.relay is not None and h.header_only for h in headers)  # nothing measured: members
    before = ask(scheduler, b"r1", headers[0], "10.0.0.1", 1000.0, claim=4)
    assert not before.alone and len(before.peers) == 2 and before.claimed == (0, 4)
    read_links(scheduler.uplink, 4, rates, acked_per_reading=MIN_BYTES // 2)  # the step measured
    answer = ask(scheduler, b"r2", headers[1], "10.0.0.2", 1000.1, claim=4)
    spans = [fetch(xfer=10 + i, span=(first, 8), stage=step.stage_id) for i, first in enumerate((0, 4))]
    for peer, request in zip((b"r1", b"r2"), spans, strict=True):
        assert scheduler.on_request(peer, request, "10.0.0.1", 1000.1) == []
    ready = list(scheduler.transfers.values())
    scheduler.swarm.sent = 1  # message 0 went out once: the first transfer's next is a second copy
    if rates is SHAPED:  # 50 MB/s for three: the uplink bounds them, the swarm stays
        assert not answer.alone and len(answer.peers) == 2 and answer.claimed == (4, 8)
        assert scheduler.swarm.first_copies(ready, step) == ready[1:]
    else:
        assert answer.alone and answer.peers == () and answer.claimed is None
        assert scheduler.swarm.first_copies(ready, step) == ready
        # It stays aside for the step (its members dropped their peers), and a new step starts afresh.
        assert ask(scheduler, b"r1", headers[0], "10.0.0.1", 1002.0).alone
        scheduler.stage(staged(), 1003.0)
        assert not scheduler.swarm.aside


def test_an_alone_answer_round_trips_and_anything_but_a_boolean_is_refused() -> None:
    assert wire.decode_reply(wire.have_reply(7, None, 12, alone=True), False, "x").alone
    assert not wire.decode_reply(wire.have_reply(7, None, 12), False, "x").alone
    for value in (1, "yes", None, [True]):
        message = {"v": wire.PROTOCOL_VERSION, "op": wire.OP_HAVE, "id": 1, "alone": value}
        with pytest.raises(ProtocolError, match="alone"):
            wire.decode_reply(msgpack.packb(message), False, "the peer")


@pytest.mark.parametrize("told", [0, 1])
def test_a_step_told_one_receiver_serves_it_directly_until_another_host_asks(told: int) -> None:
    """A swarm of one relays to nobody: the one receiver a step's sender named (torchft's dst_ranks: the
    replica group healing) is served directly, measured or not; a host beyond the one told joins a swarm
    as before. Not told how many (0), the first to ask is made a member, as before."""
    scheduler = Scheduler(TIMEOUT)
    step = staged()
    step.receivers = told
    scheduler.stage(step, 1000.0)
    first = offer(scheduler, b"a", "10.0.0.1")
    second = offer(scheduler, b"b", "10.0.0.2")
    if told:
        assert first.relay is None and not first.header_only
    else:
        assert first.relay is not None and first.header_only
    assert second.relay is not None and second.header_only


def test_members_made_on_an_earlier_steps_measure_stay_members_whatever_this_step_reads() -> None:
    """Only a judgement made blind is revised within the step: members made because a measured step said a
    swarm pays stay members, even where a few of this step's readings look fast (over tbf at 2 Gbit/s a
    swarm's readings scatter to tens of GB/s: docs/sim.md, "Fast uplinks and many receivers")."""
    scheduler = Scheduler(TIMEOUT)
    scheduler.uplink.judged_rate = 50e6  # as a measured step left it: link-bound
    step = staged()
    step.receivers = 3
    scheduler.stage(step, 1000.0)
    assert not scheduler.uplink.blind
    headers = [offer(scheduler, f"r{i}".encode(), f"10.0.0.{i}") for i in (1, 2, 3)]
    read_links(scheduler.uplink, 4, UNSHAPED_LOADED, acked_per_reading=MIN_BYTES // 2)
    answer = ask(scheduler, b"r1", headers[0], "10.0.0.1", 1000.1, claim=4)
    assert not answer.alone and len(answer.peers) == 2 and answer.claimed == (0, 4)
    # The next step follows this one's measure, as before: served directly.
    scheduler.stage(staged(), 1001.0)
    assert not scheduler.uplink.swarm_pays(3)
