"""`peer bench utilisation` in its smallest configuration, as a process (issue 36).

Two swarms of a bootstrap and two full replicas of the tiny model (three outer steps of H = 3, the
replicas in two network namespaces joined by a `tc tbf` link) train once with `--overlap 0` and once
with `--overlap 1`. Checked: both schedules committed every round on both replicas; every (t, stage)
has one state (param_hash, perp_hash) among its holders, and both replicas recorded it; the measured
outer step has its figures. No timing is asserted (the targets are the benchmark's). Skipped with
the reason when not root or without `ip netns` / `tc`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from peer.research.bench.netns import netns_unavailable

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

T = 3


def _unavailable() -> str | None:
    why = netns_unavailable()
    if why is not None:
        return why
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"network namespaces are not available: {probe.stderr.strip()}"


@pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))
def test_both_schedules_commit_one_state_per_round(tmp_path, reap_children):
    out = tmp_path / "utilisation.json"
    args = ["--preset", "tiny", "--inner-steps", "3", "--outer-steps", str(T), "--batch-size", "4"]
    args += ["--seq-len", "32", "--rate", "2mbit", "--workdir", str(tmp_path / "run"), "--json", str(out)]
    env = {**os.environ, "PEER_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
    done = subprocess.run(
        [sys.executable, "-m", "peer", "bench", "utilisation", *args], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "one state per (t, stage)" in done.stdout, done.stdout

    result = json.loads(out.read_text())
    assert result["shaping"] == "tc tbf"
    assert [s["overlap"] for s in result["schedules"]] == [0, 1]
    for sched in result["schedules"]:
        one = sched["one_state"]
        assert one["splits"] == [], (sched["schedule"], one)
        assert one["checked"] == one["agreed"] == one["all_holders"] == 2 * T, (sched["schedule"], one)  # 2 stages
        for name, r in sched["replicas"].items():
            assert r["rounds"] == list(range(T)), (sched["schedule"], name, r)
            assert r["measured"] == [1], (sched["schedule"], name, r)
            assert 0 < r["compute_fraction"] <= 1 and r["compute_s"] > 0, (sched["schedule"], name, r)
