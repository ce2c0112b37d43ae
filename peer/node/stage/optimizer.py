"""One stage's two optimizers: the inner AdamW and the outer SparseLoCo error buffer (no networking).

AdamW steps every inner step (`peer.core.model.inner.adamw_step`: clipped by the model's global norm,
the learning rate of the global step t·H + h); the error buffer carries what this stage's payloads
have not sent yet (`peer.core.sparseloco.algorithm.compress`: e = β·e + Δ, then e − Δ̂) and takes back what
a round returns to us (`peer.core.sparseloco.feedback`). Both are state: AdamW's by parameter name, so a
checkpoint or a state transfer survives a different parameter order (torch keys optimizer state by
position), the error buffer as float32 CPU tensors by name (None: empty).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from peer.core.model.decoder import Decoder
from peer.core.model.inner import adamw_step
from peer.core.model.optim import TrainConfig, build_adamw
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.feedback import add_to_errors

__all__ = ["StageOptimizer", "load_named_optimizer_state", "named_optimizer_state"]


class StageOptimizer:
    """A stage's inner AdamW over `module` and its outer error buffer."""

    def __init__(self, module: Decoder, train: TrainConfig, sparseloco: SparseLoCoConfig) -> None:
        self.module, self.train, self.sparseloco = module, train, sparseloco
        self.adamw = build_adamw(module.named_parameters(), train)
        self.errors: dict[str, Tensor] | None = None  # the SparseLoCo error buffer e, by parameter name

    def step(self, global_step: int, keep_in_subspace: Tensor | None, total_norm: float | None) -> None:
        """AdamW on the accumulated gradients (`peer.core.model.inner.adamw_step`)."""
        adamw_step(self.module, self.adamw, global_step, self.train, keep_in_subspace, total_norm)

    def zero_grad(self) -> None:
        self.adamw.zero_grad(set_to_none=True)

    def encode(self, delta: Mapping[str, Tensor]) -> Payload:
        """This round's payload of the pseudo-gradient Δ; the error buffer becomes e − Δ̂."""
        # the old error buffers are overwritten by the new ones (no model-sized allocation);
        # nothing else holds them between rounds (checkpoints are written inside the round)
        payload, self.errors = compress(delta, self.errors, self.sparseloco, in_place=True)
        return payload

    def feed_back(self, change: Mapping[str, Tensor] | None, sign: float = 1.0) -> None:
        """e ← e + sign·change: what a round returns to us (sign −1: takes back what it returned)."""
        self.errors = add_to_errors(self.errors, change, sign)

    def state_dict(self) -> dict[str, Any]:
        """{"errors": {name: e} | None, "optimizer": AdamW's state by name (`named_optimizer_state`)}."""
        return {
            "errors": None if self.errors is None else dict(self.errors),
            "optimizer": named_optimizer_state(self.module, self.adamw),
        }

    def loaded(self, state: Mapping[str, Any], stage: int) -> StageOptimizer:
        """A new one with `state` ("optimizer" and "errors", each optional: fresh AdamW, empty
        buffer); ValueError when AdamW's state is not this model's. This one is left as it was."""
        out = StageOptimizer(self.module, self.train, self.sparseloco)
        if state.get("optimizer") is not None:
            load_named_optimizer_state(self.module, out.adamw, state["optimizer"], stage)
        errors = state.get("errors")
        out.errors = None if errors is None else {n: e.to("cpu", torch.float32) for n, e in errors.items()}
        return out


def _param_names(module: Decoder, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Global parameter names of each AdamW param group, in the optimizer's order."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def named_optimizer_state(module: Decoder, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """AdamW state by global name: {"state": {"<param>/<exp_avg|exp_avg_sq|step>": tensor},
    "param_groups": [JSON-serialisable hyperparameters + "params" as global names]}."""
    names = {id(p): n for n, p in module.named_parameters()}
    tensors = {
        f"{names[id(p)]}/{key}": value.detach() for p, st in optimizer.state.items() for key, value in st.items()
    }
    groups = [
        {
            **{
                k: (v.item() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v)
                for k, v in g.items()
                if k != "params"
            },
            "params": names_,
        }
        for g, names_ in zip(optimizer.param_groups, _param_names(module, optimizer), strict=True)
    ]
    return {"state": tensors, "param_groups": groups}


def load_named_optimizer_state(
    module: Decoder, optimizer: torch.optim.Optimizer, named: Mapping[str, Any], stage: int
) -> None:
    """Load what `named_optimizer_state` returned into `optimizer` (fresh, over `module`); ValueError
    when its parameter groups are not this model's."""
    groups: Sequence[Mapping[str, Any]] = named["param_groups"]
    own_groups = _param_names(module, optimizer)
    if [list(g["params"]) for g in groups] != own_groups:
        raise ValueError(f"stage {stage}: optimizer parameter groups do not match this model")
    index = {name: i for i, name in enumerate(n for g in own_groups for n in g)}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in named["state"].items():
        name, field = key.rsplit("/", 1)
        state.setdefault(index[name], {})[field] = value
    template = optimizer.state_dict()["param_groups"]
    merged = [
        {**tg, **{k: (tuple(v) if isinstance(tg.get(k), tuple) else v) for k, v in g.items() if k != "params"}}
        for tg, g in zip(template, groups, strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": merged})
