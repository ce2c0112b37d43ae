"""T_S and T⊥ as the stages of a compressed run hold them (paper eqs. 3–4, arXiv 2601.02360 §3.2).

The embedding TE is split once, from the seed, into T_S = Π(TE) (trainable, on the stage that
holds the embedding) and T⊥ = TE − T_S (a buffer on every stage: stages > 0 need it to expand
boundaries). `initial_split` computes the split (portable: every peer gets the same bits alone),
`attach_subspace` / `init_subspace` give it to stages, `perp_of` / `set_perp` read and overwrite
T⊥ where a stage holds it.

Invariants: every holder of a compressed run keeps T⊥ as a buffer, of one shape on every stage.
"""

from __future__ import annotations

from typing import Protocol

import torch

from peer.core.model.decoder import Decoder, ModelConfig
from peer.core.subspace.compression import split_embedding

EMBED = "embed.weight"  # the embedding's global parameter name


class SeededModel(Protocol):
    """What the initial split reads from a run's config (`peer.config.RunConfig` is one)."""

    @property
    def model(self) -> ModelConfig: ...

    @property
    def seed(self) -> int: ...


def initial_split(cfg: SeededModel, U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_S, T⊥) of the seed's initial embedding; every peer computes the same split alone."""
    embed_only = Decoder(cfg.model, layers=range(0), has_embed=True, has_head=False, seed=cfg.seed)
    assert embed_only.embed is not None  # built with has_embed=True
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


def init_subspace(stages: list[Decoder], cfg: SeededModel, U: torch.Tensor) -> None:
    """Split the initial embedding TE into T_S = Π(TE) (trainable) and T⊥ (buffer) on every stage."""
    w, perp = initial_split(cfg, U)
    for stage in stages:
        attach_subspace(stage, w, perp)


def perp_of(stage: Decoder) -> torch.Tensor:
    """T⊥ as held by a stage (the embedding's buffer on stage 0, a plain buffer elsewhere)."""
    held = stage.embed.perp if stage.embed is not None else stage.get_buffer("perp")
    if held is None:
        raise ValueError("this stage holds no T⊥ (the run uses no subspace)")
    return held


def set_perp(stage: Decoder, perp: torch.Tensor) -> None:
    """Overwrite the stage's T⊥ in place (same shape, its own device)."""
    with torch.no_grad():
        perp_of(stage).copy_(perp)
