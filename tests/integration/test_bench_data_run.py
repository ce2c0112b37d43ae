"""`peer bench data` on tiny corpora: every figure is there and the corpora are deleted afterwards
(the figures themselves are the benchmark's, run by hand: `peer bench data`, default sizes 10M,1B)."""

from __future__ import annotations

import pytest

from peer.cli.bench_results import data_tables as tables
from peer.research.bench.data import bench_data

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_bench_reports_every_figure_and_cleans_up(tmp_path):
    lines = []
    result = bench_data(
        [200_000, 100_000], tmp_path, batches=30, steps=1, n_shards=2, show=lines.append, presets=("tiny",)
    )
    assert [r["corpus_tokens"] for r in result["memory"]] == [100_000, 200_000]
    assert all(r["hwm_bytes"] >= r["rss_bytes"] > 0 for r in result["memory"])
    assert len(result["speed"]) == 4 and all(r["tokens_per_s"] > 0 for r in result["speed"])
    assert result["step_share"][0]["preset"] == "tiny" and 0 < result["step_share"][0]["fraction"] < 1
    assert set(result["targets_met"]) == {"tokens_per_s", "rss_spread"}
    assert len(tables(result)) == 3 and len(lines) == 2
    assert list(tmp_path.iterdir()) == []  # corpora deleted
