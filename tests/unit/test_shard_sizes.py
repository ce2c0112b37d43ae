"""The size model of exact shards bounds the real ones, and the dense form caps them whatever M."""

from __future__ import annotations

from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.research.swarm.shard_sizes import shard_rows
from peer.research.swarm.sizes import stage_sizes


def test_the_model_bounds_real_exact_shards_and_the_dense_size_caps_them():
    for qb in (2, 0):
        rows = shard_rows("tiny", 2, 1, (2, 8), SparseLoCoConfig(quant_bits=qb), measure=True)
        for row in rows:
            assert row.exact_measured is not None
            assert row.exact_measured <= row.exact_model <= 1.1 * row.exact_measured, row  # the model: a near bound
            assert row.exact_measured <= row.dense and row.exact_model <= row.dense, row
        assert rows[1].exact_measured < (rows[1].m - 1) * rows[1].payload  # below all-to-all's M − 1 payloads
    big = shard_rows("tiny", 2, 1, (100_000,))[0]
    assert big.exact_model <= big.dense  # the cap, whatever M


def test_bench_swarm_counts_exact_shards():
    topk = stage_sizes("tiny", 2, 1, 8)
    exact = stage_sizes("tiny", 2, 1, 8, shard="exact")
    assert exact.parts == topk.parts and exact.n == topk.n
    assert sum(exact.shards) > sum(topk.shards)
    assert sum(stage_sizes("tiny", 2, 1, 32, shard="exact").shards) > sum(exact.shards)
