"""Poisoned contributions: median norm clipping of SparseLoCo payloads (issue 4, item 4).

- `clip_to_median` against a plain reference written with Python floats and loops: honest
  contributions pass bit for bit, a huge one lands on factor × the lower median, factor 0 is a
  no-op, non-finite contributions become zeros, and the norm is exactly rounded (deterministic).
- `StageWorker.apply_round` / `peer.core.sparseloco.commit.embedding_update` clip a committed set with a
  poisoned payload the same way on every holder: parameters and T⊥ stay bit-identical and the
  step stays bounded.
- Training under that attack: tests/integration/test_poison_runs.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from peer.config import build_config
from peer.core.sparseloco.algorithm import aggregate, compress, decompress
from peer.core.sparseloco.codec.clip import clip_to_median, global_norm
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.commit import embedding_update, perp_decay
from peer.core.subspace.state import EMBED, perp_of
from peer.errors import ConfigError
from peer.node.stage.worker import StageWorker
from tests.configs import tiny_run

# ------------------------------------------------------------------------- plain reference


def ref_norm(d) -> float:
    """‖d‖₂ with Python floats: every float32 square is exact in a double, fsum rounds once."""
    return math.sqrt(math.fsum(float(x) ** 2 for name in sorted(d) for x in d[name].reshape(-1).tolist()))


def ref_clip(decoded, factor):
    """(clipped list, norms, median) written the long way."""
    norms = [ref_norm(d) for d in decoded]
    voters = sorted(n for n in norms if math.isfinite(n) and n > 0)
    median = voters[(len(voters) - 1) // 2] if voters else 0.0  # the LOWER median
    out = []
    for d, n in zip(decoded, norms, strict=True):
        if factor and not math.isfinite(n):
            out.append({k: torch.zeros_like(v) for k, v in d.items()})
        elif factor and n > factor * median:
            out.append({k: v * (factor * median / n) for k, v in d.items()})
        else:
            out.append(dict(d))
    return out, norms, median


def _contribution(scale: float, seed: int) -> dict[str, torch.Tensor]:
    """A sparse Δ̂-like contribution over two tensors (a matrix and a norm gain)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 24, generator=g) * scale
    w[torch.rand(16, 24, generator=g) < 0.8] = 0.0  # sparse, as a decoded payload is
    return {"w": w, "gain": torch.randn(24, generator=g) * scale * 0.1}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(_bits(a[k]), _bits(b[k])), k


# ------------------------------------------------------------------------- clip_to_median


def test_config_field_defaults_and_validation():
    assert SparseLoCoConfig().clip_median_factor == 2.0
    assert SparseLoCoConfig(clip_median_factor=0).clip_median_factor == 0
    for bad in (-0.5, math.nan, math.inf):
        with pytest.raises(ConfigError, match="clip_median_factor"):
            SparseLoCoConfig(clip_median_factor=bad)
    with pytest.raises(ConfigError, match="clip_median_factor"):
        build_config(overrides={"sparseloco.clip_median_factor": -1}, environ={})
    cfg = build_config(overrides={"sparseloco.clip_median_factor": "3.5"}, environ={})
    assert cfg.sparseloco.clip_median_factor == 3.5
    with pytest.raises(ConfigError, match="clip_median_factor"):
        clip_to_median([_contribution(1.0, 0)], -1.0)


def test_global_norm_is_exactly_rounded():
    d = _contribution(1e-3, 1) | {"big": torch.tensor([3e30, -4e30, 1e-30])}
    assert global_norm(d) == ref_norm(d)  # exact equality: fsum of exact squares
    assert global_norm({"w": torch.tensor([3.0, 4.0])}) == 5.0
    assert global_norm({}) == 0.0 and global_norm({"w": torch.zeros(5)}) == 0.0
    # summation order does not matter: the same contribution with names in another order
    assert global_norm(dict(reversed(list(d.items())))) == global_norm(d)


