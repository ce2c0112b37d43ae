"""Issue 37: a voted round's range r (`peer.core.sparseloco.ranges.voted_range`) — votes, support, values
and the owner's mean on the wire, checked against the whole-tensor voted support and a dense mean."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from peer.core.sparseloco.aligned import aligned_sum, support_seed
from peer.core.sparseloco.codec.format import PayloadError, SparseLoCoConfig
from peer.core.sparseloco.ranges import plan_ranges, roster_digest, shard_delta
from peer.core.sparseloco.ranges.owner import Shard
from peer.core.sparseloco.ranges.voted import tile_topk, voted_support
from peer.core.sparseloco.ranges.voted_range import (
    Support,
    mean_rounding,
    mean_shard,
    parse_values,
    parse_votes,
    range_support,
    values_part,
    vote_parts,
    voted,
)

CHUNK, KEEP, SEED, T, STAGE = 8, 12, 7, 3, 1
SHAPES = {"embed": (60, 20), "norm": (20,), "w": (20, 44), "v": (44, 20)}
CFG = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=2)
ROSTER = roster_digest([(f"r{i}", "00" * 32) for i in range(4)])


def _errors(m):
    out = []
    for i in range(m):
        g = torch.Generator().manual_seed(500 + i)
        out.append({n: torch.randn(s, generator=g) for n, s in SHAPES.items()})
    return out


def _round(cfg, es, R):
    """Every sender's votes, every owner's support (one per range)."""
    plan = plan_ranges(SHAPES, CHUNK, R)
    votes = [vote_parts(e, plan, cfg) for e in es]
    parsed = [[parse_votes(v[r], plan, r, cfg) for v in votes] for r in range(plan.n)]
    supports = [range_support(T, STAGE, r, plan, parsed[r], ROSTER, cfg, KEEP, SEED) for r in range(plan.n)]
    return plan, votes, supports


def _whole(plan, supports, cfg):
    """{tensor: flat positions} assembled from the ranges' band-local supports."""
    out: dict[str, list[np.ndarray]] = {}
    for r, s in enumerate(supports):
        bands = [b for b in plan.ranges[r] if voted(b, cfg)]
        for band, pos in zip(bands, s.sets, strict=True):
            width = int(np.prod(SHAPES[band.name][1:]))
            out.setdefault(band.name, []).append(pos + band.row0 * width)
    return {n: np.sort(np.concatenate(v)) for n, v in out.items()}


@pytest.mark.parametrize("R", [1, 3, 7])
def test_range_supports_assemble_the_whole_tensors_voted_support(R):
    cfg = replace(CFG, dense_1d=False)  # every tensor voted, the 1-D one too
    es = _errors(4)
    plan, _, supports = _round(cfg, es, R)
    got = _whole(plan, supports, cfg)
    for name, shape in SHAPES.items():
        votes = [tile_topk(e[name], CHUNK, cfg.topk) for e in es]
        want, _ = voted_support(votes, shape, CHUNK, cfg.topk, KEEP, support_seed(SEED, T, STAGE, name))
        assert np.array_equal(got[name], want.numpy()), name


def test_a_vote_part_is_refused_whole_when_it_is_not_canonical():
    plan, votes, _ = _round(CFG, _errors(1), 2)
    v = votes[0][0]
    parse_votes(v, plan, 0, CFG)
    bad = {
        "short": v[:-1],
        "long": v + b"\0",
        "magic": b"VOTX" + v[4:],
        "rank past C(n, k)": v[:4] + b"\xff" * (len(v) - 4),  # a rank no k-subset has: stuffed or garbage
    }
    for what, b in bad.items():
        with pytest.raises(PayloadError):
            parse_votes(b, plan, 0, CFG)
        assert what


def test_a_support_round_trips_and_refuses_another_roster_size():
    plan, _, supports = _round(CFG, _errors(3), 2)
    s = supports[1]
    b = s.to_bytes(plan, CFG, KEEP)
    back = Support.from_bytes(b, plan, CFG, KEEP, 3)
    assert back.to_bytes(plan, CFG, KEEP) == b and back.counted == (0, 1, 2)
    for broken, n in ((b, 4), (b[:-1], 3), (b + b"\0", 3)):
        with pytest.raises(PayloadError):
            Support.from_bytes(broken, plan, CFG, KEEP, n)


def _band(t, band):
    return (t[band.row0 : band.row1] if t.dim() >= 2 else t).reshape(-1)


