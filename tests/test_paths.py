"""Several paths (issue 12, items 1 and 4): listening on several addresses, advertising them, choosing one.

Loopback stands in for several NICs: every 127.x.y.z address is local on
Linux, so a source bound on 127.0.0.1 only makes 127.0.0.3 a path that refuses
(an address of this host with nobody listening). The lab test at the end
(root and iproute2 only) takes a real NIC's link down instead.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qsl

import pytest
import torch
import zmq

from zmqtransport import BindError, ZMQTransport, sockets
from zmqtransport import lab as lab_module
from zmqtransport.fetch import racing
from zmqtransport.net import ADVERTISE_ENV, Path, PeerAddress, advertised_paths, parse_metadata, split_hosts
from zmqtransport.serve.router import Router

from .conftest import assert_same, lab_python
from .test_failfast import NOT_LOCAL, _wait_for, call_bounded, expect_error, new_context, nothing_left  # noqa: F401

pytestmark = pytest.mark.timeout(120)

LOOPBACK = "127.0.0.1"
LOOPBACK_2 = "127.0.0.2"
REFUSING = "127.0.0.3"  # local, but nothing of the source listens there
TIMEOUT = timedelta(seconds=20)
SHORT = timedelta(seconds=2)
KEY = "rq:ykFG8l{3hWT&Mx=CZ+$8Tt6^.2N!i5[e3lz0"  # a z85 curve key: '&', '=', '+', '$', ':' and '[' inside


def old_parse(metadata: str) -> tuple[str, int, dict[str, str]]:
    """The metadata parser of releases before paths existed, verbatim in what it accepts."""
    text, _, query = metadata.strip().partition("?")
    assert text.startswith("tcp://")
    host, _, port = text.removeprefix("tcp://").rpartition(":")
    assert ":" not in host and port.isdigit()
    return host, int(port), dict(parse_qsl(query, strict_parsing=True)) if query else {}


@pytest.fixture
def no_advertise_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADVERTISE_ENV, raising=False)


def state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(12)
    return {"w": torch.randn(300_000, generator=generator), "ids": torch.arange(1000), "step": 3}


# ----------------------------------------------------------------------------- the metadata string


def test_several_paths_round_trip_and_start_with_a_plain_endpoint() -> None:
    address = PeerAddress("10.0.0.7", 41231, {"curve": KEY}, (Path("10.1.0.7", 41231), Path("fd00::7", 41999)))
    text = address.to_metadata()
    assert text.startswith("tcp://10.0.0.7:41231?")
    assert "paths=10.1.0.7:41231,[fd00::7]:41999" in text  # readable, not percent-encoded
    assert parse_metadata(text) == address
    assert [path.endpoint for path in address.paths] == [
        "tcp://10.0.0.7:41231",
        "tcp://10.1.0.7:41231",
        "tcp://[fd00::7]:41999",
    ]


def test_an_old_parser_reads_the_first_path_and_keeps_the_curve_key() -> None:
    text = PeerAddress("10.0.0.7", 41231, {"curve": KEY}, (Path("10.1.0.7", 41232),)).to_metadata()
    host, port, params = old_parse(text)
    assert (host, port) == ("10.0.0.7", 41231)
    assert params["curve"] == KEY  # what an old receiver uses; "paths" it ignores


def test_one_path_metadata_is_unchanged() -> None:
    assert parse_metadata("tcp://10.0.0.7:41231") == PeerAddress("10.0.0.7", 41231)
    assert parse_metadata("tcp://10.0.0.7:41231").paths == (Path("10.0.0.7", 41231),)
    # Byte for byte what urlencode made before paths existed.
    from urllib.parse import urlencode

    address = PeerAddress("h", 5, {"curve": KEY})
    assert address.to_metadata() == f"tcp://h:5?{urlencode({'curve': KEY})}"
    assert "paths" not in address.to_metadata()


def test_unknown_parameters_are_kept_and_ignored(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    parsed = parse_metadata("tcp://h:5?future=1&paths=g:6")
    assert parsed.params == {"future": "1"} and parsed.more_paths == (Path("g", 6),)
    source = make_transport(bind_host=LOOPBACK)
    sink = make_transport(bind_host=LOOPBACK)
    sent = state()
    source.send_checkpoint([1], 3, sent, TIMEOUT)
    assert_same(sink.recv_checkpoint(0, source.metadata() + "?from_the_future=yes", 3, TIMEOUT), sent)


@pytest.mark.parametrize(
    "bad", ["tcp://h:5?paths=g", "tcp://h:5?paths=g:5,", "tcp://h:5?paths=g:0", "tcp://h:5?paths=[::1"]
)
def test_malformed_paths_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="bad zmqtransport metadata"):
        parse_metadata(bad)


# ----------------------------------------------------------------------------- host lists


def test_host_lists() -> None:
    assert split_hosts("10.1.0.7, 10.2.0.7", "bind_host") == ["10.1.0.7", "10.2.0.7"]
    assert split_hosts(["10.1.0.7", "::1"], "bind_host") == ["10.1.0.7", "::1"]
    assert split_hosts("*", "bind_host") == ["*"]
    for bad in ([], "a,,b", [3]):
        with pytest.raises(ValueError, match="bind_host="):
            split_hosts(bad, "bind_host")  # type: ignore[arg-type]


@pytest.mark.usefixtures("no_advertise_env")
def test_advertised_paths_follow_the_binds_unless_told(monkeypatch: pytest.MonkeyPatch) -> None:
    bound = [("10.1.0.7", 5000), ("10.2.0.7", 5001)]
    assert advertised_paths(bound) == (Path("10.1.0.7", 5000), Path("10.2.0.7", 5001))
    # As many advertised hosts as binds: the ports follow position.
    assert advertised_paths(bound, "a,b") == (Path("a", 5000), Path("b", 5001))
    # Otherwise every advertised host gets the first port; duplicates are dropped.
    assert advertised_paths(bound[:1], ["a", "b", "a"]) == (Path("a", 5000), Path("b", 5000))
    monkeypatch.setenv(ADVERTISE_ENV, "[fd00::1],c")
    assert advertised_paths(bound) == (Path("fd00::1", 5000), Path("c", 5001))
    assert advertised_paths(bound, "d") == (Path("d", 5000),)  # the option beats the variable


# ----------------------------------------------------------------------------- listening on several addresses


@pytest.mark.usefixtures("no_advertise_env")
def test_bind_list_listens_on_every_address_with_one_port(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    source = make_transport(bind_host=[LOOPBACK, LOOPBACK_2])
    address = source.address
    assert [path.host for path in address.paths] == [LOOPBACK, LOOPBACK_2]
    assert address.paths[0].port == address.paths[1].port
    sink = make_transport(bind_host=LOOPBACK)
    sent = state()
    source.send_checkpoint([1], 3, sent, TIMEOUT)
    for path in address.paths:  # each path alone carries a receive
        only = PeerAddress(path.host, path.port).to_metadata()
        assert_same(sink.recv_checkpoint(0, only, 3, TIMEOUT), sent)
        assert sink.last_recv_stats is not None and sink.last_recv_stats.peer == path.endpoint


@pytest.mark.usefixtures("no_advertise_env")
def test_bind_list_as_string_with_a_fixed_port(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    source = make_transport(bind_host=f"{LOOPBACK},{LOOPBACK_2}", port=port)
    assert source.address.paths == (Path(LOOPBACK, port), Path(LOOPBACK_2, port))


@pytest.mark.usefixtures("nothing_left")
def test_port_taken_on_a_later_address_falls_back_to_a_free_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """port=0: the later address tries the first one's port and takes a free one where that is taken."""
    with socket.socket() as holder:
        holder.bind((LOOPBACK_2, 0))
        holder.listen()
        taken = holder.getsockname()[1]
        real_bind = sockets.bind
        # Steer the first bind (port=0) onto the port that is taken on the second address.
        monkeypatch.setattr(sockets, "bind", lambda s, h, p: real_bind(s, h, taken if h == LOOPBACK else p))
        context = new_context()
        router = context.socket(zmq.ROUTER)
        ports, error, _ = call_bounded(lambda: sockets.bind_all(router, [LOOPBACK, LOOPBACK_2], 0))
        assert error is None
        assert ports[0] == taken and ports[1] not in (0, taken)
        router.close(linger=0)
        assert sockets.terminate(context)


