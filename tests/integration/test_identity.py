"""Integration tests of peer identity, signed DHT records and swarm admission (issue 4, item 6).

Real hivemind DHT nodes on 127.0.0.1:0, at most three running at a time per test. The "attacker"
is a plain hivemind node that does not run `peer` code, so it can try any store the DHT protocol
allows: writing under another peer's subkey, or a validly signed record that claims another id.
"""

from __future__ import annotations

import json

import hivemind
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from typer.testing import CliRunner

from peer.cli.main import app
from peer.errors import ConfigError, ManifestMismatch
from peer.net.admission import load_swarm_secret, secret_commitment
from peer.net.dht import SwarmDHT
from peer.net.identity import make_identity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SECRET = b"0123456789abcdef-the-swarm-secret"
RECORD = {"address": "127.0.0.1:5000", "role": "trainer", "state": "ready", "outer_step": 3}


@pytest.fixture
def nodes(reap_children, monkeypatch):
    """Factory of SwarmDHT nodes (no ambient PEER_SWARM_SECRET); every node is shut down after the test."""
    monkeypatch.delenv("PEER_SWARM_SECRET", raising=False)
    started: list[SwarmDHT] = []

    def start(**kwargs) -> SwarmDHT:
        node = SwarmDHT(**kwargs)
        started.append(node)
        return node

    yield start
    for node in started:
        node.shutdown()


@pytest.fixture
def stock_node():
    """Factory of plain hivemind.DHT nodes (a stock client, or an attacker that runs no peer code)."""
    started: list[hivemind.DHT] = []

    def start(initial_peers, **kwargs) -> hivemind.DHT:
        node = hivemind.DHT(initial_peers=initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True, **kwargs)
        started.append(node)
        return node

    yield start
    for node in started:
        node.shutdown()
        node.join(5)


def _manifest(run_id: str, **swarm) -> dict:
    return {"run_id": run_id, "protocol": 1, "config": {"swarm": swarm}}


def test_identity_file_is_created_and_keeps_peer_id_and_record_ownership(nodes, tmp_path):
    key = tmp_path / "keys" / "peer.key"
    runner = CliRunner()
    first = runner.invoke(app, ["bootstrap", "--identity", str(key), "--print-peer-id"])
    assert first.exit_code == 0, first.output
    peer_id = first.output.strip()
    assert key.is_file() and peer_id == make_identity(key)
    again = runner.invoke(app, ["bootstrap", "--identity", str(key), "--print-peer-id"])
    assert again.output.strip() == peer_id  # an existing key is only read

    boot = nodes()
    boot.set_run("ident")
    a = nodes(initial_peers=boot.visible_maddrs(), identity_path=key)
    assert a.peer_id == peer_id
    owner = a.owner_subkey
    a.set_run("ident")
    a.announce_stage(0, RECORD, ttl_s=60)
    assert boot.get_stage_peers(0)[peer_id].address == "127.0.0.1:5000"
    a.shutdown()

    # restarted from the same file: same peer id, same signing key, so it can update its own record
    restarted = nodes(initial_peers=boot.visible_maddrs(), identity_path=key)
    assert restarted.peer_id == peer_id and restarted.owner_subkey == owner
    restarted.set_run("ident")
    assert boot.get_stage_peers(0)[peer_id].state == "ready"  # the record outlived the process
    restarted.announce_stage(0, {**RECORD, "state": "busy"}, ttl_s=60)
    peers = boot.get_stage_peers(0)
    assert set(peers) == {peer_id} and peers[peer_id].state == "busy"
    assert peers[peer_id].peer_id == peer_id

    # without --identity every start is a new peer (a throw-away key that signs just as well)
    assert boot.peer_id != peer_id and boot.owner_subkey != owner


