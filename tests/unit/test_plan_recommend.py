"""`peer plan --recommend` (`peer.research.plan.recommend`): the mode and k/d per link from the real
planner, and the paper's Table 2 trend as the expected loss."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from peer.cli.plan import plan_recommend_command
from peer.errors import ConfigError
from peer.research.plan.command import plan_rows
from peer.research.plan.recommend import PAPER_TABLE2, expected_loss, recommend, usable_ratios

ARGS = {"preset": "70B", "stages": 4, "replicas": 8, "inner_steps": 50, "overlap": 1, "bandwidth_mbps": "10,1000"}


def test_expected_loss_is_table_2_at_its_rows_and_between_them_in_log_d_over_k():
    for dk, row in PAPER_TABLE2.items():
        assert expected_loss(f"1/{dk}") == row
    mid = expected_loss("1/48")  # between 24 and 96, halfway in log
    assert mid is not None and PAPER_TABLE2[24][0] < mid[0] < PAPER_TABLE2[96][0]
    assert mid[0] == pytest.approx((PAPER_TABLE2[24][0] + PAPER_TABLE2[96][0]) / 2, abs=0.01)
    assert expected_loss("1/1024") is None and expected_loss("1/4") is None  # outside what the paper measured


def test_only_ratios_that_give_whole_channels_least_compressed_first():
    assert usable_ratios(8192)[:3] == ["1/8", "1/16", "1/32"]
    assert "1/24" not in usable_ratios(8192) and "1/24" in usable_ratios(1536)
    with pytest.raises(ConfigError):
        usable_ratios(7)


def test_each_link_gets_uncompressed_the_least_compression_that_keeps_up_or_says_none_does():
    inputs, recs = recommend({**ARGS, "bandwidth_mbps": "1,100000"}, [1.0, 100000.0], 0.95)
    fast, slow = recs[1], recs[0]
    assert fast.mode == "uncompressed" and fast.util >= 0.95 and fast.loss_pp == 0
    assert slow.mode == "none" and slow.util < 0.95
    # 178M on the default 400 TFLOP/s stages at 1 Gbit/s: the boundary, not the round, bounds it
    small = {**ARGS, "preset": "178M"}
    inputs, (mid,) = recommend(small, [1000.0], 0.95)
    ratios = usable_ratios(1024)
    at = {r["k_ratio"]: r["util_compressed"] for r in plan_rows(replace(inputs, k_ratio=",".join(ratios)), [1000.0])}
    assert mid.mode == "compressed" and mid.k_ratio is not None and at[mid.k_ratio] >= 0.95 > mid.util_uncompressed
    less = [r for r in at if Fraction(r) > Fraction(mid.k_ratio)]
    assert less and all(at[r] < 0.95 for r in less)  # nothing less compressed keeps up
    assert (mid.loss_pp, mid.loss_het) == expected_loss(mid.k_ratio)


def test_the_cli_table_and_json(tmp_path):
    lines, written = [], {}
    rows = plan_recommend_command(
        lines.append, {**ARGS, "target_util": 0.9}, tmp_path / "r.json", lambda p, d: written.update(d)
    )
    assert [r["bandwidth_mbps"] for r in rows] == [10.0, 1000.0] and written["target_util"] == 0.9
    assert written["rows"] == rows and any(r["mode"] != "uncompressed" for r in rows)
    with pytest.raises(ConfigError, match="target-util"):
        recommend(ARGS, [10.0], 1.5)
