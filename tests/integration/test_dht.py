"""Integration tests of peer.net.dht: real hivemind DHT nodes (and their p2pd) on 127.0.0.1:0.

Each test starts at most three nodes (CI has two cores); the `nodes` fixture shuts every node
down and checks that no hivemind child process or p2pd outlives the test.
"""

from __future__ import annotations

import json
import os
import stat
import time

import hivemind
import pytest

from peer.config import build_config
from peer.errors import ConfigError, NetworkError
from peer.net.dht import SwarmDHT, dht_time
from peer.net.identity import make_identity
from peer.net.records import NetFields
from peer.node.presence import Presence
from peer.node.records import Records
from peer.node.round.refusals import Refusals
from tests.conftest import assert_no_leftover_children, is_live, live_descendants

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


@pytest.fixture
def nodes():
    """Factory of SwarmDHT nodes; always shuts them down and checks that their processes are gone."""
    before = live_descendants(os.getpid())
    started: list[SwarmDHT] = []
    pids: set[int] = set()

    def start(**kwargs) -> SwarmDHT:
        node = SwarmDHT(**kwargs)
        started.append(node)
        pids.update(node.child_pids)
        return node

    yield start
    for node in started:
        pids.update(node.child_pids)
        node.shutdown()
    assert pids, "no child process was recorded"
    assert not [p for p in pids if is_live(p)], "hivemind child or p2pd still running after shutdown"
    assert_no_leftover_children(before)  # torch's shm manager (started by the first node) aside


def test_manifest_read_by_peer_and_by_stock_hivemind_client(nodes):
    boot = nodes()
    maddrs = boot.visible_maddrs()
    assert maddrs and all(m.endswith(f"/p2p/{boot.peer_id}") and m.startswith("/ip4/127.0.0.1/tcp/") for m in maddrs)
    assert boot.get_manifest() is None

    manifest = {"run_id": "run-1", "model": {"d_model": 64, "n_layers": 2}, "lr": 0.5, "hashes": ["ab", "cd"]}
    boot.publish_manifest(manifest, ttl_s=60)
    boot.publish_manifest(manifest, ttl_s=30)  # a refresh with a shorter ttl must still be accepted

    joiner = nodes(initial_peers=maddrs)
    assert joiner.peer_id != boot.peer_id
    assert joiner.get_manifest(timeout_s=10) == manifest

    stock = hivemind.DHT(initial_peers=maddrs, start=True)
    try:
        found = stock.get("peer.manifest", latest=True)
        assert found is not None and isinstance(found.value, str)
        assert json.loads(found.value) == manifest
        assert found.expiration_time > hivemind.utils.get_dht_time()
    finally:
        stock.shutdown()
        stock.join(5)
    assert not stock.is_alive()


def test_stage_records_replicas_and_withdraw(nodes):
    a = nodes()
    b = nodes(initial_peers=a.visible_maddrs())
    for n in (a, b):
        n.set_run("run-1", n_stages=2)
    with pytest.raises(ConfigError):
        a.set_run("bad.run")

    t_before = dht_time()
    a.announce_stage(0, {"address": "127.0.0.1:5000", "state": "ready", "outer_step": 3}, ttl_s=60)
    b.announce_stage(0, {"address": "127.0.0.1:5001", "state": "syncing", "outer_step": 4}, ttl_s=60)
    b.announce_stage(1, {"address": "127.0.0.1:5002", "state": "ready", "outer_step": 2}, ttl_s=60)

    for reader in (a, b):
        peers = reader.get_stage_peers(0)
        assert set(peers) == {a.peer_id, b.peer_id}
        assert peers[a.peer_id].address == "127.0.0.1:5000"
        assert peers[b.peer_id].state == "syncing"
        assert all(t_before <= r.time <= dht_time() for r in peers.values())
    assert set(a.get_stage_peers(1)) == {b.peer_id}
    assert a.get_stage_peers(5) == {}

    # an update replaces this peer's record (same subkey), even with a shorter ttl
    a.announce_stage(0, {"address": "127.0.0.1:5000", "state": "busy", "outer_step": 3}, ttl_s=20)
    assert b.get_stage_peers(0)[a.peer_id].state == "busy"

    # a reader's max_age_s reaches the filter (its boundary is tested with set clocks in test_dht_records)
    b.announce_stage(0, {"address": "127.0.0.1:5001", "state": "ready", "outer_step": 4}, ttl_s=60)
    assert set(a.get_stage_peers(0, max_age_s=60)) == {a.peer_id, b.peer_id}
    assert a.get_stage_peers(0, max_age_s=1e-9) == {}  # every record is older than that when it is read

    a.announce_replica({"outer_step": 7, "inner_step": 12, "tokens_per_s": 1000.0, "loss": 3.5}, ttl_s=60)
    assert b.get_replicas()[a.peer_id].loss == 3.5
    assert b.current_outer_step() == 7

    # graceful leave: the record disappears for readers even though the first one had a longer ttl
    a.withdraw_replica()
    a.withdraw_stage(0)
    assert b.get_replicas() == {}
    assert set(b.get_stage_peers(0)) == {b.peer_id}
    assert b.current_outer_step() == 4  # max over the remaining stage records

    with pytest.raises(TypeError):
        a.announce_stage(0, {"bad": object()}, ttl_s=10)


