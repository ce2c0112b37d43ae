"""Outlier screening of a round's contributions (`peer.core.sparseloco.robust`, issue 12 item 5).

- the scores equal a plain reference (statistics.median of the others, Python floats, fsum), exactly;
- honest rounds drop nothing, and commit_round then gives the same bits with screening on or off;
- each attack of `peer.research.simulate.attacks` (huge random, Δ̂ × −1e4, −Δ̂) is dropped, and only it;
- the rule is order independent, never drops a majority, needs three voters, skips empty ones;
- every holder of stage 0 (and `embedding_update` observers) drops the same contribution, so
  parameters and T⊥ stay bit-identical and the attacker leaves no trace.
Measured over whole runs (8 replicas, ≥ 50 honest rounds): `peer simulate --attacks`, docs/poisoning.md.
"""

from __future__ import annotations

import math

import pytest
import torch

from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.codec.clip import global_norm
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.commit import embedding_update, perp_decay
from peer.errors import ConfigError
from peer.node.stage.worker import StageWorker
from tests.unit.test_poison import _assert_same_bits, _cfg


def _honest_set(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """n sparse contributions around one shared direction (honest replicas agree, each with its own noise)."""
    g = torch.Generator().manual_seed(seed)
    common = {"w": torch.randn(16, 24, generator=g), "gain": torch.randn(24, generator=g)}
    out = []
    for _ in range(n):
        d = {k: v + 0.8 * torch.randn(v.shape, generator=g) for k, v in common.items()}
        d["w"][torch.rand(16, 24, generator=g) < 0.6] = 0.0
        out.append(d)
    return out


def ref_scores(decoded) -> list[float]:
    """Cosine to the coordinate-wise median of the others, the long way (statistics.median, fsum)."""
    import statistics

    names = sorted({k for d in decoded for k in d})
    cols = {k: [d[k].reshape(-1).tolist() for d in decoded] for k in names}
    out = []
    for i in range(len(decoded)):
        dot, sq, sq_med = [], [], []
        for k in names:
            others = [c for j, c in enumerate(cols[k]) if j != i]
            for pos, x in enumerate(cols[k][i]):
                med = float(torch.tensor(statistics.median(o[pos] for o in others), dtype=torch.float32))
                dot.append(x * med)
                sq.append(x * x)
                sq_med.append(med * med)
        out.append(math.fsum(dot) / (math.sqrt(math.fsum(sq)) * math.sqrt(math.fsum(sq_med))))
    return out


def test_consensus_scores_match_a_plain_reference_exactly():
    from peer.core.sparseloco.robust import consensus_scores

    for n in (3, 4, 7, 8):
        decoded = _honest_set(n, seed=n)
        got = consensus_scores(decoded, list(range(n)))
        assert got == pytest.approx(ref_scores(decoded), rel=1e-12, abs=1e-15)


def test_honest_rounds_drop_nothing_and_commit_the_same_bits():
    from peer.core.sparseloco.robust import DEFAULT, OFF, screen

    for seed in range(20):
        decoded = _honest_set(8, seed)
        assert screen(decoded, [global_norm(d) for d in decoded], DEFAULT).dropped == ()
    cfg = _cfg()
    ws = [StageWorker(cfg, 1, compressed=False) for _ in range(2)]
    payloads = []
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in ws[0].module.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g))
        payloads.append(ws[0].encode_round())
        ws[0].load_state_dict(ws[1].state_dict())
    from peer.core.sparseloco.commit import commit_round

    decoded = [decompress(p) for p in payloads]
    start = {k: v.clone() for k, v in ws[1].start.items()}
    on, off = (StageWorker(cfg, 1, compressed=False) for _ in range(2))
    done_on = commit_round([on.module], start, decoded, cfg.sparseloco, on.U, None, 1.0, DEFAULT)
    done_off = commit_round([off.module], start, decoded, cfg.sparseloco, off.U, None, 1.0, OFF)
    assert done_on.dropped == () and done_off.dropped == ()
    assert stage_state(on.module).keys() == stage_state(off.module).keys()
    _assert_same_bits(stage_state(on.module), stage_state(off.module))


@pytest.mark.parametrize("attack", ["random", "flip", "negate"])
def test_each_attack_is_dropped_and_only_it(attack):
    from peer.core.sparseloco.codec.clip import clip_to_median
    from peer.core.sparseloco.robust import screen
    from peer.research.simulate.attacks import poison

    cfg = SparseLoCoConfig()
    decoded = _honest_set(8, seed=3)
    decoded[5] = (
        poison(attack, decoded[5], t=0, s=0, cfg=cfg)
        if attack != "random"
        else {k: 1e3 * torch.randn(v.shape, generator=torch.Generator().manual_seed(9)) for k, v in decoded[5].items()}
    )
    clipped, stats = clip_to_median(decoded, cfg.clip_median_factor)
    got = screen(clipped, stats.norms)
    assert got.dropped == (5,)
    assert got.scores[5] is not None
    if attack != "random":  # wrong-sign: against the consensus (random is dropped for its norm)
        assert got.scores[5] < -0.25 * got.consensus


