"""The chain of stage views (peer.core.chain): the whole model's forward, loss and gradient norm."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from peer.core.chain import chain_forward, global_grad_norm, token_loss
from peer.core.model import PRESETS, build_model, build_stage
from peer.core.optim import grad_sq_norm

TINY = PRESETS["tiny"]
SEED = 7


def _batch(b: int = 2, L: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, TINY.vocab_size, (b, L), generator=g), torch.randint(
        0, TINY.vocab_size, (b, L), generator=g
    )


@pytest.mark.parametrize("n_stages", [1, 3])
def test_chain_forward_loss_and_norm_equal_the_whole_model(n_stages):
    ids, targets = _batch()
    whole = build_model(TINY, SEED)
    ref = whole(ids)
    ref_loss = F.cross_entropy(ref.flatten(0, 1), targets.flatten())  # the dense reference
    ref_loss.backward()
    stages = [build_stage(TINY, s, n_stages, SEED) for s in range(n_stages)]
    logits = chain_forward(stages, ids)
    assert torch.equal(logits, ref)
    loss = token_loss(logits, targets)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    norm = global_grad_norm(grad_sq_norm(st.parameters()) for st in stages)
    assert norm == math.sqrt(grad_sq_norm(whole.parameters()))
    assert norm == global_grad_norm(reversed([grad_sq_norm(st.parameters()) for st in stages]))  # order-free


def test_a_boundary_maps_what_crosses_between_stages():
    ids, targets = _batch()
    stages = [build_stage(TINY, s, 2, SEED) for s in range(2)]
    crossed: list[torch.Tensor] = []

    def zero(hidden: torch.Tensor, stage: torch.nn.Module) -> torch.Tensor:
        assert stage is stages[1]
        crossed.append(hidden)
        return torch.zeros_like(hidden)

    logits = chain_forward(stages, ids, zero)
    assert len(crossed) == 1 and crossed[0].shape == (2, 16, TINY.d_model)
    assert torch.equal(logits, stages[1](torch.zeros_like(crossed[0])))
    assert not torch.equal(logits, chain_forward(stages, ids))
    per_token = token_loss(logits, targets, reduction="none")
    assert per_token.shape == (32,) and torch.allclose(per_token.mean(), token_loss(logits, targets))
