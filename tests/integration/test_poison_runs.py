"""M = 4 in-process replicas where replica 3 sends an absurd payload every round: with median norm
clipping the loss still falls; with clipping disabled the same attack blows the model up.

The clipping itself is unit-tested in tests/unit/test_poison.py; these train small models for
several outer steps, so they sit in the integration tier.
"""

from __future__ import annotations

import math

import pytest
import torch

from peer.core.data.loader import Corpus, train_batch, val_batches
from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import aggregate, compress, decompress, pseudo_gradient
from peer.core.sparseloco.codec.clip import clip_to_median
from peer.core.sparseloco.codec.format import Payload, PayloadError
from peer.core.sparseloco.commit import outer_delta
from peer.research.simulate.replica import LocalReplica
from tests.corpora import pattern_corpus

# ------------------------------------------------------------------------- plain reference
from tests.unit.test_poison import _cfg  # the tiny two-stage config of the clipping unit tests

M, POISONED = 4, 3  # replicas, and the one that sends an absurd payload every round


def _loss_cfg(factor: float):
    return _cfg(
        **{
            "model.vocab_size": 128,
            "model.n_layers": 2,
            "train.inner_steps": 5,
            "train.outer_steps": 6,
            "train.lr": 1e-2,
            "train.warmup_steps": 2,
            "sparseloco.clip_median_factor": factor,
        }
    )


def _synthetic_data(cfg, root):
    return pattern_corpus(root, cfg.model.vocab_size, tokens=50_000, period=97, val=4_000)


def _attack(kind: str | None, honest: dict, t: int, s: int, cfg) -> dict:
    """What replica 3 sends instead of its honest Δ̂ (decoded as every receiver decodes it)."""
    if kind == "flip":  # a wrong-sign flood: its own Δ̂ times −1e4
        return {k: v * -1e4 for k, v in honest.items()}
    if kind == "random":  # a valid payload of a huge random tensor
        g = torch.Generator().manual_seed(100 * t + s)
        payload, _ = compress(
            {k: 1e3 * torch.randn(v.shape, generator=g) for k, v in honest.items()}, None, cfg.sparseloco
        )
        return decompress(Payload.from_bytes(payload.to_bytes(), cfg=cfg.sparseloco))
    return honest


def _train(cfg, data: Corpus, attack: str | None) -> tuple[list[float], int, float]:
    """M replicas × S stages, the real compress → bytes → decompress → clip → aggregate → apply path.

    Returns (val loss after every round, contributions clipped, largest norm ratio seen); the
    curve ends in inf if the model diverged so far that an honest peer cannot encode any more.
    """
    torch.manual_seed(cfg.seed)
    train, slc = cfg.train, cfg.sparseloco
    reps = [LocalReplica.build(cfg, compressed=False, U=None) for _ in range(M)]
    errors = [[None] * cfg.stages for _ in range(M)]
    val = val_batches(data, train.batch_size, train.seq_len, max_batches=4)
    curve, clipped, max_ratio = [], 0, 0.0
    for t in range(train.outer_steps):
        starts = [stage_state(st) for st in reps[0].stages]
        for h in range(train.inner_steps):
            step = t * train.inner_steps + h
            for m, rep in enumerate(reps):
                rep.inner_step(*train_batch(data, m, M, step, train.batch_size, train.seq_len), step)
        for s in range(cfg.stages):
            decoded = []
            for m, rep in enumerate(reps):
                delta = pseudo_gradient(starts[s], stage_state(rep.stages[s]))
                try:
                    payload, errors[m][s] = compress(delta, errors[m][s], slc)
                except PayloadError:  # non-finite pseudo-gradient: the model has diverged
                    return curve + [math.inf], clipped, max_ratio
                d = decompress(Payload.from_bytes(payload.to_bytes(), cfg=slc))
                decoded.append(_attack(attack, d, t, s, cfg) if m == POISONED else d)
            decoded, stats = clip_to_median(decoded, slc.clip_median_factor)
            clipped, max_ratio = clipped + stats.n_clipped, max(max_ratio, stats.max_ratio)
            agg = aggregate(decoded, M, slc.aggregation)
            for rep in reps:
                _apply(rep.stages[s], starts[s], agg, slc.outer_lr)
        curve.append(reps[0].eval_loss(val))
    return curve, clipped, max_ratio


@torch.no_grad()
def _apply(stage, start, agg, lr):
    """θ = θ_start + fl32(−η·Δ̄) (the portable commit's outer step, no subspace)."""
    for name, p in stage.named_parameters():
        p.copy_(start[name] + outer_delta(agg[name], lr) if name in agg else start[name])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    data = _synthetic_data(_loss_cfg(2.0), tmp_path_factory.mktemp("corpus"))
    out = {}
    for factor in (2.0, 0.0):
        cfg = _loss_cfg(factor)
        for attack in (None, "flip", "random") if factor else ("flip", "random"):
            out[factor, attack] = _train(cfg, data, attack)
    return out


def test_honest_run_learns_and_is_never_clipped(runs):
    curve, clipped, max_ratio = runs[2.0, None]
    assert clipped == 0 and 1.0 <= max_ratio < 2.0
    assert curve[-1] < curve[0] - 0.7


def test_clipping_survives_a_huge_random_payload(runs):
    honest = runs[2.0, None][0]
    curve, clipped, max_ratio = runs[2.0, "random"]
    assert clipped == 6 * 2 and max_ratio > 1e3  # replica 3, every stage of every round
    assert math.isfinite(curve[-1]) and curve[-1] < honest[-1] + 0.5
    assert curve[-1] < curve[0] - 0.5  # still learning
    unclipped = runs[0.0, "random"][0][-1]
    assert not math.isfinite(unclipped) or unclipped > 100 * honest[-1]


def test_clipping_bounds_a_wrong_sign_flood(runs):
    """The flood lands on the bound, −2·median: it cancels two honest peers' worth but no more."""
    honest = runs[2.0, None][0]
    curve, clipped, max_ratio = runs[2.0, "flip"]
    assert clipped == 6 * 2 and max_ratio > 1e3
    assert math.isfinite(curve[-1]) and curve[-1] < honest[0] - 0.1  # still learning, slowly
    assert all(b < a for a, b in zip(curve, curve[1:], strict=False))
    unclipped = runs[0.0, "flip"][0][-1]
    assert not math.isfinite(unclipped) or unclipped > 100 * honest[-1]
