"""Mixed precision (peer.core.model.precision) and activation checkpointing, through the real StageWorker.

A pipeline here is StageWorkers of every stage driven in one process the way the head drives them
(forward down the stages, the loss and gradient back, every stage's Σ‖g‖² summed into the global
norm, every stage stepped with it), activations crossing the subspace boundary as on the wire.
"""

from __future__ import annotations

import logging
import math
import threading

import pytest
import torch

from peer.config import build_config
from peer.core.model.chain import global_grad_norm
from peer.core.model.decoder import Decoder, ModelConfig
from peer.core.model.precision import LossScaler, autocast, compute_dtype, resolve_precision
from peer.core.model.state import stage_state, state_hash
from peer.errors import ConfigError
from peer.net.transport import codec
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.errors import TransportError
from peer.net.transport.messages import StepRequest
from peer.node.stage.worker import StageWorker
from peer.node.trainer import _Full
from tests.unit.test_stage_checkpoint import BASE, SMALL

MB = 2


def _cfg(stages: int = 3):
    return build_config(overrides={**BASE, **SMALL, "model.n_layers": 3, "stages": stages}, environ={})


def _batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _pipeline(cfg, precision: str = "fp32", checkpointing: bool = False) -> list[StageWorker]:
    return [StageWorker(cfg, s, True, "cpu", precision, checkpointing) for s in range(cfg.stages)]


def _accumulate(workers: list[StageWorker], x: torch.Tensor, y: torch.Tensor, defer: bool = False) -> list:
    """Every micro-batch down the stages and back, as the head relays it; the input gradients each
    stage sent back, per micro-batch."""
    sent = []
    for mb, (mx, my) in enumerate(zip(x.chunk(MB), y.chunk(MB), strict=True)):
        key = ("p", mb)
        hidden = workers[0].forward(key, mx, None, None).hidden
        for w in workers[1:-1]:
            hidden = w.forward(key, mx, hidden, None).hidden
        last = defer and mb == MB - 1  # as a pipelined head asks: on the flush's micro-batch
        out = workers[-1].forward(key, mx, hidden, my, defer=last)
        grads, grad = [out.grad], out.grad
        for w in reversed(workers[:-1]):
            grad = w.backward(key, grad, defer=last)
            grads.append(grad)
        sent.append(grads)
    return sent


def _inner_step(workers: list[StageWorker], t: int, h: int) -> float:
    """One inner step of the pipeline: accumulate, the global norm, every stage's step; the norm."""
    _accumulate(workers, *_batch(workers[0].cfg, t * 4 + h))
    norm = global_grad_norm(w.grad_sq_norm() for w in workers)
    for w in workers:
        w.step(t, h, norm)
    return norm


def _hashes(workers: list[StageWorker]) -> list[str]:
    return [state_hash(stage_state(w.module)) for w in workers]


# ------------------------------------------------------------------------------ peer.core.model.precision


def test_auto_is_fp32_on_cpu_and_explicit_choices_stand():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert [resolve_precision(p, "cpu") for p in ("bf16", "fp16", "fp32")] == ["bf16", "fp16", "fp32"]
    with pytest.raises(ConfigError, match="precision must be"):
        resolve_precision("fp8", "cpu")
    assert compute_dtype("bf16") == torch.bfloat16 and compute_dtype("fp32") == torch.float32


def test_autocast_computes_matmuls_in_the_low_dtype_and_fp32_is_untouched():
    lin = torch.nn.Linear(8, 8)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        with autocast("cpu", precision):
            assert lin(torch.randn(2, 8)).dtype == dtype
    assert lin.weight.dtype == torch.float32


def test_the_loss_scaler_halves_on_overflow_and_doubles_after_growth_interval():
    scaler = LossScaler(True, init_scale=2.0**16, growth_interval=3)
    scaler.update(finite=False)
    assert scaler.scale == 2.0**15
    for _ in range(2):
        scaler.update(finite=True)
    assert scaler.scale == 2.0**15
    scaler.update(finite=True)  # the third finite step in a row
    assert scaler.scale == 2.0**16
    scaler.update(finite=True)
    scaler.update(finite=False)  # an overflow restarts the count
    scaler.update(finite=True)
    scaler.update(finite=True)
    assert scaler.scale == 2.0**15
    off = LossScaler.for_precision("bf16")
    off.update(finite=False)
    assert not off.enabled and off.scale == 1.0
    assert LossScaler.for_precision("fp16").scale == 2.0**16


# ------------------------------------------------------------------------------ autocast in the stage