def test_a_joiners_first_replica_record_is_published_once_before_its_records_loop(nodes):
    """`Records.publish_once` (a head or full replica's first record, sent before its data loads: holders
    gathering the round it joins at expect its payload): another node reads it at once, with the
    joiner's step and joined_at; no republishing loop starts until `announce`."""
    a = nodes()
    b = nodes(initial_peers=a.visible_maddrs())
    for n in (a, b):
        n.set_run("run-1", n_stages=2)
    me = Presence(a.peer_id, "full", address="127.0.0.1:5000")
    me.joined_at = 13
    net = NetFields("direct", None, False, 0, None, None)
    records = Records(a, build_config(environ={}).swarm, me, Refusals(), lambda: net, lambda: None)
    records.publish_once(lambda: records.replica("full", 12, 1, None, 0.0))
    seen = b.get_replicas()[a.peer_id]
    assert (seen.kind, seen.outer_step, seen.joined_at, seen.shard) == ("full", 12, 13, 1)
    assert records._thread is None  # nothing republishes it: the records' loop starts with `announce`
    records.close()  # withdraws it: a replica that never trained leaves no record behind
    assert b.get_replicas() == {}


def test_a_malformed_record_is_dropped_never_read(nodes):
    a = nodes()
    b = nodes(initial_peers=a.visible_maddrs())
    for n in (a, b):
        n.set_run("junk", n_stages=1)
    a.announce_stage(0, {"address": "127.0.0.1:5000", "state": "ready", "outer_step": 3}, ttl_s=60)
    b.announce_stage(0, {"address": "127.0.0.1:5001", "state": "ready", "outer_step": "99"}, ttl_s=60)
    b.announce_replica({"outer_step": 7, "joined_at": "soon"}, ttl_s=60)
    b.announce_payload(1, 0, {"sha256": ["aa"], "size": 1, "address": "127.0.0.1:5001"}, ttl_s=60)
    assert set(a.get_stage_peers(0)) == {a.peer_id} and a.get_stage_peers(0)[a.peer_id].outer_step == 3
    assert a.get_replicas() == {} and a.get_payloads(1, 0) == {}
    assert a.current_outer_step() == 3  # the junk outer steps count nowhere
    assert a.dropped_records["malformed"] >= 3


