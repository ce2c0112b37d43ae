"""Issue 25: Table 5c (Grassmann updates of U), 5d (AdamW in subspace coordinates), the eq. 5 bias
record, perplexity beside loss, and heterogeneous AdamW moving the residual into T⊥ (§2.4)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from peer.cli.render import simulate_table
from peer.cli.simulate_tables import bias_table
from peer.core.model.optim import lr_at
from peer.core.subspace.compression import compressed_boundary, make_basis, project
from peer.core.subspace.grassmann import boundary_with_basis_grad, grassmann_step, resplit
from peer.core.subspace.state import perp_of
from peer.errors import ConfigError
from peer.research.simulate import experiments as ex
from peer.research.simulate.ablations import bias_rows, check_ablations, grassmann_round, record_bias
from peer.research.simulate.engine import SimOptions, simulate
from peer.research.simulate.replica import LocalReplica
from peer.research.simulate.results import ConfigResult
from tests.configs import tiny_run
from tests.corpora import pattern_corpus


def _cfg(**overrides):
    extra = {
        "subspace.k_ratio": "1/8",
        "subspace.wire_dtype": "fp32",
        "sparseloco.quant_bits": 0,
        "sparseloco.clip_median_factor": 0.0,
    }
    return tiny_run(**{**extra, **overrides})


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _te(rep):
    return rep.embed_weight().detach() + perp_of(rep.stages[0])


# --- the pure math (peer.core.subspace.grassmann) ---------------------------------------------------------


def test_grassmann_step_stays_orthonormal_moves_only_along_the_tangent_and_fixes_signs():
    U = make_basis(32, 4, 0, torch.float64)
    g = torch.randn(32, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    U2 = grassmann_step(U, g, 0.3)
    assert torch.allclose(U2.T @ U2, torch.eye(4, dtype=torch.float64), atol=1e-12)
    assert not torch.allclose(U2, U)
    _, r = torch.linalg.qr(U2)
    assert torch.all(torch.diagonal(U.T @ U2) > 0)  # small step: no column flipped
    assert torch.all(torch.diagonal(r).abs() > 0)
    # a gradient inside Col(U) has no tangent part: U does not move
    inside = U @ torch.randn(4, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.allclose(grassmann_step(U, inside, 0.3), U, atol=1e-12)
    assert torch.equal(grassmann_step(U, g, 0.0), grassmann_step(U, torch.zeros_like(g), 1.0))


def test_boundary_with_basis_grad_is_the_exact_boundary_and_gives_dL_dU():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2, 5, 16, generator=g, requires_grad=True)
    tokens = torch.randint(0, 10, (2, 5), generator=g)
    perp = torch.randn(10, 16, generator=g)
    U0 = make_basis(16, 4, 3)
    U = U0.clone().requires_grad_(True)
    w = torch.randn(2, 5, 16, generator=g)
    out = boundary_with_basis_grad(X, tokens, perp, U)
    assert torch.equal(out.detach(), compressed_boundary(X.detach(), tokens, perp, U0))
    (out * w).sum().backward()
    X2 = X.detach().clone().requires_grad_(True)
    U2 = U0.clone().requires_grad_(True)
    plain = ((X2 - perp[tokens]) @ U2) @ U2.T + perp[tokens]
    (plain * w).sum().backward()
    assert torch.allclose(X.grad, X2.grad, atol=1e-6)
    assert torch.allclose(U.grad, U2.grad, atol=1e-5)


def test_resplit_keeps_TE_and_puts_T_S_in_the_new_subspace():
    g = torch.Generator().manual_seed(0)
    U, U2 = make_basis(16, 4, 0), make_basis(16, 4, 1)
    te = torch.randn(10, 16, generator=g)
    ts = project(te, U)
    ts2, perp2 = resplit(ts, te - ts, U2)
    assert torch.allclose(ts2 + perp2, te, atol=1e-6)
    assert torch.allclose(project(ts2, U2), ts2, atol=1e-6)


# --- the replica ---------------------------------------------------------------------------------


def test_modified_adamw_steps_T_S_in_subspace_coordinates_and_stays_in_Col_U():
    cfg = _cfg(**{"train.grad_clip": 1e9})  # no clipping: the step is Adam's own
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    rep = LocalReplica.build(cfg, compressed=True, U=U)
    rep.enable_ablations(modified_adamw=True)
    assert not any(p is rep.embed_weight() for grp in rep.optimizers[0].param_groups for p in grp["params"])
    x, y = _batch(cfg)
    ts0 = rep.embed_weight().detach().clone()
    rep.zero_grad()
    rep.accumulate(x, y)
    grad_z = rep.embed_weight().grad @ U
    rep.apply_step(5)
    ts1 = rep.embed_weight().detach()
    assert torch.allclose(project(ts1, U), ts1, atol=1e-6)  # in Col(U) with no projection applied
    t = cfg.train
    lr = lr_at(5, t)
    z0 = ts0 @ U
    m_hat, v_hat = grad_z, grad_z.square()  # Adam's first step: bias-corrected moments
    z1 = z0 * (1 - lr * t.weight_decay) - lr * m_hat / (v_hat.sqrt() + 1e-8)
    assert torch.allclose(ts1 @ U, z1, atol=1e-5)
    assert torch.allclose(ts1, z1 @ U.T, atol=1e-5)


def test_het_adamw_moves_the_residual_into_T_perp_and_the_all_compressed_config_projects():
    cfg = _cfg(**{"train.grad_clip": 1e9})
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    x, y = _batch(cfg)
    free = LocalReplica.build(cfg, compressed=False, U=U, weight_projection=True)
    het, uniform = copy.deepcopy(free), copy.deepcopy(free)
    te0 = _te(free).clone()
    for rep, keep, res in ((free, False, False), (het, True, True), (uniform, True, False)):
        rep.zero_grad()
        rep.accumulate(x, y)
        rep.apply_step(3, keep_in_subspace=keep, residual_to_perp=res)
    full_step = _te(free) - te0  # the unprojected AdamW step (T⊥ untouched)
    assert torch.allclose(_te(het) - te0, full_step, atol=1e-6)
    assert torch.allclose(_te(uniform) - te0, project(full_step, U), atol=1e-6)
    assert not torch.allclose(project(full_step, U), full_step, atol=1e-4)  # the residual is not nothing
    for rep in (het, uniform):
        ts = rep.embed_weight().detach()
        assert torch.allclose(project(ts, U), ts, atol=1e-6)
        for st in rep.stages:  # every stage holds the same T⊥
            assert torch.equal(perp_of(st), perp_of(rep.stages[0]))
        # the compressed forward stays exact: with W_o/W_2 in Col(U), fp32 wire, both paths agree
        batches = [_batch(cfg, 1)]
        assert rep.eval_loss(batches, compressed=True) == pytest.approx(rep.eval_loss(batches, compressed=False), 1e-5)


def test_grassmann_round_moves_U_keeps_TE_and_counts_the_U_gradient():
    cfg = _cfg()
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    reps = [LocalReplica.build(cfg, compressed=m > 0, U=U) for m in range(3)]
    for rep in reps:
        rep.enable_ablations(grassmann=True, track_bias=True)
    assert reps[0].u_leaf is None and reps[1].u_leaf is not None
    for m, rep in enumerate(reps):
        rep.inner_step(*_batch(cfg, m), 0)
    assert float(reps[1].u_leaf.grad.norm()) > 0
    tes = [_te(r).clone() for r in reps]
    pg = [0, 0, 0]
    grassmann_round(reps, SimOptions(grassmann=True, grassmann_lr=1.0), pg)
    U2 = reps[0].U
    assert all(r.U is U2 for r in reps) and not torch.allclose(U2, U)
    assert torch.allclose(U2.T @ U2, torch.eye(cfg.k), atol=1e-5)
    assert pg == [0, 4 * U.numel(), 4 * U.numel()]
    for r, te in zip(reps, tes, strict=True):
        assert torch.allclose(_te(r), te, atol=1e-5)
        ts = r.embed_weight().detach()
        assert torch.allclose(project(ts, U2), ts, atol=1e-5)
    assert reps[1].u_leaf.grad is None  # a fresh leaf for the next round


def test_record_bias_measures_what_projection_removes_and_heterogeneity_shrinks_it():
    cfg = _cfg()
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    reps = [LocalReplica.build(cfg, compressed=m > 0, U=U) for m in range(2)]
    for rep in reps:
        rep.enable_ablations(track_bias=True)
    for rep in reps:
        rep.inner_step(*_batch(cfg, 0), 0)  # the same batch: Δ*_0 ≈ Δ*_1
    star = reps[1].delta_star.clone()
    assert torch.allclose(reps[1].delta_sent, project(star, U), atol=1e-6)
    assert torch.equal(reps[0].delta_sent, reps[0].delta_star)
    res = ConfigResult("het-pp-compress", "1/8", 0.5, 0.0, 0.0)
    record_bias(reps, res, 0)
    (b,) = res.bias
    expect = float((star - project(star, U)).norm() / star.norm())
    assert b.replica == pytest.approx(expect, rel=1e-5)
    assert 0 < b.aggregate < b.replica  # half the replicas send Δ* whole
    assert float(reps[1].delta_star.abs().max()) == 0.0  # reset for the next round


def test_a_sweep_reports_bias_perplexity_and_runs_both_switches(tmp_path):
    cfg = _cfg()
    data = pattern_corpus(tmp_path, cfg.model.vocab_size, tokens=20_000, period=89, val=2_000)
    opts = SimOptions(val_tokens=160, grassmann=True, modified_adamw=True)
    results = simulate(cfg, data, 2, ["sparseloco", "het-pp-compress"], options=opts)
    base, het = results
    assert not base.bias and len(het.bias) == cfg.train.outer_steps
    assert all(b.replica == pytest.approx(0.0, abs=1e-4) for b in het.bias)  # 5d: every step in Col(U)
    assert het.summary()["val_perplexity"] == pytest.approx(math.exp(het.final_val_loss))
    assert len(het.summary()["bias"]) == cfg.train.outer_steps
    rows = bias_rows(results)
    assert rows[0]["random"] == pytest.approx(math.sqrt(1 - 1 / 8))
    assert "het-pp-compress per replica" in [c.header for c in bias_table(rows, [0]).columns]
    assert "val ppl" in [c.header for c in simulate_table(results, cfg, 2).columns]
    row = ex.summarize(results)[0]
    assert row["val_perplexity"]["het-pp-compress"]["mean"] == pytest.approx(math.exp(het.val_loss_replica_mean))
    assert row["sparseloco_val_perplexity"]["mean"] == pytest.approx(math.exp(base.val_loss_replica_mean))


def test_the_switches_refuse_bad_values_naming_the_flag():
    with pytest.raises(ConfigError, match="--grassmann-lr"):
        check_ablations(["pp-compress"], SimOptions(grassmann=True, grassmann_lr=0.0))
    with pytest.raises(ConfigError, match="--te-adaptation"):
        check_ablations(["pp-compress"], SimOptions(grassmann=True, te_adaptation=False))
    with pytest.raises(ConfigError, match="--modified-adamw"):
        check_ablations(["adamw", "adamw-pp-compress"], SimOptions(modified_adamw=True))
    check_ablations(["adamw", "pp-compress"], SimOptions(grassmann=True, modified_adamw=True))
    with pytest.raises(ConfigError, match="--grassmann"):
        ex.plan_sweep(None, {}, "adamw-het-pp-compress", None, None, (), 4, SimOptions(grassmann=True))
