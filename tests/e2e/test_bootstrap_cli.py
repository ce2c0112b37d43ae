"""`peer bootstrap` as a real process: it announces itself, prints the join lines, answers
`peer status`, and stops cleanly (exit code 0, no hivemind child or p2pd left) on SIGTERM or Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from peer.config import build_config, paper_algorithm_config
from peer.net.addresses import Reach, maddr_host, maddr_port, reach_of
from peer.net.dht import make_identity
from peer.node.manifest import run_id_for
from peer.research.bench.sybil_figures import open_swarm_status, open_swarm_warning
from tests.conftest import cmdline, is_live, live_descendants, wait_gone

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PEER = [sys.executable, "-m", "peer"]
START_DEADLINE_S = 90.0  # tokenizer on the tiny corpus + DHT start on a loaded 2-core CI machine
STOP_DEADLINE_S = 15.0


def _has_non_loopback_ipv4() -> bool:
    return any(
        a.family == socket.AF_INET and not a.address.startswith("127.")
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
    )


def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, Path, Path]:
    address_file = tmp_path / "bootstrap.json"
    stdout = tmp_path / "stdout.txt"
    cmd = [*PEER, "bootstrap", "--port", "0", "--max-chars", "300000", "--address-file", str(address_file), *extra]
    with open(stdout, "w") as out, open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True)
    return proc, address_file, stdout


def _wait_ready(proc: subprocess.Popen, address_file: Path, stdout: Path) -> dict:
    """The address file and the full banner, within START_DEADLINE_S; fails fast if the process dies."""
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"peer bootstrap exited with {proc.returncode}: {(stdout.parent / 'stderr.txt').read_text()}")
        if address_file.exists() and "peer status --initial-peers" in stdout.read_text():
            return json.loads(address_file.read_text())
        time.sleep(0.1)
    pytest.fail(f"peer bootstrap not ready within {START_DEADLINE_S:.0f} s")


def _stop(proc: subprocess.Popen, send) -> float:
    t0 = time.monotonic()
    send()
    try:
        code = proc.wait(STOP_DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"peer bootstrap still running {STOP_DEADLINE_S:.0f} s after the signal")
    assert code == 0
    return time.monotonic() - t0


def _assert_gone(pids: set[int], grace_s: float = 5.0) -> None:
    left = wait_gone(pids, grace_s)
    assert not left, f"processes left behind by peer bootstrap: {left}"


def test_bootstrap_prints_join_lines_serves_status_and_stops_on_sigterm(tmp_path, reap_children):
    t0 = time.monotonic()
    proc, address_file, stdout = _start(tmp_path)
    record = _wait_ready(proc, address_file, stdout)
    print(f"\npeer bootstrap ready in {time.monotonic() - t0:.1f} s")
    maddr = record["initial_peers"][0]
    assert maddr.endswith(f"/p2p/{record['peer_id']}")
    # on every interface by default: the line to paste names an address other machines can use, if there is one
    assert (reach_of([maddr]) is Reach.THIS_MACHINE) == (not _has_non_loopback_ipv4()), record
    assert record["grpc"].rpartition(":")[0] == maddr_host(maddr)  # the data plane is announced there too
    lines = [ln.strip() for ln in stdout.read_text().splitlines()]
    for expected in (
        f"peer join --stage 0 --initial-peers {maddr}",
        f"peer join --stage 1 --initial-peers {maddr}",
        f"peer join --full-replica --initial-peers {maddr}",
    ):
        assert expected in lines, stdout.read_text()
    assert any(record["run_id"] in ln for ln in lines)
    said = " ".join(stdout.read_text().split())  # no admission: what it admits, what that risks, how to restrict
    assert all(" ".join(line.split()) in said for line in open_swarm_warning()), said
    children = live_descendants(proc.pid)
    assert any("p2pd" in cmdline(p) for p in children if is_live(p))

    status = subprocess.run(
        [*PEER, "status", "--initial-peers", maddr, "--timeout-s", "20"], capture_output=True, text=True, timeout=90
    )
    assert status.returncode == 0, status.stderr
    assert record["run_id"] in status.stdout and "stage peers" in status.stdout and "no peer" in status.stdout
    assert " ".join(open_swarm_status().split()) in " ".join(status.stdout.split())

    took = _stop(proc, lambda: proc.send_signal(signal.SIGTERM))
    print(f"peer bootstrap exited {took:.2f} s after SIGTERM")
    assert stdout.read_text().rstrip().endswith("bootstrap stopped")
    assert not address_file.exists()
    _assert_gone(children)


def test_bootstrap_stops_on_ctrl_c_to_its_process_group(tmp_path, reap_children):
    # A terminal's Ctrl-C reaches every process of the group at once, p2pd included.
    # --paper-settings (issue 25): the paper's round rule is what the manifest (its run id) holds;
    # --swarm-secret-file: admission, so no open swarm's warning
    secret = tmp_path / "swarm.secret"
    secret.write_text("a-long-random-test-secret-0123456789\n")
    flags = ("--stages", "1", "--host", "127.0.0.1", "--paper-settings", "--swarm-secret-file", str(secret))
    proc, address_file, stdout = _start(tmp_path, *flags)
    record = _wait_ready(proc, address_file, stdout)
    assert "peer join --stage 1 " not in stdout.read_text()  # one stage: only --stage 0 is printed
    assert "admission: secret" in stdout.read_text() and "admission: open" not in stdout.read_text()
    assert "--swarm-secret-file SECRET_FILE" in stdout.read_text()
    flags = {"stages": 1, "data.max_chars": 300000, "swarm.admission": "secret"}  # what _start passed
    paper, changed = paper_algorithm_config(None, flags)
    assert changed and all(f"--paper-settings: {line}" in stdout.read_text() for line in changed)
    assert record["run_id"] == run_id_for(paper) != run_id_for(build_config(None, flags))
    port = maddr_port(record["initial_peers"][0])
    assert record["initial_peers"] == [f"/ip4/127.0.0.1/tcp/{port}/p2p/{record['peer_id']}"]
    said = " ".join(stdout.read_text().split())  # on loopback only: it says so, and which flag opens it
    assert "only this machine can join" in said and "restart it with --host 0.0.0.0" in said, said
    assert "join this run (on this machine only):" in said and "paste on another machine" not in said
    children = live_descendants(proc.pid)
    took = _stop(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    print(f"\npeer bootstrap exited {took:.2f} s after Ctrl-C")
    assert not address_file.exists()
    _assert_gone(children)


def test_print_peer_id_is_stable_and_needs_identity(tmp_path):
    key = tmp_path / "boot.key"
    first = subprocess.run(
        [*PEER, "bootstrap", "--print-peer-id", "--identity", str(key)], capture_output=True, text=True, timeout=60
    )
    assert first.returncode == 0, first.stderr
    peer_id = first.stdout.strip()
    assert re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{40,60}", peer_id), first.stdout  # base58, one line
    assert make_identity(key) == peer_id  # the key file now exists and is only read: the id is fixed
    missing = subprocess.run([*PEER, "bootstrap", "--print-peer-id"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--identity" in missing.stderr


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} of a live Prometheus endpoint (real HTTP)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_bootstrap_metrics_port_serves_the_swarm_it_sees(tmp_path, reap_children):
    """`--metrics-port 0`: the address file names the endpoint; a peer's stage and replica records
    show up in it, the manifest's re-publications are counted, and it stops with the bootstrap."""
    from peer.net.dht import SwarmDHT

    proc, address_file, stdout = _start(tmp_path, "--stages", "2", "--metrics-port", "0")
    record = _wait_ready(proc, address_file, stdout)
    url = record["metrics"]
    grpc_host = record["grpc"].rpartition(":")[0]  # listening on every interface: served where others reach it
    assert re.fullmatch(rf"http://{re.escape(grpc_host)}:\d+/metrics", url) and url in stdout.read_text()
    first = _scrape(url)
    assert first[("peer_bootstrap_uptime_seconds", ())] > 0
    assert first[("peer_bootstrap_stage_peers", (("stage", "1"),))] == 0
    assert first[("peer_bootstrap_manifest_publications_total", ())] >= 1
    # one peer publishes a stage-1 record and a full replica's record, as `peer join` does
    with SwarmDHT(initial_peers=record["initial_peers"], client_mode=True) as dht:
        dht.set_run(record["run_id"], 2)
        dht.announce_stage(1, {"address": "127.0.0.1:1", "role": "spare", "outer_step": 3}, ttl_s=60)
        dht.announce_replica({"address": "127.0.0.1:1", "kind": "full", "outer_step": 3}, ttl_s=60)
        deadline = time.monotonic() + 40  # a poll every 2 s, a manifest refresh every ttl/3 = 10 s
        seen = first
        while time.monotonic() < deadline:
            seen = _scrape(url)
            if (
                seen[("peer_bootstrap_stage_peers", (("stage", "1"),))] == 1
                and seen[("peer_bootstrap_manifest_publications_total", ())] >= 2
            ):
                break
            time.sleep(0.5)
    assert seen[("peer_bootstrap_stage_peers", (("stage", "1"),))] == 1, seen
    assert seen[("peer_bootstrap_stage_peers", (("stage", "0"),))] == 0
    assert seen[("peer_bootstrap_stage_peers_seen_total", (("stage", "1"),))] == 1
    assert seen[("peer_bootstrap_replicas", (("kind", "full"),))] == 1
    assert seen[("peer_bootstrap_replicas", (("kind", "pipeline"),))] == 0
    assert seen[("peer_bootstrap_outer_step", ())] == 3
    assert seen[("peer_bootstrap_manifest_publications_total", ())] >= 2  # re-published
    assert seen[("peer_bootstrap_manifest_refresh_failures_total", ())] == 0
    assert seen[("peer_bootstrap_uptime_seconds", ())] > first[("peer_bootstrap_uptime_seconds", ())]
    children = live_descendants(proc.pid)
    _stop(proc, lambda: proc.send_signal(signal.SIGTERM))
    _assert_gone(children)
    with pytest.raises(OSError):  # the endpoint went with the process
        _scrape(url)
