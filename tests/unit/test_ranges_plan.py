"""The range plan: bands of whole tile rows, every element once, R ranges of about equal size."""

from __future__ import annotations

import math

import pytest
import torch

from peer.core.sparseloco.codec.format import PayloadError, SparseLoCoConfig
from peer.core.sparseloco.ranges import assemble, band_views, encode_parts, n_ranges_for, n_units, plan_ranges

SHAPES = {
    "embed.weight": (200, 24),  # ragged last tile row (chunk 16)
    "layers.0.norm.weight": (24,),
    "layers.0.attn.weight": (72, 24),
    "layers.0.conv": (40, 3, 5),  # > 2 dims: rows × the rest
    "scale": (),
    "empty": (0, 8),
    "head.weight": (24, 200),
}
CHUNK = 16


def _numbered(shapes):
    out, start = {}, 0
    for name, s in shapes.items():
        n = math.prod(s)
        out[name] = torch.arange(start, start + n, dtype=torch.float32).reshape(s)
        start += n
    return out, start


@pytest.mark.parametrize("R", [1, 2, 3, 5, 8, 16, 40])
def test_every_element_is_in_exactly_one_band_of_whole_tile_rows(R):
    plan = plan_ranges(SHAPES, CHUNK, R)
    assert plan.n == R
    tensors, total = _numbered(SHAPES)
    seen = torch.cat([v.reshape(-1) for r in range(R) for v in band_views(tensors, plan, r).values()])
    assert torch.equal(torch.sort(seen).values, torch.arange(total, dtype=torch.float32))
    order = [b.name for bands in plan.ranges for b in bands]
    assert list(dict.fromkeys(order)) == list(SHAPES)  # tensor order kept
    for r in range(R):
        views = band_views(tensors, plan, r)
        assert sum(v.numel() for v in views.values()) == plan.range_elements(r)
        for b in plan.ranges[r]:
            assert views[b.entry].is_contiguous() and tuple(views[b.entry].shape) == b.shape
            assert b.entry == f"{b.name}@{b.row0}"
            if len(SHAPES[b.name]) >= 2:
                assert b.row0 % CHUNK == 0
                assert b.row1 % CHUNK == 0 or b.row1 == SHAPES[b.name][0]


def test_ranges_have_about_equal_element_counts_and_the_plan_is_deterministic():
    shapes = {f"l{i}.w": (256, 128) for i in range(6)} | {"embed": (1000, 128), "n": (128,)}
    total = sum(math.prod(s) for s in shapes.values())
    unit = CHUNK * 128
    for R in (2, 4, 8, 16, 32):
        plan = plan_ranges(shapes, CHUNK, R)
        assert plan == plan_ranges(dict(shapes), CHUNK, R)
        sizes = [plan.range_elements(r) for r in range(R)]
        assert sum(sizes) == total
        assert max(abs(s - total / R) for s in sizes) <= unit  # within one tile row of the ideal
    assert plan_ranges(shapes, CHUNK, 4) != plan_ranges(dict(reversed(shapes.items())), CHUNK, 4)


def test_small_tensors_share_a_range_and_a_large_one_spans_several():
    plan = plan_ranges({"a": (8,), "b": (4, 4), "big": (64 * 16, 16), "c": (3,)}, CHUNK, 4)
    assert [b.name for b in plan.ranges[0]][:2] == ["a", "b"]
    assert sum(b.name == "big" for bands in plan.ranges for b in bands) >= 3


def test_more_ranges_than_units_leave_empty_ranges_and_fewer_none():
    units = n_units(SHAPES, CHUNK)
    assert all(plan_ranges(SHAPES, CHUNK, units).ranges)
    plan = plan_ranges(SHAPES, CHUNK, units + 3)
    assert plan.n == units + 3 and sum(not bands for bands in plan.ranges) >= 3


@pytest.mark.parametrize(
    ("n", "tiles", "R"),
    [
        (0, 100, 1),
        (1, 100, 1),
        (2, 100, 2),
        (3, 100, 4),
        (8, 100, 8),
        (9, 100, 16),
        (1000, 100, 64),
        (1000, 5000, 1024),
        (5, 0, 1),
        (5, 6, 4),
    ],
)
def test_n_ranges_for(n, tiles, R):
    assert n_ranges_for(n, tiles) == R


def test_assemble_puts_bands_back_and_leaves_missing_ranges_zero():
    plan = plan_ranges(SHAPES, CHUNK, 5)
    tensors, _ = _numbered(SHAPES)
    shards = {r: {k: v.clone() for k, v in band_views(tensors, plan, r).items()} for r in range(5)}
    whole = assemble(plan, shards, SHAPES)
    assert list(whole) == list(SHAPES)
    assert all(torch.equal(whole[n], tensors[n]) for n in SHAPES)
    del shards[2]
    part = assemble(plan, shards, SHAPES)
    missing = band_views(part, plan, 2)
    assert all(not v.any() for v in missing.values())
    kept = sum(int((part[n] != 0).sum()) for n in SHAPES)
    assert kept == sum(int((tensors[n] != 0).sum()) for n in SHAPES) - sum(
        int((v != 0).sum()) for v in band_views(tensors, plan, 2).values()
    )


def test_the_validator_takes_its_own_part_and_refuses_every_other():
    cfg = SparseLoCoConfig(topk=4, chunk=CHUNK, quant_bits=2)
    plan = plan_ranges(SHAPES, CHUNK, 4)
    delta = {n: torch.randn(s, generator=torch.Generator().manual_seed(1)) for n, s in SHAPES.items()}
    parts, _ = encode_parts(delta, None, cfg, plan)
    for r, part in enumerate(parts):
        b = part.to_bytes()
        assert len(b) == plan.part_nbytes(r, cfg)
        assert plan.validator(r, cfg)(b).names() == [x.entry for x in plan.ranges[r]]
        with pytest.raises(PayloadError):
            plan.validator((r + 1) % 4, cfg)(b)
        with pytest.raises(PayloadError):
            plan.validator(r, cfg)(b[:-1])
        with pytest.raises(PayloadError):
            plan.validator(r, SparseLoCoConfig(topk=5, chunk=CHUNK, quant_bits=2))(b)
    other = plan_ranges(dict(reversed(SHAPES.items())), CHUNK, 4)
    with pytest.raises(PayloadError):
        other.validator(0, cfg)(parts[0].to_bytes())
