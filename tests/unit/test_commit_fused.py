"""The fused commit (issue 24 item 5): payloads in, the same bits as decode-then-aggregate.

- the sparse consensus scores equal the dense form as it was written before (kept here verbatim as
  the reference), exactly, over several slices, absent tensors, −0.0 values and a dense attacker;
- `commit_state` / `embedding_update` / `robust_aggregate` given parsed payloads give the bits
  the dense path gives (clip_to_median → screen → aggregate of decompressed Δ̂), attacks dropped;
- reused buffers: `decompress(out=…)` writes the caller's buffers (same bits as fresh ones), the
  commit's lent accumulators never alias what it returns, two open lends never share a buffer.
"""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest
import torch

from peer.core.sparseloco import consensus, robust
from peer.core.sparseloco.algorithm import aggregate, compress, decompress, screen_rows
from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.clip import clip_to_median, global_norm
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.codec.scratch import ACCUMULATORS, BufferPool
from peer.core.sparseloco.commit import commit_state, embedding_update, robust_aggregate
from peer.core.subspace.state import EMBED

# ------------------------------------------------------------------ the dense form, as it was


def _exact_dot(a, b) -> float:
    nz = a != 0
    if not bool(nz.any()):
        return 0.0
    prod = a[nz].to(torch.float64) * b[nz].to(torch.float64)
    return math.fsum(prod.tolist())


def _medians_without_each(stack):
    n = stack.shape[0]
    ordered = stack.sort(dim=0, stable=True)
    ranks = torch.empty_like(ordered.indices)
    ranks.scatter_(0, ordered.indices, torch.arange(n).unsqueeze(1).expand_as(ordered.indices).contiguous())
    m = n - 1
    lo = (m - 1) // 2 + ((m - 1) // 2 >= ranks).long()
    hi = m // 2 + (m // 2 >= ranks).long()
    low, high = ordered.values.gather(0, lo), ordered.values.gather(0, hi)
    return low if m % 2 else (low + high) * 0.5


def dense_scores(decoded, voters) -> list[float]:
    """`consensus_scores` before issue 24, verbatim (with its two helpers above): dense slices of
    every voter, every coordinate sorted, in torch."""
    names = sorted({name for i in voters for name in decoded[i]})
    dots = [[0.0] for _ in voters]
    sq_self = [[0.0] for _ in voters]
    sq_med = [[0.0] for _ in voters]
    for name in names:
        shape = next(decoded[i][name].shape for i in voters if name in decoded[i])
        numel = math.prod(shape)
        flat = [
            decoded[i][name].detach().reshape(-1).to("cpu", torch.float32) if name in decoded[i] else None
            for i in voters
        ]
        for start in range(0, numel, consensus.SLICE):
            stop = min(numel, start + consensus.SLICE)
            rows = [f[start:stop] if f is not None else torch.zeros(stop - start) for f in flat]
            meds = _medians_without_each(torch.stack(rows))
            for j, row in enumerate(rows):
                dots[j].append(_exact_dot(row, meds[j]))
                sq_self[j].append(_exact_dot(row, row))
                sq_med[j].append(_exact_dot(meds[j], meds[j]))
    out = []
    for dot, sq, sq_m in zip(dots, sq_self, sq_med, strict=True):
        norm, med_norm = math.sqrt(math.fsum(sq)), math.sqrt(math.fsum(sq_m))
        out.append(math.fsum(dot) / (norm * med_norm) if norm > 0 and med_norm > 0 else 0.0)
    return out


def dense_robust_aggregate(decoded, cfg, rcfg=robust.DEFAULT, keys=None, monkeypatch=None):
    """robust_aggregate before issue 24, by sections: clip_to_median by whole norms, then per section (the
    embedding, the rest) screen with `dense_scores` and that section's norms, aggregate what it kept."""
    clipped, clip = clip_to_median(decoded, cfg.clip_median_factor)
    summed, screens = {}, {}
    for section in robust.sections({n for d in decoded for n in d}):
        norms = [global_norm({n: t for n, t in d.items() if n in section}) for d in decoded]
        norms = [n if math.isfinite(w) else math.nan for n, w in zip(norms, clip.norms, strict=True)]
        parts = [{n: t for n, t in d.items() if n in section} for d in clipped]
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(robust, "consensus_scores", dense_scores)
            screens[section] = robust.screen(parts, norms, rcfg, keys)
        kept = [p for i, p in enumerate(parts) if i not in set(screens[section].dropped)]
        summed.update(aggregate(kept, len(kept), cfg.aggregation))
    embedding = screens.pop((EMBED,), None)
    rest = next(iter(screens.values()), embedding)
    summed = {n: summed[n] for n in dict.fromkeys(n for d in decoded for n in d)}  # as one aggregate names them
    return summed, clip, rest if embedding is None else dataclasses.replace(rest, embedding=embedding)


