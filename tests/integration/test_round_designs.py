"""Issue 37: `peer simulate --round aligned | residual` (`peer.research.simulate.round_designs`) —
each commits one state every replica loads; aligned's sum has the agreed support and is the exact
mean there; residual's agreed R keeps, undecayed, whatever its shards leave out."""

from __future__ import annotations

import copy

import pytest
import torch

from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import pseudo_gradient
from peer.core.sparseloco.aligned import agreed_support, support_seed
from peer.errors import ConfigError
from peer.research.simulate import experiments as ex
from peer.research.simulate.engine import SimOptions, _commit_stage, simulate
from peer.research.simulate.replica import LocalReplica
from peer.research.simulate.round_designs import DesignState, check_design
from tests.configs import tiny_run
from tests.corpora import pattern_corpus

ALIGNED, RESIDUAL = SimOptions(round_rule="aligned"), SimOptions(round_rule="residual")
VOTED = SimOptions(round_rule="voted")


def _cfg(**overrides):
    extra = {"sparseloco.quant_bits": 0, "sparseloco.clip_median_factor": 0.0, "sparseloco.screening": False}
    return tiny_run(**{**extra, **overrides})


def _replicas(cfg, n):
    """n replicas from one start, each moved by its own noise (different pseudo-gradients)."""
    reps = [LocalReplica.build(cfg, compressed=False, U=None) for _ in range(n)]
    starts = [stage_state(st) for st in reps[0].stages]
    for m, rep in enumerate(reps):
        gen = torch.Generator().manual_seed(m)
        with torch.no_grad():
            for st in rep.stages:
                for p in st.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.01 * (1 + m))
    return reps, starts


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _committed(start, rep, s, lr):
    """Δ̄ as the replica's parameters show it: (θ_start − θ) / η (exact enough to read a support)."""
    now = stage_state(rep.stages[s])
    return {n: (start[n] - now[n]) / lr for n in start}


def test_an_aligned_round_commits_the_exact_mean_on_the_agreed_support_to_every_replica():
    cfg = _cfg()
    reps, starts = _replicas(cfg, 3)
    s, start, keep = 1, starts[1], cfg.sparseloco.topk
    deltas = [pseudo_gradient(start, stage_state(r.stages[s])) for r in reps]
    errors, state = [[None, None] for _ in reps], DesignState()
    done = _commit_stage(reps, s, start, errors, [0] * 3, cfg, 1.0, None, ALIGNED, 0, state)
    states = [stage_state(r.stages[s]) for r in reps]
    assert all(_same(states[0], other) for other in states[1:])  # one state, every replica
    summed = state.agreed[s]  # the committed Δ̄ of the sparse tensors
    for n, agg in summed.items():
        support = agreed_support(None, agg.shape, cfg.sparseloco.chunk, keep, support_seed(cfg.seed, 0, s, n))
        off = torch.ones(agg.numel(), dtype=torch.bool)
        off[support] = False
        assert not agg.view(-1)[off].any()  # at most the agreed support: nothing re-sparsified
        mean = (deltas[0][n] + deltas[1][n] + deltas[2][n]).view(-1)[support] / 3  # quant_bits 0: e = Δ
        torch.testing.assert_close(agg.view(-1)[support], mean, rtol=1e-6, atol=1e-9)
        for m in range(3):  # each sender keeps everything off the support, nothing on it
            assert torch.equal(errors[m][s][n].view(-1)[off], deltas[m][n].view(-1)[off])
            assert not errors[m][s][n].view(-1)[support].any()
        moved = _committed(start, reps[0], s, cfg.sparseloco.outer_lr)[n]
        assert not moved.view(-1)[off].any()
    assert done.mass is not None and 0.0 < done.mass.dropped_fraction < 1.0 and done.mass.quant_sq < 1e-12
    assert state.sent_bytes > 0 and state.down_bytes > 0


def test_the_next_aligned_support_follows_the_last_aggregate():
    cfg = _cfg(**{"sparseloco.quant_bits": 2})
    reps, starts = _replicas(cfg, 2)
    errors, state = [[None, None] for _ in reps], DesignState()
    _commit_stage(reps, 1, starts[1], errors, [0] * 2, cfg, 1.0, None, ALIGNED, 0, state)
    first = {n: t.clone() for n, t in state.agreed[1].items()}
    starts1 = stage_state(reps[0].stages[1])
    _commit_stage(reps, 1, starts1, errors, [0] * 2, cfg, 1.0, None, ALIGNED, 1, state)
    for n, agg in state.agreed[1].items():
        was, now = first[n] != 0, agg != 0
        assert int((was & now).sum()) >= int(0.7 * int(was.sum()))  # k′ − x of the k′ are last round's
        assert not torch.equal(was, now)  # and exploration moved the rest