def test_screening_is_order_independent_and_ties_break_by_key():
    from peer.core.sparseloco.robust import RobustConfig, drop_rule, screen

    decoded = _honest_set(7, seed=4)
    decoded[2] = {k: -v for k, v in decoded[2].items()}
    keys = [f"replica-{c}" for c in "gacfbed"]
    norms = [global_norm(d) for d in decoded]
    base = screen(decoded, norms, RobustConfig(), keys)
    assert [keys[i] for i in base.dropped] == ["replica-c"]
    for perm in ([6, 5, 4, 3, 2, 1, 0], [2, 0, 1, 3, 6, 4, 5]):
        got = screen([decoded[i] for i in perm], [norms[i] for i in perm], RobustConfig(), [keys[i] for i in perm])
        assert [keys[perm[i]] for i in got.dropped] == ["replica-c"]
        assert [got.scores[perm.index(i)] for i in range(7)] == list(base.scores)  # the same bits, any order

    # the rule on scores and norms; the cap: at most ⌊(n − 1)/2⌋, norm outliers first, equal values in key order
    def rule(scores, keys, norms=None, **kw):
        return drop_rule(scores, norms or [1.0] * len(scores), list(keys), RobustConfig(**kw))

    assert rule([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0], "abcdefg") == []  # median ≤ 0: no consensus
    assert rule([1.0] * 5 + [-1.0] * 3, "hgfedcba") == [5, 6, 7]
    assert rule([1.0] * 5 + [0.0, -0.2, -0.3], "abcdefgh") == [7]  # 0 and −0.2 ≥ −0.25 × median: kept
    assert rule([1.0] * 5 + [0.0, -0.2, -0.3], "abcdefgh", ratio=0.0) == [6, 7]
    assert rule([0.01, 0.004, 0.0, -0.001, 0.02], "abcde") == []  # weak consensus, nobody against it
    assert rule([0.004, 0.003, 0.005, -0.002, 0.006], "abcde") == []  # just below zero: within the floor
    assert rule([0.004, 0.003, 0.005, -0.002, 0.006], "abcde", floor=0.0) == [3]
    # norm outliers: > 10 × the lower-median norm, whatever their direction; they go first under the cap
    assert rule([1.0] * 5, "abcde", norms=[1.0, 1.1, 9.9, 0.9, 1e4]) == [4]
    assert rule([1.0] * 5, "abcde", norms=[1.0, 1.1, 9.9, 0.9, 1e4], norm_ratio=0.0) == []
    assert rule([1.0, 1.0, 1.0, -1.0, 1.0], "abcde", norms=[1.0, 50.0, 1.0, 1.0, 60.0]) == [1, 4]  # cap 2
    assert rule([1.0] * 3 + [-1.0] * 2 + [1.0] * 2, "abcdefg", norms=[1.0] * 5 + [99.0, 99.0]) == [3, 5, 6]
    assert rule([1.0] * 3 + [-1.0] * 2 + [1.0] * 2, "abcgdfe", norms=[1.0] * 5 + [99.0, 99.0]) == [4, 5, 6]
    g = torch.Generator().manual_seed(0)
    for n in range(1, 12):  # a majority is never dropped, whatever the scores and norms
        for _ in range(20):
            scores = (torch.randn(n, generator=g) * 0.5 + 0.2).tolist()
            norms = torch.rand(n, generator=g).mul(30).exp().tolist()
            assert len(drop_rule(scores, norms, [str(i) for i in range(n)])) <= (n - 1) // 2


def test_too_few_voters_or_screening_off_drops_nothing():
    from peer.core.sparseloco.robust import OFF, RobustConfig, screen

    two = _honest_set(2)
    two[1] = {k: -v for k, v in two[1].items()}
    assert screen(two, [global_norm(d) for d in two]).dropped == ()
    five = _honest_set(5)
    five[0] = {k: -v for k, v in five[0].items()}
    norms = [global_norm(d) for d in five]
    assert screen(five, norms).dropped == (0,)
    assert screen(five, norms, OFF).dropped == ()
    # empty and non-finite (already zeroed) contributions are no voters and never dropped
    zero = {k: torch.zeros_like(v) for k, v in five[1].items()}
    assert screen([*five, zero], [*norms, 0.0]).dropped == (0,)
    assert screen([*five, zero], [*norms, math.inf]).scores[-1] is None
    with pytest.raises(ConfigError, match="robust.ratio"):
        RobustConfig(ratio=1.5)
    with pytest.raises(ConfigError, match="robust.norm_ratio"):
        RobustConfig(norm_ratio=0.5)
    with pytest.raises(ConfigError, match="min_voters"):
        RobustConfig(min_voters=2)


def test_every_holder_drops_the_same_contribution_and_moves_t_perp_alike():
    """A stage-0 round with a wrong-sign contribution: heads, full replicas and observers of
    stage 0 (`embedding_update`) drop it alike, so parameters and T⊥ stay bit-identical."""
    from peer.core.sparseloco.commit import commit_round

    cfg = _cfg()
    holders = [StageWorker(cfg, 0, compressed=True) for _ in range(2)]
    payloads = []
    for i in range(5):
        w = StageWorker(cfg, 0, compressed=True)
        g = torch.Generator().manual_seed(40 + i)
        shared = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in w.module.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=shared) + 0.005 * torch.randn(p.shape, generator=g))
        payloads.append(w.encode_round())
    decoded = [decompress(p) for p in payloads]
    decoded[3] = {k: v * -1e4 for k, v in decoded[3].items()}
    start = {k: v.clone() for k, v in holders[0].start.items()}
    done = [
        commit_round([h.module], start, decoded, cfg.sparseloco, h.U, None, perp_decay(cfg.train, 0)) for h in holders
    ]
    assert done[0].dropped == done[1].dropped == (3,)
    assert holders[0].param_hash() == holders[1].param_hash() and holders[0].perp_hash() == holders[1].perp_hash()
    observed = embedding_update(decoded, cfg.sparseloco)
    assert torch.equal(observed, done[0].embed_update)
    kept = [d for i, d in enumerate(decoded) if i != 3]
    honest_only = embedding_update(kept, cfg.sparseloco)
    torch.testing.assert_close(observed, honest_only, rtol=0, atol=0)  # the attacker left no trace
