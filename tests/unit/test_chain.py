"""The chain of stage views (peer.core.model.chain): the whole model's forward, loss and gradient norm."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from peer.core.model.chain import chain_forward, global_grad_norm, token_loss
from peer.core.model.decoder import PRESETS, build_model, build_stage
from peer.core.model.optim import SQ_NORM_EXACT_BELOW, SQ_NORM_GRID, grad_sq_norm, sq_norm

TINY = PRESETS["tiny"]
SEED = 7


def _batch(b: int = 2, L: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, TINY.vocab_size, (b, L), generator=g), torch.randint(
        0, TINY.vocab_size, (b, L), generator=g
    )


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
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
    shares = [grad_sq_norm(st.parameters()) for st in stages]
    assert math.fsum(shares) == grad_sq_norm(whole.parameters())  # Σ‖g‖² itself, before the square root
    norm = global_grad_norm(shares)
    assert norm == math.sqrt(grad_sq_norm(whole.parameters()))
    assert norm == global_grad_norm(reversed(shares))  # order-free


def _with_grads(*grads: list[float]) -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.zeros(len(g))) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = torch.tensor(g)
    return params


def test_the_norm_does_not_depend_on_the_split_where_rounding_per_stage_would():
    """Σ‖g‖² of 1, 2⁻⁵³, 2⁻⁵³: rounded per stage ({1, 2⁻⁵³} → 1, a tie to even) and then added, the
    two halves lose what the whole model keeps (1 + 2⁻⁵²). On the grid every split gives one float."""
    tiny = [2.0**-27, 2.0**-27]  # Σg² = 2⁻⁵³: half an ulp of 1
    params = _with_grads([1.0], tiny, tiny)
    whole = grad_sq_norm(params)
    for split in (1, 2):
        assert math.fsum([grad_sq_norm(params[:split]), grad_sq_norm(params[split:])]) == whole
    assert math.fsum(grad_sq_norm([p]) for p in reversed(params)) == whole
    # the grid's own promise: below SQ_NORM_EXACT_BELOW each share is a whole number of grid units
    for p in _with_grads([0.1, 0.3], [1e3, 7e-4], [3.0]):
        sq = grad_sq_norm([p])
        assert 0 < sq < SQ_NORM_EXACT_BELOW and (sq / SQ_NORM_GRID).is_integer()


def test_the_norm_unscales_before_the_grid():
    """An fp16 stage's Σ‖g‖² of S·g, unscaled by S², is the float32 stage's Σ‖g‖² of g."""
    grads = [[0.1, -0.2, 3e-5], [7.0]]
    scale = 2.0**16
    plain = grad_sq_norm(_with_grads(*grads))
    scaled = grad_sq_norm(_with_grads(*[[g * scale for g in gs] for gs in grads]), unscale=scale**2)
    assert scaled == plain
    assert grad_sq_norm(_with_grads([float("inf")], [1.0])) == math.inf


def test_a_sharded_tensors_shard_sums_give_the_whole_tensors_norm():
    """A sharded replica's Σ‖g‖²: each parameter's Σg² summed over its dim-0 shards, then the grid."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(n, 48)) for n in (97, 64, 5)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    for ranks in (1, 2, 4):
        per = [sum(float(c.double().square().sum()) for c in p.grad.chunk(ranks)) for p in params]
        assert sq_norm(per) == grad_sq_norm(params)


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
