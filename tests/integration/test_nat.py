"""Peers behind a real NAT (network namespaces, iptables MASQUERADE, inbound NEW dropped) still train.

Each test runs `peer bootstrap` and `peer join` as processes, some in the public namespace and
some in homes behind NAT routers (`tests/integration/nat_lab.py`), on the tiny preset with few
steps, and checks: every join exits 0 after every round, every stage's parameters are
bit-identical across the replicas that hold it after every round, and each peer found the
connectivity mode it should (direct / reverse / relayed, from its "connectivity" event).
Skipped with the reason when not root or iptables is missing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.node.metrics import read_events
from tests.integration import nat_lab
from tests.integration.nat_lab import PUBLIC_IP, NatLab

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.skipif(nat_lab.unavailable() is not None, reason=str(nat_lab.unavailable())),
]

OUTER = 3
INNER = 3
JOIN_TIMEOUT_S = 150


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        PEER_CACHE_DIR=str(tmp_path / "cache"),
        HF_HUB_OFFLINE="1",
        PEER_LOG_LEVEL="INFO",
        OMP_NUM_THREADS="1",
        PEER_SWARM__MIN_REPLICAS="2",
        PEER_SWARM__ANNOUNCE_INTERVAL_S="0.5",
        PEER_SWARM__ROUND_TIMEOUT_S="60",
        PEER_SWARM__CLAIM_TIMEOUT_S="60",
    )
    return env


def _spawn(lab: NatLab, ns: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*lab.exec_prefix(ns), sys.executable, "-m", "peer", *args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _swarm(tmp_path: Path, homes: int, roles: dict[str, tuple[list[str], int | None]], relay: bool) -> dict:
    """Run a bootstrap (public, `--relay` if asked) and `roles` ({name: (join flags, home or None)})
    until every join exits; returns {name: (round events by t, connectivity event)}."""
    env = _env(tmp_path)
    address_file = tmp_path / "bootstrap.json"
    procs: dict[str, subprocess.Popen] = {}
    with NatLab("t12n", homes) as lab:
        try:
            boot_args = ["bootstrap", "--host", PUBLIC_IP, "--inner-steps", str(INNER), "--outer-steps", str(OUTER)]
            boot_args += ["--batch-size", "4", "--seq-len", "32", "--max-chars", "200000", "--address-file"]
            boot_args += [str(address_file), *(["--relay"] if relay else [])]
            procs["bootstrap"] = _spawn(lab, lab.public, boot_args, env, tmp_path / "bootstrap.log")
            deadline = time.monotonic() + 120
            while not address_file.exists():
                assert procs["bootstrap"].poll() is None, (tmp_path / "bootstrap.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the bootstrap never wrote its address file"
                time.sleep(0.2)
            for name, (flags, home) in roles.items():
                ns, host = (lab.public, PUBLIC_IP) if home is None else (lab.home(home), lab.home_ip(home))
                args = ["join", *flags, "--host", host, "--initial-peers-file", str(address_file)]
                args += ["--data-dir", str(tmp_path / name), "--device", "cpu"]
                procs[name] = _spawn(lab, ns, args, env, tmp_path / f"{name}.log")
            for name in roles:
                rc = procs[name].wait(timeout=JOIN_TIMEOUT_S)
                assert rc == 0, f"{name} exited {rc}:\n" + (tmp_path / f"{name}.log").read_text()[-4000:]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in procs.values():
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
    out = {}
    for name in roles:
        metrics = tmp_path / name / "metrics.jsonl"
        (conn,) = read_events(metrics, "connectivity")
        out[name] = ({r["t"]: r for r in read_events(metrics, "round")}, conn)
    return out


def _check_rounds(results: dict, holders: dict[str, list[str]]) -> None:
    """Every peer did every round; each stage's hash is one value per round across its holders."""
    for name, (rounds, _) in results.items():
        assert sorted(rounds) == list(range(OUTER)), f"{name} did rounds {sorted(rounds)}"
    for stage, names in holders.items():
        for t in range(OUTER):
            hashes = {results[n][0][t]["stages"][stage]["param_hash"] for n in names}
            assert len(hashes) == 1, f"stage {stage} differs across {names} after round {t}: {hashes}"
            for n in names:  # both replicas' payloads made every commit: the hidden peer's were fetched too
                assert len(results[n][0][t]["stages"][stage]["committed"]) == 2, (n, t, results[n][0][t])


def test_a_stage_peer_behind_nat_serves_a_public_head(tmp_path, reap_children):
    roles = {"stage1": (["--stage", "1"], 0), "head": (["--stage", "0"], None), "full": (["--full-replica"], None)}
    results = _swarm(tmp_path, homes=1, roles=roles, relay=False)
    modes = {name: conn["connectivity"] for name, (_, conn) in results.items()}
    assert modes == {"stage1": "reverse", "head": "direct", "full": "direct"}
    assert results["stage1"][1]["address"].split("@")[0] != results["stage1"][1]["address"]  # "PEERID@hub"
    _check_rounds(results, {"0": ["head", "full"], "1": ["stage1", "full"]})


def test_a_head_and_its_stage_peer_both_behind_nat_train_through_a_relay(tmp_path, reap_children):
    roles = {"stage1": (["--stage", "1"], 1), "head": (["--stage", "0"], 0), "full": (["--full-replica"], None)}
    results = _swarm(tmp_path, homes=2, roles=roles, relay=True)
    modes = {name: conn["connectivity"] for name, (_, conn) in results.items()}
    assert modes == {"stage1": "relayed", "head": "relayed", "full": "direct"}
    _check_rounds(results, {"0": ["head", "full"], "1": ["stage1", "full"]})


def test_a_full_replica_behind_nat_takes_part_in_rounds(tmp_path, reap_children):
    roles = {"stage1": (["--stage", "1"], None), "head": (["--stage", "0"], None), "full": (["--full-replica"], 0)}
    results = _swarm(tmp_path, homes=1, roles=roles, relay=False)
    modes = {name: conn["connectivity"] for name, (_, conn) in results.items()}
    assert modes == {"stage1": "direct", "head": "direct", "full": "reverse"}
    _check_rounds(results, {"0": ["head", "full"], "1": ["stage1", "full"]})