def _bindable(host: str, port: int) -> bool:
    """Whether a listener could bind ``host:port`` now (SO_REUSEADDR, as libzmq binds)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


@pytest.fixture
def busy_port_2() -> Iterator[int]:
    """A port some other socket listens on at 127.0.0.2 (and that is free on 127.0.0.1)."""
    for _ in range(20):  # the port picked on 127.0.0.2 can be some other process's listener on 127.0.0.1
        with socket.socket() as holder:
            holder.bind((LOOPBACK_2, 0))
            holder.listen()
            if _bindable(LOOPBACK, holder.getsockname()[1]):
                yield holder.getsockname()[1]
                return
    raise RuntimeError("no port free on 127.0.0.1 among 20 taken on 127.0.0.2")


@pytest.mark.usefixtures("nothing_left")
def test_failure_on_the_second_address_releases_the_first(busy_port_2: int) -> None:
    error = expect_error(lambda: ZMQTransport(SHORT, bind_host=[LOOPBACK, LOOPBACK_2], port=busy_port_2), BindError)
    assert error.errno == errno.EADDRINUSE
    assert f"port={busy_port_2} is already in use on bind_host={LOOPBACK_2!r}" in str(error)
    # The first address was bound, then released with the socket: it can be bound again at once.
    with ZMQTransport(SHORT, bind_host=LOOPBACK, port=busy_port_2) as again:
        assert again.address.port == busy_port_2


@pytest.mark.usefixtures("nothing_left")
def test_second_address_not_on_this_host_is_named() -> None:
    error = expect_error(lambda: ZMQTransport(SHORT, bind_host=[LOOPBACK, NOT_LOCAL]), BindError)
    assert str(error) == f"bind_host={NOT_LOCAL!r}: not an address of this host"


@pytest.mark.usefixtures("nothing_left")
def test_rebind_listens_on_every_address_again() -> None:
    context = new_context()
    router = Router(context, [LOOPBACK, LOOPBACK_2], 0, None)
    try:
        router.rebind()
        for host, port in router.bound:
            socket.create_connection((host, port), timeout=5).close()
    finally:
        router.close()
    assert sockets.terminate(context)


@pytest.mark.usefixtures("no_advertise_env")
def test_advertise_list_from_the_option_and_the_variable(
    make_transport: Callable[..., ZMQTransport[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = make_transport(bind_host=LOOPBACK, advertise_host="10.1.0.7,10.2.0.7")
    port = source.address.port
    assert source.metadata() == f"tcp://10.1.0.7:{port}?paths=10.2.0.7:{port}"
    monkeypatch.setenv(ADVERTISE_ENV, "10.1.0.8, 10.2.0.8")
    source = make_transport(bind_host=LOOPBACK)
    port = source.address.port
    assert source.metadata() == f"tcp://10.1.0.8:{port}?paths=10.2.0.8:{port}"


# ----------------------------------------------------------------------------- choosing a path (pure)


H, R, D = zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_CONNECT_RETRIED, zmq.EVENT_DISCONNECTED


def test_choice_prefers_the_first_path_that_connects_within_the_bound() -> None:
    choice = racing.PathChoice(2, bound=1.0)
    choice.on_event(1, H, now=0.0)
    assert choice.choice(0.5) is None  # path 0 may still come
    choice.on_event(0, H, now=0.6)
    assert choice.choice(0.6) == 0


def test_choice_skips_a_silent_path_after_the_bound() -> None:
    choice = racing.PathChoice(3, bound=1.0)
    choice.on_event(2, H, now=0.2)
    assert choice.wake_at() == 1.2
    assert choice.choice(1.19) is None
    assert choice.choice(1.2) == 2


def test_choice_skips_a_refused_path_at_once_when_the_source_was_listening() -> None:
    choice = racing.PathChoice(2, bound=1.0)
    choice.on_event(0, R, now=0.01)
    choice.on_event(1, H, now=0.02)  # path 1 was never refused: the source listened all along
    assert choice.choice(0.02) == 1


def test_choice_retries_a_path_refused_before_a_late_source_listened() -> None:
    choice = racing.PathChoice(2, bound=1.0)
    choice.on_event(0, R, now=0.1)
    choice.on_event(1, R, now=0.1)
    choice.on_event(1, H, now=2.0)  # the source came up after both were refused
    assert choice.choice(2.0) is None
    choice.on_event(0, H, now=2.1)
    assert choice.choice(2.1) == 0


def test_choice_waits_while_nothing_connects_and_describes_the_paths() -> None:
    choice = racing.PathChoice(2, bound=1.0)
    choice.on_event(0, R, now=0.1)
    choice.on_event(1, H, now=0.2)
    choice.on_event(1, D, now=0.3)
    assert choice.choice(5.0) is None
    described = choice.describe([Path("a", 1), Path("b", 2)])
    assert described == "tcp://a:1 (refused), tcp://b:2 (no answer)"


# ----------------------------------------------------------------------------- choosing a path (transfers)


def fetch_timed(sink: ZMQTransport[Any], metadata: str, timeout: timedelta = TIMEOUT) -> tuple[Any, float]:
    started = time.monotonic()
    got = sink.recv_checkpoint(0, metadata, 3, timeout)
    return got, time.monotonic() - started


def test_a_refusing_first_path_is_skipped(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    source = make_transport(bind_host=LOOPBACK, advertise_host=f"{REFUSING},{LOOPBACK}")
    sink = make_transport(bind_host=LOOPBACK)
    sent = state()
    source.send_checkpoint([1], 3, sent, TIMEOUT)
    for _ in range(3):
        got, seconds = fetch_timed(sink, source.metadata())
        assert_same(got, sent)
        assert (
            sink.last_recv_stats is not None and sink.last_recv_stats.peer == f"tcp://{LOOPBACK}:{source.address.port}"
        )
        # Far from the 20 s timeout: the refused path is not waited on (a bound, not a benchmark).
        assert seconds < TIMEOUT.total_seconds() / 4


def test_a_silent_first_path_costs_at_most_the_connect_bound(
    make_transport: Callable[..., ZMQTransport[Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A path whose connection attempts never fail nor succeed (a dropped link) is given up after the bound."""
    real_choice = racing.PathChoice

    class DeafToPathZero(real_choice):  # type: ignore[misc, valid-type]
        def on_event(self, index: int, event: int, now: float) -> None:
            if index != 0:  # path 0 answers nothing, as a link that drops every packet
                super().on_event(index, event, now)

    monkeypatch.setattr(racing, "PathChoice", DeafToPathZero)
    source = make_transport(bind_host=LOOPBACK, advertise_host=f"{REFUSING},{LOOPBACK}")
    sink = make_transport(bind_host=LOOPBACK)
    sent = state()
    source.send_checkpoint([1], 3, sent, TIMEOUT)
    got, seconds = fetch_timed(sink, source.metadata())
    assert_same(got, sent)
    assert racing.CONNECT_BOUND <= seconds < TIMEOUT.total_seconds() / 4


