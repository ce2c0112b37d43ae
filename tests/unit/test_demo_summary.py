"""`summarize_runs` aggregates the metrics.jsonl files of a demo's join processes (issue 3 contract)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peer.demo.summary import DemoState, ProcessView, summarize_runs
from peer.node.metrics import MetricsTail


def _round(role, t, stages, train_loss=None, val_loss=None, acts=0, equiv=0, pg=0):
    return {
        "event": "round",
        "role": role,
        "t": t,
        "stages": stages,
        "train_loss": train_loss,
        "val_loss": val_loss,
        "bytes": {"activations": acts, "activations_uncompressed_equiv": equiv, "pseudo_gradients": pg},
        "round_wall_s": 1.0,
        "time": 100.0 + t,
    }


def _st(param_hash, perp_hash="p", participants=2):
    return {"param_hash": param_hash, "perp_hash": perp_hash, "participants": participants}


def _write(path: Path, events, torn_tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        json.dumps(
            {
                "event": "start",
                "role": events[0]["role"] if events else "stage",
                "stage": None,
                "peer_id": "x",
                "address": "127.0.0.1:1",
                "time": 99.0,
            }
        )
    ]
    lines += [json.dumps(e) for e in events]
    path.write_text("\n".join(lines) + "\n" + torn_tail)
    return path


def _swarm(tmp_path, full_stage1_hash="b1", head_perp="p"):
    """A head (stage 0), a stage-1 peer and a full replica (both stages), two rounds each."""
    head = _write(
        tmp_path / "p0-s0" / "metrics.jsonl",
        [
            _round("head", 0, {"0": _st("a0", head_perp)}, 5.0, 5.5, acts=100, equiv=800, pg=10),
            _round("head", 1, {"0": _st("a1", head_perp)}, 4.0, 4.5, acts=200, equiv=1600, pg=20),
        ],
    )
    stage1 = _write(
        tmp_path / "p0-s1" / "metrics.jsonl",
        [
            _round("stage", 0, {"1": _st("b0")}, acts=50, equiv=400, pg=7),
            _round("stage", 1, {"1": _st("b1")}, acts=90, equiv=720, pg=14),
        ],
    )
    full = _write(
        tmp_path / "full0" / "metrics.jsonl",
        [
            _round("full", 0, {"0": _st("a0"), "1": _st("b0", participants=3)}, 6.0, None, pg=30),
            _round("full", 1, {"0": _st("a1"), "1": _st(full_stage1_hash, participants=2)}, 3.0, 3.5, pg=60),
        ],
        torn_tail='{"event": "exit", "rea',
    )
    return [head, stage1, full]


def test_consistent_swarm(tmp_path):
    out = summarize_runs(_swarm(tmp_path))
    assert out["params_consistent"] is True
    assert [r["t"] for r in out["rounds"]] == [0, 1]
    r0, r1 = out["rounds"]
    assert r0["train_loss"] == pytest.approx(5.5)  # mean of head 5.0 and full 6.0; the stage peer has none
    assert r0["val_loss"] == pytest.approx(5.5)  # only the head reported one
    assert r1["train_loss"] == pytest.approx(3.5) and r1["val_loss"] == pytest.approx(4.0)
    assert r0["param_hash"] == {"0": "a0", "1": "b0"}
    assert r1["param_hash"] == {"0": "a1", "1": "b1"}
    assert r0["participants"] == {"0": 2, "1": 3}  # max reported
    assert r0["reporters"] == 3


def test_byte_sums_use_each_process_final_counters(tmp_path):
    out = summarize_runs(_swarm(tmp_path))
    assert out["bytes"] == {
        "activations": 200 + 90,
        "activations_uncompressed_equiv": 1600 + 720,
        "pseudo_gradients": 20 + 14 + 60,
    }


@pytest.mark.parametrize("kind", ["param", "perp"])
def test_inconsistent_hashes(tmp_path, kind):
    paths = _swarm(tmp_path, full_stage1_hash="DIFFERENT") if kind == "param" else _swarm(tmp_path, head_perp="q")
    out = summarize_runs(paths)
    assert out["params_consistent"] is False


def test_missing_rounds_and_files(tmp_path):
    head, stage1, full = _swarm(tmp_path)
    # the stage peer missed round 1 entirely and reported round 3; a fourth process never wrote a file
    _write(
        stage1,
        [
            _round("stage", 0, {"1": _st("b0")}, acts=5, equiv=40, pg=1),
            _round("stage", 3, {"1": _st("b3")}, acts=9, equiv=72, pg=3),
        ],
    )
    out = summarize_runs([head, stage1, full, tmp_path / "never-started" / "metrics.jsonl"])
    assert [r["t"] for r in out["rounds"]] == [0, 1, 3]
    r1, r3 = out["rounds"][1], out["rounds"][2]
    assert r1["param_hash"] == {"0": "a1", "1": "b1"}  # the full replica still reports stage 1
    assert r1["reporters"] == 2
    assert r3["train_loss"] is None and r3["val_loss"] is None  # no head/full replica reported round 3
    assert r3["param_hash"] == {"1": "b3"}
    assert out["params_consistent"] is True
    assert out["bytes"]["activations"] == 200 + 9
    assert out["bytes"]["pseudo_gradients"] == 20 + 3 + 60


def test_no_files_gives_empty_summary(tmp_path):
    out = summarize_runs([tmp_path / "a.jsonl"])
    assert out == {
        "rounds": [],
        "params_consistent": True,
        "bytes": {"activations": 0, "activations_uncompressed_equiv": 0, "pseudo_gradients": 0},
    }


def test_tail_and_live_state(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = MetricsTail(path)
    assert tail.read_new() == []  # not there yet
    with open(path, "w") as f:
        f.write(json.dumps({"event": "start", "role": "head", "stage": 0}) + "\n")
        f.write(json.dumps({"event": "step", "role": "head", "t": 0, "h": 0, "loss": 7.0, "tokens": 512, "time": 10.0}))
    view = ProcessView("p0-s0", "head", 0)
    for ev in tail.read_new():  # the step line has no newline yet: held back
        view.apply(ev)
    assert view.started and view.loss is None
    with open(path, "a") as f:
        f.write(
            "\n"
            + json.dumps({"event": "step", "role": "head", "t": 0, "h": 1, "loss": 6.0, "tokens": 512, "time": 12.0})
            + "\n"
        )
        f.write(json.dumps(_round("head", 0, {"0": _st("a0")}, 6.5, None, acts=10, equiv=80, pg=3)) + "\n")
    for ev in tail.read_new():
        view.apply(ev)
    assert view.loss == 6.0 and view.inner_step == 1
    assert view.tokens_per_s == pytest.approx(512 / 2.0)
    assert view.rounds_done == 1 and view.bytes["activations_uncompressed_equiv"] == 80
    stage = ProcessView("p0-s1", "stage", 1)
    state = DemoState("training", 1.0, 3, tmp_path, [view, stage])
    assert state.round == 0  # the stage peer has committed nothing yet
    assert state.train_loss == 6.0 and state.bytes["pseudo_gradients"] == 3


@pytest.mark.parametrize(
    "kwargs", [{"stages": 0}, {"outer_steps": 0}, {"pipelines": -1}, {"pipelines": 0, "full_replicas": 0}]
)
def test_demo_config_rejects_impossible_swarms(kwargs):
    from peer.demo.run import DemoConfig
    from peer.errors import ConfigError

    with pytest.raises(ConfigError):
        DemoConfig(**kwargs)
