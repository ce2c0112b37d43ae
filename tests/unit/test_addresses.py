"""Which addresses a peer prints and announces (peer.net.addresses) and the heading of the
bootstrap's join lines (peer.cli.render)."""

from __future__ import annotations

import pytest

from peer.bootstrap.node import BootstrapInfo
from peer.cli.render import who_can_join
from peer.net.addresses import (
    Reach,
    advertised_host,
    host_reach,
    maddr_host,
    maddr_port,
    order_maddrs,
    reach_of,
    route_source,
)

ID = "QmWnqw17L6pqN1HmXe3jBrz6qmZuGK7RGSimByTJ2iekxB"
LOOP = f"/ip4/127.0.0.1/tcp/31337/p2p/{ID}"
PRIVATE = f"/ip4/10.77.0.1/tcp/31337/p2p/{ID}"
NAMED = f"/dns/bootstrap/tcp/31337/p2p/{ID}"


def test_maddr_parts():
    assert maddr_host(PRIVATE) == "10.77.0.1" and maddr_port(PRIVATE) == 31337
    assert maddr_host(f"/ip6/::1/tcp/5/p2p/{ID}") == "::1"
    assert maddr_host(NAMED) == "bootstrap"
    assert maddr_host(f"/p2p/{ID}") is None and maddr_port(f"/p2p/{ID}") is None


@pytest.mark.parametrize(
    ("host", "reach"),
    [
        ("127.0.0.1", Reach.THIS_MACHINE),
        ("::1", Reach.THIS_MACHINE),
        ("localhost", Reach.THIS_MACHINE),
        ("10.77.0.1", Reach.THIS_NETWORK),
        ("192.168.1.2", Reach.THIS_NETWORK),
        ("203.0.113.9", Reach.THIS_NETWORK),  # a documentation range: private to ipaddress
        ("8.8.8.8", Reach.ANYONE),
        ("bootstrap", Reach.ANYONE),  # a name: assumed to resolve where it is used
    ],
)
def test_host_reach(host, reach):
    assert host_reach(host) is reach


def test_loopback_comes_last_and_public_first():
    public = f"/ip4/8.8.8.8/tcp/31337/p2p/{ID}"
    assert order_maddrs([LOOP, PRIVATE, public]) == (public, PRIVATE, LOOP)
    assert order_maddrs([LOOP, PRIVATE]) == (PRIVATE, LOOP)
    assert reach_of([LOOP, PRIVATE]) is Reach.THIS_NETWORK
    assert reach_of([LOOP]) is Reach.THIS_MACHINE
    assert reach_of([]) is Reach.THIS_MACHINE


def test_advertised_host_prefers_announce_then_bind_host():
    assert advertised_host("0.0.0.0", "peer.example.org", [PRIVATE], [PRIVATE]) == "peer.example.org"
    assert advertised_host("127.0.0.1", None, [PRIVATE], [PRIVATE]) == "127.0.0.1"
    assert advertised_host("10.0.0.5", None) == "10.0.0.5"


def test_advertised_host_on_every_interface_is_never_unspecified():
    # toward a loopback initial peer the route's source is loopback: the widest listening address wins
    assert advertised_host("0.0.0.0", None, [LOOP], [LOOP, PRIVATE]) == "10.77.0.1"
    assert advertised_host("0.0.0.0", None, [], [LOOP]) == "127.0.0.1"
    assert advertised_host("::", None) == "127.0.0.1"


def test_route_source_is_the_local_address_facing_a_host():
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("not-an-ip") is None


def _info(*maddrs: str) -> BootstrapInfo:
    return BootstrapInfo("run", ID, order_maddrs(maddrs), "10.77.0.1:40000", "0" * 64, {})


def test_banner_says_who_can_join_and_which_flags_open_the_run():
    only_here = " ".join(t.plain for t in who_can_join(_info(LOOP)))
    assert "only this machine can join" in only_here and "--host 0.0.0.0" in only_here
    assert "--announce-host PUBLIC_IP --port 31337 --grpc-port 40000" in only_here
    assert "paste on another machine" not in only_here
    private = [t.plain for t in who_can_join(_info(LOOP, PRIVATE))]
    assert private[-1] == "join this run (paste on another machine):"
    assert "machines on this network can join" in private[0]
    assert "--announce-host PUBLIC_IP --port 31337 --grpc-port 40000" in private[0]
    public = [t.plain for t in who_can_join(_info(LOOP, f"/ip4/8.8.8.8/tcp/31337/p2p/{ID}"))]
    assert public == ["join this run (paste on another machine):"]
