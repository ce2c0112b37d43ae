"""A stage's canonical initial state: recomputed from the run's config by every peer, never downloaded.

Every weight comes from the seed and the embedding's T_S/T⊥ split from the basis U (docs/protocol.md,
"The initial state is defined by bytes"), so any two peers build the same bits alone.
"""

from __future__ import annotations

import torch

from peer.config import RunConfig
from peer.core.model.decoder import Decoder, build_stage
from peer.core.model.state import stage_state
from peer.core.subspace.compression import make_basis
from peer.core.subspace.state import attach_subspace, initial_split, perp_of


def initial_module(cfg: RunConfig, stage: int) -> tuple[Decoder, torch.Tensor]:
    """The canonical initial stage (CPU) and the basis U: every weight from the seed, T_S/T⊥ split
    by Π (docs/protocol.md, "The initial state is defined by bytes")."""
    module = build_stage(cfg.model, stage, cfg.stages, cfg.seed)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    w, perp = initial_split(cfg, U)
    attach_subspace(module, w, perp)
    return module, U


def canonical_state(cfg: RunConfig, stage: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(θ_start, T⊥) of `stage`'s canonical initial state, recomputed (what `reset_initial` loads)."""
    module, _ = initial_module(cfg, stage)
    return stage_state(module), perp_of(module).detach().clone()
