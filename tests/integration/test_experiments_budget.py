"""Issue 25: Table 3's token-budget mode (`peer simulate --token-budget N --extend F`): the baselines
at N and F·N, the subspace configs at F·N, Δ % against the baseline at the same tokens and at N."""

from __future__ import annotations

import math

import pytest

from peer.cli.simulate_tables import summary_table
from peer.config import build_config
from peer.core.model.optim import lr_at
from peer.errors import ConfigError
from peer.research.simulate import experiments as ex
from peer.research.simulate import experiments_budget as eb
from peer.research.simulate.engine import SimOptions
from tests.corpora import pattern_corpus

M = 2
BASE = {"train.batch_size": 4, "train.seq_len": 16, "train.inner_steps": 3, "train.outer_steps": 2, "stages": 2}
BASE |= {"train.warmup_steps": 1}


def _cfg():
    return build_config(overrides=BASE, environ={})


def test_budgets_from_the_flag_or_the_outer_steps_and_bad_extend_is_an_error():
    cfg, opts = _cfg(), SimOptions(replicas=M)
    per = M * 3 * 4 * 16  # M·H·B·L = 384 tokens per outer step
    b = eb.plan_budgets(cfg, opts, None, 1.5, ["sparseloco", "pp-compress"])  # N: the 2 outer steps
    assert (b.short.train.outer_steps, b.long.train.outer_steps) == (2, 3)
    assert (b.tokens(b.short), b.tokens(b.long)) == (2 * per, 3 * per)
    b = eb.plan_budgets(cfg, opts, 10 * per, 2, ["sparseloco"])
    assert (b.short.train.outer_steps, b.long.train.outer_steps) == (10, 20)
    for bad in (1.0, 0.5, -2.0, math.nan, math.inf):
        with pytest.raises(ConfigError, match="--extend must be a number > 1"):
            eb.plan_budgets(cfg, opts, None, bad, ["sparseloco"])
    with pytest.raises(ConfigError, match="rounds to the same 2 outer steps"):
        eb.plan_budgets(cfg, opts, 1.5 * per, 1.2, ["sparseloco"])  # ceil(1.5) = ceil(1.8)
    with pytest.raises(ConfigError, match=r"--extend .* add \['adamw'\] to --configs"):
        eb.plan_budgets(cfg, opts, None, 2, ["sparseloco", "adamw-pp-compress"])
    with pytest.raises(ConfigError, match="drop --attacks"):
        eb.plan_budgets(cfg, SimOptions(replicas=M, attacks=("flip",)), None, 2, ["sparseloco"])


def test_table_3_deltas_are_against_the_right_baselines(tmp_path):
    cfg, opts = _cfg(), SimOptions(replicas=M, val_tokens=512)
    data = pattern_corpus(tmp_path, cfg.model.vocab_size, tokens=30_000, period=89, val=5_000)
    b = eb.plan_budgets(cfg, opts, None, 1.5, ["sparseloco", "pp-compress"])
    long, short = eb.run_budgets(b, data, ["sparseloco", "pp-compress"], [0, 1], ["1/8"], opts)
    # the baseline ran at both budgets (each seed), the subspace config at F·N only
    assert sorted((r.name, r.seed) for r in short) == [("sparseloco @N", 0), ("sparseloco @N", 1)]
    assert sorted((r.name, r.seed) for r in long) == [(n, s) for n in ("pp-compress", "sparseloco") for s in (0, 1)]
    assert all(len(r.val_curve) == 2 for r in short) and all(len(r.val_curve) == 3 for r in long)
    assert all(r.val_curve[-1][0] == 3 * 3 for r in long) and all(r.val_curve[-1][0] == 2 * 3 for r in short)
    # each run's cosine spans its own length: the N run's last step is mid-schedule at F·N
    assert lr_at(5, b.long.train) > lr_at(5, b.short.train) > lr_at(8, b.long.train) > cfg.train.min_lr_ratio * 3e-3
    for seed in (0, 1):
        pp = next(r for r in long if r.name == "pp-compress" and r.seed == seed)
        same = next(r for r in long if r.name == "sparseloco" and r.seed == seed)
        own = next(r for r in short if r.seed == seed)
        assert same.final_val_loss != own.final_val_loss
        want_same = 100 * (pp.final_val_loss - same.final_val_loss) / same.final_val_loss
        want_own = 100 * (pp.final_val_loss - own.final_val_loss) / own.final_val_loss
        assert pp.delta_pct == pytest.approx(want_same, rel=1e-12)
        assert ex.own_budget_delta(pp, short) == pytest.approx(want_own, rel=1e-12)
    (row,) = ex.summarize(long, short)
    own_deltas = [ex.own_budget_delta(r, short) for r in long if r.name == "pp-compress"]
    assert row["delta_pct_own_budget"]["pp-compress"]["mean"] == pytest.approx(sum(own_deltas) / 2)
    assert row["sparseloco_val_loss_own_budget"]["mean"] == pytest.approx(sum(r.final_val_loss for r in short) / 2)
    runs = eb.budget_json(b, long, short)
    assert {(r["name"], r["budget"], r["tokens"]) for r in runs} >= {
        ("pp-compress", "F·N", b.tokens(b.long)),
        ("sparseloco @N", "N", b.tokens(b.short)),
    }
    assert all((r["delta_pct_own_budget"] is None) == (r["k_ratio"] is None) for r in runs)
    title = eb.budget_title(b, [0, 1])
    assert "N=768 tokens (T=2)" in title and "F·N=1,152 (F=1.5, T=3)" in title
    table = summary_table([row], title)
    assert "pp-compress Δ % vs own budget" in [c.header for c in table.columns]