def test_residual_keeps_what_its_shard_drops_in_an_agreed_residual_that_never_decays():
    cfg = _cfg(**{"sparseloco.quant_bits": 2})
    reps, starts = _replicas(cfg, 3)
    s = 1
    errors, state = [[None, None] for _ in reps], DesignState()
    twins = copy.deepcopy(reps)  # the all-to-all round gives the exact mean Δ̄_0 of these contributions
    _commit_stage(twins, s, starts[s], [[None, None] for _ in reps], [0] * 3, cfg, 1.0, None, SimOptions())
    mean0 = _committed(starts[s], twins[0], s, cfg.sparseloco.outer_lr)
    _commit_stage(reps, s, starts[s], errors, [0] * 3, cfg, 1.0, None, RESIDUAL, 0, state)
    states = [stage_state(r.stages[s]) for r in reps]
    assert all(_same(states[0], other) for other in states[1:])
    C0 = _committed(starts[s], reps[0], s, cfg.sparseloco.outer_lr)
    R0 = {n: t.clone() for n, t in state.agreed[s].items()}
    for n in mean0:  # R_0 + C_0 = A_0 = Δ̄_0: every bit of the mean's mass is accounted for
        torch.testing.assert_close(R0[n] + C0[n], mean0[n], rtol=1e-5, atol=1e-6)  # C, Δ̄ read off θ
        if mean0[n].dim() >= 2:  # ≤ k per tile committed (one 64×64 tile holds 4096 entries)
            assert int((C0[n] != 0).sum()) <= cfg.sparseloco.topk * -(-mean0[n].numel() // 4096)
    assert sum(float(r.abs().sum()) for r in R0.values()) > 0
    start1 = stage_state(reps[0].stages[s])
    nothing = {n: torch.zeros_like(v) for n, v in start1.items()}  # round 1: no replica moved, Δ̄_1 = 0
    state_before = copy.deepcopy(state)
    _commit_stage(reps, s, start1, [[nothing, nothing] for _ in reps], [0] * 3, cfg, 1.0, None, RESIDUAL, 1, state)
    C1 = _committed(start1, reps[0], s, cfg.sparseloco.outer_lr)
    for n in R0:  # R_1 + C_1 = R_0 + Δ̄_1 = R_0: not decayed by β, nor by anything else
        torch.testing.assert_close(state.agreed[s][n] + C1[n], state_before.agreed[s][n], rtol=1e-5, atol=1e-6)
    assert any(bool(c.any()) for c in C1.values())  # the kept residual is committed later


def test_voted_residual_publishes_two_bit_means_and_keeps_their_rounding_undecayed():
    cfg = _cfg(**{"sparseloco.quant_bits": 2})
    reps, starts = _replicas(cfg, 3)
    s, lr = 1, cfg.sparseloco.outer_lr
    rule = SimOptions(round_rule="voted-residual")
    twins, twin_state = copy.deepcopy(reps), DesignState()  # the voted round: the exact float32 mean
    f32 = _cfg(**{"sparseloco.quant_bits": 2, "swarm.mean_bits": 0})
    _commit_stage(twins, s, starts[s], [[None, None] for _ in reps], [0] * 3, f32, 1.0, None, VOTED, 0, twin_state)
    errors, state = [[None, None] for _ in reps], DesignState()
    _commit_stage(reps, s, starts[s], errors, [0] * 3, cfg, 1.0, None, rule, 0, state)
    states = [stage_state(r.stages[s]) for r in reps]
    assert all(_same(states[0], other) for other in states[1:])
    C0 = _committed(starts[s], reps[0], s, lr)
    for n, mean in twin_state.agreed[s].items():  # the same votes, the same support: R_0 + C_0 = Δ̄_0
        torch.testing.assert_close(state.agreed[s][n] + C0[n], mean, rtol=1e-5, atol=1e-6)
        assert not C0[n][mean == 0].any()  # C lies on the agreed support
        mags = torch.sort(C0[n][C0[n] != 0].abs()).values  # 2-bit codes: two magnitudes (read off θ: noise)
        assert int((mags.diff() > 1e-5).sum()) <= 1
    R0 = {n: t.clone() for n, t in state.agreed[s].items()}
    start1 = stage_state(reps[0].stages[s])
    nothing = {n: torch.zeros_like(v) for n, v in start1.items()}
    _commit_stage(reps, s, start1, [[nothing, nothing] for _ in reps], [0] * 3, cfg, 1.0, None, rule, 1, state)
    C1 = _committed(start1, reps[0], s, lr)
    for n in R0:  # Δ̄_1 = 0: R_1 + C_1 = R_0, nothing decayed
        torch.testing.assert_close(state.agreed[s][n] + C1[n], R0[n], rtol=1e-5, atol=1e-6)


def test_residual_shards_that_keep_every_entry_commit_exactly_the_all_round():
    cfg = _cfg(**{"swarm.shard_topk": 64 * 64})
    reps, starts = _replicas(cfg, 3)
    twins = copy.deepcopy(reps)
    state = DesignState()
    errs_all, errs_res = [[None, None] for _ in reps], [[None, None] for _ in reps]
    for s in (0, 1):
        a = _commit_stage(twins, s, starts[s], errs_all, [0] * 3, cfg, 1.0, None, SimOptions())
        r = _commit_stage(reps, s, starts[s], errs_res, [0] * 3, cfg, 1.0, a.embed_update, RESIDUAL, 0, state)
        for rep, twin in zip(reps, twins, strict=True):
            assert _same(stage_state(rep.stages[s]), stage_state(twin.stages[s]))
        assert r.mass is not None and r.mass.dropped_fraction == pytest.approx(0.0, abs=1e-12)
        assert all(not t.any() for t in state.agreed[s].values())  # nothing left over


@pytest.mark.parametrize("rule", ["aligned", "voted", "voted-residual", "residual"])
def test_simulate_runs_a_design_and_reports_its_bytes(tmp_path, rule):
    cfg = _cfg(**{"sparseloco.quant_bits": 2})
    data = pattern_corpus(tmp_path, cfg.model.vocab_size, tokens=20_000, period=89, val=2_000)
    (res,) = simulate(cfg, data, 2, ["sparseloco"], options=SimOptions(val_tokens=160, round_rule=rule))
    summary = res.summary()
    assert summary["round_rule"] == rule and len(res.dropped_mass) == res.rounds == 4
    sent, down = summary["holder_bytes"]
    assert sent > 0 and down > 0 and summary["pg_bytes"] > 0
    assert res.val_curve[-1][1] < 7.0
    assert f"({rule})" in ex.dropped_mass_lines([res])[0]
    with pytest.raises(ConfigError, match="clip"):
        check_design(rule, _cfg(**{"sparseloco.clip_median_factor": 2.0}))