def test_payload_announcements_per_round_and_stage(nodes):
    a = nodes()
    b = nodes(initial_peers=a.visible_maddrs())
    with pytest.raises(RuntimeError, match="set_run"):
        a.get_payloads(0, 0)
    for n in (a, b):
        n.set_run("r2", n_stages=2)
    assert a.current_outer_step() == 0

    a.announce_payload(1, 0, {"sha256": "aa", "size": 100, "address": "127.0.0.1:1"}, ttl_s=60)
    b.announce_payload(1, 0, {"sha256": "bb", "size": 120, "address": "127.0.0.1:2"}, ttl_s=60)
    b.announce_payload(1, 1, {"sha256": "cc", "size": 130, "address": "127.0.0.1:2"}, ttl_s=60)
    b.announce_payload(2, 0, {"sha256": "dd", "size": 140, "address": "127.0.0.1:2"}, ttl_s=60)

    r10 = a.get_payloads(1, 0)
    assert {p: r.sha256 for p, r in r10.items()} == {a.peer_id: "aa", b.peer_id: "bb"}
    assert {p: r.sha256 for p, r in b.get_payloads(1, 1).items()} == {b.peer_id: "cc"}
    assert {p: r.sha256 for p, r in a.get_payloads(2, 0).items()} == {b.peer_id: "dd"}
    assert a.get_payloads(3, 0) == {}

    # outer step comes from stage records too, not only from replicas
    b.announce_stage(1, {"state": "ready", "outer_step": 2}, ttl_s=60)
    assert a.current_outer_step() == 2
    a.set_run("other-run", n_stages=2)  # a different run sees none of it
    assert a.current_outer_step() == 0 and a.get_payloads(1, 0) == {}


async def _list_connected(_dht, node) -> list[str]:
    return [info.peer_id.to_base58() for info in await node.p2p.list_peers()]


def _connected_ids(node: SwarmDHT) -> list[str]:
    """Peer ids the node's p2pd is connected to now (runs inside its hivemind child)."""
    return node._dht.run_coroutine(_list_connected, return_future=True).result(timeout=10)


def test_identity_file_keeps_peer_id_across_restarts(nodes, tmp_path):
    path = tmp_path / "keys" / "peer.key"
    expected = make_identity(path)
    assert path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o400
    assert make_identity(path) == expected  # an existing file is only read

    boot = nodes()
    maddrs = boot.visible_maddrs()
    first = nodes(initial_peers=maddrs, identity_path=path)
    assert first.peer_id == expected
    # hivemind detects the duplicate by asking the initial peer to find `first`, so wait until the
    # initial peer is connected to it. A duplicate that slipped in before would take over that
    # connection (same peer id) and leave the initial peer unable to find `first` at all.
    deadline = time.monotonic() + 15
    while expected not in _connected_ids(boot):
        assert time.monotonic() < deadline, "the initial peer never connected to the first node"
        time.sleep(0.2)
    with pytest.raises(NetworkError, match="already used"):
        nodes(initial_peers=maddrs, identity_path=path)
    first.shutdown()

    t0 = time.monotonic()
    again = nodes(initial_peers=maddrs, identity_path=path)
    print(f"\nrestart with identity check: {time.monotonic() - t0:.2f} s")
    assert again.peer_id == expected

    # a missing file is created on first use
    fresh = tmp_path / "fresh.key"
    node = nodes(identity_path=fresh)
    assert fresh.is_file() and node.peer_id == make_identity(fresh)


def test_dead_initial_peer_raises_network_error_quickly(nodes):
    gone = nodes()
    maddrs = gone.visible_maddrs()
    gone.shutdown()

    t0 = time.monotonic()
    with pytest.raises(NetworkError) as info:
        nodes(initial_peers=maddrs, start_timeout_s=20)
    assert time.monotonic() - t0 < 20
    message = str(info.value)
    assert "\n" not in message and "--initial-peers" in message

    with pytest.raises(ConfigError, match="multiaddr"):
        SwarmDHT(initial_peers=["127.0.0.1:31337"])
    with pytest.raises(ConfigError, match="--port"):
        SwarmDHT(announce_host="203.0.113.7")


def test_requests_keep_their_deadline_after_the_swarm_dies(nodes):
    boot = nodes()
    joiner = nodes(initial_peers=boot.visible_maddrs())
    joiner.set_run("r3")
    boot.shutdown()
    t0 = time.monotonic()
    try:
        peers = joiner.get_stage_peers(0, timeout_s=3)
    except NetworkError as e:
        assert "--initial-peers" in str(e)
    else:
        assert peers == {}
    assert time.monotonic() - t0 < 3 + 1.0


def test_shutdown_is_idempotent_and_reaps_children():
    with SwarmDHT() as node:
        pids = node.child_pids
        assert len(pids) >= 2 and all(is_live(p) for p in pids)  # the DHT process and its p2pd
        assert node.peer_id in node.visible_maddrs()[0]
    assert not [p for p in pids if is_live(p)]
    node.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        node.get_manifest()
