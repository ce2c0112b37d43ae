"""A round committed a band of rows at a time (peer.core.sparseloco.commit_rows) gives the rows of the whole
commit (`commit_state`), bit for bit: at 1–4 bands, with a payload clipped to the median and screened
out as an outlier, for the stage that holds the embedding (T_S/T⊥ split row by row) and for one that
moves T⊥ by stage 0's change."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.bands import band_rows, banded
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.commit import commit_state, decide, screening_rule
from peer.core.sparseloco.commit_rows import commit_rows, payload_rows
from peer.core.subspace.state import EMBED

D, K = 32, 8
STAGES = {
    "with the embedding": {EMBED: (200, D), "layers.0.attn.w": (130, 96), "layers.0.norm.weight": (D,)},
    "without it": {"layers.1.mlp.w": (150, 70), "head.weight": (200, D), "norm.weight": (D,)},
}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int32).numpy().tobytes()


def _round(shapes, cfg):
    start = {n: torch.randn(s, generator=_gen(i)) for i, (n, s) in enumerate(shapes.items())}
    U = torch.linalg.qr(torch.randn(D, K, generator=_gen(50), dtype=torch.float64))[0].float()
    perp = torch.randn(200, D, generator=_gen(51)) * 0.1
    payloads = []
    for m in range(5):  # the last one far larger than the others: clipped, and screened out
        scale = 30.0 if m == 4 else 1.0
        delta = {
            n: torch.randn(s, generator=_gen(100 + 10 * m + i)) * 1e-2 * scale
            for i, (n, s) in enumerate(shapes.items())
        }
        payloads.append(compress(delta, None, cfg)[0])
    return start, U, perp, payloads


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_bands_commit_the_rows_of_the_whole_commit(stage):
    shapes = STAGES[stage]
    cfg = dataclasses.replace(SparseLoCoConfig(), clip_median_factor=2.0)
    start, U, perp, payloads = _round(shapes, cfg)
    update = None if EMBED in shapes else torch.randn(200, D, generator=_gen(52)) * 1e-3
    whole = commit_state(start, perp, payloads, cfg, U, update, perp_factor=0.99)
    plan = decide(payloads, cfg, screening_rule(cfg), None)
    assert plan.clip.n_clipped >= 1 and 4 in plan.screen.outliers  # the case the docstring names
    for ranks in (1, 2, 3, 4):
        params: dict[str, list[torch.Tensor]] = {n: [] for n in shapes}
        perps = []
        for r in range(ranks):
            rows = {n: band_rows(s, cfg.chunk, ranks)[r] for n, s in shapes.items() if banded(s)}
            keep = [n for n in shapes if not banded(shapes[n])] if r == 0 else []
            a, b = band_rows(perp.shape, cfg.chunk, ranks)[r]  # T⊥'s rows: the embedding's, where it is held
            band_start = {n: start[n][slice(*rows[n])] if n in rows else start[n] for n in [*rows, *keep]}
            cut = [payload_rows(p, rows, keep) for p in payloads]
            got, got_perp, _ = commit_rows(
                band_start, perp[a:b], cut, plan, cfg, U, None if update is None else update[a:b], perp_factor=0.99
            )
            for n, t in got.items():
                params[n].append(t)
            assert got_perp is not None
            perps.append(got_perp)
        for n in shapes:
            assert _bits(torch.cat(params[n])) == _bits(whole.params[n]), (stage, ranks, n)
        assert whole.perp is not None and _bits(torch.cat(perps)) == _bits(whole.perp), (stage, ranks)
