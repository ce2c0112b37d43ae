"""Integration tests of the bootstrap node: a real hivemind DHT, a real gRPC server, real artefacts.

One `peer bootstrap` process (tiny corpus, records with a 3 s ttl) serves the module's tests; it
runs as a separate process because every reader here forks a hivemind child, and forking a process
whose threads run a gRPC server and a DHT refresh loop is unsafe (DESIGN §3). Readers are a STOCK
hivemind client (no `peer` code), peer.net.dht.SwarmDHT nodes, PeerClient and `peer status` as a
process. `run_bootstrap` itself runs in-process (in a thread) for the restart test. Every
bootstrap is stopped at the end and must leave no hivemind child or p2pd behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import hivemind
import pytest

from peer.bootstrap.node import BootstrapInfo, run_bootstrap
from peer.cli.status import LINK_FIELDS, collect_status
from peer.config import build_config
from peer.core.data.shards import DatasetIndex
from peer.errors import NetworkError
from peer.net.addresses import maddr_host, order_maddrs
from peer.net.dht import SwarmDHT, make_identity
from peer.net.transport import ArtifactRequest, NotFoundError, PeerClient, StateRequest
from peer.node.manifest import run_id_for, verify_manifest
from peer.node.stage.state import StageState
from tests.conftest import assert_no_leftover_children, live_descendants, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PEER = [sys.executable, "-m", "peer"]
READY_TIMEOUT_S = 60.0  # tokenizer training on the tiny corpus + DHT start, on a slow CI machine
STOP_TIMEOUT_S = 20.0
TTL_S = 3.0  # record ttl of the shared bootstrap: its refresh loop runs every ttl/3 = 1 s
TINY = {"data.max_chars": 300_000, "swarm.record_ttl_s": TTL_S}


class RunningBootstrap:
    """run_bootstrap in a background thread; `stop()` ends it and returns its result."""

    def __init__(self, cfg, **kwargs):
        self.cfg = cfg
        self.stop_event = threading.Event()
        self._ready = threading.Event()
        self.info: BootstrapInfo | None = None
        self.result: object = None
        self.error: BaseException | None = None

        def on_ready(info: BootstrapInfo) -> None:
            self.info = info
            self._ready.set()

        def target() -> None:
            try:
                self.result = run_bootstrap(cfg, on_ready=on_ready, stop_event=self.stop_event, **kwargs)
            except BaseException as e:  # surfaced by wait_ready/stop
                self.error = e
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=target, name="bootstrap", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> BootstrapInfo:
        assert self._ready.wait(timeout_s), f"bootstrap not ready within {timeout_s} s"
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info

    def stop(self, timeout_s: float = 20.0) -> object:
        self.stop_event.set()
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"run_bootstrap did not return within {timeout_s} s of stop"
        if self.error is not None:
            raise self.error
        return self.result


class BootstrapProcess:
    """`peer bootstrap --address-file F` as a child process; `record` is the address file's JSON."""

    def __init__(self, workdir: Path, cache: Path):
        self.address_file = workdir / "bootstrap.json"
        self.stderr = workdir / "stderr.txt"
        env = {**os.environ, "PEER_CACHE_DIR": str(cache), "PEER_SWARM__RECORD_TTL_S": str(TTL_S)}
        cmd = [*PEER, "bootstrap", "--max-chars", str(TINY["data.max_chars"]), "--address-file", str(self.address_file)]
        with open(workdir / "stdout.txt", "w") as out, open(self.stderr, "w") as err:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.address_file.exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"peer bootstrap exited with {self.proc.returncode}: {self.stderr.read_text()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"peer bootstrap wrote no address file within {READY_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
        self.record = json.loads(self.address_file.read_text())
        self.maddrs = list(self.record["initial_peers"])
        self.children = live_descendants(self.proc.pid)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
            raise AssertionError(f"peer bootstrap still running {STOP_TIMEOUT_S:.0f} s after SIGTERM") from None


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    t0 = time.monotonic()
    # the same cache as the autouse _isolated_cache fixture gives each test
    running = BootstrapProcess(tmp_path_factory.mktemp("boot"), tmp_path_factory.getbasetemp() / "peer-cache")
    print(f"\npeer bootstrap ready in {time.monotonic() - t0:.1f} s")
    try:
        yield running
    finally:
        t0 = time.monotonic()
        code = running.stop()
        print(f"\npeer bootstrap stopped in {time.monotonic() - t0:.2f} s")
    assert code == 0, running.stderr.read_text()
    assert not running.address_file.exists(), "the address file must be removed on a clean stop"
    assert running.children and not wait_gone(running.children, 5.0), "hivemind child or p2pd left behind"


def _manifest(maddrs: list[str]) -> dict:
    with SwarmDHT(initial_peers=maddrs) as node:
        manifest = node.get_manifest(timeout_s=10)
    assert manifest is not None
    return manifest


def test_address_file_names_the_dht_node_and_the_grpc_server(boot):
    record = boot.record
    assert set(record) == {"initial_peers", "grpc", "run_id", "peer_id"}
    assert record["run_id"] == run_id_for(build_config(None, TINY))
    assert boot.maddrs[0].endswith(f"/p2p/{record['peer_id']}")
    assert boot.maddrs == list(order_maddrs(boot.maddrs))  # the address other machines can use comes first
    assert record["grpc"].rpartition(":")[0] == maddr_host(boot.maddrs[0])  # announced where the DHT node is


def test_stock_hivemind_client_reads_the_manifest(boot):
    stock = hivemind.DHT(initial_peers=boot.maddrs, start=True)
    try:
        found = stock.get("peer.manifest", latest=True)
        assert found is not None and isinstance(found.value, str)
        manifest = json.loads(found.value)
        assert manifest["run_id"] == boot.record["run_id"] and manifest["bootstrap_address"] == boot.record["grpc"]
        # the refresh loop (every ttl/3 = 1 s) keeps a 3 s record alive past its first expiration
        first_expiration = found.expiration_time
        time.sleep(TTL_S + 0.5)
        again = stock.get("peer.manifest", latest=True)
        assert again is not None and json.loads(again.value) == manifest
        assert again.expiration_time > max(first_expiration, hivemind.utils.get_dht_time())
    finally:
        stock.shutdown()
        stock.join(5)


def test_swarm_dht_manifest_verifies_to_the_same_config(boot):
    expected = build_config(None, TINY)
    cfg = verify_manifest(_manifest(boot.maddrs))
    assert cfg == expected and cfg.fingerprint() == expected.fingerprint()


def test_artifacts_over_grpc(boot):
    manifest = _manifest(boot.maddrs)
    cfg = verify_manifest(manifest)
    with PeerClient(boot.record["grpc"], timeout_s=10) as client:
        tokenizer = client.get_artifact(ArtifactRequest("tokenizer"))
        assert hashlib.sha256(tokenizer).hexdigest() == manifest["tokenizer_sha256"]
        assert client.get_artifact(ArtifactRequest("tokenizer.model")) == tokenizer
        served_manifest = client.get_artifact(ArtifactRequest("manifest"))
        assert json.loads(served_manifest) == manifest
        with pytest.raises(NotFoundError, match="no artefact"):
            client.get_artifact(ArtifactRequest("weights"))
        # the run's one corpus: its index as the manifest names it, a shard by sha256, from an offset
        raw = client.get_artifact(ArtifactRequest("dataset-index"))
        assert hashlib.sha256(raw).hexdigest() == manifest["dataset_index_sha256"]
        index = DatasetIndex.from_json(raw)
        assert (index.fingerprint, index.val_fingerprint) == (
            manifest["dataset_fingerprint"],
            manifest["dataset_val_fingerprint"],
        )
        assert index.tokenizer_sha256 == manifest["tokenizer_sha256"]
        shard = index.val[0]
        tail = client.get_artifact(ArtifactRequest(shard.sha256, offset=10))
        head = client.get_artifact(ArtifactRequest(shard.sha256))
        assert hashlib.sha256(head).hexdigest() == shard.sha256 and head[10:] == tail
        with pytest.raises(NotFoundError, match="no shard"):
            client.get_artifact(ArtifactRequest("0" * 64))
        # its attester serves the state it reached once it is built (on its own thread, while the first
        # peers start): here, with no peer yet, the canonical initial state
        state = _attested(client, 0)
        assert state.outer_step == 0 and state.meta["state_id"] == StageState(cfg, 0).initial_state_id
        with pytest.raises(NotFoundError, match="holds no stage"):
            client.get_state(StateRequest(stage=cfg.stages))
        about = client.info()
    assert about["role"] == "bootstrap" and about["run_id"] == manifest["run_id"]
    assert about["peer_id"] == boot.record["peer_id"] and about["initial_peers"] == boot.maddrs
    assert about["artifacts"] == {"manifest": len(served_manifest), "tokenizer": len(tokenizer)}
    assert about["artifacts_served"] >= 3 and about["manifest_refresh_failures"] == 0
    assert about["dataset"]["fingerprint"] == manifest["dataset_fingerprint"]
    assert about["dataset"]["shards_held"] == about["dataset"]["shards"] == len(index.shards)
    assert about["states_served"] == 1 and {s["outer_step"] for s in about["attested"].values()} == {0}


def _attested(client, stage: int, wait_s: float = 60.0):
    """The bootstrap's attested state of `stage`, waiting (bounded) for its attester to be built."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return client.get_state(StateRequest(stage=stage))
        except NotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_peer_status_json_with_no_peers(boot):
    t0 = time.monotonic()
    proc = subprocess.run(
        [*PEER, "status", "--initial-peers", boot.maddrs[0], "--json", "--timeout-s", "20"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    print(f"\npeer status --json took {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status == {
        "run_id": boot.record["run_id"],
        "preset": "tiny",
        "outer_step": 0,
        "admission": "open",
        "stages": {"0": [], "1": []},
        "full_replicas": [],
    }


def test_collect_status_reads_stage_and_replica_records(boot):
    run_id = boot.record["run_id"]
    with SwarmDHT(initial_peers=boot.maddrs) as head, SwarmDHT(initial_peers=boot.maddrs) as full:
        for node in (head, full):
            node.set_run(run_id, 2)
        head.announce_stage(
            0,
            {
                "address": "127.0.0.1:7000",
                "role": "head",
                "state": "busy",
                "outer_step": 3,
                "inner_step": 5,
                "tokens_per_s": 1200.0,
                "loss": 4.5,
                "in_flight": 4,
            },
            ttl_s=30,
        )
        head.announce_replica(
            {
                "address": "127.0.0.1:7000",
                "kind": "pipeline",
                "outer_step": 3,
                "loss": 4.5,
                "tokens_per_s": 1200.0,
                "mode": "uncompressed",  # the head's boundary mode of this outer step, shown with its stage row
            },
            ttl_s=30,
        )
        full.announce_replica(
            {
                "address": "127.0.0.1:7001",
                "kind": "full",
                "outer_step": 4,
                "inner_step": 1,
                "tokens_per_s": 900.0,
                "loss": 4.25,
            },
            ttl_s=30,
        )
        status = collect_status(full, timeout_s=10)
        head.withdraw_stage(0)
        head.withdraw_replica()
        full.withdraw_replica()
    no_link = dict.fromkeys(LINK_FIELDS)  # records without connectivity fields (docs/connectivity.md)
    assert status == {
        "run_id": run_id,
        "preset": "tiny",
        "outer_step": 4,
        "admission": "open",
        "stages": {
            "0": [
                {
                    "peer_id": head.peer_id,
                    "state": "busy",
                    "outer_step": 3,
                    "tokens_per_s": 1200.0,
                    "role": "head",
                    "address": "127.0.0.1:7000",
                    "in_flight": 4,
                    "mode": "uncompressed",
                    **no_link,
                }
            ],
            "1": [],
        },
        "full_replicas": [
            # a record that does not say how many processes train it (before torchrun replicas): None
            {"peer_id": full.peer_id, "outer_step": 4, "loss": 4.25, "tokens_per_s": 900.0, **no_link}
            | {"ranks": None, "global_batch": None}
        ],
    }


def test_status_without_manifest_fails_with_one_line(reap_children):
    with SwarmDHT() as empty:
        maddr = empty.visible_maddrs()[0]
        with pytest.raises(NetworkError, match="no manifest at") as caught:
            collect_status(empty, timeout_s=1.0, where=maddr)
        assert "\n" not in str(caught.value) and "--initial-peers" in str(caught.value)
        t0 = time.monotonic()
        # --timeout-s bounds the DHT's start too: 2 s was too short for a loaded CI machine (stop 48)
        proc = subprocess.run(
            [*PEER, "status", "--initial-peers", maddr, "--timeout-s", "8"], capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())  # rich may wrap the one-line message at the terminal width
    assert text.count("error:") == 1 and "Traceback" not in text, proc.stderr
    assert "error: no manifest at" in text and "is the bootstrap running? check --initial-peers" in text, proc.stderr
    assert time.monotonic() - t0 < 45


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fixed_identity_keeps_the_multiaddr_across_restarts(tmp_path, reap_children):
    """run_bootstrap in-process (a thread), twice with the same key file and port."""
    key = tmp_path / "bootstrap.key"
    port = _free_port()
    cfg = build_config(None, TINY)
    before = live_descendants(os.getpid())
    seen = []
    for _ in range(2):
        running = RunningBootstrap(cfg, dht_port=port, identity_path=key, address_file=tmp_path / "boot.json")
        try:
            seen.append(running.wait_ready())
            assert json.loads((tmp_path / "boot.json").read_text()) == seen[-1].address_record()
        finally:
            assert running.stop() == seen[-1]
        assert not (tmp_path / "boot.json").exists()
    assert_no_leftover_children(before)
    first, second = seen
    assert first.peer_id == second.peer_id == make_identity(key)
    assert first.initial_peers == second.initial_peers == (f"/ip4/127.0.0.1/tcp/{port}/p2p/{first.peer_id}",)
    assert first.run_id == second.run_id and first.tokenizer_sha256 == second.tokenizer_sha256


def test_the_manifest_outlives_the_bootstrap_through_any_peer(tmp_path, reap_children):
    """A peer re-publishes the bootstrap's sealed manifest; once the bootstrap is gone (its own
    record expired), a new node that knows only that peer still reads the bootstrap-signed manifest."""
    boot = BootstrapProcess(tmp_path, tmp_path / "peer-cache")
    try:
        with SwarmDHT(initial_peers=boot.maddrs) as peer:
            manifest = peer.get_manifest(timeout_s=10)
            assert manifest is not None and peer.manifest_signer == boot.record["peer_id"]
            assert peer.republish_manifest(ttl_s=60)
            assert boot.stop() == 0
            time.sleep(2 * TTL_S + 1)  # the bootstrap's own signed record has expired
            with SwarmDHT(initial_peers=peer.visible_maddrs()) as joiner:
                assert joiner.get_manifest(timeout_s=10) == manifest
                assert joiner.manifest_signer == boot.record["peer_id"]  # trust stays with its signature
    finally:
        boot.stop()


def test_a_forged_seal_is_not_a_manifest():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from peer.net.identity import IdentityKey, seal, unseal

    der = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    key = IdentityKey(der)
    owner = b"[owner:" + key.get_public_key().to_bytes() + b"]"
    good = seal(key, owner, '{"run_id": "x"}')
    assert unseal(good) is not None and unseal(good)[1] == '{"run_id": "x"}'
    assert unseal({**good, "text": '{"run_id": "evil"}'}) is None
    assert unseal({**good, "owner": b"[owner:nope]"}) is None
    assert unseal("not a seal") is None