def test_a_bf16_stage_computes_in_bf16_and_keeps_fp32_weights_gradients_and_boundaries():
    cfg = _cfg()
    workers = _pipeline(cfg, "bf16")
    seen: list[torch.dtype] = []
    hooks = [
        w.module.layers[str(w.module.layer_range.start)].attn.wq.register_forward_hook(
            lambda mod, args, out: seen.append(out.dtype)
        )
        for w in workers
    ]
    x, y = _batch(cfg, 0)
    sent = _accumulate(workers, x, y)
    assert seen and set(seen) == {torch.bfloat16}  # every stage's attention ran in bf16
    for w in workers:
        assert all(p.dtype == torch.float32 and p.grad is not None for p in w.module.parameters())
        assert all(p.grad.dtype == torch.float32 for p in w.module.parameters())
    assert all(g.dtype == torch.float32 for grads in sent for g in grads if g is not None)
    hidden = workers[0].evaluate(x[:2], None, None).hidden  # validation runs under autocast too
    assert hidden is not None and hidden.dtype == torch.float32
    assert workers[-1].evaluate(x[:2], workers[1].evaluate(x[:2], hidden, None).hidden, y[:2]).loss is not None
    assert len(seen) == 2 * 3 + 3  # two micro-batches and one validation forward on each stage
    for hook in hooks:
        hook.remove()
    assert math.isfinite(workers[-1].grad_sq_norm())


# ------------------------------------------------------------------------------ fp16 loss scaling


def test_fp16_gradients_carry_the_scale_and_unscale_to_the_fp32_gradients():
    cfg = _cfg()
    ref, half = _pipeline(cfg, "fp32"), _pipeline(cfg, "fp16")
    assert {w.scaler.scale for w in half} == {2.0**16}
    x, y = _batch(cfg, 0)
    sent_ref, sent_half = _accumulate(ref, x, y), _accumulate(half, x, y)
    for r, h in zip(ref, half, strict=True):
        g_ref = torch.cat([p.grad.flatten() for p in r.module.parameters()])
        g_half = torch.cat([p.grad.flatten() for p in h.module.parameters()])
        assert g_half.norm() > 1e3 * g_ref.norm()  # .grad stays scaled by S during the inner step
        err = (g_half / h.scaler.scale - g_ref).norm() / g_ref.norm()
        assert err < 0.02, (h.stage, float(err))
        assert h.grad_sq_norm() == pytest.approx(r.grad_sq_norm(), rel=0.02)  # Σ‖g‖² reported unscaled
    for grads_ref, grads_half in zip(sent_ref, sent_half, strict=True):  # input gradients go out unscaled
        for a, b in zip(grads_ref, grads_half, strict=True):
            if a is not None:
                assert ((b - a).norm() / a.norm()) < 0.02
    norm_ref = global_grad_norm(w.grad_sq_norm() for w in ref)
    norm_half = global_grad_norm(w.grad_sq_norm() for w in half)
    for r, h in zip(ref, half, strict=True):
        r.step(0, 0, norm_ref)
        h.step(0, 0, norm_half)
    for r, h in zip(ref, half, strict=True):  # AdamW stepped on unscaled gradients: the same update
        start = torch.cat([v.flatten() for v in r.start.values()])
        moved_ref = torch.cat([p.detach().flatten() for p in r.module.parameters()]) - start
        moved_half = torch.cat([p.detach().flatten() for p in h.module.parameters()]) - start
        assert float(moved_half.norm()) == pytest.approx(float(moved_ref.norm()), rel=0.05)
        assert torch.dot(moved_ref, moved_half) / moved_ref.norm() ** 2 > 0.95, r.stage
    assert all(h.skipped_steps == 0 for h in half)


def test_an_overflow_on_one_stage_skips_the_step_on_every_stage_and_halves_the_scale(caplog):
    cfg = _cfg()
    workers = _pipeline(cfg, "fp16")
    workers[-1].scaler = LossScaler(True, init_scale=2.0**100)  # the last stage's backward overflows fp16
    before = _hashes(workers)
    with caplog.at_level(logging.INFO, logger="peer.node.stage.worker"):
        sent = _accumulate(workers, *_batch(cfg, 0))
        assert all(torch.isfinite(g).all() for grads in sent for g in grads if g is not None)  # wire-safe
        assert workers[-1].grad_sq_norm() == math.inf and math.isfinite(workers[0].grad_sq_norm())
        norm = global_grad_norm(w.grad_sq_norm() for w in workers)
        assert norm == math.inf
        for w in workers:
            w.step(0, 0, norm)
    assert _hashes(workers) == before  # no stage moved
    assert all(p.grad is None for w in workers for p in w.module.parameters())
    assert [w.scaler.scale for w in workers] == [2.0**15, 2.0**15, 2.0**99]
    assert [w.skipped_steps for w in workers] == [1, 1, 1]
    skips = [r for r in caplog.records if "step skipped" in r.getMessage()]
    assert len(skips) == 3 and all(r.levelno == logging.INFO for r in skips)
    workers[-1].scaler = LossScaler(True)  # a sane scale: the next inner step trains every stage
    assert math.isfinite(_inner_step(workers, 0, 1))
    assert all(a != b for a, b in zip(_hashes(workers), before, strict=True))


