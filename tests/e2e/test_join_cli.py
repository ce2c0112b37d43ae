"""`peer bootstrap` + `peer join` as separate processes, exactly as a user runs them.

Three terminals' worth: a bootstrap, a 2-stage compressed pipeline (a stage-1 peer and a head)
and a full replica, on 127.0.0.1. Every join exits 0 after the run's rounds, the parameters of
each stage agree across the pipeline and the full replica, and a join with a bad address or
flags, or with a `--dataset` of another corpus, fails with a one-line error instead of a traceback.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.logger_files import tensorboard_scalars, wandb_run
from tests.prepared import corpus, make_prepared

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

OUTER = 3


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(PEER_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", PEER_LOG_LEVEL="INFO", OMP_NUM_THREADS="1")
    return env


def _peer(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "peer", *args],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _rounds(path: Path) -> dict[int, dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["t"]: r for r in recs if r["event"] == "round"}


def test_bootstrap_and_joins_as_processes(tmp_path, reap_children):
    env = _env(tmp_path)
    address_file = tmp_path / "bootstrap.json"
    boot = _peer(
        [
            "bootstrap",
            "--host",
            "127.0.0.1",
            "--inner-steps",
            "3",
            "--outer-steps",
            str(OUTER),
            "--batch-size",
            "4",
            "--seq-len",
            "32",
            "--max-chars",
            "200000",
            "--port",
            "0",
            "--address-file",
            str(address_file),
        ],
        {**env, "PEER_SWARM__MIN_REPLICAS": "2"},
        tmp_path / "bootstrap.log",
    )
    procs = []
    try:
        deadline = time.monotonic() + 120
        while not address_file.exists() or "running; Ctrl-C" not in (tmp_path / "bootstrap.log").read_text():
            assert boot.poll() is None, (tmp_path / "bootstrap.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "bootstrap never wrote its address file and join lines"
            time.sleep(0.2)
        maddr = json.loads(address_file.read_text())["initial_peers"][0]
        assert f"--initial-peers {maddr}" in (tmp_path / "bootstrap.log").read_text()  # the printed join line

        # the head logs to TensorBoard, the full replica to an offline W&B run (peer.node.loggers)
        roles = {
            "stage1": ["--stage", "1"],
            "full": ["--full-replica", "--wandb", "peer-e2e"],
            "head": ["--stage", "0", "--tensorboard", str(tmp_path / "tb")],
        }
        wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
        for name, flags in roles.items():
            procs.append(
                (
                    name,
                    _peer(
                        [
                            "join",
                            *flags,
                            "--host",
                            "127.0.0.1",
                            "--initial-peers",
                            maddr,
                            "--data-dir",
                            str(tmp_path / name),
                        ],
                        {**env, **wandb_env} if name == "full" else env,
                        tmp_path / f"{name}.log",
                    ),
                )
            )
        # meanwhile a head whose --dataset is another corpus is refused in one line (exit 2) before it
        # builds or announces anything; it runs beside the swarm, so it costs no extra wall time
        other = make_prepared(tmp_path / "other-corpus", corpus(1)).index
        foreign = subprocess.Popen(
            [sys.executable, "-m", "peer", "join", "--stage", "0", "--dataset", str(tmp_path / "other-corpus")]
            + ["--host", "127.0.0.1", "--initial-peers", maddr, "--data-dir", str(tmp_path / "foreign")],
            env={**env, "PEER_LOG_LEVEL": "WARNING"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        procs.append(("foreign", foreign))
        _, err = foreign.communicate(timeout=120)
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert foreign.returncode == 2 and len(errors) == 1 and "Traceback" not in err, err
        banner = re.search(r"dataset ([0-9a-f]{12}) \(validation", (tmp_path / "bootstrap.log").read_text())
        assert banner is not None  # the bootstrap names the run's corpus
        assert other.fingerprint[:12] in errors[0] and banner.group(1) in errors[0] and "--dataset" in errors[0]

        for name, proc in procs[:-1]:
            rc = proc.wait(timeout=240)
            assert rc == 0, f"{name} exited {rc}:\n" + (tmp_path / f"{name}.log").read_text()[-3000:]

        head, full, stage1 = (_rounds(tmp_path / n / "metrics.jsonl") for n in ("head", "full", "stage1"))
        assert sorted(head) == sorted(full) == sorted(stage1) == list(range(OUTER))
        for t in range(OUTER):
            assert head[t]["stages"]["0"]["param_hash"] == full[t]["stages"]["0"]["param_hash"]
            assert stage1[t]["stages"]["1"]["param_hash"] == full[t]["stages"]["1"]["param_hash"]
            assert stage1[t]["stages"]["1"]["perp_hash"] == head[t]["stages"]["0"]["perp_hash"]
        assert head[OUTER - 1]["train_loss"] < head[0]["train_loss"]
        board = tensorboard_scalars(tmp_path / "tb")  # the head's series, as metrics.jsonl has them
        assert [t for t, _ in board["round/train_loss"]] == list(range(OUTER))
        assert board["round/train_loss"][-1][1] == pytest.approx(head[OUTER - 1]["train_loss"])
        assert len(board["train/loss"]) == OUTER * 3
        wb = wandb_run(tmp_path / "full" / "wandb")
        assert wb["group"] and wb["config"]["train"]["inner_steps"] == 3
        assert [r["outer_step"] for r in wb["history"] if "round/train_loss" in r] == list(range(OUTER))

        # a bad address: one line, exit code 2, no traceback
        bad = subprocess.run(
            [
                sys.executable,
                "-m",
                "peer",
                "join",
                "--stage",
                "1",
                "--initial-peers",
                "/ip4/127.0.0.1/tcp/1/p2p/" + maddr.rsplit("/", 1)[1],
                "--manifest-timeout-s",
                "5",
                "--data-dir",
                str(tmp_path / "bad"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert bad.returncode == 2, bad.stderr
        assert "Traceback" not in bad.stderr and "error:" in bad.stderr
        both = subprocess.run(
            [sys.executable, "-m", "peer", "join", "--stage", "1", "--full-replica", "--initial-peers", maddr],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert both.returncode == 2 and "exactly one of --stage N or --full-replica" in both.stderr
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        boot.send_signal(signal.SIGTERM)
        assert boot.wait(timeout=30) == 0


@pytest.mark.parametrize("where", ["under_a_file", "a_file", "unwritable"])
def test_unusable_data_dir_is_one_line_and_exit_code_2(tmp_path, where):
    """No swarm needed: the data directory is checked before anything starts."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    data_dir = {
        "under_a_file": afile / "sub",
        "a_file": afile,
        "unwritable": Path("/proc/peer-no-such-dir"),  # not writable even for root
    }[where]
    maddr = "/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    run = subprocess.run(
        [sys.executable, "-m", "peer", "join", "--stage", "1", "--initial-peers", maddr, "--data-dir", str(data_dir)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in run.stderr and len(lines) == 1 and "--data-dir" in lines[0], run.stderr
