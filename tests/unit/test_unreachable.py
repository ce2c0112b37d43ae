"""Why a join reached no initial peer (peer.net.unreachable): each dial outcome's cause, row by row,
and real TCP dials on 127.0.0.1 (a libp2p greeting, a silent listener, a refused port)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from peer.net import unreachable
from peer.net.unreachable import Dial, cause, dial

ID = "QmWnqw17L6pqN1HmXe3jBrz6qmZuGK7RGSimByTJ2iekxB"
LOOP = f"/ip4/127.0.0.1/tcp/31337/p2p/{ID}"
PRIVATE = f"/ip4/10.77.0.1/tcp/31337/p2p/{ID}"
PUBLIC = f"/ip4/203.0.113.9/tcp/31337/p2p/{ID}"
NAMED = f"/dns/bootstrap/tcp/31337/p2p/{ID}"


@pytest.mark.parametrize(
    ("maddr", "found", "words"),
    [
        (LOOP, Dial.REFUSED, ("loopback address", "only this machine", "--host 0.0.0.0")),
        (PRIVATE, Dial.REFUSED, ("nothing listens on 10.77.0.1:31337", "loopback only", "--host 0.0.0.0")),
        (PUBLIC, Dial.SILENT, ("firewall", "open TCP port 31337", "--announce-host")),
        (PRIVATE, Dial.NO_ROUTE, ("no route to 10.77.0.1", "private address")),
        (NAMED, Dial.UNRESOLVED, ("host name bootstrap does not resolve",)),
        (PRIVATE, Dial.LIBP2P, ("not as peer " + ID, "peer id after /p2p/ is wrong")),
        (LOOP, Dial.LIBP2P, ("peer id after /p2p/ is wrong",)),
        (PUBLIC, Dial.OTHER, ("not as a libp2p node", "check the port")),
    ],
)
def test_each_dial_outcome_names_its_cause(maddr, found, words):
    text = cause(maddr, found)
    assert "\n" not in text
    for word in words:
        assert word in text, text


def _listener(greeting: bytes | None) -> tuple[socket.socket, int]:
    """A real TCP listener on 127.0.0.1 that sends `greeting` to each connection (None: says nothing)."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                if greeting is not None:
                    conn.sendall(greeting)
                conn.recv(1)  # until the prober closes

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_dial_tells_a_libp2p_node_from_another_program_and_from_nothing():
    libp2p, p1 = _listener(b"\x13/multistream/1.0.0\n")
    silent, p2 = _listener(None)
    with libp2p, silent, _unused_port() as p3:
        assert dial("127.0.0.1", p1, timeout_s=2.0) is Dial.LIBP2P
        assert dial("127.0.0.1", p2, timeout_s=0.2) is Dial.OTHER
        assert dial("127.0.0.1", p3, timeout_s=1.0) is Dial.REFUSED
    assert dial("no-such-host.invalid", 1, timeout_s=1.0) is Dial.UNRESOLVED


@contextlib.contextmanager
def _unused_port() -> Iterator[int]:
    """A port held (bound, not listening) for the block: a connect to it is refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def test_explain_is_one_line_per_join_and_names_each_address():
    with _unused_port() as port:
        addr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{ID}"
        one = unreachable.explain([addr])
        two = unreachable.explain([addr, f"/dns/no-such-host.invalid/tcp/1/p2p/{ID}"])
    assert one.startswith(f"--initial-peers {addr} did not answer: 127.0.0.1 is a loopback address")
    assert two.startswith("none of the 2 --initial-peers answered: ") and "does not resolve" in two
    assert "\n" not in one + two
