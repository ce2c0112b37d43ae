"""The inner step of a full replica sharded over N ranks (`peer join --full-replica --sharded`, FSDP2).

Every rank holds 1/N of every stage's parameters, gradients and AdamW state: torch's `fully_shard`
(FSDP2, dim-0 shards: ⌈rows/N⌉ rows of each parameter) on gloo (CPU) or NCCL, with the units of
`peer.core.memory.sharded` — each transformer block, the embedding, the head, and the rest of a stage
(the final norm). Buffers (T⊥) are not sharded: every rank holds them whole.

One inner step (`ShardedChain.step`, paper Alg. 1 as `peer.core.model.inner`): each rank draws its
own batch of the shard (`rank_batch_index`); every micro-batch's forward all-gathers each unit's
parameters and its backward reduce-scatters the unit's gradient, averaged over the ranks (gradients
stay sharded); the gradient norm over every stage is each parameter's Σg², summed over the shards
(one all-reduce) and put on the fixed grid of `peer.core.model.optim.sq_norm` (the whole model's
float); each stage's shards are clipped by it and step AdamW at lr(t·H + h).

The round (`gather`, `scatter`) is today's, on rank 0: before it, every stage's parameters and
AdamW state are all-gathered into rank 0's whole `StageWorker`s (θ_start and the error buffer live
there only); after the committed state changed, rank 0's state is scattered back to the shards.
So what leaves the replica and what it commits is an unsharded replica's, byte for byte.

`per_step` (`peer join --sharded --gather-per-step`) trades memory for traffic: each unit's
parameters are all-gathered once per inner step and kept through its micro-batches (no re-gather in
the backward, nor for the next micro-batch), and its gradient accumulates whole on each rank and is
reduce-scattered once, after the last micro-batch — DDP's traffic and DDP's float order (the local
sum over micro-batches, then one average over the ranks). During the step a rank then holds the whole
replica's parameters and gradients; between steps only its shards (`peer.core.memory.sharded`). On
2 CPU cores it lifts 2 ranks' tokens/s from 1.36× one rank's to 1.61× (docs/hardware.md).

Invariants: every rank calls `step`, `gather` and `scatter` at the same point (they are
collectives); with one micro-batch per step, N sharded ranks take DDP's step over N ranks bit for bit
(one average of N gradients either way); with several, the sum runs per micro-batch (a different
float order, the price of sharded gradients), or with `per_step` as DDP's.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor, distribute_tensor

from peer.config import RunConfig
from peer.core.model.chain import global_grad_norm, token_loss
from peer.core.model.decoder import Decoder
from peer.core.model.inner import accumulate
from peer.core.model.optim import build_adamw, clip_grads_to, lr_at, set_lr, sq_norm
from peer.core.model.precision import autocast
from peer.errors import ConfigError
from peer.node.replica.reduce import sum_in_rank_order
from peer.node.stage.initial import initial_module
from peer.node.stage.optimizer import named_optimizer_state
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)


class RankOrderReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter as an all-to-all and a sum in rank order (`peer.node.replica.reduce`: the
    float order DDP's hook uses too), so sharded and data-parallel ranks average alike."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            raise ValueError(f"a rank-order reduce-scatter sums or averages, not {op}")
        n = group.size()
        received = torch.empty((n, output_tensor.numel()), dtype=input_tensor.dtype, device=input_tensor.device)
        dist.all_to_all_single(received.view(-1), input_tensor.view(-1), group=group)
        sum_in_rank_order(received, output_tensor.view(-1))
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)


class _Stages(nn.Module):
    """Every stage's module in one root module; forward: the chain's loss, as `chain_loss`."""

    def __init__(self, stages: Sequence[Decoder], device: torch.device, precision: str) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.device, self.precision = device, precision

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        hidden = x.to(self.device)  # (b, L)
        for stage in self.stages:
            with autocast(self.device, self.precision):
                out = stage(hidden)
            hidden = out.float()  # (b, L, d), the last: (b, L, V)
        return token_loss(hidden, y.to(self.device))


class ShardedChain:
    """Every stage of a full replica under FSDP2 over the process group's ranks, with its AdamW.

    Building it is a collective; its state is the canonical initial one until the first `scatter`."""

    def __init__(self, cfg: RunConfig, device: str | torch.device, precision: str, per_step: bool = False) -> None:
        """`per_step`: gather and reduce once per inner step (module docstring)."""
        if precision == "fp16":
            raise ConfigError("--sharded trains in bf16 or fp32 (fp16's loss scale is not sharded); pass --precision")
        self.cfg, self.device, self.precision, self.per_step = cfg, torch.device(device), precision, per_step
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        modules: list[Decoder] = []
        for s in range(cfg.stages):  # each stage sharded before the next is built: one stage whole at a time
            m = initial_module(cfg, s)[0].to(self.device)
            # the head its own unit: inside the stage's (m: the final norm) it stayed gathered, with its
            # gradient, through the stage's whole backward (the 4-rank peak of docs/hardware.md)
            embed, head = [m.embed] if m.embed is not None else [], [m.head] if m.head is not None else []
            for unit in (*embed, *m.layers.values(), *head, m):
                self._shard(unit)
            modules.append(m)
        self.root = _Stages(modules, self.device, precision)
        self._shard(self.root)
        self.stages: list[Decoder] = modules
        self.optims = [build_adamw(m.named_parameters(), cfg.train) for m in modules]
        self.skipped_steps = 0

    def _shard(self, unit: nn.Module) -> None:
        """`fully_shard` one unit (its parameters become this rank's shards at once)."""
        fully_shard(unit, mesh=self.mesh, reshard_after_forward=not self.per_step)  # per step: kept to the backward
        fsdp = cast(FSDPModule, unit)  # gradients averaged in rank order, as DataParallel's (`.reduce`)
        fsdp.set_force_sum_reduction_for_comms(True)
        fsdp.set_custom_reduce_scatter(RankOrderReduceScatter())

    # ------------------------------------------------------------------ the inner step
    def step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """Inner step h of outer step t on this rank's (b, L) batch; the batch's mean loss (this rank's)."""
        n, seen = self.cfg.train.microbatches, [0]

        def forward(mx: torch.Tensor, my: torch.Tensor) -> tuple[torch.Tensor, int]:
            seen[0] += 1
            if self.per_step:  # reduce-scatter and reshard after the last micro-batch's backward only
                root = cast(FSDPModule, self.root)
                root.set_requires_gradient_sync(seen[0] == n)
                root.set_reshard_after_backward(seen[0] == n)
            return self.root(mx, my), 0

        loss, _ = accumulate(forward, x, y, n)
        norm = global_grad_norm(self._sq_norms())
        if not math.isfinite(norm):
            log.info("sharded replica: gradient norm %s at inner step %d of outer step %d; step skipped", norm, h, t)
            self.skipped_steps += 1
        else:
            train = self.cfg.train
            for m, opt in zip(self.stages, self.optims, strict=True):
                clip_grads_to(m.parameters(), train.grad_clip, norm)
                set_lr(opt, lr_at(t * train.inner_steps + h, train))
                opt.step()
        self.zero_grad()
        return loss

    def _sq_norms(self) -> list[float]:
        """Each stage's Σ‖g‖²: every parameter's Σg² over its shards (float64, one all-reduce), on the grid."""
        per = [[_local_sq(p) for p in m.parameters()] for m in self.stages]
        flat = torch.stack([v for stage in per for v in stage])  # (n_params,) float64, on the device
        dist.all_reduce(flat)
        sums, out = flat.tolist(), []
        for stage in per:
            out.append(sq_norm(sums[: len(stage)]))
            sums = sums[len(stage) :]
        return out

    def zero_grad(self) -> None:
        for opt in self.optims:
            opt.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ the round's state
    @torch.no_grad()
    def gather(self, chain: Sequence[StageWorker] | None) -> None:
        """All-gather every stage's parameters and AdamW state; rank 0 (`chain`: its whole stages)
        takes them into its workers (the round's input), the other ranks drop them (pass None)."""
        whole: Sequence[StageWorker | None] = chain or [None] * len(self.stages)
        for m, opt, w in zip(self.stages, self.optims, whole, strict=True):
            params = {n: _full(p) for n, p in m.named_parameters()}
            named = named_optimizer_state(m, opt)
            state = {k: _full(v) for k, v in sorted(named["state"].items())}
            if w is None:
                continue
            with w.lock:
                for n, p in w.module.named_parameters():
                    p.copy_(params[n])
                optimizer = {"state": state, "param_groups": named["param_groups"]} if state else None
                w.optim = w.optim.loaded({"errors": w.optim.errors, "optimizer": optimizer}, w.stage)
                w.casts.clear()

    @torch.no_grad()
    def scatter(self, chain: Sequence[StageWorker] | None) -> dict[str, Any]:
        """Rank 0 (`chain`) sends its stages' parameters, buffers (T⊥) and AdamW state; every rank
        keeps its shard (the others pass None). Returns what rank 0 said about them (outer step, hashes)."""
        meta: list[Any] = [None]
        if chain is not None:
            opt_states = [w.optim.state_dict()["optimizer"]["state"] for w in chain]
            keys = [{k: float(v) if k.endswith("/step") else None for k, v in sorted(st.items())} for st in opt_states]
            hashes = {str(w.stage): w.param_hash() for w in chain}
            meta = [{"keys": keys, "outer_step": chain[0].outer_step, "param_hashes": hashes}]
        dist.broadcast_object_list(meta, src=0)
        for s, m in enumerate(self.stages):
            src = None if chain is None else chain[s].module
            params = dict(m.named_parameters())
            for n, p in params.items():
                p.copy_(self._shard_of(None if src is None else src.get_parameter(n), p))
            for n, b in m.named_buffers():
                if src is not None:
                    b.copy_(src.get_buffer(n))
                dist.broadcast(b, src=0)
            opt = build_adamw(m.named_parameters(), self.cfg.train)
            for key, step in meta[0]["keys"][s].items():
                name, field = key.rsplit("/", 1)
                p = params[name]
                if step is not None:
                    opt.state[p][field] = torch.tensor(step, dtype=torch.float32)
                else:
                    full = None if chain is None else opt_states[s][key]
                    opt.state[p][field] = self._shard_of(full, p)
            self.optims[s] = opt
        out: dict[str, Any] = meta[0]
        return out

    def _shard_of(self, full: torch.Tensor | None, like: torch.Tensor) -> DTensor:
        """This rank's shard of rank 0's `full` (the others pass None), laid out as `like`'s."""
        assert isinstance(like, DTensor)
        if full is None:
            full = torch.empty(like.shape, dtype=like.dtype, device=self.device)
        return distribute_tensor(full.to(self.device, like.dtype), like.device_mesh, like.placements, src_data_rank=0)

    # ------------------------------------------------------------------ what a rank holds
    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of the replica's parameters, gradients and AdamW state (its shards)."""
        params = [p for m in self.stages for p in m.parameters()]
        grads = [p.grad for p in params if p.grad is not None]
        opt = [v for o in self.optims for st in o.state.values() for v in st.values() if isinstance(v, DTensor)]
        return {
            "params": sum(_local(p).nbytes for p in params),
            "grads": sum(_local(g).nbytes for g in grads),
            "optimizer": sum(_local(v).nbytes for v in opt),
        }


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (an all-gather: every rank calls it), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _local_sq(p: torch.Tensor) -> torch.Tensor:
    """Σg² of this rank's shard of p's gradient (float64 on its device; 0 without a gradient)."""
    if p.grad is None:
        return torch.zeros((), dtype=torch.float64, device=p.device)
    return _local(p.grad).detach().double().square().sum()
