"""Issue 25: `peer simulate --paper-settings` / `--setting` (Table 9 per preset, outer steps from the
token budget, what was set printed with its source) and the named, extendable settings."""

from __future__ import annotations

import math
import os

import pytest

from peer.cli.args import SimulateArgs
from peer.cli.options import parameters
from peer.cli.simulate_tables import settings_table
from peer.config import PAPER_ALGORITHM, build_config
from peer.core.model.decoder import PRESETS
from peer.core.model.optim import TrainConfig
from peer.errors import ConfigError
from peer.research.simulate import experiments as ex
from peer.research.simulate import paper_settings as ps
from peer.research.simulate.engine import SimOptions


@pytest.fixture(autouse=True)
def _no_peer_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("PEER_")]:
        monkeypatch.delenv(key)


def _resolve(overrides=None, names=("paper",), replicas=None, adamw_lr=None, budget=None):
    base = {"preset": "tiny", "train.outer_steps": None}
    return ps.resolve(None, base | (overrides or {}), list(names), replicas, adamw_lr, budget)


def _table(res):
    return {r.key: (r.value, r.source) for r in res.table}


PAPER_TRAIN = TrainConfig(inner_steps=50, batch_size=32, seq_len=2048)


@pytest.mark.parametrize(("preset", "outer"), [("178M", 116), ("512M", 391), ("1B", 763)])
def test_paper_budgets_give_table_9s_outer_steps(preset, outer):
    cfg = build_config(overrides={"preset": preset}, environ={})
    row = ps.paper_budget(cfg)
    assert ps.outer_steps_for(row.value, ps.PAPER_REPLICAS, PAPER_TRAIN) == outer
    assert ps.tokens_per_outer(8, PAPER_TRAIN) == 26_214_400
    if preset == "178M":
        assert row.value == 116 * 26_214_400 == 3_040_870_400 and "17.1/param" in row.source
    if preset == "512M":
        assert row.value == 391 * 26_214_400 and "20.0/param" in row.source
    if preset == "1B":
        assert row.value == 20 * 10**9  # 20 tokens per nominal parameter: ceil(2e10 / 26,214,400) = 763


def test_paper_settings_at_tiny_set_table_9_and_print_their_sources():
    res = _resolve()
    t, cfg = res.cfg.train, res.cfg
    n = PRESETS["tiny"].n_params
    assert (res.replicas, res.adamw_lr, res.budget) == (8, 3e-4, 20 * n)
    assert (cfg.stages, t.inner_steps, t.batch_size, t.seq_len, t.lr) == (4, 50, 32, 128, 1e-3)
    assert t.outer_steps == math.ceil(20 * n / (8 * 50 * 32 * 128)) == 5
    assert t.warmup_steps == 25  # Table 9's 500 capped at 10 % of the 250 inner steps
    for key, value in PAPER_ALGORITHM.items():
        assert ps.value_at(cfg, key) == value
    table = _table(res)
    assert table["train.batch_size"] == (32, "Table 9")
    assert table["train.seq_len"][0] == 128 and "max_seq_len" in table["train.seq_len"][1]
    assert table["adamw_lr"][1].startswith("Table 9") and table["replicas"][1] == "paper §3 (M)"
    assert table["train.warmup_steps"] == (25, "Table 9: 500, ≤ 10 % of run (ours)")
    assert table["token_budget"] == (20 * n, f"20 tokens/param × {n:,} params (ours; not a paper model)")
    assert table["train.outer_steps"][0] == 5 and "1,638,400" in table["train.outer_steps"][1]


