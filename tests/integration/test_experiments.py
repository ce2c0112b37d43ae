"""Issue 10: the paper's metric, seeds × k/d sweeps, Tables 4 and 5, clipping and T⊥ decay as the
paper does them, honest k/d labels and CLI defaults."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch

from peer.cli.args import SimulateArgs
from peer.cli.options import parameters
from peer.cli.simulate_tables import summary_table
from peer.config import build_config
from peer.core.model.optim import lr_at
from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.clip import clip_to_median, clipped_mass
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.commit import commit_round, perp_decay
from peer.core.subspace.compression import distinct_ks, k_from_ratio, make_basis
from peer.core.subspace.state import perp_of
from peer.errors import ConfigError
from peer.net.transport.codec import decode, encode
from peer.net.transport.messages import BackwardReply, ForwardReply, StepRequest
from peer.node.stage.worker import StageWorker
from peer.research.simulate import experiments as ex
from peer.research.simulate.engine import SIMULATE_DEFAULTS, SimOptions, _commit_stage, run_config, simulate
from peer.research.simulate.paper_settings import PAPER_ADAMW_LR, PAPER_REPLICAS, resolve
from peer.research.simulate.replica import LocalReplica
from tests.configs import tiny_run
from tests.corpora import pattern_corpus


def _cfg(**overrides):
    extra = {
        "train.inner_steps": 3,
    }
    return tiny_run(**{**extra, **overrides})


def _data(cfg, root):
    return pattern_corpus(root, cfg.model.vocab_size, tokens=30_000, period=89, val=5_000)


# ----------------------------------------------------------------------------- 1. the metric


def test_replica_mean_weights_each_path_by_its_replicas(tmp_path):
    cfg = _cfg()
    res = simulate(cfg, _data(cfg, tmp_path), 4, ["sparseloco", "pp-compress", "het-pp-compress"], 0.25)
    by = {r.name: r for r in res}
    het = by["het-pp-compress"]
    assert het.val_loss_compressed_path is not None and het.val_loss_uncompressed_path is not None
    want = 0.25 * het.val_loss_uncompressed_path + 0.75 * het.val_loss_compressed_path
    assert het.val_loss_replica_mean == pytest.approx(want, rel=1e-12)
    assert het.final_val_loss == het.val_loss_replica_mean
    assert by["pp-compress"].val_loss_uncompressed_path is None
    assert by["sparseloco"].val_loss_compressed_path is None
    for r in res:
        assert r.val_tokens == 5_000 // 16 * 16  # the whole (small) split: every window once
        assert 0 < r.val_loss_stderr < 0.1
        assert len(r.val_curve) == cfg.train.outer_steps  # after every outer step
        assert r.delta_pct == pytest.approx(
            100 * (r.val_loss_replica_mean / by["sparseloco"].val_loss_replica_mean - 1)
        )
        assert {
            "val_loss_replica_mean",
            "val_loss_compressed_path",
            "val_loss_uncompressed_path",
            "val_tokens",
            "k",
        } <= set(r.summary())
    assert by["het-pp-compress"].k == cfg.k == 8


def test_val_tokens_sets_the_held_out_set(tmp_path):
    cfg = _cfg()
    (res,) = simulate(cfg, _data(cfg, tmp_path), 2, ["sparseloco"], options=SimOptions(val_tokens=320))
    assert res.val_tokens == 320


# ----------------------------------------------------------------------------- 2. sweeps


def test_sweep_runs_baselines_once_per_seed_and_summarizes_pairs(tmp_path):
    cfg = _cfg(**{"train.outer_steps": 1})
    configs = ["sparseloco", "pp-compress", "het-pp-compress"]
    results = ex.run_sweep(cfg, _data(cfg, tmp_path), configs, [0, 1], ["1/8", "1/32"], SimOptions(replicas=2))
    assert [(r.name, r.k_ratio, r.seed) for r in results if r.name == "sparseloco"] == [
        ("sparseloco", None, 0),
        ("sparseloco", None, 1),
    ]
    assert len(results) == 2 * (1 + 2 * 2)
    assert {r.k for r in results if r.k_ratio == "1/32"} == {2}
    rows = ex.summarize(results)
    assert [r["k_ratio"] for r in rows] == ["1/8", "1/32"]
    for row in rows:
        assert row["delta_pct"]["het-pp-compress"]["n"] == 2
        (pair,) = row["pairs"]
        assert pair["a"] == "het-pp-compress" and pair["n"] == 2
        lo, hi = pair["ci95"]
        assert lo <= pair["diff_mean"] <= hi
        at = {(r.name, r.seed): r for r in results if r.k_ratio == row["k_ratio"]}
        diffs = [
            at["het-pp-compress", s].val_loss_replica_mean - at["pp-compress", s].val_loss_replica_mean for s in (0, 1)
        ]
        assert pair["diffs"] == pytest.approx(diffs)
    assert summary_table(rows, "t").row_count == 2
    assert ex.t95(2) == pytest.approx(4.303) and ex.t95(100) == 1.96


def test_sweep_rejects_ratios_with_the_same_k_and_repeated_seeds(tmp_path):
    cfg = _cfg()
    with pytest.raises(ConfigError, match="both give k = 1.*1/64"):
        ex.run_sweep(cfg, _data(cfg, tmp_path), ["pp-compress"], [0], ["1/64", "1/100"], SimOptions())
    with pytest.raises(ConfigError, match="seed twice"):
        ex.run_sweep(cfg, _data(cfg, tmp_path), ["pp-compress"], [0, 0], ["1/8"], SimOptions())


# ----------------------------------------------------------------------------- 3. Tables 4 and 5


def test_adamw_subspace_configs_run_on_their_paths(tmp_path):
    cfg = _cfg()
    res = simulate(cfg, _data(cfg, tmp_path), 2, ["adamw", "adamw-pp-compress", "adamw-het-pp-compress"], 0.5)
    by = {r.name: r for r in res}
    assert by["adamw-pp-compress"].val_loss_uncompressed_path is None
    het = by["adamw-het-pp-compress"]
    assert het.val_loss_replica_mean == pytest.approx(
        (het.val_loss_compressed_path + het.val_loss_uncompressed_path) / 2, rel=1e-12
    )
    assert by["adamw-pp-compress"].act_bytes < by["adamw"].act_bytes
    # Δ % of the adamw family is against adamw
    assert by["adamw"].delta_pct == 0.0
    lr = simulate(cfg, _data(cfg, tmp_path), 2, ["adamw"], options=SimOptions(adamw_lr=1e-5))[0]
    assert lr.train_curve != by["adamw"].train_curve


def test_no_te_adaptation_keeps_perp_and_weight_projection_keeps_outputs_in_col_u(tmp_path):
    cfg = _cfg()
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    fixed = LocalReplica.build(cfg, compressed=True, U=U)
    perp0 = perp_of(fixed.stages[1]).clone()
    opts = SimOptions(replicas=2, te_adaptation=False, weight_projection=True)
    res = run_config(cfg, _data(cfg, tmp_path), "pp-compress", opts)
    assert math.isfinite(res.val_loss_replica_mean)
    from peer.research.simulate.engine import run_diloco

    _, rep = run_diloco(cfg, _data(cfg, tmp_path), "pp-compress", opts, None)
    assert torch.equal(perp_of(rep.stages[1]), perp0)
    P = U @ U.T
    for stage in rep.stages:
        for name, p in stage.named_parameters():
            if name.endswith(("attn.wo.weight", "ffn.w2.weight")):
                assert torch.allclose(P @ p.detach(), p.detach(), atol=1e-5)


def test_paper_settings():  # the whole of --paper-settings: tests/unit/test_paper_settings.py
    res = resolve(None, {"preset": "tiny"}, ["paper"], None, None, None)
    cfg = res.cfg
    assert (cfg.sparseloco.quant_bits, cfg.stages, cfg.train.inner_steps) == (0, 4, 50)
    assert res.replicas == PAPER_REPLICAS == 8 and cfg.train.lr != PAPER_ADAMW_LR == res.adamw_lr


# ----------------------------------------------------------------------------- 5. clipping, T⊥


def test_clipped_mass_is_returned_to_the_senders_error_buffer():
    cfg = _cfg(**{"sparseloco.clip_median_factor": 0.5})
    reps = [LocalReplica.build(cfg, compressed=False, U=None) for _ in range(3)]
    start = stage_state(reps[0].stages[1])
    for m, rep in enumerate(reps):  # different pseudo-gradients, one much larger
        with torch.no_grad():
            for p in rep.stages[1].parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(m)) * (0.01 + m))
    errors = [[None, None] for _ in reps]
    delta = [{n: start[n] - p.detach() for n, p in rep.stages[1].named_parameters()} for rep in reps]
    sent = [compress(d, None, cfg.sparseloco) for d in delta]
    n_clipped = _commit_stage(reps, 1, start, errors, [0, 0, 0], cfg, 1.0, None).clipped
    assert n_clipped >= 1
    decoded = [decompress(p) for p, _ in sent]
    _, stats = clip_to_median(decoded, 0.5)
    for m in range(3):
        for name, e in errors[m][1].items():
            kept = sent[m][1][name] + (
                0 if stats.scales[m] is None else clipped_mass(decoded[m], stats.scales[m])[name]
            )
            assert torch.allclose(e, kept, atol=1e-6)
        if stats.scales[m] is not None:  # nothing lost: sent·scale + returned = what was sent
            mass = clipped_mass(decoded[m], stats.scales[m])
            for name, d in decoded[m].items():
                assert torch.allclose(d * stats.scales[m] + mass[name], d, atol=1e-6)


def test_a_stage_worker_takes_back_what_clipping_removed_from_its_payload():
    cfg = _cfg(**{"sparseloco.clip_median_factor": 1.0})
    workers = [StageWorker(cfg, 1, compressed=False) for _ in range(3)]
    for i, w in enumerate(workers):
        with torch.no_grad():
            for p in w.module.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * (0.01 + 3 * i))
    payloads = [w.contribute(f"r{i}") for i, w in enumerate(workers)]
    before = {n: e.clone() for n, e in workers[2].optim.errors.items()}
    done = workers[2].apply_round(payloads, None, ["r0", "r1", "r2"])
    assert done.clip.scales[2] is not None
    mass = clipped_mass(decompress(payloads[2]), done.clip.scales[2])
    for name, e in workers[2].optim.errors.items():
        assert torch.allclose(e, before[name] + mass[name], atol=1e-6)


def test_perp_decays_like_the_embedding_every_round():
    cfg = _cfg()
    want = 1.0
    for step in range(3, 6):
        want *= 1 - lr_at(step, cfg.train) * cfg.train.weight_decay
    assert perp_decay(cfg.train, 1) == pytest.approx(want, rel=1e-15)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    rep = LocalReplica.build(cfg, compressed=True, U=U)
    perp0 = perp_of(rep.stages[1]).clone()
    start = stage_state(rep.stages[1])
    commit_round([rep.stages[1]], start, [], SparseLoCoConfig(), U, None, want)
    assert torch.equal(perp_of(rep.stages[1]), perp0 * want)


def test_replicas_clip_by_the_norm_over_all_stages():
    cfg = _cfg(**{"train.grad_clip": 1e-3})
    rep = LocalReplica.build(cfg, compressed=False, U=None)
    x = torch.randint(0, 100, (4, 17), generator=torch.Generator().manual_seed(0))
    rep.zero_grad()
    rep.accumulate(x[:, :-1], x[:, 1:])
    grads = [p.grad.clone() for st in rep.stages for p in st.parameters()]
    total = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    rep.apply_step(0)
    coef = 1e-3 / (total + 1e-6)
    for g, p in zip(grads, [p for st in rep.stages for p in st.parameters()], strict=True):
        assert torch.allclose(p.grad, g * coef, rtol=1e-5, atol=0)  # one coefficient for all stages


def test_gradient_norms_cross_the_wire():
    for msg in (
        ForwardReply(loss=1.0, grad=torch.zeros(1, 2, 3), grad_sq_norm=2.5),
        BackwardReply(grad=torch.zeros(1, 2, 3), grad_sq_norm=0.0),
        StepRequest("p", 0, 1, 2, 3, grad_norm=1.5),
        StepRequest("p", 0, 1, 2, 3),
    ):
        back = decode(encode(msg))
        assert getattr(back, "grad_sq_norm", None) == getattr(msg, "grad_sq_norm", None)
        assert getattr(back, "grad_norm", None) == getattr(msg, "grad_norm", None)


# ----------------------------------------------------------------------------- 6. honest labels


def test_k_ratio_below_one_channel_names_the_smallest_valid_ratio():
    assert k_from_ratio(64, "1/64") == 1
    with pytest.raises(ConfigError, match=re.escape("smallest valid ratio for this width is 1/64")):
        k_from_ratio(64, "1/256")
    with pytest.raises(ConfigError, match="both give k = 2"):
        distinct_ks(64, ["1/32", "1/40"])
    assert distinct_ks(64, ["1/8", "1/32"]) == [8, 2]


def test_simulate_defaults_are_the_ones_its_help_prints():
    helps = {p.name: p.annotation.__metadata__[0].help for p in parameters(SimulateArgs)}

    def default_in_help(name: str) -> str:
        return re.search(r"default (\S+?)\)", helps[name]).group(1)

    assert default_in_help("inner_steps") == str(SIMULATE_DEFAULTS["train.inner_steps"])
    assert default_in_help("outer_steps") == str(SIMULATE_DEFAULTS["train.outer_steps"])
    cfg = build_config(overrides={}, environ={}, defaults=SIMULATE_DEFAULTS)
    assert default_in_help("stages") == str(cfg.stages)
    assert default_in_help("clip_median") == str(cfg.sparseloco.clip_median_factor)
    assert cfg.sparseloco.clip_median_factor == 0.0  # median clipping off in the simulator
    assert SparseLoCoConfig().clip_median_factor == 2.0  # the swarm keeps it as a defence
    assert dataclasses.replace(cfg).train.inner_steps == 10


# ----------------------------------------------------------------------------- 7. the demo


def test_demo_defaults_are_the_clis_and_reach_the_bootstrap(monkeypatch):
    import dataclasses

    from peer.cli.args import DemoArgs
    from peer.demo.run import DemoConfig, _train_env

    defaults = {f.name: f.default for f in dataclasses.fields(DemoArgs)}
    cfg = DemoConfig()
    assert (defaults["outer_steps"], defaults["inner_steps"]) == (cfg.outer_steps, cfg.inner_steps)
    assert cfg.outer_steps * cfg.inner_steps <= 150  # inner steps that fit the 150 s budget on 2 cores
    monkeypatch.delenv("PEER_TRAIN__LR", raising=False)
    monkeypatch.setenv("PEER_SPARSELOCO__TOPK", "32")  # a user's own setting wins
    env = _train_env(cfg)
    assert env == {"PEER_TRAIN__LR": str(cfg.lr), "PEER_TRAIN__WARMUP_STEPS": str(cfg.warmup_steps)}
    built = build_config(overrides={}, environ=env)
    assert (built.train.lr, built.train.warmup_steps) == (cfg.lr, cfg.warmup_steps)
