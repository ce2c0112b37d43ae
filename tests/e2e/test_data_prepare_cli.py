"""`peer data prepare` as a real process: the summary it prints, a kill -9 in the middle resumed to the same
bytes as an uninterrupted run, and the CLI's error contract (exit 2, one `error:` line)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.core.data.prepare_state import STATE_FILE, load_state
from peer.core.data.shards import PreparedDataset

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PEER = [sys.executable, "-m", "peer", "data", "prepare"]
ROOT = Path(__file__).resolve().parents[2]
# four batches of 1 MiB (`prepare._BATCH_CHARS`): a kill after the first finished shard lands with three
# batches still to come (with 800 000 characters, one batch, the index could be written before the kill)
STDLIB = ["builtin:stdlib", "--max-chars", "4000000", "--vocab-size", "512", "--shard-tokens", "8000"]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PEER_LOG_LEVEL": "WARNING"}


def _prepare(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PEER, *args], capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != STATE_FILE}


def test_prepare_prints_what_it_made(tmp_path, reap_children):
    src = tmp_path / "rows.jsonl"
    paragraphs = (ROOT / "peer" / "core" / "data" / "prepare.py").read_text().split("\n\n") * 3
    src.write_text("".join(json.dumps({"content": p}) + "\n" for p in paragraphs if p.strip()))
    out = tmp_path / "out"
    done = _prepare(str(src), "--out", str(out), "--text-field", "content", "--vocab-size", "300", "--workers", "2")
    assert done.returncode == 0, done.stderr
    index = PreparedDataset.open(out).index
    assert index.fingerprint in done.stdout and index.val_fingerprint in done.stdout
    assert "tokens/s" in done.stdout and "Traceback" not in done.stderr
    again = _prepare(str(src), "--out", str(out), "--text-field", "content", "--vocab-size", "300")
    assert again.returncode == 0 and "already prepared" in again.stdout


def test_kill_9_then_the_same_command_gives_the_same_bytes(tmp_path, reap_children):
    whole = _prepare(*STDLIB, "--out", str(tmp_path / "whole"), "--workers", "1")
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [*PEER, *STDLIB, "--out", str(out), "--workers", "2"],
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # kill -9 the whole group: the parent and its tokenizing workers
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        state = load_state(out) if (out / STATE_FILE).is_file() else None
        if state is not None and state.splits["train"].shards:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.01)
    assert proc.wait(timeout=30) == -signal.SIGKILL, "the prepare ended before it could be killed"
    assert not (out / "index.json").exists()
    resumed = _prepare(*STDLIB, "--out", str(out), "--workers", "2")
    assert resumed.returncode == 0, resumed.stderr
    assert _files(out) == _files(tmp_path / "whole")


def test_bad_input_is_exit_2_and_one_error_line(tmp_path):
    for args in (
        [str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o")],
        ["builtin:stdlib", "--out", str(tmp_path / "o"), "--val-fraction", "1.5"],
        ["builtin:stdlib", "--out", str(tmp_path / "o"), "--config", "en"],
    ):
        done = _prepare(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
