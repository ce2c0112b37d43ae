"""The shared plot helper (peer.cli.plots) and the two loss plots built on it write real PNGs."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest

from peer.cli.plots import figure, plot_curves, plot_demo
from peer.demo.summary import DemoResult, ProcessView
from peer.research.simulate.engine import ConfigResult

PNG = b"\x89PNG\r\n\x1a\n"


def test_figure_labels_saves_and_closes(tmp_path):
    path = tmp_path / "nested" / "dir" / "p.png"
    with figure(path, "title", xlabel="x", ylabel="y") as ax:
        ax.plot([0, 1], [1, 0], label="line")
    assert path.read_bytes().startswith(PNG)
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("x", "y", "title")
    assert plt.get_fignums() == []


def test_figure_is_closed_and_nothing_written_when_drawing_fails(tmp_path):
    path = tmp_path / "p.png"
    with pytest.raises(ValueError), figure(path, "title"):
        raise ValueError("drawing failed")
    assert not path.exists() and plt.get_fignums() == []


def test_simulate_and_demo_plots(tmp_path):
    results = [
        ConfigResult(
            name=n,
            k_ratio=None,
            het_fraction=None,
            final_loss=1.0,
            final_val_loss=1.0,
            train_curve=[(s, 5.0 - 0.01 * s) for s in range(120)],
            val_curve=[(40, 4.5), (80, 4.2)],
        )
        for n in ("adamw", "sparseloco")
    ]
    assert plot_curves(results, tmp_path / "sim.png").read_bytes().startswith(PNG)

    metrics = tmp_path / "head" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text(
        "\n".join(
            json.dumps({"event": "step", "role": "head", "t": t, "h": h, "loss": 5.0 - t - 0.1 * h})
            for t in range(2)
            for h in range(3)
        )
        + "\n"
    )
    summary = {"rounds": [{"t": 0, "train_loss": 4.9, "val_loss": 4.8}, {"t": 1, "train_loss": 3.9, "val_loss": None}]}
    result = DemoResult(summary, tmp_path, {"head": metrics}, [ProcessView("head", "head", 0)])
    assert plot_demo(result, tmp_path / "demo.png", inner_steps=3).read_bytes().startswith(PNG)
    assert plt.get_fignums() == []
