"""Why no initial peer answered: one TCP dial per address, and the likely cause in one line.

When the DHT node cannot reach any `--initial-peers`, hivemind says only that it failed to
connect. This module dials each address's host:port once (a plain TCP connect with a deadline)
and names what the answer means (`cause`, a pure function of the address and the `Dial` outcome):
nothing listening (the bootstrap is down, on another port, or on loopback only), no answer at all
(a firewall or NAT drops the connection), no route, a name that does not resolve, a loopback
address (which reaches only this machine), a libp2p node that is not the peer id after /p2p/ (it greets
every connection with the multistream-select header), or something else on that port.

Invariants: at most `MAX_PROBED` addresses are dialled, each connect and greeting within
`DIAL_TIMEOUT_S`; nothing is sent on a connection, and it is closed once the greeting is read.
"""

from __future__ import annotations

import enum
import errno
import socket
from collections.abc import Sequence

from hivemind.p2p import P2PDaemonError

from peer.net.addresses import Reach, host_reach, maddr_host, maddr_port

DIAL_TIMEOUT_S = 3.0  # one TCP connect per address
MAX_PROBED = 4  # addresses dialled at most (the rest are named without a cause)
_NO_ROUTE = (errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL)
LIBP2P_GREETING = b"/multistream/1.0.0\n"  # what a libp2p listener sends first (after a length byte)


class Dial(enum.Enum):
    """What one TCP connect to an initial peer's host:port found."""

    LIBP2P = "libp2p"  # a libp2p node accepted the connection and greeted
    OTHER = "other"  # something accepted the connection but did not greet as libp2p
    REFUSED = "refused"  # the host answered that nothing listens on that port
    SILENT = "silent"  # no answer within the deadline: dropped on the way
    NO_ROUTE = "no route"  # this machine has no route to the host
    UNRESOLVED = "unresolved"  # the host name does not resolve
    NOT_DIALLED = "not dialled"  # no host:port in the address, or past MAX_PROBED


def dial(host: str, port: int, timeout_s: float = DIAL_TIMEOUT_S) -> Dial:
    """One TCP connect to host:port and a read of its greeting, each within `timeout_s`; what it found."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            try:
                greeting = sock.recv(64)
            except OSError:
                return Dial.OTHER
            return Dial.LIBP2P if LIBP2P_GREETING in greeting else Dial.OTHER
    except socket.gaierror:
        return Dial.UNRESOLVED
    except ConnectionRefusedError:
        return Dial.REFUSED
    except TimeoutError:
        return Dial.SILENT
    except OSError as exc:
        return Dial.NO_ROUTE if exc.errno in _NO_ROUTE else Dial.SILENT


def cause(maddr: str, found: Dial) -> str:
    """The likely reason `maddr` did not answer as a libp2p peer, and what to do, given the dial's outcome."""
    host, port = maddr_host(maddr) or "?", maddr_port(maddr)
    peer_id = maddr.rsplit("/p2p/", 1)[-1] if "/p2p/" in maddr else "?"
    where = f"{host}:{port}"
    if found is Dial.LIBP2P:
        return (
            f"a libp2p node answers at {where}, but not as peer {peer_id}: the peer id after /p2p/ is wrong (a "
            "bootstrap restarted without --identity has a new one); paste the line it prints now"
        )
    if found is Dial.OTHER:
        return (
            f"something answers at {where} but not as a libp2p node (another program on that port, or a proxy or "
            "firewall in between); check the port: the bootstrap's is the number after /tcp/ in the line it printed"
        )
    if host_reach(host) is Reach.THIS_MACHINE:
        return (
            f"{host} is a loopback address, which reaches only this machine, and nothing listens on port {port} here; "
            "paste the address the bootstrap printed for other machines (one listening on loopback only prints "
            "none: restart it with --host 0.0.0.0)"
        )
    if found is Dial.REFUSED:
        return (
            f"nothing listens on {where}: the bootstrap is not running, uses another --port, or listens on loopback "
            "only (restart it with --host 0.0.0.0)"
        )
    if found is Dial.SILENT:
        return (
            f"{where} did not answer within {DIAL_TIMEOUT_S:.0f} s: a firewall or NAT drops the connection; open TCP "
            f"port {port} on the bootstrap's machine (behind NAT: forward it and start the bootstrap with "
            "--announce-host PUBLIC_IP)"
        )
    if found is Dial.NO_ROUTE:
        return (
            f"this machine has no route to {host}: check the address (a private address such as 10.x or 192.168.x "
            "is reachable only inside its own network)"
        )
    if found is Dial.UNRESOLVED:
        return f"the host name {host} does not resolve here: check the address or use the bootstrap's IP"
    return "check the address (each ends in /p2p/<peer id>) and that this host can reach it"


def explain(initial: Sequence[str]) -> str:
    """One line: why none of `initial` answered, dialling each (at most MAX_PROBED) once."""
    reasons = []
    for i, maddr in enumerate(initial):
        host, port = maddr_host(maddr), maddr_port(maddr)
        found = dial(host, port) if host and port and i < MAX_PROBED else Dial.NOT_DIALLED
        reasons.append(cause(maddr, found))
    if len(initial) == 1:
        return f"--initial-peers {initial[0]} did not answer: {reasons[0]}"
    listed = "; ".join(f"{m}: {r}" for m, r in zip(initial, reasons, strict=True))
    return f"none of the {len(initial)} --initial-peers answered: {listed}"


def start_error(e: Exception, initial: Sequence[str], identity_path: object) -> str:
    """One line saying why a node failed to start and what to do."""
    text = " ".join(str(e).split())
    if "already taken" in text:
        return (
            f"identity {identity_path} is already used by a running peer; stop that peer or use another identity file"
        )
    if initial and ("bootstrap" in text or "initial_peers" in text):
        return explain(initial)  # dials each address once to name the likely cause
    if isinstance(e, P2PDaemonError):
        return f"the libp2p daemon failed to start ({text[:200]}); check --host/--port are free and valid"
    return f"DHT node failed to start: {type(e).__name__}: {text[:200]}"
