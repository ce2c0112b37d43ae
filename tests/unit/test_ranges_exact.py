"""Exact shards (issue 37): all-to-all's Δ̄ and state to the bit at quant_bits 0, canonical bytes, the bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import aggregate, compress, decompress
from peer.core.sparseloco.codec.format import PayloadError, SparseLoCoConfig
from peer.core.sparseloco.commit import commit_state, commit_summed
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
from peer.core.sparseloco.ranges.exact import (
    ExactBody,
    ExactEntry,
    dense_nbytes,
    encode_band,
    max_body_nbytes,
    parse_body,
    rice_bits,
    sparse_nbytes,
    unary_len,
)
from peer.core.sparseloco.ranges.plan import Band

CHUNK = 8
SHAPES = {"embed": (60, 20), "norm": (20,), "w": (20, 44), "v": (44, 20)}
F32 = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=0)
ROSTER = roster_digest([(f"r{i}", "00" * 32) for i in range(12)])


def _deltas(m: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(m):
        g = torch.Generator().manual_seed(300 + i)
        out.append({n: torch.randn(s, generator=g) for n, s in SHAPES.items()})
    return out


def _exact(cfg: SparseLoCoConfig, deltas, R: int):
    plan = plan_ranges(SHAPES, CHUNK, R)
    parts = [encode_parts(d, None, cfg, plan)[0] for d in deltas]
    shards = [aggregate_range(2, 0, r, plan, [p[r] for p in parts], ROSTER, cfg, exact=True) for r in range(plan.n)]
    return plan, parts, shards


@pytest.mark.parametrize("m", [1, 3, 40])
def test_exact_shards_commit_the_all_to_all_state_to_the_bit(m):
    """quant_bits 0, no clip, no screening: assemble(exact shards) is all-to-all's Δ̄, and
    commit_summed of it gives commit_state's state hashes (every M: sparse and dense bands)."""
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=0, clip_median_factor=0.0, screening=False)
    deltas = _deltas(m)
    plan, _, shards = _exact(cfg, deltas, R=4)
    for _, stats in shards:
        assert stats.dropped_sq == 0 and stats.quant_sq == 0 and stats.dense_sq == stats.kept_sq
    payloads = [compress(d, None, cfg)[0] for d in deltas]
    whole = aggregate([decompress(p) for p in payloads], m)
    summed = assemble(plan, {r: shard_delta(s) for r, (s, _) in enumerate(shards)}, SHAPES)
    for n in SHAPES:
        assert torch.equal(summed[n].view(torch.int32), whole[n].view(torch.int32)), n
    g = torch.Generator().manual_seed(9)
    start = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    a2a = commit_state(start, None, payloads, cfg, None)
    ranges = commit_summed(start, None, summed, cfg, None)
    assert a2a.param_hash and a2a.param_hash == ranges.param_hash
    dense = [e.dense for s, _ in shards for e in s.payload.entries if len(e.shape) == 2]
    assert any(dense) == (m == 40)  # one sender's top-k: every 2-D band sparse; forty: some dense


@pytest.mark.parametrize("qb", [0, 2, 4])
def test_exact_shard_bytes_are_canonical_and_bounded(qb):
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=qb, clip_median_factor=2.0)
    deltas = _deltas(12)
    deltas[5] = {n: t * 40 for n, t in deltas[5].items()}  # clipped in every range
    plan, parts, shards = _exact(cfg, deltas, R=4)
    for r, (shard, stats) in enumerate(shards):
        b = shard.to_bytes()
        back = Shard.from_bytes(b, plan, cfg, 12, exact=True)
        assert back.to_bytes() == b and back.scale_of(5) is not None
        for name, t in shard_delta(back).items():
            assert torch.equal(t, shard_delta(shard)[name])
        assert len(shard.payload.to_bytes()) <= max_body_nbytes(plan, r, cfg)
        assert (stats.quant_sq > 0) == (qb > 0)
        with pytest.raises(PayloadError):
            Shard.from_bytes(b, plan, cfg, 12)  # not a topk shard
        for bad in (b[:-1], b + b"\0", b[:-9]):
            with pytest.raises(PayloadError):
                Shard.from_bytes(bad, plan, cfg, 12, exact=True)
        rng = np.random.default_rng(r)
        for at in rng.integers(0, len(b), 40):  # one flipped byte: rejected, or another canonical shard
            m = bytearray(b)
            m[at] ^= 0xFF
            try:
                other = Shard.from_bytes(bytes(m), plan, cfg, 12, exact=True)
            except PayloadError:
                continue
            assert other.to_bytes() == bytes(m)


