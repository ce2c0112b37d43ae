"""Issue 25, item 6: `peer simulate` with worker processes, a checkpoint every outer step, `--resume`
and `--device` — real processes, no mocks. Workers and the in-process path give the same bits for
every configuration (and range-sharded rounds); a sweep killed after its first checkpoint and resumed
gives the bits of an uninterrupted one; changed settings refuse to resume; no worker outlives a sweep."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from peer.core.data.loader import Corpus
from peer.errors import ConfigError, DataError
from peer.research.bench.simulate import fingerprint
from peer.research.simulate.checkpoint import ARGS_FILE, SUFFIX, SweepCheckpoint
from peer.research.simulate.engine import CONFIGS, SimOptions, simulate
from peer.research.simulate.links import parse_schedule
from peer.research.simulate.pool import ReplicaPool, check_workers
from peer.research.simulate.runtime import check_device, session
from tests.configs import tiny_run
from tests.conftest import assert_no_leftover_children, live_descendants
from tests.corpora import pattern_corpus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _cfg(**overrides):
    extra = {
        "sparseloco.clip_median_factor": 0.0,
        "sparseloco.screening": False,  # `peer simulate`'s default
    }
    return tiny_run(**{**extra, **overrides})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    return pattern_corpus(tmp_path_factory.mktemp("corpus"), 1024, tokens=20_000, period=89, val=2_000)


def _run(cfg, data, configs, opts, **runtime):
    with session(**runtime):
        return fingerprint(simulate(cfg, data, opts.replicas, configs, opts.het_fraction, options=opts))


def test_workers_give_the_in_process_bits_for_every_config(corpus):
    """M = 3 over 2 workers (uneven shares), two micro-batches per step: every curve value, held-out
    loss and byte count equal; the pool is gone after the sweep. het-bw-pp-compress's replicas switch
    mode after the first outer step (issue 39): the workers train each step in the mode it was sent in."""
    before = live_descendants(os.getpid())
    links = parse_schedule("full,1000,10", "1:full,10,1000", 1e11)  # F U C, then F C U
    cfg, opts = _cfg(), SimOptions(replicas=3, val_tokens=160, links=links)
    today = _run(cfg, corpus, CONFIGS, opts, workers=1, fused_commit=False)
    assert _run(cfg, corpus, CONFIGS, opts, workers=1) == today  # the fused commit: the same bits
    assert _run(cfg, corpus, CONFIGS, opts, workers=2) == today
    assert_no_leftover_children(before, wait_s=10.0, what="simulator workers left running")


def test_workers_give_the_in_process_bits_with_range_rounds_and_te_off(corpus):
    cfg = _cfg(**{"sparseloco.quant_bits": 0})
    configs = ["sparseloco", "het-pp-compress"]
    for opts in (
        SimOptions(replicas=4, val_tokens=160, round_rule="ranges"),
        SimOptions(replicas=4, val_tokens=160, round_rule="exact"),
        SimOptions(val_tokens=160, te_adaptation=False),
    ):
        assert _run(cfg, corpus, configs, opts, workers=2) == _run(
            cfg, corpus, configs, opts, workers=1, fused_commit=False
        )


def test_workers_carry_the_ablations_state(corpus):
    """Table 5c/5d: the replicas' extra fields (U's gradient, subspace moments) ride along to the workers."""
    cfg, configs = _cfg(), ["het-pp-compress"]  # compressed and uncompressed replicas side by side
    for opts in (SimOptions(val_tokens=160, grassmann=True), SimOptions(val_tokens=160, modified_adamw=True)):
        assert _run(cfg, corpus, configs, opts, workers=2) == _run(cfg, corpus, configs, opts, workers=1)


def test_a_worker_failure_is_raised_here_and_leaves_no_process(tmp_path):
    before = live_descendants(os.getpid())
    pool = ReplicaPool(2)
    try:
        with pytest.raises(DataError):
            pool.map("inner", (str(tmp_path / "nothing"), 0), [(None, 0, 2, 0, 1), (None, 1, 2, 0, 1)])
    finally:
        pool.close()
    assert_no_leftover_children(before, wait_s=10.0, what="simulator workers left running")


def test_bad_workers_and_devices_are_config_errors():
    with pytest.raises(ConfigError, match="--workers"):
        check_workers(0)
    with pytest.raises(ConfigError, match="--device"):
        check_device("tpu", None)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="--device cuda: no CUDA device is visible"):
            check_device("cuda", None)


def test_changed_settings_refuse_to_resume(tmp_path):
    SweepCheckpoint(tmp_path, {"outer_steps": 4, "configs": "sparseloco"}, resume=False)
    SweepCheckpoint(tmp_path, {"outer_steps": 4, "configs": "sparseloco"}, resume=True)  # the same: fine
    with pytest.raises(ConfigError, match="outer_steps = 4, this run has 5"):
        SweepCheckpoint(tmp_path, {"outer_steps": 5, "configs": "sparseloco"}, resume=True)
    with pytest.raises(ConfigError, match="no sweep checkpoint"):
        SweepCheckpoint(tmp_path / "empty", {}, resume=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_replicas_train_and_commit(corpus):
    cfg, opts = _cfg(), SimOptions(replicas=2, val_tokens=160)
    with session(device="cuda"):
        results = simulate(cfg, corpus, 2, ["sparseloco", "het-pp-compress"], options=opts)
    for r in results:
        assert all(torch.isfinite(torch.tensor(v)) for _, v in r.val_curve) and r.pg_bytes > 0


# ------------------------------------------------------------------------------ the CLI, killed and resumed

SIM = ["simulate", "--preset", "tiny", "--replicas", "2", "--inner-steps", "2", "--outer-steps", "3"]
SIM += ["--batch-size", "4", "--seq-len", "16", "--val-tokens", "160", "--configs", "sparseloco,het-pp-compress"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEER_")}
    return env | {"PEER_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}


def _cli(tmp_path: Path, data: Path, ckpt: Path, *extra: str) -> list[str]:
    out = [sys.executable, "-m", "peer", *SIM, "--dataset", str(data), "--checkpoint-dir", str(ckpt)]
    return [*out, "--plot", str(ckpt.with_suffix(".png")), *extra]


def _results(ckpt: Path) -> dict[str, list]:
    """Every finished run's stored result, as exact values."""
    out = {}
    for path in ckpt.glob(f"*{SUFFIX}"):
        record = pickle.loads(path.read_bytes())
        assert record["done"], f"{path.name} did not finish"
        out[path.name] = fingerprint([record["state"]])
    return out


