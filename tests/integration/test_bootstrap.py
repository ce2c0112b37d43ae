"""Integration tests of the bootstrap node: a real hivemind DHT, a real gRPC server, real artefacts.

One bootstrap (run_bootstrap in a thread, tiny corpus) serves the module's tests; it is stopped at
the end and must leave no hivemind child or p2pd behind. Readers are a STOCK hivemind client (no
`peer` code), peer.dht.SwarmDHT nodes, PeerClient and `peer status` as a separate process.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import hivemind
import pytest

from bootstrap.node import BootstrapInfo, run_bootstrap
from peer.config import build_config
from peer.dht import SwarmDHT, make_identity
from peer.errors import NetworkError
from peer.manifest import run_id_for, verify_manifest
from peer.status import collect_status
from peer.transport import ArtifactRequest, NotFoundError, PeerClient, StateRequest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

PEER = [sys.executable, "-m", "peer"]
READY_TIMEOUT_S = 60.0  # tokenizer training on the tiny corpus + DHT start, on a slow CI machine
TINY = {"data.max_chars": 300_000, "swarm.record_ttl_s": 3.0}  # ttl 3 s: the refresh loop runs every 1 s


def _live(pid: int) -> bool:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _live_descendants(root: int) -> set[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if raw[raw.rindex(")") + 2] != "Z":
                parents[int(entry)] = int(raw[raw.rindex(")") + 2 :].split()[1])
    out, todo = set(), [root]
    while todo:
        parent = todo.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in out:
                out.add(pid)
                todo.append(pid)
    return out


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


@pytest.fixture(scope="module")
def boot(tmp_path_factory):
    # the autouse cache fixture is function-scoped; point this module-scoped bootstrap at the same cache
    cache = tmp_path_factory.getbasetemp() / "peer-cache"
    os.environ["PEER_CACHE_DIR"] = str(cache)
    before = _live_descendants(os.getpid())
    address_file = tmp_path_factory.mktemp("boot") / "bootstrap.json"
    t0 = time.monotonic()
    running = RunningBootstrap(build_config(None, TINY), address_file=address_file)
    try:
        info = running.wait_ready()
        print(f"\nbootstrap ready in {time.monotonic() - t0:.1f} s")
        running.address_file = address_file
        yield running
    finally:
        t0 = time.monotonic()
        result = running.stop()
        print(f"\nbootstrap stopped in {time.monotonic() - t0:.2f} s")
    assert result == info
    assert not address_file.exists(), "the address file must be removed on a clean stop"
    leaked = {p for p in _live_descendants(os.getpid()) - before if _cmdline(p) != "torch_shm_manager"}
    assert not leaked, f"leaked child processes: {[_cmdline(p) for p in leaked]}"


def test_address_file_and_join_info(boot):
    info = boot.wait_ready()
    record = json.loads(boot.address_file.read_text())
    assert record == {"initial_peers": list(info.initial_peers), "grpc": info.grpc_address,
                      "run_id": info.run_id, "peer_id": info.peer_id}
    assert info.run_id == run_id_for(boot.cfg)
    assert info.initial_peers[0].startswith("/ip4/127.0.0.1/tcp/") and info.initial_peers[0].endswith(f"/p2p/{info.peer_id}")
    assert info.grpc_address.startswith("127.0.0.1:")


def test_stock_hivemind_client_reads_the_manifest(boot):
    info = boot.wait_ready()
    stock = hivemind.DHT(initial_peers=list(info.initial_peers), start=True)
    try:
        found = stock.get("peer.manifest", latest=True)
        assert found is not None and isinstance(found.value, str)
        manifest = json.loads(found.value)
        assert manifest == info.manifest
        assert manifest["run_id"] == info.run_id and manifest["bootstrap_address"] == info.grpc_address
        # the refresh loop (every ttl/3 = 1 s) keeps a 3 s record alive past its first expiration
        first_expiration = found.expiration_time
        time.sleep(boot.cfg.swarm.record_ttl_s + 0.5)
        again = stock.get("peer.manifest", latest=True)
        assert again is not None and again.expiration_time > first_expiration
        assert again.expiration_time > hivemind.utils.get_dht_time()
    finally:
        stock.shutdown()
        stock.join(5)


def test_swarm_dht_manifest_verifies_to_the_same_config(boot):
    info = boot.wait_ready()
    with SwarmDHT(initial_peers=list(info.initial_peers)) as node:
        manifest = node.get_manifest(timeout_s=10)
    assert manifest == info.manifest
    cfg = verify_manifest(manifest)
    assert cfg == boot.cfg and cfg.fingerprint() == boot.cfg.fingerprint()


def test_artifacts_over_grpc(boot):
    info = boot.wait_ready()
    with PeerClient(info.grpc_address, timeout_s=10) as client:
        tokenizer = client.get_artifact(ArtifactRequest("tokenizer"))
        assert hashlib.sha256(tokenizer).hexdigest() == info.manifest["tokenizer_sha256"] == info.tokenizer_sha256
        assert client.get_artifact(ArtifactRequest("tokenizer.model")) == tokenizer
        manifest = client.get_artifact(ArtifactRequest("manifest"))
        assert json.loads(manifest) == info.manifest
        with pytest.raises(NotFoundError, match="no artefact"):
            client.get_artifact(ArtifactRequest("weights"))
        with pytest.raises(NotFoundError, match="holds no stage"):
            client.get_state(StateRequest(stage=0))
        about = client.info()
    assert about["role"] == "bootstrap" and about["run_id"] == info.run_id and about["peer_id"] == info.peer_id
    assert about["artifacts"] == {"manifest": len(manifest), "tokenizer": len(tokenizer)}
    assert about["artifacts_served"] >= 3 and about["manifest_refresh_failures"] == 0


def test_peer_status_json_with_no_peers(boot):
    info = boot.wait_ready()
    t0 = time.monotonic()
    proc = subprocess.run(
        [*PEER, "status", "--initial-peers", info.initial_peers[0], "--json", "--timeout-s", "20"],
        capture_output=True, text=True, timeout=90,
    )
    print(f"\npeer status --json took {time.monotonic() - t0:.1f} s")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status == {"run_id": info.run_id, "preset": "tiny", "outer_step": 0,
                      "stages": {"0": [], "1": []}, "full_replicas": []}


def test_collect_status_reads_stage_and_replica_records(boot):
    info = boot.wait_ready()
    with SwarmDHT(initial_peers=list(info.initial_peers)) as head, \
            SwarmDHT(initial_peers=list(info.initial_peers)) as full:
        for node in (head, full):
            node.set_run(info.run_id, boot.cfg.stages)
        head.announce_stage(0, {"address": "127.0.0.1:7000", "role": "head", "state": "busy", "outer_step": 3,
                                "inner_step": 5, "tokens_per_s": 1200.0, "loss": 4.5}, ttl_s=30)
        head.announce_replica({"address": "127.0.0.1:7000", "kind": "pipeline", "outer_step": 3, "loss": 4.5,
                               "tokens_per_s": 1200.0}, ttl_s=30)
        full.announce_replica({"address": "127.0.0.1:7001", "kind": "full", "outer_step": 4, "inner_step": 1,
                               "tokens_per_s": 900.0, "loss": 4.25}, ttl_s=30)
        status = collect_status(full, timeout_s=10)
    assert status == {
        "run_id": info.run_id, "preset": "tiny", "outer_step": 4,
        "stages": {"0": [{"peer_id": head.peer_id, "state": "busy", "outer_step": 3, "tokens_per_s": 1200.0,
                          "role": "head", "address": "127.0.0.1:7000"}], "1": []},
        "full_replicas": [{"peer_id": full.peer_id, "outer_step": 4, "loss": 4.25, "tokens_per_s": 900.0}],
    }


def test_status_without_manifest_fails_with_one_line(reap_children):
    with SwarmDHT() as empty:
        maddr = empty.visible_maddrs()[0]
        with pytest.raises(NetworkError, match="no manifest at") as caught:
            collect_status(empty, timeout_s=1.0, where=maddr)
        assert "\n" not in str(caught.value) and "--initial-peers" in str(caught.value)
        t0 = time.monotonic()
        proc = subprocess.run([*PEER, "status", "--initial-peers", maddr, "--timeout-s", "2"],
                              capture_output=True, text=True, timeout=60)
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
    key = tmp_path / "bootstrap.key"
    port = _free_port()
    cfg = build_config(None, TINY)
    seen = []
    for _ in range(2):
        running = RunningBootstrap(cfg, dht_port=port, identity_path=key)
        try:
            seen.append(running.wait_ready())
        finally:
            running.stop()
    first, second = seen
    assert first.peer_id == second.peer_id == make_identity(key)
    assert first.initial_peers == second.initial_peers == (f"/ip4/127.0.0.1/tcp/{port}/p2p/{first.peer_id}",)
    assert first.run_id == second.run_id and first.tokenizer_sha256 == second.tokenizer_sha256
