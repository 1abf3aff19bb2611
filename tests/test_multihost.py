"""Two "hosts" as two network namespaces joined by a veth pair (issue 5).

Host A runs the sender, host B the receiver, each a real process started with
``ip netns exec``. The addresses (10.211.0.0/24 on the link between them,
10.212.0.0/24 on a second interface of A that B cannot reach) exist only
inside namespaces this test creates and always deletes; nothing is routed out
of them.

What it proves:

* with a default route over the shared link, the metadata of a transport bound
  to all interfaces advertises A's address on that link, and B fetches through
  it (no override);
* on a multi-NIC host whose default route leaves by another interface, the
  automatic choice names that other address, which B cannot reach, and both
  overrides (``ZMQTRANSPORT_ADVERTISE_HOST`` and ``advertise_host=``) fix it.

Needs root and iproute2's ``ip``; skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import textwrap
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from zmqtransport.net import ADVERTISE_ENV, parse_metadata

from .conftest import warm_python

LINK_A, LINK_B = "10.211.0.1", "10.211.0.2"  # the shared link
OTHER_A, OTHER_GW = "10.212.0.1", "10.212.0.2"  # A's other interface, unreachable from B
STEP = 3
pytestmark = pytest.mark.system


@dataclass
class Namespaces:
    a: str
    b: str

    def run(self, *args: str) -> None:
        _ip(*args)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


def _cannot_make_namespaces() -> str | None:
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (apt-get install iproute2)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    return None


@pytest.fixture
def hosts() -> Iterator[Namespaces]:
    reason = _cannot_make_namespaces()
    if reason:
        pytest.skip(reason)
    tag = f"{os.getpid() % 100000}"
    spaces = Namespaces(a=f"ztA{tag}", b=f"ztB{tag}")
    made: list[str] = []
    try:
        for name in (spaces.a, spaces.b):
            try:
                _ip("netns", "add", name)
            except RuntimeError as exc:
                pytest.skip(f"cannot create network namespaces here: {exc}")
            made.append(name)
        # The link between the two hosts, created straight inside them.
        _ip(
            "link",
            "add",
            f"zva{tag}",
            "netns",
            spaces.a,
            "type",
            "veth",
            "peer",
            "name",
            f"zvb{tag}",
            "netns",
            spaces.b,
        )
        # A second interface on A (a veth whose peer also stays in A).
        _ip("-n", spaces.a, "link", "add", f"zxa{tag}", "type", "veth", "peer", "name", f"zxb{tag}")
        for space, device, address in (
            (spaces.a, f"zva{tag}", LINK_A),
            (spaces.b, f"zvb{tag}", LINK_B),
            (spaces.a, f"zxa{tag}", OTHER_A),
        ):
            _ip("-n", space, "addr", "add", f"{address}/24", "dev", device)
            _ip("-n", space, "link", "set", device, "up")
        _ip("-n", spaces.a, "link", "set", f"zxb{tag}", "up")
        for space in (spaces.a, spaces.b):
            _ip("-n", space, "link", "set", "lo", "up")
        yield spaces
    finally:
        for name in made:  # deleting a namespace deletes its interfaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


SENDER = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    import torch
    from zmqtransport import ZMQTransport

    timeout = timedelta(seconds=20)
    state = {"w": torch.arange(100_000, dtype=torch.float64), "step": %(step)d}
    transports = []
    for options in json.loads(sys.argv[1]):
        env = options.pop("env", None)
        if env is None:
            os.environ.pop(%(env_name)r, None)
        else:
            os.environ[%(env_name)r] = env
        transport = ZMQTransport(timeout, **options)
        transport.send_checkpoint([1], %(step)d, state, timeout)
        transports.append(transport)
    print(json.dumps([t.metadata() for t in transports]), flush=True)
    sys.stdin.read()  # serve until the test closes our stdin
    for transport in transports:
        transport.shutdown()
    """
) % {"step": STEP, "env_name": ADVERTISE_ENV}

RECEIVER = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    import torch
    from zmqtransport import ZMQTransport

    receiver = ZMQTransport(timedelta(seconds=20), bind_host="127.0.0.1")
    outcomes = []
    for metadata in json.loads(sys.argv[1]):
        try:
            got = receiver.recv_checkpoint(0, metadata, %(step)d, timedelta(seconds=2))
            same = torch.equal(got["w"], torch.arange(100_000, dtype=torch.float64))
            outcomes.append("ok" if same and got["step"] == %(step)d else "wrong content")
        except Exception as exc:
            outcomes.append(f"{type(exc).__name__}: {exc}")
    receiver.shutdown()
    print(json.dumps(outcomes), flush=True)
    """
) % {"step": STEP}


def serve_and_fetch(hosts: Namespaces, configs: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """Start the sender in A with ``configs``, fetch every metadata from B; both results."""
    env = {k: v for k, v in os.environ.items() if k != ADVERTISE_ENV}
    sender = warm_python(hosts.a, SENDER, json.dumps(configs), env=env)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(sender.stdout.readline()))  # type: ignore[union-attr]
        reader.start()
        reader.join(120)
        if not line or not line[0]:
            sender.kill()
            raise AssertionError(f"the sender in {hosts.a} failed: {sender.communicate()[1][-2000:]}")
        metadata = json.loads(line[0])
        receiver = warm_python(hosts.b, RECEIVER, json.dumps(metadata))
        out, err = receiver.communicate(timeout=180)
        assert receiver.returncode == 0, err[-2000:]
        return metadata, json.loads(out.strip().splitlines()[-1])
    finally:
        if sender.poll() is None:
            try:
                sender.communicate(input="", timeout=60)
            except subprocess.TimeoutExpired:
                sender.kill()
                sender.communicate()


def test_advertised_address_is_reachable_from_the_other_host(hosts: Namespaces) -> None:
    # A's default route goes over the shared link, as on a single-NIC host.
    hosts.run("-n", hosts.a, "route", "add", "default", "via", LINK_B)
    metadata, outcomes = serve_and_fetch(hosts, [{}, {"bind_host": LINK_A}])
    # Bound to all interfaces, no override: the default-route interface's address.
    assert parse_metadata(metadata[0]).host == LINK_A
    # Bound to one address: that address.
    assert parse_metadata(metadata[1]).host == LINK_A
    assert outcomes == ["ok", "ok"], outcomes


def test_advertise_override_on_a_multi_nic_host(hosts: Namespaces) -> None:
    """The wrong-network problem: A's default route leaves by an interface B cannot
    reach. The automatic choice then advertises the wrong address; both overrides
    put the right one in the metadata."""
    hosts.run("-n", hosts.a, "route", "add", "default", "via", OTHER_GW)
    configs = [{}, {"env": LINK_A}, {"advertise_host": LINK_A}]
    metadata, outcomes = serve_and_fetch(hosts, configs)
    hosts_advertised = [parse_metadata(m).host for m in metadata]
    assert hosts_advertised == [OTHER_A, LINK_A, LINK_A]
    assert outcomes[0].startswith("TimeoutError") and "timed out" in outcomes[0], outcomes
    assert outcomes[1:] == ["ok", "ok"], outcomes