def test_honest_contributions_pass_bit_for_bit():
    decoded = [_contribution(1.0 + 0.1 * i, seed=i) for i in range(3)]
    before = [{k: v.clone() for k, v in d.items()} for d in decoded]
    out, stats = clip_to_median(decoded, 2.0)
    assert stats.n_clipped == 0
    for o, b in zip(out, before, strict=True):
        _assert_same_bits(o, b)
    for d, b in zip(decoded, before, strict=True):  # inputs are not modified
        _assert_same_bits(d, b)
    _, norms, median = ref_clip(decoded, 2.0)
    assert stats.norms == tuple(norms) and stats.median == median
    assert stats.max_ratio == pytest.approx(max(norms) / median, rel=1e-15)


def test_one_huge_among_three_is_clipped_to_the_bound():
    decoded = [_contribution(1.0, 0), _contribution(1e4, 1), _contribution(1.2, 2)]
    out, stats = clip_to_median(decoded, 2.0)
    ref, norms, median = ref_clip(decoded, 2.0)
    assert stats.n_clipped == 1
    assert stats.median == median == max(norms[0], norms[2])  # lower median of three = the middle one
    assert stats.max_ratio == pytest.approx(norms[1] / median, rel=1e-12) and stats.max_ratio > 1e3
    _assert_same_bits(out[0], decoded[0])
    _assert_same_bits(out[2], decoded[2])
    for k in decoded[1]:
        torch.testing.assert_close(out[1][k], ref[1][k], rtol=1e-6, atol=0)
    assert global_norm(out[1]) == pytest.approx(2.0 * median, rel=1e-6)  # exactly on the bound
    # the direction is kept: the clipped contribution is a positive multiple of the original
    cos = torch.nn.functional.cosine_similarity(out[1]["w"].reshape(1, -1), decoded[1]["w"].reshape(1, -1))
    assert float(cos) == pytest.approx(1.0, abs=1e-6)


def test_two_participants_the_honest_one_is_the_reference():
    honest, huge = _contribution(1.0, 0), _contribution(1e6, 1)
    for order in ((honest, huge), (huge, honest)):
        out, stats = clip_to_median(list(order), 2.0)
        assert stats.median == ref_norm(honest)  # lower median of two = the smaller norm
        assert stats.n_clipped == 1
        i_h, i_x = (0, 1) if order[0] is honest else (1, 0)
        _assert_same_bits(out[i_h], honest)
        assert global_norm(out[i_x]) == pytest.approx(2.0 * ref_norm(honest), rel=1e-6)


def test_lower_median_of_four_and_zero_contributions_do_not_vote():
    decoded = [{"w": torch.tensor([n])} for n in (1.0, 2.0, 3.0, 100.0)]
    out, stats = clip_to_median(decoded, 2.0)
    assert stats.median == 2.0 and stats.n_clipped == 1 and stats.max_ratio == 50.0
    assert [float(o["w"]) for o in out] == [1.0, 2.0, 3.0, 4.0]
    # empty (all-zero) contributions carry no update and do not drag the median to zero
    zeros = [{"w": torch.zeros(1)}] * 3 + [{"w": torch.tensor([5.0])}]
    out, stats = clip_to_median(zeros, 2.0)
    assert stats.median == 5.0 and stats.n_clipped == 0 and float(out[3]["w"]) == 5.0
    out, stats = clip_to_median([], 2.0)
    assert out == [] and stats.n_clipped == 0 and stats.median == 0.0


def test_factor_zero_is_a_no_op():
    decoded = [_contribution(1.0, 0), _contribution(1e4, 1), {"w": torch.full((16, 24), math.nan)}]
    out, stats = clip_to_median(decoded, 0.0)
    assert stats.n_clipped == 0 and stats.max_ratio > 1e3  # still measured, for the metrics
    for o, d in zip(out, decoded, strict=True):
        _assert_same_bits(o, d)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_contributions_are_zeroed_and_never_propagate(bad):
    honest = [_contribution(1.0, 0), _contribution(1.1, 2)]
    poisoned = _contribution(1.0, 1)
    poisoned["w"][3, 5] = bad
    decoded = [honest[0], poisoned, honest[1]]
    out, stats = clip_to_median(decoded, 2.0)
    assert stats.n_clipped == 1 and not math.isfinite(stats.norms[1])
    assert stats.median == min(ref_norm(h) for h in honest)  # the bad one does not vote
    assert math.isfinite(stats.max_ratio)  # the metric stays JSON-safe
    for k, v in out[1].items():
        assert torch.equal(v, torch.zeros_like(v)), k
    _assert_same_bits(out[0], honest[0])
    _assert_same_bits(out[2], honest[1])
    agg = aggregate(out, 3)
    assert all(torch.isfinite(v).all() for v in agg.values())
    all_bad, _ = clip_to_median([poisoned], 2.0)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in all_bad[0].values())