@pytest.mark.parametrize("qb", [0, 2])
def test_values_and_the_owners_mean_match_a_dense_reference(qb):
    cfg = replace(CFG, quant_bits=qb)
    es = _errors(3)
    before = [{n: t.clone() for n, t in e.items()} for e in es]
    plan, _, supports = _round(cfg, es, 3)
    parts = [[values_part(e, plan, s, cfg) for s in supports] for e in es]  # e written in place
    for r, s in enumerate(supports):
        vals = [parse_values(p[r], plan, s, cfg, KEEP) for p in parts]
        sets = iter(s.sets)
        for j, band in enumerate(plan.ranges[r]):
            at = torch.from_numpy(next(sets)) if voted(band, cfg) else torch.arange(band.numel)
            for m in range(3):
                e, e0, v = (
                    _band(es[m][band.name], band),
                    _band(before[m][band.name], band),
                    torch.from_numpy(vals[m][j]),
                )
                assert torch.equal(e[at], e0[at] - v)  # e − v̂ on S, v̂ exactly as the owner decodes it
                off = torch.ones(band.numel, dtype=torch.bool)
                off[at] = False
                assert torch.equal(e[off], e0[off])  # error feedback keeps the rest
                if qb == 0:
                    assert torch.equal(v, e0[at])
        vals[1] = None  # one sender's values never arrived: zero in the mean over the roster
        shard = mean_shard(plan, s, vals, cfg)
        again = Shard.from_bytes(shard.to_bytes(), plan, replace(cfg, quant_bits=0), 3, exact=True)
        assert again.to_bytes() == shard.to_bytes() and not again.is_included(1)
        got = shard_delta(again)
        sets = iter(s.sets)
        for j, band in enumerate(plan.ranges[r]):
            at = torch.from_numpy(next(sets)) if voted(band, cfg) else torch.arange(band.numel)
            sent = [torch.from_numpy(vals[m][j]) for m in (0, 2)]
            ref = aligned_sum(sent, at, (band.numel,), 3)  # float32, roster order, one division
            assert torch.equal(got[band.entry].reshape(-1), ref), band.entry


def test_a_member_whose_vote_was_not_counted_is_left_out_of_the_mean():
    es = _errors(3)
    plan, votes, _ = _round(CFG, es, 2)
    parsed = [parse_votes(v[0], plan, 0, CFG) for v in votes]
    parsed[2] = None  # its vote part was refused (or never arrived)
    support = range_support(T, STAGE, 0, plan, parsed, ROSTER, CFG, KEEP, SEED)
    assert support.counted == (0, 1)
    values = [parse_values(values_part(e, plan, support, CFG), plan, support, CFG, KEEP) for e in es]
    shard = mean_shard(plan, support, values, CFG)
    assert [shard.is_included(i) for i in range(3)] == [True, True, False]
    assert shard.to_bytes() == mean_shard(plan, support, [*values[:2], None], CFG).to_bytes()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_mean_shard_at_mean_bits_is_the_quantized_mean_and_the_size_model_bounds_it(bits):
    """`swarm.mean_bits`: the owner publishes Q(Δ̄) (the codec's quantizer per band, 1-D bands float32):
    the same bytes from every owner, smaller than the float32 mean, its rounding measured, and never more
    bytes than `peer bench swarm`'s size model (`sizes.mean_shard_nbytes`) counts."""
    from peer.research.swarm.sizes import mean_shard_nbytes

    es = _errors(3)
    plan, _, supports = _round(CFG, es, 2)
    for r, s in enumerate(supports):
        values = [parse_values(values_part(e, plan, s, CFG), plan, s, CFG, KEEP) for e in es]
        exact, coded = mean_shard(plan, s, values, CFG), mean_shard(plan, s, values, CFG, bits)
        assert coded.to_bytes() == mean_shard(plan, s, [v.copy() for v in values], CFG, bits).to_bytes()
        assert len(coded.to_bytes()) < len(exact.to_bytes())
        again = Shard.from_bytes(coded.to_bytes(), plan, replace(CFG, quant_bits=bits), 3, exact=True)
        assert again.to_bytes() == coded.to_bytes()
        with pytest.raises(PayloadError):  # a holder expecting float32 means refuses it
            Shard.from_bytes(coded.to_bytes(), plan, replace(CFG, quant_bits=0), 3, exact=True)
        want, got = shard_delta(exact), shard_delta(again)
        quant_sq, mean_sq = mean_rounding(plan, s, values, CFG, bits)
        diff = sum(float(torch.square(want[n].double() - got[n].double()).sum()) for n in want)
        assert diff == pytest.approx(quant_sq, rel=1e-6) and 0 < quant_sq < (0.02 if bits == 8 else 0.2) * mean_sq
        for band in plan.ranges[r]:
            if not voted(band, CFG):  # a band sent dense stays float32: exactly the mean
                assert torch.equal(got[band.entry], want[band.entry])
            else:  # positions: those of the float32 mean; the values' signs kept
                assert torch.equal(got[band.entry] != 0, want[band.entry] != 0)
                assert torch.equal(torch.sign(got[band.entry]), torch.sign(want[band.entry]))
        assert len(coded.payload.to_bytes()) <= mean_shard_nbytes(plan, r, CFG, KEEP, bits)
