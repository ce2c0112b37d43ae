"""`peer join --initial-peers-file`: the bootstrap's address file, waited for under a deadline."""

from __future__ import annotations

import json
import threading

import pytest

from peer.cli.join_setup import prepare_join
from peer.errors import PeerError
from peer.node.discovery import read_address_file, wait_for_address_file

MADDR = "/dns4/bootstrap/tcp/31337/p2p/12D3KooWNDs8CvEXsBKSkNMWHPHLoVZy49d1Azq771t92xKG6sBD"


def test_reads_the_multiaddrs_and_ignores_what_is_not_one(tmp_path):
    f = tmp_path / "bootstrap.json"
    assert read_address_file(f) == ()  # missing
    f.write_text('{"initial_peers": ["' + MADDR[:10])  # torn
    assert read_address_file(f) == ()
    f.write_text(json.dumps({"initial_peers": []}))
    assert read_address_file(f) == ()
    f.write_text(json.dumps({"initial_peers": [MADDR, 7, "not-a-maddr"], "grpc": "bootstrap:31338"}))
    assert read_address_file(f) == (MADDR,)


def test_waits_for_the_file_then_joins_through_it(tmp_path):
    """The joiner starts first (as a container may); the bootstrap's file appears later."""
    f = tmp_path / "swarm" / "bootstrap.json"
    f.parent.mkdir()
    writer = threading.Timer(0.3, lambda: f.write_text(json.dumps({"initial_peers": [MADDR]})))
    writer.start()
    try:
        peers = prepare_join(["/ip4/10.0.0.1/tcp/1/p2p/QmX"], f, 60.0, None, "127.0.0.1", threading.Event())
    finally:
        writer.join()
    assert peers == ("/ip4/10.0.0.1/tcp/1/p2p/QmX", MADDR)


def test_deadline_and_stop_give_a_one_line_error(tmp_path):
    f = tmp_path / "never.json"
    with pytest.raises(PeerError, match="no bootstrap address in .*never.json after 0 s"):
        wait_for_address_file(f, 0.0)
    stop = threading.Event()
    stop.set()
    with pytest.raises(PeerError, match="stopped while waiting"):
        wait_for_address_file(f, 60.0, stop)
