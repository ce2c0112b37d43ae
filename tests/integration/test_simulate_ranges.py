"""Issue 24: `peer simulate --round ranges` — a stage's round committed range by range (owners'
shards assembled), replicas bit-identical after it, `--round all` unchanged, and the shards' dropped
mass reported and kept by error feedback."""

from __future__ import annotations

import copy

import pytest
import torch

from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import aggregate, compress, decompress, pseudo_gradient
from peer.core.sparseloco.commit import commit_round
from peer.core.sparseloco.ranges import assemble, encode_parts
from peer.core.subspace.compression import make_basis
from peer.core.subspace.state import perp_of
from peer.errors import ConfigError
from peer.research.simulate import experiments as ex
from peer.research.simulate.engine import SimOptions, _commit_stage, simulate
from peer.research.simulate.ranges import check_ranges, plan_for
from peer.research.simulate.replica import LocalReplica
from peer.research.simulate.results import robust_rule
from tests.configs import tiny_run
from tests.corpora import pattern_corpus

RANGES = SimOptions(round_rule="ranges")


def _cfg(**overrides):
    extra = {
        "sparseloco.quant_bits": 0,
        "sparseloco.clip_median_factor": 0.0,  # `peer simulate`'s default: nothing clipped
        "sparseloco.screening": False,  # ... and nothing screened
    }
    return tiny_run(**{**extra, **overrides})


def _replicas(cfg, n, U=None):
    """n replicas from one start, each moved by its own noise (different pseudo-gradients)."""
    reps = [LocalReplica.build(cfg, compressed=False, U=U) for _ in range(n)]
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


def test_a_ranges_round_commits_the_same_bits_to_every_replica_and_feeds_the_embedding_change_on():
    cfg = _cfg()
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)  # the T⊥ path too
    reps, starts = _replicas(cfg, 3, U)
    errors = [[None, None] for _ in reps]
    sent = [0, 0, 0]
    first = _commit_stage(reps, 0, starts[0], errors, sent, cfg, 0.99, None, RANGES)
    assert first.embed_update is not None and first.dropped == ()
    perp_before = perp_of(reps[0].stages[1]).clone()
    second = _commit_stage(reps, 1, starts[1], errors, sent, cfg, 0.99, first.embed_update, RANGES)
    assert second.embed_update is None
    for s in (0, 1):
        states = [stage_state(rep.stages[s]) for rep in reps]
        assert all(_same(states[0], other) for other in states[1:])  # bit-identical
        assert not _same(states[0], starts[s])  # and the round moved them
        assert all(torch.equal(perp_of(rep.stages[s]), perp_of(reps[0].stages[s])) for rep in reps)
    assert not torch.equal(perp_of(reps[0].stages[1]), perp_before)  # stage 0's change moved T⊥
    assert all(n > 0 for n in sent)
    for done in (first, second):
        assert done.mass is not None and 0.0 < done.mass.dropped_fraction < 1.0
        assert done.mass.quant_sq == 0.0  # quant_bits 0: the kept values are exact


def test_the_all_round_is_todays_commit_bit_for_bit():
    """`--round all` (the default) is compress → bytes → decompress → commit_round, as before issue 24."""
    cfg = _cfg(**{"sparseloco.quant_bits": 2, "sparseloco.clip_median_factor": 1.0})
    reps, starts = _replicas(cfg, 3)
    ref = copy.deepcopy(reps)
    errors = [[None, None] for _ in reps]
    done = _commit_stage(reps, 1, starts[1], errors, [0, 0, 0], cfg, 1.0, None, SimOptions())
    assert done.mass is None
    sent = [compress(pseudo_gradient(starts[1], stage_state(r.stages[1])), None, cfg.sparseloco) for r in ref]
    decoded = [decompress(type(p).from_bytes(p.to_bytes())) for p, _ in sent]
    want = commit_round([r.stages[1] for r in ref], starts[1], decoded, cfg.sparseloco, None)
    assert done.clipped == want.clip.n_clipped
    for rep, r in zip(reps, ref, strict=True):
        assert _same(stage_state(rep.stages[1]), stage_state(r.stages[1]))
    for m, (_, e) in enumerate(sent):
        if want.clip.scales[m] is None:
            assert _same(errors[m][1], e)


