"""The size model of exact shards bounds the real ones, and the dense form caps them whatever M; the
voted round's range sizes add up to the stage's."""

from __future__ import annotations

from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.aligned import indices_nbytes, sparse_names, values_nbytes
from peer.core.sparseloco.codec.format import (
    DENSE_F32,
    HEADER_NBYTES,
    SparseLoCoConfig,
    entry_nbytes,
    payload_nbytes,
)
from peer.core.sparseloco.ranges.plan import plan_ranges
from peer.research.plan.command import PlanInputs, resolve_model
from peer.research.swarm.shard_sizes import shard_rows
from peer.research.swarm.sizes import stage_sizes, voted_sizes


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


def test_the_voted_rounds_range_sizes_add_up_to_the_stage_as_the_design_counts_it():
    """`voted_sizes` per range sums to `peer simulate --round voted`'s whole-stage counts (the aligned
    functions on the stage's tensors) up to each band's own entry header, codebook and byte rounding."""
    preset, stages, stage, keep = "tiny", 2, 1, 64
    cfg = SparseLoCoConfig()
    _, model = resolve_model(PlanInputs(preset=preset))
    shapes = stage_shapes(model, stage, stages)
    sparse = sparse_names(shapes, cfg.dense_1d)
    dense = {n: s for n, s in shapes.items() if n not in sparse}
    whole = (
        indices_nbytes(shapes, cfg.chunk, cfg.topk, sparse),
        values_nbytes(shapes, cfg.chunk, keep, cfg.quant_bits, sparse) + payload_nbytes(dense, cfg) - HEADER_NBYTES,
        indices_nbytes(shapes, cfg.chunk, keep, sparse),
    )
    f32_values = values_nbytes(shapes, cfg.chunk, keep, 0, sparse) + sum(
        entry_nbytes(n, DENSE_F32, s, cfg.chunk, keep, 0) for n, s in dense.items()
    )
    for m in (1, 8):
        v = voted_sizes(preset, stages, stage, m, keep)
        bands = sum(len(b) for b in plan_ranges(shapes, cfg.chunk, v.n).ranges)
        for ranged, stage_total in zip((v.votes, v.values, v.supports), whole, strict=True):
            extra = sum(ranged) - stage_total - (v.n - 1) * HEADER_NBYTES
            assert 0 <= extra <= 64 * bands, (m, extra, bands)
        # the float32 mean shard: the values the design counts plus positions (Rice, <= 12 bits each here)
        n_values = (f32_values - HEADER_NBYTES) // 4
        assert f32_values - HEADER_NBYTES < sum(v.means) < f32_values + 2 * n_values, m
    v = voted_sizes(preset, stages, stage, 8, keep)
    assert sum(v.supports) > sum(v.votes) and sum(v.means) > 4 * sum(v.values)  # k′ = 2k; float32 vs 2-bit
    # swarm.mean_bits 8: codes in place of float32 (at 1B; a tiny band's 512-byte codebook outweighs them)
    f32, b8 = voted_sizes("1B", 4, 0, 8, keep), voted_sizes("1B", 4, 0, 8, keep, 8)
    assert sum(b8.means) < 0.5 * sum(f32.means)