# ------------------------------------------------------------------ rounds


SHAPES = {EMBED: (96, 40), "blocks.0.w": (130, 70), "blocks.0.gain": (70,), "head.w": (40, 33)}


def _round(m: int, cfg: SparseLoCoConfig, seed: int = 0, attack: bool = True) -> list[Payload]:
    """m parsed payloads of correlated contributions; with `attack`, the last one is −100 × the first."""
    g = torch.Generator().manual_seed(seed)
    common = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    deltas = [{n: c + 0.7 * torch.randn(c.shape, generator=g) for n, c in common.items()} for _ in range(m)]
    if attack:
        deltas[-1] = {n: -100.0 * t for n, t in deltas[0].items()}
    if m > 1:
        deltas[1].pop("head.w")  # an absent tensor counts as zeros
    return [Payload.from_bytes(compress(d, None, cfg)[0].to_bytes()) for d in deltas]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for n in a:
        assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape
        assert torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)), n  # bits, −0.0 included


CFGS = [
    SparseLoCoConfig(),
    SparseLoCoConfig(quant_bits=0, aggregation="mean-over-contributors"),
    SparseLoCoConfig(topk=8, chunk=16, clip_median_factor=0.0),
]


@pytest.mark.parametrize(
    ("slice_", "pass_"), [(consensus.SLICE, consensus.PASS), (1000, consensus.PASS), (257, 50), (1000, 7)]
)
def test_sparse_scores_equal_the_dense_form_exactly(monkeypatch, slice_, pass_):
    monkeypatch.setattr(consensus, "SLICE", slice_)
    monkeypatch.setattr(consensus, "PASS", pass_)  # a slice ranked in several passes sums the same
    cfg = SparseLoCoConfig()
    payloads = _round(7, cfg, seed=slice_)
    decoded = [decompress(p) for p in payloads]
    decoded[2]["blocks.0.w"][0, :5] = -0.0  # explicit −0.0 entries and a dense, huge one
    decoded[3] = {n: torch.randn(t.shape) * 50 for n, t in decoded[3].items()}
    decoded[5] = {n: t.clone() for n, t in decoded[4].items()}  # ties everywhere it sends
    for voters in ([0, 1, 2, 3, 4, 5, 6], [1, 3, 5], [6, 0, 4, 2], [0, 1, 2, 4, 5, 6]):
        assert robust.consensus_scores(decoded, voters) == dense_scores(decoded, voters)
    plan = [None, 0.5, None, None, 0.25, None, None]  # clip scales: the payload rows are clipped values
    clipped = [
        decompress(p) if s is None else {n: t * s for n, t in decompress(p).items()}
        for p, s in zip(payloads, plan, strict=True)
    ]
    for voters in ([0, 1, 4, 6], [0, 1, 2, 3, 4, 5, 6]):
        got = robust.sparse_consensus_scores(screen_rows(payloads, voters, plan), len(voters))
        assert got == dense_scores(clipped, voters)  # read off the payloads, without a dense Δ̂


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("numba", [True, False])
def test_fused_robust_aggregate_is_the_dense_one_bit_for_bit(cfg, numba, monkeypatch):
    monkeypatch.setattr(consensus, "SLICE", 997)
    monkeypatch.setattr(consensus, "PASS", 1500)
    pk.set_numba(numba)
    if numba:
        pk.compiled(pk.NUMBA_MIN_WORK)  # load the kernels: small tensors then use them too
    try:
        for m, attack in ((1, False), (2, True), (5, True), (8, False)):
            payloads = _round(m, cfg, seed=m, attack=attack)
            keys = [f"r{i}" for i in range(m)]
            want, wclip, wscreen = dense_robust_aggregate([decompress(p) for p in payloads], cfg, keys=keys)
            got, clip, screened = robust_aggregate(payloads, cfg, keys=keys)
            _same(got, want)
            assert clip == wclip and screened == wscreen
            if attack and m >= 5:
                assert screened.dropped == (m - 1,)  # the attacker, and only it
    finally:
        pk.set_numba(True)