def test_the_preferred_path_is_used_when_every_path_connects(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    source = make_transport(bind_host=[LOOPBACK_2, LOOPBACK])
    sink = make_transport(bind_host=LOOPBACK)
    sent = state()
    source.send_checkpoint([1], 3, sent, TIMEOUT)
    for _ in range(3):
        assert_same(sink.recv_checkpoint(0, source.metadata(), 3, TIMEOUT), sent)
        assert sink.last_recv_stats is not None
        assert sink.last_recv_stats.peer == f"tcp://{LOOPBACK_2}:{source.address.port}"
    # One transfer served per receive: the other DEALERs were closed without a request. The source records
    # a transfer once its serving thread has finished it, which can come just after the receive returns.
    _wait_for(lambda: len(source.sent_since(0)[1]) >= 3, 5.0)
    assert len(source.sent_since(0)[1]) == 3


def test_a_source_that_listens_late_is_reached_over_its_preferred_path(
    make_transport: Callable[..., ZMQTransport[Any]],
) -> None:
    """Every path refused at first (the source is not up yet): the early refusals do not rule a path out."""
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port = probe.getsockname()[1]
    metadata = PeerAddress(LOOPBACK_2, port, {}, (Path(LOOPBACK, port),)).to_metadata()
    sink = make_transport(bind_host=LOOPBACK)
    outcome: dict[str, Any] = {}
    receiving = threading.Thread(target=lambda: outcome.update(got=sink.recv_checkpoint(0, metadata, 3, TIMEOUT)))
    receiving.start()
    time.sleep(0.5)  # both paths refused a few times by now
    source = make_transport(bind_host=[LOOPBACK, LOOPBACK_2], port=port)
    sent = state()
    source.send_checkpoint([1], 3, sent, TIMEOUT)
    receiving.join(TIMEOUT.total_seconds() + 5)
    assert not receiving.is_alive()
    assert_same(outcome["got"], sent)
    assert sink.last_recv_stats is not None and sink.last_recv_stats.peer == f"tcp://{LOOPBACK_2}:{port}"


def test_every_path_unreachable_times_out_naming_them(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    sink = make_transport(bind_host=LOOPBACK)
    metadata = PeerAddress(REFUSING, 9, {}, (Path("127.0.0.4", 9),)).to_metadata()
    _, error, seconds = call_bounded(lambda: sink.recv_checkpoint(0, metadata, 3, SHORT))
    assert isinstance(error, TimeoutError)
    assert f"tcp://{REFUSING}:9 (refused)" in str(error) and "tcp://127.0.0.4:9 (refused)" in str(error)
    assert seconds < SHORT.total_seconds() + 5  # the transfer timeout bounds it


def test_several_paths_with_curve(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    secret = "a job secret of sixteen bytes or more"
    source = make_transport(bind_host=LOOPBACK, advertise_host=f"{REFUSING},{LOOPBACK}", curve_secret=secret)
    sink = make_transport(bind_host=LOOPBACK, curve_secret=secret)
    assert "curve=" in source.metadata() and "paths=" in source.metadata()
    sent = state()
    source.send_checkpoint([1], 3, sent, TIMEOUT)
    assert_same(sink.recv_checkpoint(0, source.metadata(), 3, TIMEOUT), sent)


def test_fetch_header_uses_the_paths_too(make_transport: Callable[..., ZMQTransport[Any]]) -> None:
    source = make_transport(bind_host=LOOPBACK, advertise_host=f"{REFUSING},{LOOPBACK}")
    sink = make_transport(bind_host=LOOPBACK)
    source.send_checkpoint([1], 3, state(), TIMEOUT)
    assert sink.fetch_header(source.metadata(), 3, TIMEOUT).step == 3


# ----------------------------------------------------------------------------- the lab: a NIC whose link is down

REASON = lab_module.unavailable_reason()

LAB_SENDER = """
import sys, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
nics = sys.argv[1].split(",")
state = {"w": torch.arange(1 << 20, dtype=torch.int32)}
transport = ZMQTransport(timedelta(seconds=30), bind_host=nics)
transport.send_checkpoint([1], 3, state, timedelta(seconds=30))
print(transport.metadata(), flush=True)
sys.stdin.readline()
transport.shutdown()
"""

LAB_RECEIVER = """
import sys, time, torch
from datetime import timedelta
from zmqtransport import ZMQTransport
transport = ZMQTransport(timedelta(seconds=30))
metadata = sys.stdin.readline().strip()
started = time.perf_counter()
got = transport.recv_checkpoint(0, metadata, 3, timedelta(seconds=30))
seconds = time.perf_counter() - started
assert got["w"].equal(torch.arange(1 << 20, dtype=torch.int32))
print(transport.last_recv_stats.peer, seconds, flush=True)
transport.shutdown()
"""


@pytest.mark.system
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
def test_lab_receive_uses_the_second_nic_when_the_first_is_down() -> None:
    env = dict(os.environ)
    env.pop(ADVERTISE_ENV, None)
    with lab_module.Lab(hosts=2, nics=2, rate_mbit=200) as lab:
        nics = f"{lab.address(0, 0)},{lab.address(0, 1)}"
        sender = lab_python(lab, 0, LAB_SENDER, nics, env=env, stderr=False)
        receiver = lab_python(lab, 1, LAB_RECEIVER, env=env)
        assert sender.stdout is not None and sender.stdin is not None
        metadata = sender.stdout.readline().strip()
        assert metadata.startswith(f"tcp://{lab.address(0, 0)}:") and f"paths={lab.address(0, 1)}:" in metadata
        lab.link_down(0, 0)  # the source's first NIC: its packets go nowhere, nothing answers
        out, err = receiver.communicate(metadata + "\n", timeout=60)
        assert receiver.returncode == 0, err
        sender.stdin.write("\n")
        sender.stdin.flush()
        assert sender.wait(30) == 0
    peer, seconds = out.split()
    assert peer.startswith(f"tcp://{lab.address(0, 1)}:")
    print(f"lab: first NIC down, receive over the second took {float(seconds):.3f} s")
    assert float(seconds) < 20  # far below the 30 s timeout