def test_a_band_goes_dense_exactly_when_smaller():
    band = Band("w", 0, 8, (8, 64))
    for qb in (0, 2):
        for n in (1, 20, 100, 300, 512):
            x = np.zeros(512, dtype=np.float32)
            x[np.random.default_rng(n).choice(512, n, replace=False)] = 1.5
            entry, _ = encode_band(band, x, qb)
            body = ExactBody((entry,), CHUNK, qb)
            size = len(body.to_bytes()) - 6
            dense = dense_nbytes(512, n, qb)
            assert size <= dense and entry.dense == (size == dense and size < _sparse(x, qb))
    assert rice_bits(512, 1) == 8 and rice_bits(512, 512) == 0


def _sparse(x, qb):
    pos = np.flatnonzero(x)
    return sparse_nbytes(x.size, len(pos), unary_len(pos, rice_bits(x.size, len(pos))), qb)


def test_non_canonical_forms_are_refused():
    """A band sent in its larger form, or a +0.0 sent as a sparse value, is refused."""
    band = Band("w", 0, 8, (8, 64))
    plan = plan_ranges({"w": (8, 64)}, CHUNK, 1)
    x = np.zeros(512, dtype=np.float32)
    x[[3, 70]] = [1.0, -2.0]
    sparse, _ = encode_band(band, x, 0)
    assert not sparse.dense
    as_dense = ExactBody((ExactEntry("w@0", (8, 64), True, None, x),), CHUNK, 0).to_bytes()
    with pytest.raises(PayloadError, match="smaller form"):
        parse_body(as_dense, 0, plan, 0, F32)
    zero = ExactBody(
        (type(sparse)("w@0", (8, 64), False, np.array([3, 70]), np.array([1.0, 0.0], np.float32)),), CHUNK, 0
    )
    with pytest.raises(PayloadError, match=r"\+0.0"):
        parse_body(zero.to_bytes(), 0, plan, 0, F32)
    assert parse_body(ExactBody((sparse,), CHUNK, 0).to_bytes(), 0, plan, 0, F32).entries[0].pos.tolist() == [
        3,
        70,
    ]


def test_an_exact_shard_returns_only_the_clipped_mass():
    cfg = SparseLoCoConfig(topk=6, chunk=CHUNK, quant_bits=0, clip_median_factor=2.0)
    deltas = _deltas(12)
    deltas[3] = {n: t * 40 for n, t in deltas[3].items()}
    plan, parts, shards = _exact(cfg, deltas, R=2)
    for r, (shard, _) in enumerate(shards):
        kept = returned_to(parts[0][r], 0, shard)
        assert not any(t.any() for t in kept.values())  # unclipped: nothing comes back
        back = returned_to(parts[3][r], 3, shard)
        scale = np.float32(shard.scale_of(3))
        for name, d in decompress(parts[3][r]).items():
            assert torch.equal(back[name], d - d * torch.tensor(scale))
    partial, _ = aggregate_range(
        2, 0, 0, plan, [p[0] if i else None for i, p in enumerate(parts)], ROSTER, cfg, exact=True
    )
    whole = returned_to(parts[0][0], 0, partial)  # not in the aggregate: its whole part comes back
    for name, d in decompress(parts[0][0]).items():
        assert torch.equal(whole[name], d)