def test_shards_that_keep_every_entry_commit_exactly_the_all_round():
    """With swarm.shard_topk = chunk² (nothing re-sparsified) and exact values, the ranges round is
    the all-to-all round bit for bit: same θ, same error buffers (the machinery loses nothing)."""
    cfg = _cfg(**{"swarm.shard_topk": 64 * 64})
    reps, starts = _replicas(cfg, 3)
    twins = copy.deepcopy(reps)
    errs_all, errs_ranges = [[None, None] for _ in reps], [[None, None] for _ in reps]
    for s in (0, 1):
        a = _commit_stage(twins, s, starts[s], errs_all, [0] * 3, cfg, 1.0, None, SimOptions())
        r = _commit_stage(reps, s, starts[s], errs_ranges, [0] * 3, cfg, 1.0, None, RANGES)
        assert r.mass is not None and r.mass.dropped_fraction == 0.0
        assert (a.embed_update is None) == (r.embed_update is None)
        for rep, twin in zip(reps, twins, strict=True):
            assert _same(stage_state(rep.stages[s]), stage_state(twin.stages[s]))
        for m in range(3):
            assert _same(errs_ranges[m][s], errs_all[m][s])


def test_error_feedback_keeps_what_the_shards_dropped():
    """Each replica's buffer = encode_parts's e − Δ̂ plus its own Δ̂ where the shard kept nothing; the
    mean of what returns is exactly the dropped part of Δ̄, whose share of ‖Δ̄‖² is reported."""
    cfg = _cfg()
    reps, starts = _replicas(cfg, 4)
    s, start = 1, starts[1]
    plan = plan_for(start, cfg, len(reps))
    assert plan.n == 4
    shapes = {n: v.shape for n, v in start.items()}
    encoded = [encode_parts(pseudo_gradient(start, stage_state(r.stages[s])), None, cfg.sparseloco, plan) for r in reps]
    sent = [assemble(plan, {r: decompress(p) for r, p in enumerate(parts)}, shapes) for parts, _ in encoded]
    errors = [[None, None] for _ in reps]
    done = _commit_stage(reps, s, start, errors, [0] * 4, cfg, 1.0, None, RANGES)
    lr = cfg.sparseloco.outer_lr
    committed = {n: (start[n] - stage_state(reps[0].stages[s])[n]) / lr for n in start}  # ≈ the shards' Δ̄
    kept = {n: committed[n] != 0 for n in start}
    back_sum = {n: torch.zeros(shapes[n]) for n in start}
    for m in range(4):
        for n in start:
            back = torch.where(kept[n], torch.zeros(()), sent[m][n])
            assert torch.equal(errors[m][s][n], encoded[m][1][n] + back)  # its returned share, bit for bit
            back_sum[n] += back
    mean = aggregate(sent, len(sent))  # Δ̄ before re-sparsification
    dropped = {n: torch.where(kept[n], torch.zeros(()), mean[n]) for n in start}
    for n in start:
        torch.testing.assert_close(back_sum[n] / 4, dropped[n], rtol=1e-5, atol=1e-9)
    dense_sq = sum(float((v.double() ** 2).sum()) for v in mean.values())
    dropped_sq = sum(float((v.double() ** 2).sum()) for v in dropped.values())
    assert done.mass is not None and 0.0 < done.mass.dropped_fraction < 1.0
    assert done.mass.dropped_fraction == pytest.approx(dropped_sq / dense_sq, rel=1e-5)