def test_another_peer_cannot_overwrite_or_forge_a_record(nodes, stock_node):
    a = nodes()
    reader = nodes(initial_peers=a.visible_maddrs())
    for n in (a, reader):
        n.set_run("sig", n_stages=1)
    a.announce_stage(0, RECORD, ttl_s=60)
    reader.announce_stage(0, {**RECORD, "address": "127.0.0.1:5001"}, ttl_s=60)

    attacker_key = RSAPrivateKey()
    attacker = stock_node(a.visible_maddrs(), record_validators=[RSASignatureValidator(attacker_key)])
    key = "peer.sig.stage.0"
    later = hivemind.utils.get_dht_time() + 90
    evil = {**RECORD, "address": "203.0.113.66:6666", "peer_id": a.peer_id, "time": hivemind.utils.get_dht_time()}

    # 1. a store under A's subkey is not signed by A's key: every node refuses it
    assert attacker.store(key, evil, later, subkey=a.owner_subkey) is False
    # 2. a record validly signed by the attacker's own key that claims to be A: stored, but dropped by readers
    own_subkey = RSASignatureValidator(attacker_key).local_public_key
    assert attacker.store(key, evil, later + 1, subkey=own_subkey) is True
    # 3. the old unsigned layout (subkey = A's peer id as text): stored, but dropped by readers
    assert attacker.store(key, evil, later + 2, subkey=a.peer_id) is True

    for node in (reader, a):
        peers = node.get_stage_peers(0)
        assert set(peers) == {a.peer_id, reader.peer_id}
        assert peers[a.peer_id].address == "127.0.0.1:5000"
        assert node.current_outer_step() == 3
    assert reader.dropped_records["forged"] >= 1 and reader.dropped_records["unsigned"] >= 1

    # A still owns its subkey: its own update and withdrawal go through
    a.announce_stage(0, {**RECORD, "state": "busy"}, ttl_s=30)
    assert reader.get_stage_peers(0)[a.peer_id].state == "busy"
    a.withdraw_stage(0)
    assert set(reader.get_stage_peers(0)) == {reader.peer_id}
    # a round in progress tells a graceful leave (a signed "left" record) from a record that expired
    assert reader.get_stage_peers(0, keep_left=True)[a.peer_id].state == "left"


def test_manifest_is_taken_from_the_bootstrap_and_stays_readable_by_stock_hivemind(nodes, stock_node):
    boot = nodes()
    maddrs = boot.visible_maddrs()
    manifest = _manifest("genuine")
    boot.publish_manifest(manifest, ttl_s=60)

    # another peer publishes its own (validly signed) manifest later; it overwrites the unsigned mirror
    impostor = nodes(initial_peers=maddrs)
    impostor.publish_manifest(_manifest("impostor"), ttl_s=90)

    joiner = nodes(initial_peers=maddrs)  # trusts the peer id in its --initial-peers
    assert joiner.get_manifest() == manifest and joiner.manifest_signer == boot.peer_id
    impostor.shutdown()
    joiner.shutdown()

    stock = stock_node(maddrs)  # a stock client without peer installed reads the plain mirror
    found = stock.get("peer.manifest", latest=True)
    assert found is not None and isinstance(found.value, str)
    assert json.loads(found.value)["run_id"] in ("genuine", "impostor")  # unverified, by design


def test_secret_mode_wrong_secret_fails_at_join_and_its_records_are_invisible(nodes, stock_node, tmp_path):
    secret_file = tmp_path / "swarm.secret"
    secret_file.write_text(SECRET.decode() + "\n")
    assert load_swarm_secret(secret_file) == SECRET
    boot = nodes(swarm_secret=load_swarm_secret(secret_file))
    maddrs = boot.visible_maddrs()
    boot.publish_manifest(_manifest("sec", admission="secret"), ttl_s=60)

    good = nodes(initial_peers=maddrs, swarm_secret=SECRET)
    manifest = good.get_manifest()
    assert manifest["swarm_secret_commitment"] == secret_commitment(SECRET)
    assert SECRET.decode() not in json.dumps(manifest)

    wrong = nodes(initial_peers=maddrs, swarm_secret=b"not-the-swarm-secret-at-all")
    with pytest.raises(ManifestMismatch, match="wrong swarm secret"):
        wrong.get_manifest()

    for n in (boot, good, wrong):  # the wrong peer ignores the error and announces anyway
        n.set_run("sec", n_stages=1)
    good.announce_stage(0, RECORD, ttl_s=60)
    wrong.announce_stage(0, {**RECORD, "outer_step": 99}, ttl_s=60)
    wrong.announce_replica({"outer_step": 99}, ttl_s=60)
    for reader in (boot, good):
        assert set(reader.get_stage_peers(0)) == {good.peer_id}
        assert reader.get_replicas() == {}
        assert reader.current_outer_step() == 3
        rec = reader.get_stage_peers(0)[good.peer_id]  # the proof is checked, then stripped; the rest parsed
        assert (rec.address, rec.state, rec.outer_step) == (RECORD["address"], RECORD["state"], RECORD["outer_step"])
    assert good.dropped_records["not_admitted"] >= 1
    wrong.shutdown()

    stock = stock_node(maddrs)
    assert json.loads(stock.get("peer.manifest", latest=True).value) == manifest


