"""A stage's AdamW state by parameter name, so a checkpoint or a state transfer survives a
different parameter order (torch keys optimizer state by position). Used by `StageWorker`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from peer.core.model import Decoder

__all__ = ["load_named_optimizer_state", "named_optimizer_state"]


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
