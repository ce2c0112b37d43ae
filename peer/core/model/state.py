"""A stage's state by global parameter name: taken (`stage_state`), checked before it is adopted
(`check_stage_state`) and hashed (`state_hash`).

Layer keys are global (`layers.3.attn.wq.weight` on whichever stage holds layer 3), so states of
one stage from different holders compare name by name.

Invariants: `state_hash` is equal iff the tensors are bit-identical (names, dtypes, shapes,
bytes); `check_stage_state` raises before anything changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from peer.core.model.decoder import Decoder
from peer.core.subspace.state import perp_of


def stage_state(stage: Decoder) -> dict[str, torch.Tensor]:
    """Trainable parameters of a stage by global name (detached clones)."""
    return {name: p.detach().clone() for name, p in stage.named_parameters()}


def check_stage_state(
    module: Decoder,
    stage: int,
    start: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    perp: torch.Tensor,
) -> None:
    """ValueError unless `start` and `params` name exactly `module`'s parameters with their shapes
    and `perp` has T⊥'s shape (a state to adopt, checked before anything changes)."""
    own = dict(module.named_parameters())
    for what, tensors in (("state", start), ("parameters", params)):
        if set(tensors) != set(own):
            missing, extra = set(own) - set(tensors), set(tensors) - set(own)
            raise ValueError(
                f"{what} for stage {stage} does not match: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(extra)[:3]}"
            )
        for name, value in tensors.items():
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(own[name].shape)}")
    if perp.shape != perp_of(module).shape:
        raise ValueError(f"T⊥: shape {tuple(perp.shape)} != {tuple(perp_of(module).shape)}")


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]