def test_simulate_reports_the_dropped_mass_and_refuses_what_ranges_lacks(tmp_path):
    cfg = _cfg()
    data = pattern_corpus(tmp_path, cfg.model.vocab_size, tokens=20_000, period=89, val=2_000)
    (res,) = simulate(cfg, data, 2, ["sparseloco"], options=SimOptions(val_tokens=160, round_rule="ranges"))
    summary = res.summary()
    assert summary["round_rule"] == "ranges" and len(res.dropped_mass) == res.rounds == 4
    assert 0.0 < summary["dropped_mass_mean"] <= summary["dropped_mass_max"] < 1.0
    assert summary["quant_error_mean"] == 0.0  # quant_bits 0: the shards keep exact values
    assert "dropped" in ex.dropped_mass_lines([res])[0]
    assert res.val_curve[-1][1] < 7.0
    with pytest.raises(ConfigError, match="--round"):
        check_ranges("some", robust_rule(SimOptions(), cfg), None)
    with pytest.raises(ConfigError, match="attacks"):
        check_ranges("ranges", robust_rule(SimOptions(), cfg), "flip")
    screened = _cfg(**{"sparseloco.screening": True})  # the swarm's default: this round has no screening
    with pytest.raises(ConfigError, match="sparseloco.screening"):
        simulate(screened, data, 2, ["sparseloco"], options=SimOptions(val_tokens=160, round_rule="ranges"))


def test_exact_shards_commit_exactly_the_all_round():
    """--round exact, quant_bits 0, nothing clipped or screened: the same θ and the same error buffers
    as the all-to-all round, to the bit, with several ranges per stage and no shard_topk override."""
    cfg = _cfg()
    reps, starts = _replicas(cfg, 4)
    twins = copy.deepcopy(reps)
    errs_all, errs_exact = [[None, None] for _ in reps], [[None, None] for _ in reps]
    for s in (0, 1):
        assert plan_for(starts[s], cfg, 4).n == 4
        a = _commit_stage(twins, s, starts[s], errs_all, [0] * 4, cfg, 1.0, None, SimOptions())
        r = _commit_stage(reps, s, starts[s], errs_exact, [0] * 4, cfg, 1.0, None, SimOptions(round_rule="exact"))
        assert r.mass is not None and r.mass.dropped_fraction == 0.0 and r.mass.quant_fraction == 0.0
        assert (a.embed_update is None) == (r.embed_update is None)
        for rep, twin in zip(reps, twins, strict=True):
            assert _same(stage_state(rep.stages[s]), stage_state(twin.stages[s]))
        for m in range(4):
            assert _same(errs_exact[m][s], errs_all[m][s])


def test_a_run_with_exact_shards_ends_where_the_all_round_does(tmp_path):
    """`peer simulate --round exact --quant-bits 0` (4 replicas, 2 stages, H 2, T 2) gives the same
    train and held-out losses, bit for bit, as `--round all`; with 2-bit values it still runs and
    reports the shards' requantization share."""
    cfg = _cfg(**{"train.inner_steps": 2, "train.outer_steps": 2})
    data = pattern_corpus(tmp_path, cfg.model.vocab_size, tokens=20_000, period=89, val=2_000)

    def run(rule, c=cfg):
        (res,) = simulate(c, data, 4, ["sparseloco"], options=SimOptions(val_tokens=160, round_rule=rule))
        return res

    every, exact = run("all"), run("exact")
    assert exact.summary()["round_rule"] == "exact" and exact.rounds == 4  # 2 outer steps × 2 stages
    assert [v.hex() for _, v in exact.train_curve] == [v.hex() for _, v in every.train_curve]
    assert [v.hex() for _, v in exact.val_curve] == [v.hex() for _, v in every.val_curve]
    assert exact.summary()["dropped_mass_max"] == 0.0 and exact.summary()["quant_error_mean"] == 0.0
    quantized = run("exact", _cfg(**{"train.inner_steps": 2, "train.outer_steps": 2, "sparseloco.quant_bits": 2}))
    assert quantized.summary()["dropped_mass_max"] == 0.0 and 0.0 < quantized.summary()["quant_error_mean"] < 1.0
