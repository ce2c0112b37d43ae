"""Input gradient first, weight gradients after (peer.core.model.split_backward, StageWorker `defer`).

The two passes must give the one-pass results bit for bit, so a pipelined stage that answers the
flush's input gradient early ends exactly where the sequential schedule ends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peer.core.model.decoder import Decoder, ModelConfig
from peer.core.model.split_backward import input_grad_first
from peer.core.model.state import stage_state, state_hash
from peer.node.stage.worker import StageWorker
from tests.unit.test_step_overtaken import MB, _cfg, _inputs

TINY = ModelConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=2, head_dim=16, ffn_hidden=48, max_seq_len=16)


def _grads(last: bool, split_on: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Three micro-batches accumulated through stage 1 of 2 (last) or a middle stage; the one
    numbered `split_on` runs input-gradient-first. Returns the last input gradient and .grad."""
    torch.manual_seed(0)
    module = Decoder(TINY, layers=range(2, 4), has_embed=False, has_head=last, seed=3)
    g = torch.Generator().manual_seed(1)
    grad_in = torch.empty(0)
    for mb in range(3):
        x = torch.randn(2, 16, 32, generator=g).requires_grad_(True)
        out = module(x)
        if last:
            root, root_grad = F.cross_entropy(out.flatten(0, 1), torch.randint(0, 64, (32,), generator=g)) / 3, None
        else:
            root, root_grad = out, torch.randn(out.shape, generator=g)
        if mb == split_on:
            grad_in, weights = input_grad_first(root, root_grad, x, module.parameters())
            assert all(p.grad is None or mb > 0 for p in module.parameters())  # nothing accumulated yet
            weights()
        else:
            root.backward(root_grad)
            assert x.grad is not None
            grad_in = x.grad
    return grad_in, [p.grad.clone() for p in module.parameters()]


def test_two_passes_equal_one_pass_bit_for_bit():
    for last in (True, False):
        ref_in, ref = _grads(last, None)
        for split_on in (0, 2):
            got_in, got = _grads(last, split_on)
            assert torch.equal(got_in, ref_in), (last, split_on)
            assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_a_stage_that_defers_its_weight_gradients_steps_to_the_same_bits():
    cfg = _cfg()
    plain, deferred = StageWorker(cfg, 1), StageWorker(cfg, 1)
    for h in range(2):
        for mb in range(MB):
            tokens, hidden, targets = _inputs(cfg, h, mb)
            defer = mb == MB - 1
            a = plain.forward(("p", mb), tokens, hidden, targets, epoch=(h, 0), window=4)
            b = deferred.forward(("p", mb), tokens, hidden, targets, epoch=(h, 0), window=4, defer=defer)
            assert a.loss == b.loss and a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)
            if defer:  # the answer came before the weights' pass: it is still due
                assert deferred._weights_due is not None
        assert plain.grad_sq_norm() == deferred.grad_sq_norm()  # runs the deferred pass first
        plain.step(0, h, None)
        deferred.step(0, h, None)
    assert state_hash(stage_state(plain.module)) == state_hash(stage_state(deferred.module))


def test_a_replay_drops_the_deferred_weight_gradients():
    cfg = _cfg()
    worker = StageWorker(cfg, 1)
    for mb in range(MB):
        tokens, hidden, targets = _inputs(cfg, 0, mb)
        worker.forward(("p", mb), tokens, hidden, targets, epoch=(0, 0), window=4, defer=mb == MB - 1)
    assert worker._weights_due is not None
    answered = worker.gate.generation  # the answer went out; its Σ‖g‖² is still to come
    worker.zero_grad()
    assert worker._weights_due is None and all(p.grad is None for p in worker.module.parameters())
    with pytest.raises(ValueError, match="a replay reset the gradients"):
        worker.grad_sq_norm(answered)  # never the norm of gradients that are gone
    assert worker.grad_sq_norm() == 0.0