def test_clipping_is_deterministic():
    decoded = [_contribution(s, seed=i) for i, s in enumerate((1.0, 30.0, 0.7, 1e5, 1.3))]
    a, sa = clip_to_median(decoded, 1.5)
    b, sb = clip_to_median([{k: v.clone() for k, v in d.items()} for d in decoded], 1.5)
    assert sa == sb and sa.n_clipped == 2
    for x, y in zip(a, b, strict=True):
        _assert_same_bits(x, y)


# ------------------------------------------------------------------------- stage workers


def _cfg(**overrides):
    extra = {
        "train.microbatches": 1,
    }
    return tiny_run(**{**extra, **overrides})


def _poisoned_payload(worker: StageWorker, scale: float, seed: int) -> Payload:
    """A well-formed payload (it passes every wire check) built by compress() of a huge random Δ."""
    g = torch.Generator().manual_seed(seed)
    delta = {k: scale * torch.randn(v.shape, generator=g) for k, v in worker.start.items()}
    payload, _ = compress(delta, None, worker.cfg.sparseloco)
    return Payload.from_bytes(payload.to_bytes(), cfg=worker.cfg.sparseloco)


def test_every_holder_clips_a_poisoned_round_identically():
    cfg = _cfg()
    holders = {s: [StageWorker(cfg, s, compressed=True), StageWorker(cfg, s, compressed=False)] for s in range(2)}
    te_before = holders[0][0].start[EMBED] + perp_of(holders[0][0].module)
    perp_before = perp_of(holders[0][0].module).clone()
    committed = {}
    for s, ws in holders.items():
        payloads = []
        for i, w in enumerate(ws):  # honest: a small local change each
            g = torch.Generator().manual_seed(10 * s + i)
            with torch.no_grad():
                for p in w.module.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=g))
            payloads.append(w.encode_round())
        payloads.append(_poisoned_payload(ws[0], 1e4, seed=s))
        committed[s] = payloads
    starts = {s: {k: v.clone() for k, v in ws[0].start.items()} for s, ws in holders.items()}
    embed_update = embedding_update([decompress(p) for p in committed[0]], cfg.sparseloco)
    for s, ws in holders.items():
        for w in ws:
            stats = w.apply_round(committed[s], embed_update).clip
            assert stats is w.ledger.last_clip and stats.n_clipped == 1 and stats.max_ratio > 100
        assert ws[0].param_hash() == ws[1].param_hash()
        # the step is bounded: ‖θ − θ_start‖ ≤ η · (honest norms + 2·median) / 3
        norms = sorted(ws[0].ledger.last_clip.norms)
        bound = cfg.sparseloco.outer_lr * (norms[0] + norms[1] + 2.0 * ws[0].ledger.last_clip.median) / 3
        moved = global_norm({k: ws[0].start[k] - starts[s][k] for k in starts[s] if k != EMBED})
        assert moved <= bound * (1 + 1e-5)
    assert len({w.perp_hash() for ws in holders.values() for w in ws}) == 1
    te_after = holders[0][0].module.embed.weight.detach() + perp_of(holders[0][0].module)
    # TE moves by the clipped update, and T⊥ decays as AdamW decays the rest of the embedding
    decay_step = (perp_decay(cfg.train, 0) - 1) * perp_before
    torch.testing.assert_close(te_after - te_before, embed_update + decay_step, atol=1e-6, rtol=0)
    # the embedding update is the clipped one, not the raw aggregate
    raw = -cfg.sparseloco.outer_lr * aggregate([decompress(p) for p in committed[0]], 3)[EMBED]
    assert embed_update.norm() < raw.norm() / 10
