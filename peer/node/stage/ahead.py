"""A stage trained ahead of its round in flight: the rebase onto the committed state (`train.overlap` 1).

docs/protocol.md, "Overlapped outer steps".

At the end of outer step t's inner steps a holder encodes its payload from θ_start(t) and its local
parameters θ_b, then trains the inner steps of t + 1 while round t gathers and commits in the
background. `Ahead` keeps θ_b (the base the progress since the boundary is measured from). When
round t commits θ_start(t + 1), the local parameters are rebased onto it:

    θ ← θ + (θ_start(t + 1) − base);   base ← θ_start(t + 1)

so θ = θ_start(t + 1) + (the inner progress made since the boundary), and a later change of the
committed state in the same window (a checked switch of round t − 1's set, then round t) rebases
onto the newest the same way. Only the local parameters move this way: the committed state (θ_start,
T⊥, bans) is installed whole, exactly as the synchronous schedule installs it, so every holder of
the stage still holds the same committed bits. T⊥ is not trained by inner steps: it is replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


class Ahead:
    """The outer step trained ahead of the committed one, and θ_b, the base of its progress."""

    def __init__(self, module: nn.Module, training: int) -> None:
        self.training = training
        self.base = {n: p.detach().clone() for n, p in module.named_parameters()}

    @torch.no_grad()
    def rebase(self, module: nn.Module, committed: Mapping[str, torch.Tensor]) -> None:
        """θ ← θ + (committed − base) for every committed parameter; base ← committed."""
        params = dict(module.named_parameters())
        for name, value in committed.items():
            p = params[name]
            new = value.to(p.device, p.dtype)
            p.add_(new - self.base[name])
            self.base[name] = new.clone() if new.data_ptr() == value.data_ptr() else new


def cloned(obj: Any) -> Any:
    """A deep copy of a state dict's tensors (dicts, lists and tuples rebuilt; other values shared)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: cloned(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(cloned(v) for v in obj)
    return obj
