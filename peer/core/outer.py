"""The outer step of one stage and the stage helpers around it (paper Alg. 1, eqs. 3–4).

Used by the simulator (M replicas in one process) and by every peer of the swarm (full replicas,
heads, stage peers, spares). Every holder of a stage keeps T⊥ as a buffer when the run uses a
subspace, so one outer rule updates every holder of the embedding identically
(`peer.core.subspace.embedding_outer_update`).

Outer step for stage s (paper Alg. 1, SparseLoCo):  θ ← θ_start − η·Δ̄, with the embedding's change
split into its Col(U) part (kept in T_S) and the rest (moved into T⊥), so TE = T_S + T⊥ moves by
exactly −η·Δ̄ and T⊥ stays bit-identical on every peer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from peer.config import RunConfig
from peer.core.model import Decoder
from peer.core.sparseloco import outer_step
from peer.core.subspace import (
    embedding_outer_update,
    perp_outer_update,
    split_embedding,
)

EMBED = "embed.weight"


def stage_state(stage: Decoder) -> dict[str, torch.Tensor]:
    """Trainable parameters of a stage by global name (detached clones)."""
    return {name: p.detach().clone() for name, p in stage.named_parameters()}


def initial_split(cfg: RunConfig, U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_S, T⊥) of the seed's initial embedding; every peer computes the same split alone."""
    embed_only = Decoder(cfg.model, layers=range(0), has_embed=True, has_head=False, seed=cfg.seed)
    with torch.no_grad():
        return split_embedding(embed_only.embed.weight, U)


def attach_subspace(stage: Decoder, w: torch.Tensor, perp: torch.Tensor) -> None:
    """Give a stage its T⊥ (stages > 0 need it to expand boundaries); stage 0 also gets T_S = w."""
    if stage.embed is not None:
        with torch.no_grad():
            stage.embed.weight.copy_(w)
        stage.embed.enable_subspace(perp.clone())
    else:
        stage.register_buffer("perp", perp.clone(), persistent=True)


def init_subspace(stages: list[Decoder], cfg: RunConfig, U: torch.Tensor) -> None:
    """Split the initial embedding TE into T_S = Π(TE) (trainable) and T⊥ (buffer) on every stage."""
    w, perp = initial_split(cfg, U)
    for stage in stages:
        attach_subspace(stage, w, perp)


def perp_of(stage: Decoder) -> torch.Tensor:
    """T⊥ as held by a stage (the embedding's buffer on stage 0, a plain buffer elsewhere)."""
    if stage.embed is not None:
        return stage.embed.perp
    return stage.perp


def set_perp(stage: Decoder, perp: torch.Tensor) -> None:
    if stage.embed is not None:
        stage.embed.perp.copy_(perp)
    else:
        stage.perp.copy_(perp)


def apply_outer_update(
    stage: Decoder,
    start: Mapping[str, torch.Tensor],
    aggregate: Mapping[str, torch.Tensor],
    outer_lr: float,
    U: torch.Tensor | None,
    embed_update: torch.Tensor | None = None,
) -> None:
    """Set the stage's parameters to θ_start − η·Δ̄ (in place).

    `embed_update` is the committed change of `embed.weight` (−η·Δ̄ of stage 0); stages that hold
    only T⊥ pass it so their T⊥ moves exactly as stage 0's does.
    """
    new = outer_step({k: v for k, v in start.items() if k != EMBED}, aggregate, outer_lr)
    with torch.no_grad():
        params = dict(stage.named_parameters())
        for name, value in new.items():
            params[name].copy_(value)
        if EMBED in start:
            update = -outer_lr * aggregate[EMBED]
            if U is None:
                params[EMBED].copy_(start[EMBED] + update)
            else:
                w, perp = embedding_outer_update(start[EMBED], perp_of(stage), update, U)
                params[EMBED].copy_(w)
                set_perp(stage, perp)
        elif U is not None and embed_update is not None:
            set_perp(stage, perp_outer_update(perp_of(stage), embed_update, U))


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal iff bit-identical."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]
