"""`peer demo` end to end: a bootstrap, a 2-stage compressed pipeline and a full replica as real
processes on loopback train the tiny model for 3 rounds, agree on every parameter hash, and leave
no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def _tagged(tag: str) -> list[str]:
    """Live processes that inherited DEMO_TEST_TAG=tag (the demo, its peers, their DHT daemons)."""
    out = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DEMO_TEST_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid}: {' '.join(proc.cmdline())[:200]}")
        except psutil.Error:  # gone meanwhile, or another user's process
            continue
    return out


def _logs(workdir: Path) -> str:
    parts = []
    for log in sorted(workdir.glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()[-15:]
        parts.append(f"--- {log.name}\n" + "\n".join(lines))
    return "\n".join(parts)


def test_demo_trains_a_heterogeneous_swarm(tmp_path, reap_children):
    tag = uuid.uuid4().hex
    out, workdir = tmp_path / "demo.json", tmp_path / "work"
    cmd = [
        sys.executable,
        "-m",
        "peer",
        "demo",
        "--pipelines",
        "1",
        "--stages",
        "2",
        "--full-replicas",
        "1",
        "--outer-steps",
        "3",
        "--inner-steps",
        "5",
        "--json",
        str(out),
        "--workdir",
        str(workdir),
        "--timeout-s",
        "370",
    ]
    proc = subprocess.run(cmd, env={**os.environ, "DEMO_TEST_TAG": tag}, capture_output=True, text=True, timeout=390)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{_logs(workdir)}"
    assert _tagged(tag) == []

    summary = json.loads(out.read_text())
    rounds = summary["rounds"]
    assert [r["t"] for r in rounds] == [0, 1, 2], summary
    assert summary["params_consistent"] is True, summary
    assert all(set(r["param_hash"]) == {"0", "1"} for r in rounds)
    assert all(r["participants"]["0"] >= 2 and r["participants"]["1"] >= 2 for r in rounds), rounds  # pipeline + full
    assert rounds[-1]["train_loss"] < rounds[0]["train_loss"], rounds
    b = summary["bytes"]
    assert 0 < b["activations"] < b["activations_uncompressed_equiv"], b
    assert b["pseudo_gradients"] > 0, b
    assert summary["wall_s"] > 0
    assert out.with_suffix(".png").stat().st_size > 0
    assert (workdir / "bootstrap.log").exists() and (workdir / "p0-s1" / "metrics.jsonl").exists()