def test_commit_state_of_payloads_is_the_dense_commit_and_lends_no_result():
    cfg = SparseLoCoConfig()
    payloads = _round(6, cfg, seed=3)
    g = torch.Generator().manual_seed(9)
    start = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    U, perp = torch.linalg.qr(torch.randn(40, 8, generator=g))[0], torch.randn(96, 40, generator=g) * 1e-3
    keys = [f"r{i}" for i in range(6)]
    dense = commit_state(start, perp, [decompress(p) for p in payloads], cfg, U, None, 0.99, keys=keys)
    fused = commit_state(start, perp, payloads, cfg, U, None, 0.99, keys=keys)
    _same(fused.params, dense.params)
    _same({"perp": fused.perp}, {"perp": dense.perp})
    _same({"u": fused.commit.embed_update}, {"u": dense.commit.embed_update})
    assert fused.commit.clip == dense.commit.clip and fused.commit.screen == dense.commit.screen
    assert fused.commit.dropped == (5,)
    kept = {n: t.clone() for n, t in fused.params.items()}
    u = fused.commit.embed_update.clone()
    again = commit_state(start, perp, _round(6, cfg, seed=4), cfg, U, None, 0.99, keys=keys)  # reuses the buffers
    _same(fused.params, kept)  # a later commit never writes what an earlier one returned
    _same({"u": fused.commit.embed_update}, {"u": u})
    assert not torch.equal(again.params["head.w"], kept["head.w"])
    held = [b.data_ptr() for bufs in ACCUMULATORS._free.values() for b in bufs]
    results = [t.data_ptr() for t in (*again.params.values(), again.perp, again.commit.embed_update)]
    assert held and not set(held) & set(results)


def test_embedding_update_of_payloads_is_the_dense_one():
    cfg = SparseLoCoConfig()
    payloads = _round(5, cfg, seed=11)
    keys = [f"r{i}" for i in range(5)]
    want = embedding_update([decompress(p) for p in payloads], cfg, keys=keys)
    _same({"u": embedding_update(payloads, cfg, keys=keys)}, {"u": want})


def test_decompress_into_the_callers_buffers_gives_the_same_bits():
    for cfg in CFGS:
        p = _round(2, cfg, seed=5, attack=False)[0]
        fresh = decompress(p)
        bufs = {n: torch.full(t.shape, float("nan")) for n, t in fresh.items()}  # stale contents
        got = decompress(p, out=bufs)
        _same(got, fresh)
        assert all(got[n] is bufs[n] for n in got)  # the caller's tensors: it owns them
        other = decompress(_round(2, cfg, seed=6, attack=False)[0], out=bufs)
        assert other["head.w"] is got["head.w"]  # a reuse overwrites what the last decode returned
    with pytest.raises(ValueError, match="shape"):
        decompress(p, out={n: torch.zeros(3) for n in fresh})


def test_a_pool_never_lends_one_buffer_to_two_open_blocks():
    pool = BufferPool()
    seen: list[int] = []
    inside = threading.Barrier(2)

    def borrow() -> None:
        with pool.lend({"a": (4, 4)}) as bufs:
            seen.append(bufs["a"].data_ptr())
            inside.wait()  # both blocks are open at once

    threads = [threading.Thread(target=borrow) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == 2 and pool.held_bytes() == 2 * 64
    with pool.lend({"a": (4, 4)}) as bufs:
        assert bufs["a"].data_ptr() in seen  # later blocks reuse them
    pool.clear()
    assert pool.held_bytes() == 0


def test_the_bucketing_groups_entries_by_unit_in_their_order_however_it_is_cut(monkeypatch):
    count, place = pk.compiled_function(consensus._count_jit), pk.compiled_function(consensus._place_jit)
    if count is None or place is None:
        pytest.skip("numba is not available here: the numpy path runs instead")
    rng = np.random.default_rng(0)
    unit, per_slice = consensus.UNIT, consensus.SLICE // consensus.UNIT
    pos = rng.integers(0, 3 * consensus.SLICE - 5, size=300_000)  # three slices, enough to share out
    units = (pos // consensus.SLICE) * per_slice + (pos % consensus.SLICE) // unit
    n_units = 3 * per_slice
    want_order = np.argsort(units, kind="stable")  # by unit, each unit's entries in their given order
    want_starts = np.concatenate([[0], np.cumsum(np.bincount(units, minlength=n_units))])
    for min_piece in (1 << 20, 1 << 16, 1000):  # one piece, a few, the most there may be
        monkeypatch.setattr(consensus, "MIN_PIECE", min_piece)
        starts, order = consensus._bucket(count, place, pos, unit, per_slice, n_units)
        assert np.array_equal(starts, want_starts) and np.array_equal(order, want_order), min_piece