def test_a_killed_sweep_resumes_to_the_bits_of_an_uninterrupted_one(tmp_path, corpus):
    data, env = corpus.dataset.root, _env(tmp_path)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    done = subprocess.run(_cli(tmp_path, data, whole, "--workers", "2"), env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    cut_cmd = _cli(tmp_path, data, cut, "--workers", "1")  # in process: no worker start-up before the kill
    proc = subprocess.Popen(cut_cmd, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not list(cut.glob(f"*{SUFFIX}")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # mid-sweep: after the first outer step's checkpoint
    proc.wait()
    stored = [pickle.loads(p.read_bytes()) for p in cut.glob(f"*{SUFFIX}")]
    assert stored and not (len(stored) == 2 and all(r["done"] for r in stored)), "the sweep finished before the kill"
    changed = subprocess.run(
        _cli(tmp_path, data, cut, "--resume", "--lr", "0.01"), env=env, capture_output=True, text=True
    )
    assert changed.returncode == 2 and "--resume" in changed.stderr and "lr" in changed.stderr
    assert "Traceback" not in changed.stderr
    json_out = tmp_path / "resumed.json"
    resumed = subprocess.run(
        _cli(tmp_path, data, cut, "--resume", "--workers", "1", "--json", str(json_out)),
        env=env,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _results(cut) == _results(whole) and len(_results(whole)) == 2
    assert {c["name"] for c in json.loads(json_out.read_text())["configs"]} == {"sparseloco", "het-pp-compress"}
    assert (whole / ARGS_FILE).read_text() == (cut / ARGS_FILE).read_text()
