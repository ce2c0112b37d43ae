"""`het-bw-pp-compress` (issue 39): compression chosen by each replica's link, every outer step.

Static links whose modes give het-pp-compress's split give its losses bit for bit: an uncompressed
pipeline contributes what a full replica contributes, in the simulator as in the swarm. A link
degraded at outer step t makes its replica compressed from t on, and the run is the static one's
bits until then.
"""

from __future__ import annotations

import dataclasses

import pytest

from peer.errors import ConfigError
from peer.research.simulate import experiments as ex
from peer.research.simulate.engine import SimOptions, run_config, simulate
from peer.research.simulate.links import parse_schedule
from tests.configs import tiny_run
from tests.corpora import pattern_corpus

FLOPS = 1e11  # at tiny_run's micro-batch: 1000 Mbit/s runs uncompressed, 10 Mbit/s compressed


def _data(cfg, root):
    return pattern_corpus(root, cfg.model.vocab_size, tokens=50_000, period=97, val=4_000)


def test_static_links_of_het_pp_compress_split_give_its_losses_bit_for_bit(tmp_path):
    cfg = tiny_run(**{"train.outer_steps": 3})
    data = _data(cfg, tmp_path)
    links = parse_schedule("full,1000,10,10", None, FLOPS)
    by_role, by_link = simulate(
        cfg, data, 4, ["het-pp-compress", "het-bw-pp-compress"], 0.5, options=SimOptions(val_tokens=320, links=links)
    )
    assert by_link.modes == ["FUCC"] * 3 and by_role.modes == ["FFCC"] * 3
    assert by_link.train_curve == by_role.train_curve
    assert by_link.val_curve == by_role.val_curve
    assert by_link.final_val_loss == by_role.final_val_loss and by_link.het_fraction == by_role.het_fraction == 0.5
    assert by_link.val_loss_compressed_path == by_role.val_loss_compressed_path
    assert (by_link.pg_bytes, by_link.act_bytes) == (by_role.pg_bytes, by_role.act_bytes)
    (row,) = ex.summarize([by_role, by_link])
    pair = next(p for p in row["pairs"] if p["a"] == "het-bw-pp-compress")
    assert pair["b"] == "het-pp-compress" and pair["diffs"] == [0.0]


def test_a_link_degraded_mid_run_compresses_its_replica_from_then_on(tmp_path):
    cfg = tiny_run(**{"train.outer_steps": 4})
    data = _data(cfg, tmp_path)
    static = parse_schedule("full,1000,1000,10", None, FLOPS)
    degraded = parse_schedule("full,1000,1000,10", "2:full,1000,10,10", FLOPS)
    opts = SimOptions(replicas=4, val_tokens=320)
    a = run_config(cfg, data, "het-bw-pp-compress", dataclasses.replace(opts, links=static))
    b = run_config(cfg, data, "het-bw-pp-compress", dataclasses.replace(opts, links=degraded))
    assert a.modes == ["FUUC"] * 4
    assert b.modes == ["FUUC", "FUUC", "FUCC", "FUCC"]
    H = cfg.train.inner_steps
    assert b.train_curve[: 2 * H] == a.train_curve[: 2 * H] and b.val_curve[:2] == a.val_curve[:2]
    assert b.train_curve[2 * H :] != a.train_curve[2 * H :]
    assert b.act_bytes < a.act_bytes  # replica 2 sent (b, L, k) boundaries in steps 2 and 3
    assert b.het_fraction == 10 / 16  # F, U, U then C, C over 4 steps: 10 of 16 replica-steps uncompressed


def test_het_bw_needs_links(tmp_path):
    cfg = tiny_run()
    with pytest.raises(ConfigError, match="needs --links"):
        simulate(cfg, _data(cfg, tmp_path), 2, ["het-bw-pp-compress"])