def test_a_non_finite_norm_skips_an_fp32_step_too_and_the_wire_carries_inf_norms():
    cfg = _cfg(stages=2)
    workers = _pipeline(cfg, "fp32")
    before = _hashes(workers)
    _accumulate(workers, *_batch(cfg, 0))
    for w in workers:
        w.step(0, 0, math.inf)
    assert _hashes(workers) == before and [w.scaler.scale for w in workers] == [1.0, 1.0]
    step = codec.from_bytes(pb.StepRequest, codec.to_bytes(StepRequest("p", 0, 0, 2, 64, grad_norm=math.inf)))
    assert step.grad_norm == math.inf
    with pytest.raises(TransportError, match="grad_norm"):
        codec.from_bytes(pb.StepRequest, codec.to_bytes(StepRequest("p", 0, 0, 2, 64, grad_norm=math.nan)))
    assert codec.late_norms_from_bytes(codec.late_norms_to_bytes((1.0, math.inf))) == (1.0, math.inf)


# ------------------------------------------------------------------------------ activation checkpointing

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, head_dim=16, ffn_hidden=48, max_seq_len=16)


def test_checkpointed_blocks_give_the_same_gradients_bit_for_bit():
    grads = []
    for recompute in (False, True):
        module = Decoder(TINY, seed=3)
        module.activation_checkpointing = recompute
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        module(x).float().logsumexp(-1).mean().backward()
        grads.append([p.grad for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_checkpointing_stage_accumulates_the_same_bits_plain_and_deferred(precision):
    cfg = _cfg()
    for defer in (False, True):
        plain, recomputing = _pipeline(cfg, precision), _pipeline(cfg, precision, checkpointing=True)
        x, y = _batch(cfg, 0)
        sent_plain = _accumulate(plain, x, y, defer)
        sent_recomputed = _accumulate(recomputing, x, y, defer)
        for a, b in zip(sent_plain, sent_recomputed, strict=True):
            assert all(torch.equal(u, v) for u, v in zip(a[:-1], b[:-1], strict=True))  # input gradients
        for p, r in zip(plain, recomputing, strict=True):
            assert p.grad_sq_norm() == r.grad_sq_norm()  # runs the deferred weight pass first
            for u, v in zip(p.module.parameters(), r.module.parameters(), strict=True):
                assert torch.equal(u.grad, v.grad)


# ------------------------------------------------------------------------------ the commit stays fp32


def test_an_fp32_and_a_bf16_holder_of_a_stage_commit_one_round_to_the_same_state():
    cfg = _cfg(stages=2)
    holders = [StageWorker(cfg, 1, True, "cpu", "fp32"), StageWorker(cfg, 1, True, "cpu", "bf16", True)]
    g = torch.Generator().manual_seed(5)
    for i, w in enumerate(holders):  # each trains on its own data: different inner steps
        for h in range(cfg.train.inner_steps):
            for mb in range(MB):
                tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len), generator=g)
                hidden = torch.randn(2, cfg.train.seq_len, cfg.k, generator=g)
                w.forward((f"p{i}", mb), tokens, hidden, tokens.roll(-1, 1))
            w.step(0, h, None)
    assert holders[0].param_hash() == holders[1].param_hash()  # θ_start, the committed state: one hash
    assert _hashes(holders)[0] != _hashes(holders)[1]  # but they trained apart
    payloads = [w.contribute(f"r{i}") for i, w in enumerate(holders)]
    commits = [w.apply_round(payloads, None, ("r0", "r1")) for w in holders]
    assert commits[0] == commits[1]
    assert holders[0].param_hash() == holders[1].param_hash() and holders[0].outer_step == 1
    assert holders[0].perp_hash() == holders[1].perp_hash()
    assert _hashes(holders)[0] == _hashes(holders)[1]  # the live parameters too, bit for bit
    for w in holders:  # what every holder must agree on is float32
        assert all(v.dtype == torch.float32 for v in w.start.values())
        assert w.optim.errors is not None and all(e.dtype == torch.float32 for e in w.optim.errors.values())
        assert all(p.dtype == torch.float32 for p in w.module.parameters())


# ------------------------------------------------------------------------------ the full replica


def test_a_full_replica_in_fp16_scales_its_one_backward_and_skips_an_overflow_on_every_stage():
    cfg = _cfg()
    workers = {s: StageWorker(cfg, s, False, "cpu", "fp16") for s in range(cfg.stages)}
    full = _Full(None, workers, threading.Event())  # type: ignore[arg-type]  # inner steps need no session
    for w in full.chain:  # an overflow of fp16 in the chain's backward
        w.scaler = LossScaler(True, init_scale=2.0**100)
    before = _hashes(full.chain)
    loss = full.inner_step(0, 0, *_batch(cfg, 0))
    assert math.isfinite(loss) and _hashes(full.chain) == before
    assert [w.scaler.scale for w in full.chain] == [2.0**99] * 3 and all(w.skipped_steps == 1 for w in full.chain)
    for w in full.chain:
        w.scaler = LossScaler(True)
    full.inner_step(0, 1, *_batch(cfg, 1))
    assert all(a != b for a, b in zip(_hashes(full.chain), before, strict=True))
    assert all(w.skipped_steps == 1 and w.scaler.scale == 2.0**16 for w in full.chain)
    full.chain[0].scaler = LossScaler(True, init_scale=2.0**8)
    with pytest.raises(RuntimeError, match="disagree on the loss scale"):
        full.inner_step(0, 2, *_batch(cfg, 2))
