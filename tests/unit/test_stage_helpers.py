"""The stage helpers of peer/core: the initial T_S/T⊥ split read from anything that names a model
and a seed (`subspace_state`), and a stage's state taken, checked and hashed (`state`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from peer.config import build_config
from peer.core.model.decoder import Decoder, ModelConfig
from peer.core.model.state import check_stage_state, stage_state, state_hash
from peer.core.subspace.compression import make_basis, project
from peer.core.subspace.state import EMBED, attach_subspace, initial_split, perp_of, set_perp


@dataclass(frozen=True)
class _Seeded:  # not a RunConfig: the split needs only these two fields
    model: ModelConfig
    seed: int


def _setup() -> tuple[ModelConfig, int, torch.Tensor]:
    cfg = build_config(overrides={"preset": "tiny", "seed": 3})
    return cfg.model, cfg.seed, make_basis(cfg.model.d_model, cfg.k, cfg.seed)


def test_initial_split_reads_only_the_model_and_the_seed():
    model, seed, U = _setup()
    cfg = build_config(overrides={"preset": "tiny", "seed": 3})
    w, perp = initial_split(_Seeded(model, seed), U)
    w_run, perp_run = initial_split(cfg, U)
    assert torch.equal(w, w_run) and torch.equal(perp, perp_run)
    assert torch.allclose(project(w, U), w, atol=1e-5)  # T_S lies in Col(U)
    embed = Decoder(model, layers=range(0), has_embed=True, has_head=False, seed=seed).embed
    assert embed is not None
    assert torch.allclose(w + perp, embed.weight.detach(), atol=1e-5)  # TE = T_S + T⊥
    _, other = initial_split(_Seeded(model, seed + 1), U)
    assert not torch.equal(perp, other)


def test_every_stage_holds_t_perp_and_set_perp_overwrites_it():
    model, seed, U = _setup()
    w, perp = initial_split(_Seeded(model, seed), U)
    first = Decoder(model, layers=range(0, 1), has_embed=True, has_head=False, seed=seed)
    later = Decoder(model, layers=range(1, 2), has_embed=False, has_head=True, seed=seed)
    with pytest.raises(ValueError, match="no T⊥"):  # an embedding without a subspace
        perp_of(first)
    for stage in (first, later):
        attach_subspace(stage, w, perp)
        assert torch.equal(perp_of(stage), perp)
    assert torch.equal(dict(first.named_parameters())[EMBED].detach(), w)
    set_perp(later, torch.zeros_like(perp))
    assert not perp_of(later).any() and torch.equal(perp_of(first), perp)


def test_check_stage_state_names_what_does_not_match():
    model, seed, U = _setup()
    _, perp = initial_split(_Seeded(model, seed), U)
    stage = Decoder(model, layers=range(1, 2), has_embed=False, has_head=True, seed=seed)
    attach_subspace(stage, torch.empty(0), perp)
    state = stage_state(stage)
    check_stage_state(stage, 1, state, state, perp)  # its own state passes
    name = next(k for k, v in state.items() if v.ndim == 2)
    missing = {k: v for k, v in state.items() if k != name}
    with pytest.raises(ValueError, match="missing"):
        check_stage_state(stage, 1, missing, state, perp)
    reshaped = {**state, name: state[name].reshape(-1)}
    with pytest.raises(ValueError, match=re.escape(name)):
        check_stage_state(stage, 1, state, reshaped, perp)
    with pytest.raises(ValueError, match="T⊥"):
        check_stage_state(stage, 1, state, state, perp[:-1])


def test_state_hash_is_equal_iff_bit_identical():
    model, seed, _ = _setup()
    state = stage_state(Decoder(model, layers=range(0, 1), has_embed=True, has_head=False, seed=seed))
    assert state_hash(state) == state_hash({k: v.clone() for k, v in reversed(state.items())})
    name = next(iter(state))
    nudged = {**state, name: state[name].clone()}
    nudged[name].view(-1)[0] = torch.nextafter(nudged[name].view(-1)[0], torch.tensor(float("inf")))
    assert state_hash(nudged) != state_hash(state)
    assert state_hash({**state, name: state[name].double()}) != state_hash(state)  # dtype counts
