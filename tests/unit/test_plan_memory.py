"""`peer plan --memory`: one row per preset and stage count, GPU memory per mode and host RAM beside it."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from peer.cli.main import app
from peer.core.memory import estimate_stage
from peer.research.plan.command import PLAN_PRESETS
from peer.research.plan.memory import memory_rows


def test_every_preset_and_stage_count_has_a_row_whose_modes_order_as_the_estimate_says():
    rows = memory_rows(microbatch_size=1, seq_len=1024, microbatches=8, k_ratio="1/8")
    assert {r["model"] for r in rows} == set(PLAN_PRESETS)
    by = {(r["model"], r["stages"]): r for r in rows}
    for (model, S), r in by.items():
        assert r["in_flight"] == (1 if S == 1 else 8)
        assert r["fp32 ckpt"] <= r["fp32"] and r["host"] > 0
        assert all(r["cpu " + m] >= r[m] for m in ("fp32", "bf16", "fp32 ckpt", "bf16 ckpt"))
        if S > 2:  # twice the stages at the same window: a smaller largest stage
            assert r["fp32"] < by[(model, S // 2)]["fp32"] and r["bf16 ckpt"] < by[(model, S // 2)]["bf16 ckpt"]
    for model in ("1B", "7B", "70B"):  # many micro-batches in flight: bf16 activations are half
        assert by[(model, 4)]["bf16"] < by[(model, 4)]["fp32"]
    # the row is the largest stage's device estimate
    cfg = PLAN_PRESETS["small"]
    largest = max(
        estimate_stage(cfg, s, 4, microbatch_size=1, seq_len=256, in_flight=8, k=32, device_kind="cuda").device
        for s in range(4)
    )
    assert by[("small", 4)]["fp32"] == largest


def test_the_cli_prints_the_table_and_writes_the_rows(tmp_path):
    out = tmp_path / "plan-memory.json"
    result = CliRunner().invoke(app, ["plan", "--memory", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "GPU memory of the largest stage" in result.output and "70B" in result.output
    data = json.loads(out.read_text())
    assert data["inputs"]["microbatch_size"] == 1 and len(data["rows"]) == len(memory_rows(1, 2048, 8, "1/8"))
