"""The owner's shard: the aggregate of one range, re-sparsified; its bytes; what returns to senders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import aggregate, aggregate_payloads, compress, decompress
from peer.core.sparseloco.codec.clip import clip_plan, payload_norm
from peer.core.sparseloco.codec.decode import entry_values
from peer.core.sparseloco.codec.format import PayloadError, SparseLoCoConfig
from peer.core.sparseloco.ranges import (
    Shard,
    aggregate_range,
    assemble,
    encode_parts,
    plan_ranges,
    returned_to,
    roster_digest,
    shard_delta,
)
from peer.core.sparseloco.ranges.owner import top_k_tiles

CHUNK = 8
SHAPES = {"embed": (60, 20), "norm": (20,), "w": (20, 44), "v": (44, 20)}
ROSTER = roster_digest([(f"r{i}", "00" * 32) for i in range(6)])


def _contributions(m: int, cfg: SparseLoCoConfig, R: int, big: int | None = None):
    plan = plan_ranges(SHAPES, CHUNK, R)
    out = []
    for i in range(m):
        g = torch.Generator().manual_seed(100 + i)
        delta = {n: torch.randn(s, generator=g) * (50.0 if i == big else 1.0) for n, s in SHAPES.items()}
        out.append(delta)
    parts = [encode_parts(d, None, cfg, plan)[0] for d in out]
    return plan, out, parts


def _dense_mean(parts_r, n):
    """Δ̄_r by the plain reference: aggregate of the decoded parts."""
    return aggregate([decompress(p) for p in parts_r if p is not None], n)


def test_a_full_shard_is_the_all_to_all_aggregate():
    """shard_topk = chunk², float32 values, no clipping: the assembled shards are aggregate() of the whole payloads."""
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=0, clip_median_factor=0.0)
    plan, deltas, parts = _contributions(5, cfg, R=4)
    shards = {}
    for r in range(plan.n):
        shard, stats = aggregate_range(3, 0, r, plan, [p[r] for p in parts], ROSTER, cfg, shard_topk=CHUNK * CHUNK)
        assert stats.dropped_sq == 0 and stats.quant_sq == 0 and stats.n_included == 5
        shards[r] = shard_delta(shard)
    whole = aggregate([decompress(compress(d, None, cfg)[0]) for d in deltas], 5)
    got = assemble(plan, shards, SHAPES)
    for n in SHAPES:
        torch.testing.assert_close(got[n], whole[n], atol=1e-6, rtol=0)
        assert torch.equal(got[n], whole[n])  # in fact the same bits


@pytest.mark.parametrize("qb", [0, 2])
def test_error_feedback_keeps_the_dropped_mass(qb):
    """Mean over the roster of what returns = Δ̄_r − shard where the shard dropped a coordinate, 0 where it kept one."""
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=qb, clip_median_factor=0.0)
    plan, _, parts = _contributions(6, cfg, R=3)
    for r in range(plan.n):
        parts_r = [p[r] for p in parts]
        shard, stats = aggregate_range(0, 1, r, plan, parts_r, ROSTER, cfg, shard_topk=3)
        mean = _dense_mean(parts_r, 6)
        back = [returned_to(p, i, shard) for i, p in enumerate(parts_r)]
        got = {n: sum(b[n] for b in back) / 6 for n in back[0]}
        sd = shard_delta(shard)
        dropped_sq = 0.0
        for e in shard.payload.entries:
            pos, _ = entry_values(e, shard.payload.chunk, shard.payload.topk)
            drop = torch.ones(e.shape, dtype=torch.bool).reshape(-1)
            if pos is not None:
                drop[torch.from_numpy(pos)] = False
            else:
                drop[:] = False
            want = (mean[e.name] - sd[e.name]).reshape(-1)
            torch.testing.assert_close(got[e.name].reshape(-1)[drop], want[drop], atol=1e-6, rtol=1e-5)
            assert not got[e.name].reshape(-1)[~drop].any()  # nothing returns where the shard kept a value
            dropped_sq += float((mean[e.name].reshape(-1)[drop].double() ** 2).sum())
        assert stats.dropped_sq == pytest.approx(dropped_sq, rel=1e-5, abs=1e-9)
        assert (stats.quant_sq > 0) == (qb > 0)


def test_clipped_and_missing_contributions_get_their_share_back():
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=2, clip_median_factor=2.0)
    plan, _, parts = _contributions(5, cfg, R=2, big=1)
    parts_r = [p[0] for p in parts]
    parts_r[3] = None  # not fetched: counted in the mean, returned whole
    shard, stats = aggregate_range(0, 0, 0, plan, parts_r, ROSTER, cfg)
    assert [shard.is_included(i) for i in range(5)] == [True, True, True, False, True]
    assert stats.n_included == 4 and stats.n_clipped == 1 and shard.scale_of(1) is not None
    s = np.float32(shard.scale_of(1))
    assert 0 < s < 1 and shard.scale_of(0) is None
    mask = {e.name: entry_values(e, shard.payload.chunk, shard.payload.topk)[0] for e in shard.payload.entries}
    own = decompress(parts_r[1])
    back = returned_to(parts_r[1], 1, shard)
    for name, d in own.items():
        flat, ret = d.reshape(-1).numpy(), back[name].reshape(-1).numpy()
        kept = mask[name]
        keep = np.zeros(flat.size, bool)
        keep[kept if kept is not None else slice(None)] = True
        assert np.array_equal(ret[~keep], flat[~keep])  # dropped: all of it
        assert np.array_equal(ret[keep], flat[keep] - flat[keep] * s)  # kept: the clipped mass
    missing = returned_to(parts[3][0], 3, shard)
    assert all(torch.equal(missing[n], t) for n, t in decompress(parts[3][0]).items())


def test_a_full_shard_with_clipping_is_the_fused_aggregate_bit_for_bit():
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=0, clip_median_factor=1.5)
    plan, _, parts = _contributions(6, cfg, R=3, big=2)
    for r in range(plan.n):
        parts_r: list = [p[r] for p in parts]
        parts_r[4] = None
        shard, stats = aggregate_range(0, 0, r, plan, parts_r, ROSTER, cfg, shard_topk=CHUNK * CHUNK)
        present = [p for p in parts_r if p is not None]
        scales, clip = clip_plan([payload_norm(p) for p in present], cfg.clip_median_factor)
        assert stats.n_clipped == clip.n_clipped >= 1
        want = aggregate_payloads(present, 6, scales=scales)
        got = shard_delta(shard)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_the_shard_bytes_are_canonical_and_anything_else_is_refused():
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=2)
    plan, _, parts = _contributions(6, cfg, R=2, big=4)
    parts_r = [p[1] for p in parts]
    parts_r[2] = None
    shard, _ = aggregate_range(7, 2, 1, plan, parts_r, ROSTER, cfg, shard_topk=4)
    b = shard.to_bytes()
    back = Shard.from_bytes(b, plan, cfg, 6, shard_topk=4)
    assert back.to_bytes() == b
    assert (back.t, back.stage, back.r, back.roster, back.n_roster) == (7, 2, 1, ROSTER, 6)
    assert back.scales == shard.scales and len(back.scales) == 1
    for bad in (
        lambda: Shard.from_bytes(b, plan, cfg, 5, shard_topk=4),  # another roster size
        lambda: Shard.from_bytes(b, plan, cfg, 6),  # another k
        lambda: Shard.from_bytes(b[:-1], plan, cfg, 6, shard_topk=4),
        lambda: Shard.from_bytes(b + b"\0", plan, cfg, 6, shard_topk=4),
        lambda: Shard.from_bytes(b, plan_ranges(SHAPES, CHUNK, 3), cfg, 6, shard_topk=4),
        lambda: Shard.from_bytes("text", plan, cfg, 6),  # type: ignore[arg-type]
    ):
        with pytest.raises(PayloadError):
            bad()
    for i in range(len(b)):  # every single-bit change: refused, or another canonical shard
        for bit in (0, 7):
            m = bytearray(b)
            m[i] ^= 1 << bit
            try:
                other = Shard.from_bytes(bytes(m), plan, cfg, 6, shard_topk=4)
            except PayloadError:
                continue
            assert other.to_bytes() == bytes(m)


@pytest.mark.parametrize(
    ("field", "value"),
    [("clipped", b"\x04"), ("scales", (1.5,)), ("scales", (-0.0,))],
)
def test_a_shard_with_impossible_bitmaps_or_scales_is_refused(field, value):
    from dataclasses import replace

    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=2)
    plan, _, parts = _contributions(6, cfg, R=2, big=4)
    parts_r = [p[0] for p in parts]
    parts_r[2] = None
    shard, _ = aggregate_range(0, 0, 0, plan, parts_r, ROSTER, cfg)
    with pytest.raises(PayloadError):
        Shard.from_bytes(replace(shard, **{field: value}).to_bytes(), plan, cfg, 6)


@pytest.mark.parametrize(
    ("missing", "clipped"),
    [([6], []), ([3, 1], []), ([2, 2], []), ([2], [(6, 0.5)]), ([2], [(4, 0.5), (3, 0.5)]), ([2], [(2, 0.5)])],
)
def test_a_shard_whose_exception_lists_are_not_canonical_is_refused(missing, clipped):
    """Missing and clipped roster positions travel as strictly ascending lists of positions < n_roster
    (clipped ones included): anything else is refused, so one shard has one encoding."""
    import struct

    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=2)
    plan, _, parts = _contributions(6, cfg, R=2, big=4)
    parts_r = [p[0] for p in parts]
    parts_r[2] = None
    shard, _ = aggregate_range(0, 0, 0, plan, parts_r, ROSTER, cfg)
    good = shard.to_bytes()
    head = good[: struct.calcsize("<4sBQII16sI")]
    n_clip = sum(shard.scale_of(i) is not None for i in range(6))
    tail = good[len(head) + 4 + 4 * 1 + 4 + 8 * n_clip :]  # past the good lists: the payload
    lists = struct.pack(f"<I{len(missing)}I", len(missing), *missing) + struct.pack("<I", len(clipped))
    lists += b"".join(struct.pack("<If", i, v) for i, v in clipped)
    assert Shard.from_bytes(good, plan, cfg, 6).to_bytes() == good
    with pytest.raises(PayloadError):
        Shard.from_bytes(head + lists + tail, plan, cfg, 6)


def test_top_k_per_tile_breaks_ties_by_position():
    rng = np.random.default_rng(0)
    for shape in [(20, 13), (8, 8), (3, 70), (100,)]:
        x = (rng.integers(-3, 4, size=int(np.prod(shape)))).astype(np.float32)  # many ties
        local = top_k_tiles(x, shape, 4, 5)
        rows, cols = (shape[0], shape[1]) if len(shape) == 2 else (1, shape[0])
        th, tw = (4, 4) if len(shape) == 2 else (1, 16)
        X = np.abs(x.reshape(rows, cols))
        want = []
        for tr in range(0, rows, th):
            for tc in range(0, cols, tw):
                tile = np.full((th, tw), -np.inf, np.float32)
                blk = X[tr : tr + th, tc : tc + tw]
                tile[: blk.shape[0], : blk.shape[1]] = blk
                flat = tile.reshape(-1)
                order = np.argsort(-flat, kind="stable")[: min(5, blk.size)]  # largest first, ties by position
                want.append(np.sort(order))
        assert np.array_equal(local, np.concatenate(want).astype(np.uint16)), shape


def test_roster_digest_is_order_and_content_sensitive():
    a = [("r1", "aa"), ("r2", "bb")]
    assert len(roster_digest(a)) == 32
    assert roster_digest(a) != roster_digest(a[::-1])
    assert roster_digest([("r1a", "a")]) != roster_digest([("r1", "aa")])


def test_mean_over_contributors_is_the_fused_aggregate_bit_for_bit():
    cfg = SparseLoCoConfig(
        topk=6, chunk=CHUNK, quant_bits=0, clip_median_factor=0.0, aggregation="mean-over-contributors"
    )
    plan, _, parts = _contributions(4, cfg, R=2)
    for r in range(plan.n):
        shard, _ = aggregate_range(0, 0, r, plan, [p[r] for p in parts], ROSTER, cfg, shard_topk=CHUNK * CHUNK)
        want = aggregate_payloads([p[r] for p in parts], 4, "mean-over-contributors")
        got = shard_delta(shard)
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_odd_tensors_and_missing_parts_go_through_the_whole_round():
    """Scalars, empty and 3-D tensors, ranges without any part: parts, shards and their bytes stay valid."""
    shapes = {"s": (), "e": (0, 8), "c": (20, 3, 5), "w": (30, 10), "n": (7,)}
    cfg = SparseLoCoConfig(topk=3, chunk=4, quant_bits=2)
    plan = plan_ranges(shapes, 4, 4)
    deltas = [
        {n: torch.randn(s, generator=torch.Generator().manual_seed(i)) for n, s in shapes.items()} for i in range(3)
    ]
    parts = [encode_parts(d, None, cfg, plan)[0] for d in deltas]
    shards = {}
    for r in range(plan.n):
        got = [plan.validator(r, cfg)(p[r].to_bytes()) for p in parts]
        shard, _ = aggregate_range(1, 0, r, plan, got, ROSTER, cfg)
        assert Shard.from_bytes(shard.to_bytes(), plan, cfg, 3).to_bytes() == shard.to_bytes()
        shards[r] = shard_delta(shard)
        empty, _ = aggregate_range(1, 0, r, plan, [None, None, None], ROSTER, cfg)
        assert not any(t.any() for t in shard_delta(empty).values())
    whole = assemble(plan, shards, shapes)
    assert {n: tuple(t.shape) for n, t in whole.items()} == shapes
