"""`peer join --tensorboard / --wandb`'s sinks with the real packages: events written through a real
`MetricsWriter` come back from TensorBoard's event files and from W&B's offline run file."""

from __future__ import annotations

import pytest

from peer.config import build_config
from peer.node.loggers import TensorBoardSink, WandbSink
from peer.node.metrics import MetricsWriter, add_sink, remove_sink
from tests.logger_files import tensorboard_scalars, tensorboard_text, wandb_run

H = 3


def _train(tmp_path, sink) -> None:
    """A peer's events of two outer steps (H inner steps each), as the node logs them."""
    cfg = build_config(overrides={"train.inner_steps": H}, environ={})
    metrics = MetricsWriter(tmp_path / "data", "head")
    add_sink(sink)
    try:
        metrics.log("connectivity", mode="direct")  # the session's first event comes before `start`
        metrics.log("start", stage=0, peer_id="12D3KooWabcdefgh", address="127.0.0.1:1", config=cfg.to_dict(),
                    fingerprint=cfg.fingerprint())  # fmt: skip
        for t in range(2):
            for h in range(H):
                metrics.log("step", t=t, h=h, loss=5.0 - t - h / 10, tokens=128, step_s=0.25)
            metrics.log("round", t=t, train_loss=5.0 - t, val_loss=5.5 - t, round_wall_s=1.5,
                        bytes={"activations": 100 * (t + 1), "pseudo_gradients": 7},
                        stages={"0": {"participants": 2, "clipped": 0, "dropped": []}})  # fmt: skip
        metrics.log("checkpoint", t=1)
        metrics.log("exit", reason="done")
    finally:
        remove_sink(sink)
        sink.close()
        metrics.close()


def test_tensorboard_gets_every_series_at_its_step(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb")
    _train(tmp_path, sink)
    got = tensorboard_scalars(tmp_path / "tb")
    assert [s for s, _ in got["train/loss"]] == list(range(2 * H))
    assert got["train/loss"][H + 1] == (H + 1, pytest.approx(3.9))
    assert got["round/val_loss"] == [(0, 5.5), (1, 4.5)]
    assert got["bytes/activations"] == [(0, 100.0), (1, 200.0)]
    assert got["train/tokens_per_s"][0] == (0, 512.0)
    assert got["events/checkpoint"] == [(1, 1.0)]
    assert '"inner_steps": 3' in tensorboard_text(tmp_path / "tb", "config")


def test_wandb_offline_run_holds_the_config_and_the_series(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    sink = WandbSink("peer-test", tmp_path / "data")
    _train(tmp_path, sink)
    run = wandb_run(tmp_path / "data" / "wandb")
    cfg = build_config(overrides={"train.inner_steps": H}, environ={})
    assert run["name"] == "head-s0-12D3KooW" and run["group"] == cfg.fingerprint()
    assert run["config"]["train"]["inner_steps"] == H and run["config"]["model"] == cfg.to_dict()["model"]
    steps = [(r["inner_step"], r["train/loss"]) for r in run["history"] if "train/loss" in r]
    assert [s for s, _ in steps] == list(range(2 * H))
    rounds = [(r["outer_step"], r["round/val_loss"]) for r in run["history"] if "round/val_loss" in r]
    assert rounds == [(0, 5.5), (1, 4.5)]
