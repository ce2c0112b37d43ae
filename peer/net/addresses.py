"""Which of this node's addresses others can use: the lines to paste and the host to announce.

A node that listens on all interfaces (`--host 0.0.0.0`, the default) is reachable at every
address of this machine; libp2p lists them (its "visible multiaddrs"), loopback among them. This
module orders them for people (`order_maddrs`: addresses another machine can use first), says who
can use the first one (`reach_of`: this machine only, this network, anyone) and picks the host a
peer announces for its gRPC data plane (`advertised_host`). It also builds the multiaddr a node
listens on (`listen_maddr`) and checks a pasted initial peer (`check_initial_peer`).

Invariants: a loopback address is printed first only when the node has no other; the announced
data-plane host is never 0.0.0.0 or ::, and is loopback only when the node listens on loopback
only (or the operator asked for it with `--host`/`--announce-host`).
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import socket
from collections.abc import Sequence

from hivemind.utils.multiaddr import Multiaddr

from peer.errors import ConfigError

log = logging.getLogger(__name__)

UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "")  # listen on every interface
_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


class Reach(enum.Enum):
    """Who can dial an address."""

    THIS_MACHINE = "this machine"  # loopback
    THIS_NETWORK = "this network"  # a private address: 10/8, 172.16/12, 192.168/16, fc00::/7 …
    ANYONE = "anyone"  # a public address or a host name (names are assumed to resolve where they are used)


def maddr_host(maddr: str) -> str | None:
    """The host part of /ip4/H/…, /ip6/H/…, /dns*/H/…; None for any other multiaddr."""
    parts = maddr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in _HOST_PROTOCOLS else None


def maddr_port(maddr: str) -> int | None:
    """The TCP port of a multiaddr (…/tcp/PORT/…); None without one."""
    parts = maddr.split("/")
    for proto, value in zip(parts, parts[1:], strict=False):
        if proto == "tcp" and value.isdigit():
            return int(value)
    return None


def host_reach(host: str) -> Reach:
    """Who can dial `host`: loopback is this machine, a private IP this network, else anyone."""
    if host == "localhost":
        return Reach.THIS_MACHINE
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return Reach.ANYONE
    if ip.is_loopback:
        return Reach.THIS_MACHINE
    return Reach.THIS_NETWORK if ip.is_private or ip.is_link_local else Reach.ANYONE


def _maddr_reach(maddr: str) -> Reach:
    host = maddr_host(maddr)
    return Reach.ANYONE if host is None else host_reach(host)


_ORDER = {Reach.ANYONE: 0, Reach.THIS_NETWORK: 1, Reach.THIS_MACHINE: 2}


def order_maddrs(maddrs: Sequence[str]) -> tuple[str, ...]:
    """The widest-reaching addresses first (public, then private, then loopback); stable otherwise."""
    return tuple(sorted(maddrs, key=lambda m: _ORDER[_maddr_reach(m)]))


def reach_of(maddrs: Sequence[str]) -> Reach:
    """Who can use the best of `maddrs` (THIS_MACHINE when there is none)."""
    ordered = order_maddrs(maddrs)
    return _maddr_reach(ordered[0]) if ordered else Reach.THIS_MACHINE


def route_source(host: str) -> str | None:
    """The local IP this machine sends from to reach the IP `host`; None without a route (or a name).

    No library answers "which of my addresses faces that host": connecting a UDP socket makes the
    kernel choose the route and the source address, and sends nothing.
    """
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, 9))  # the discard port; nothing is sent
        except OSError:
            return None
        return str(sock.getsockname()[0])


def advertised_host(
    host: str, announce_host: str | None, toward: Sequence[str] = (), listening: Sequence[str] = ()
) -> str:
    """The host other peers dial this node's gRPC data plane at.

    `--announce-host` if given, else the `--host` it listens on; listening on every interface, the
    address this machine reaches its first reachable initial peer from (`toward`: multiaddrs), else
    the widest-reaching of the addresses its DHT node listens on (`listening`), else 127.0.0.1.
    """
    if announce_host:
        return announce_host
    if host not in UNSPECIFIED_HOSTS:
        return host
    for maddr in toward:
        target = maddr_host(maddr)
        source = route_source(target) if target else None
        if source is not None and host_reach(source) is not Reach.THIS_MACHINE:
            return source
    for maddr in order_maddrs(listening):
        found = maddr_host(maddr)
        if found is not None:
            return found
    return "127.0.0.1"


def listen_maddr(host: str, port: int) -> str:
    """The libp2p multiaddr of `host` (an IP or a DNS name) and a TCP port."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{ip.version}/{host}/tcp/{port}"


def check_initial_peer(addr: str) -> str:
    """`addr` as a full multiaddr ending in /p2p/<peer id>; ConfigError saying what to paste instead."""
    try:
        maddr = Multiaddr(addr)
        maddr["p2p"]
    except Exception as e:
        raise ConfigError(
            f"initial peer {addr!r} is not a full multiaddr like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; "
            "copy the line the bootstrap printed"
        ) from e
    return str(maddr)
