"""Whole simulator runs (`peer.research.simulate.engine.simulate`) on a pattern corpus the test writes:
deterministic for a seed, reporting every config, learning, and refusing bad configs.

Moved out of the unit tier (in-process and pure): these train small models for several outer steps.
"""

from __future__ import annotations

import pytest

from peer.research.simulate.engine import simulate
from tests.corpora import pattern_corpus
from tests.unit.test_replica import _cfg  # the tiny two-stage config the unit tests use


def _synthetic_data(cfg, root):
    return pattern_corpus(root, cfg.model.vocab_size, tokens=50_000, period=97, val=4_000)


def test_simulator_is_deterministic_and_reports_every_config(tmp_path):
    cfg = _cfg()
    data = _synthetic_data(cfg, tmp_path)
    a = simulate(cfg, data, replicas=2, het_fraction=0.5)
    b = simulate(cfg, data, replicas=2, configs=["pp-compress"], het_fraction=0.5)
    assert [r.name for r in a] == ["adamw", "sparseloco", "pp-compress", "het-pp-compress"]
    assert a[2].train_curve == b[0].train_curve  # bit-identical losses for the same seed
    by = {r.name: r for r in a}
    assert by["sparseloco"].delta_pct == 0.0
    assert by["adamw"].pg_bytes > 50 * by["sparseloco"].pg_bytes  # dense fp32 every step vs 2-bit top-k
    assert by["pp-compress"].act_bytes < by["het-pp-compress"].act_bytes < by["sparseloco"].act_bytes
    assert by["pp-compress"].k_ratio == "1/8" and by["het-pp-compress"].het_fraction == 0.5


def test_simulator_learns_a_pattern(tmp_path):
    cfg = _cfg(**{"train.outer_steps": 6, "train.inner_steps": 5, "train.lr": 1e-2})
    (res,) = simulate(cfg, _synthetic_data(cfg, tmp_path), replicas=2, configs=["sparseloco"])
    assert res.val_curve[-1][1] < res.val_curve[0][1] - 0.5


def test_het_fraction_must_leave_both_kinds(tmp_path):
    from peer.errors import ConfigError

    cfg = _cfg()
    with pytest.raises(ConfigError, match="het-fraction"):
        simulate(cfg, _synthetic_data(cfg, tmp_path), replicas=2, configs=["het-pp-compress"], het_fraction=1.0)
    with pytest.raises(ConfigError, match="unknown simulator config"):
        simulate(cfg, _synthetic_data(cfg, tmp_path), replicas=2, configs=["nope"])