def test_secret_mode_without_a_secret_fails_and_env_secret_works(nodes, monkeypatch):
    boot = nodes(swarm_secret=SECRET)
    maddrs = boot.visible_maddrs()
    with pytest.raises(ConfigError, match="swarm-secret-file"):
        nodes().publish_manifest(_manifest("sec2", admission="secret"), ttl_s=60)  # a bootstrap without it
    boot.publish_manifest(_manifest("sec2", admission="secret"), ttl_s=60)

    none = nodes(initial_peers=maddrs)
    with pytest.raises(ManifestMismatch, match="--swarm-secret-file"):
        none.get_manifest()
    monkeypatch.setenv("PEER_SWARM_SECRET", SECRET.decode())
    from_env = nodes(initial_peers=maddrs)
    assert from_env.get_manifest()["run_id"] == "sec2"

    for n in (boot, none, from_env):
        n.set_run("sec2", n_stages=1)
    none.announce_stage(0, RECORD, ttl_s=60)
    from_env.announce_stage(0, RECORD, ttl_s=60)
    assert set(boot.get_stage_peers(0)) == {from_env.peer_id}


def test_allowlist_mode_drops_unlisted_peers_and_refuses_them_at_join(nodes, tmp_path):
    key = tmp_path / "listed.key"
    listed_id = make_identity(key)
    boot = nodes()
    maddrs = boot.visible_maddrs()
    boot.publish_manifest(_manifest("allow", admission="allowlist", allowlist=[listed_id]), ttl_s=60)

    listed = nodes(initial_peers=maddrs, identity_path=key)
    assert listed.get_manifest()["run_id"] == "allow"
    outsider = nodes(initial_peers=maddrs)
    with pytest.raises(ManifestMismatch, match=f"not on the swarm's allow-list.*--allow-peer {outsider.peer_id}"):
        outsider.get_manifest()

    for n in (boot, listed, outsider):
        n.set_run("allow", n_stages=1)
    listed.announce_stage(0, RECORD, ttl_s=60)
    outsider.announce_stage(0, {**RECORD, "outer_step": 50}, ttl_s=60)
    for reader in (boot, listed):
        assert set(reader.get_stage_peers(0)) == {listed_id}
        assert reader.current_outer_step() == 3
    outsider.shutdown()

    # a read-only client (peer status) need not be listed; it sees only listed peers too
    client = nodes(initial_peers=maddrs, client_mode=True)
    client.get_manifest()
    client.set_run("allow", n_stages=1)
    assert set(client.get_stage_peers(0)) == {listed_id}


def test_cli_admission_flags_are_checked_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("PEER_SWARM_SECRET", raising=False)
    monkeypatch.setenv("PEER_LOG_LEVEL", "WARNING")  # `peer join` sets a default; keep it test-local
    runner = CliRunner()

    def error_of(*args: str) -> str:
        result = runner.invoke(app, list(args))
        assert isinstance(result.exception, ConfigError), result.output
        return str(result.exception)

    assert "needs --swarm-secret-file" in error_of("bootstrap", "--admission", "secret")
    assert "cannot read the swarm secret file" in error_of("bootstrap", "--swarm-secret-file", str(tmp_path / "nope"))
    assert "not a peer id" in error_of("bootstrap", "--allow-peer", "alice")
    assert "needs at least one peer id" in error_of("bootstrap", "--admission", "allowlist")
    empty = tmp_path / "empty.secret"
    empty.write_text("\n")
    assert "is empty" in error_of(
        "join", "--stage", "0", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/QmX", "--swarm-secret-file", str(empty)
    )