def test_flags_override_and_the_outer_steps_follow_the_budget():
    res = _resolve({"train.batch_size": 8}, replicas=4)
    n = PRESETS["tiny"].n_params
    assert res.cfg.train.outer_steps == math.ceil(20 * n / (4 * 50 * 8 * 128))  # recomputed: 33
    assert _table(res)["train.batch_size"] == (8, "a flag (the setting: 32)")
    assert _table(res)["replicas"] == (4, "a flag (the setting: 8)")
    res = _resolve({"train.outer_steps": 3})  # --outer-steps wins over the budget; the warmup follows it
    assert (res.cfg.train.outer_steps, res.cfg.train.warmup_steps) == (3, 15)
    assert _table(res)["train.outer_steps"][1].startswith("a flag") and res.budget is None  # not the budget's
    res = _resolve(budget=2e6, replicas=4)
    assert res.cfg.train.outer_steps == 3 and _table(res)["token_budget"][:1] == (2_000_000,)
    assert _table(res)["token_budget"][1] == f"--token-budget (the setting: {20 * n:,})"
    assert _resolve(adamw_lr=1e-4).adamw_lr == 1e-4
    with pytest.raises(ConfigError, match="--token-budget or --outer-steps, not both"):
        _resolve({"train.outer_steps": 3}, budget=1e6)
    with pytest.raises(ConfigError, match="--token-budget must be a positive"):
        _resolve(budget=0)


def test_named_settings_unknown_names_and_toml_files(tmp_path):
    assert ps.settings_names("adamw-tuned", True) == ["paper", "adamw-tuned"]
    res = _resolve(names=["adamw-tuned"])
    assert (res.adamw_lr, res.replicas, res.cfg.train.batch_size) == (3e-4, 4, 8)  # only the AdamW lr
    with pytest.raises(ConfigError, match="--setting: unknown setting 'tuned'; choose from paper, adamw-tuned"):
        _resolve(names=["tuned"])
    toml = tmp_path / "tuned.toml"
    toml.write_text('adamw_lr = 5e-4\ntrain.lr = 2e-3\n"train.batch_size" = 16\n')
    res = _resolve(names=["paper", str(toml)])  # later wins
    assert (res.adamw_lr, res.cfg.train.lr, res.cfg.train.batch_size, res.replicas) == (5e-4, 2e-3, 16, 8)
    assert _table(res)["train.lr"] == (2e-3, str(toml))
    toml.write_text("replicas = 0\n")
    with pytest.raises(ConfigError, match="replicas must be an integer >= 1"):
        _resolve(names=[str(toml)])
    toml.write_text("train.no_such_key = 1\n")
    with pytest.raises(ConfigError, match="with --setting"):
        _resolve(names=[str(toml)])
    with pytest.raises(ConfigError, match="not found"):
        _resolve(names=[str(tmp_path / "missing.toml")])


def test_every_named_setting_is_in_the_flags_help():
    text = next(p.annotation.__metadata__[0].help for p in parameters(SimulateArgs) if p.name == "setting")
    for name in ps.SETTINGS:
        assert name in text


def test_plan_sweep_carries_the_settings_into_the_options():
    cfg, _, _, _, opts, res = ex.plan_sweep(
        None, {"preset": "tiny"}, "adamw,sparseloco", None, "0,1", ["paper"], None, SimOptions(0)
    )
    assert (opts.replicas, opts.adamw_lr, cfg.train.batch_size) == (8, 3e-4, 32) and res.table


@pytest.mark.skipif(PRESETS["178M"].max_seq_len < 2048, reason="178M's max_seq_len 2048 lands with issue 25 (D)")
def test_paper_settings_at_178m_run_table_9():
    res = _resolve({"preset": "178M"})
    t = res.cfg.train
    assert (t.seq_len, t.batch_size, t.inner_steps, t.outer_steps, t.warmup_steps) == (2048, 32, 50, 116, 500)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--setting", "nope"], "--setting: unknown setting 'nope'"),
        (["--extend", "1"], "--extend must be a number > 1"),
        (["--token-budget", "1e6", "--outer-steps", "3"], "not both"),
    ],
)
def test_the_cli_refuses_bad_settings_before_any_data(flags, message):
    from typer.testing import CliRunner

    from peer.cli.main import app

    result = CliRunner().invoke(app, ["simulate", "--preset", "tiny", "--dataset", "/nonexistent", *flags])
    assert isinstance(result.exception, ConfigError) and message in str(result.exception)


def test_the_printed_table_says_setting_value_and_source():
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(settings_table(_resolve({"train.batch_size": 8}), ["paper"]))
    text = console.export_text()
    assert "settings — paper (tiny)" in text and "where from" in text
    assert "train.batch_size" in text and "a flag (the setting: 32)" in text
    assert "6,647,040" in text and "Table 9 (AdamW baseline, tuned *)" in text
