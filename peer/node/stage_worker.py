"""The compute side of one pipeline stage held by a peer (no networking here).

A stage peer receives compressed activations X̃ (b, L, k) and token ids, expands them
(X̂ = X̃·Uᵀ + T⊥[x]), runs its layers and sends on X̃' = (X' − T⊥[x])·U; on the way back it expands
∇X̃' with Uᵀ, backpropagates, and returns ∇X̂·U. The last stage computes the loss and its backward
in the same call. Gradients accumulate over micro-batches until the head says `step`.

Outer round state lives here too: θ_start of the current outer step and the SparseLoCo error
buffer. `encode_round()` produces this peer's payload; `apply_round()` applies a committed set.
Every method is synchronous and thread-safe (one lock), so the gRPC handler can call it from any
worker thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from peer.config import RunConfig
from peer.core.model import Decoder, build_stage
from peer.core.optim import build_adamw, clip_grads, lr_at, set_lr
from peer.core.outer import EMBED, apply_outer_update, attach_subspace, initial_split, perp_of, stage_state, state_hash
from peer.core.sparseloco import (
    ClipStats,
    Payload,
    aggregate,
    clip_to_median,
    compress,
    decompress,
    pseudo_gradient,
    restore_unsent,
)
from peer.core.subspace import (
    compress_activations,
    compress_grad,
    expand_activations,
    expand_grad,
    make_basis,
    project_,
)

log = logging.getLogger(__name__)


@dataclass
class ForwardOut:
    hidden: torch.Tensor | None = None  # (b, L, k) compressed output, for stages before the last
    loss: float | None = None  # last stage only
    grad: torch.Tensor | None = None  # last stage only: (b, L, k) gradient wrt its compressed input


class StageWorker:
    """One stage view with its optimizer, subspace buffers and round state."""

    def __init__(self, cfg: RunConfig, stage: int, compressed: bool = True, device: str = "cpu") -> None:
        """compressed=False: a full replica's stage (T_S trained freely, no boundary compression)."""
        self.cfg, self.stage, self.compressed = cfg, stage, compressed
        self.is_first, self.is_last = stage == 0, stage == cfg.stages - 1
        self.device = torch.device(device)
        self.module: Decoder = build_stage(cfg.model, stage, cfg.stages, cfg.seed)
        U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
        w, perp = initial_split(cfg, U)
        attach_subspace(self.module, w, perp)
        self.module.to(self.device)
        self.U = U.to(self.device)
        self.optimizer = build_adamw(self.module.named_parameters(), cfg.train)
        self.lock = threading.RLock()
        self.pending: dict[tuple[str, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.outer_step = 0
        self.start: dict[str, torch.Tensor] = stage_state(self.module)
        self.errors: dict[str, torch.Tensor] | None = None
        self.microbatches_seen = 0
        self.seen: set[tuple[str, int]] = set()  # micro-batches of the current inner step
        self.last_contribution: tuple[str, Payload] | None = None  # (replica id, payload) of the last round
        self.last_committed: list[str] = []  # replica ids committed in the last round
        self.last_clip = ClipStats(0, (), 0.0, 0.0)  # what median clipping did in the last round

    @property
    def start(self) -> dict[str, torch.Tensor]:
        """θ_start: the committed parameters of the current outer step."""
        return self._start

    @start.setter
    def start(self, value: dict[str, torch.Tensor]) -> None:
        self._start = value
        self._start_version = getattr(self, "_start_version", 0) + 1

    # ---------------------------------------------------------------- pipeline compute
    def forward(
        self, key: tuple[str, int], tokens: torch.Tensor, hidden: torch.Tensor | None, targets: torch.Tensor | None
    ) -> ForwardOut:
        """Run this stage on one micro-batch. tokens (b, L) int; hidden (b, L, k) for stages > 0."""
        tokens = tokens.long().to(self.device)
        hidden = hidden.to(self.device) if hidden is not None else None
        targets = targets.to(self.device) if targets is not None else None
        with self.lock:
            if key in self.seen:  # the head replays the inner step (a stage peer failed): start it over
                log.info(
                    "stage %d: replay of inner step detected (micro-batch %s); dropping its gradients",
                    self.stage,
                    key[1],
                )
                self._reset_step()
            self.seen.add(key)
            x_in = None
            if self.is_first:
                out = self.module(tokens)  # (b, L, d)
            else:
                if hidden is None:
                    raise ValueError(f"stage {self.stage} needs activations from stage {self.stage - 1}")
                x_in = expand_activations(hidden.float(), tokens, perp_of(self.module), self.U)  # (b, L, d)
                x_in.requires_grad_(True)
                out = self.module(x_in)
            if self.is_last:
                if targets is None:
                    raise ValueError("the last stage needs targets")
                loss = F.cross_entropy(out.flatten(0, 1).float(), targets.long().flatten())
                if not torch.isfinite(loss):  # refused before backward: nothing non-finite reaches a gradient
                    self.seen.discard(key)
                    raise ValueError(
                        f"the loss of micro-batch {key[1]} is {loss.item()}, refused before backward "
                        "(out-of-range activations or diverged parameters; lower the learning rate)"
                    )
                (loss / self.cfg.train.microbatches).backward()
                self.microbatches_seen += 1
                grad = compress_grad(x_in.grad, self.U).cpu() if x_in is not None else None  # (b, L, k)
                return ForwardOut(loss=loss.item(), grad=grad)
            self.pending[key] = (x_in, out)
            return ForwardOut(hidden=compress_activations(out.detach(), tokens, perp_of(self.module), self.U).cpu())

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, hidden: torch.Tensor | None, targets: torch.Tensor | None) -> ForwardOut:
        """Forward without keeping anything for backward (validation loss through the pipeline)."""
        tokens = tokens.long().to(self.device)
        with self.lock:
            if self.is_first:
                out = self.module(tokens)
            else:
                out = self.module(
                    expand_activations(hidden.to(self.device).float(), tokens, perp_of(self.module), self.U)
                )
            if self.is_last:
                loss = F.cross_entropy(out.flatten(0, 1).float(), targets.long().to(self.device).flatten())
                return ForwardOut(loss=loss.item())
            return ForwardOut(hidden=compress_activations(out, tokens, perp_of(self.module), self.U).cpu())

    def backward(self, key: tuple[str, int], grad: torch.Tensor) -> torch.Tensor | None:
        """Backpropagate a compressed output gradient (b, L, k); returns ∇ of the input, compressed."""
        with self.lock:
            if key not in self.pending:
                raise KeyError(f"no forward pass {key} pending on stage {self.stage}")
            x_in, out = self.pending.pop(key)
            out.backward(expand_grad(grad.to(self.device).float(), self.U))  # already scaled by 1/n_micro
            self.microbatches_seen += 1
            return compress_grad(x_in.grad, self.U).cpu() if x_in is not None else None

    def drop_pending(self, pipeline_id: str | None = None) -> None:
        """Forget activations of failed micro-batches (all, or one pipeline's)."""
        with self.lock:
            for key in [k for k in self.pending if pipeline_id is None or k[0] == pipeline_id]:
                del self.pending[key]

    def step(self, outer_step: int, inner_step: int) -> None:
        """Optimizer step of the accumulated gradients at the global step t·H + inner_step."""
        with self.lock:
            global_step = outer_step * self.cfg.train.inner_steps + inner_step
            clip_grads(self.module.parameters(), self.cfg.train.grad_clip)
            set_lr(self.optimizer, lr_at(global_step, self.cfg.train))
            self.optimizer.step()
            self._reset_step()
            if self.is_first and self.compressed:
                project_(self.module.embed.weight, self.U)  # keep T_S in Col(U)

    def zero_grad(self) -> None:
        with self.lock:
            self._reset_step()

    def _reset_step(self) -> None:
        """Forget the current inner step's gradients and pending activations."""
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.clear()
        self.seen.clear()
        self.microbatches_seen = 0

    # ---------------------------------------------------------------- outer rounds
    def encode_round(self) -> Payload:
        """This peer's SparseLoCo payload for the current outer step (updates the error buffer)."""
        with self.lock:
            delta = pseudo_gradient(self.start, stage_state(self.module))
            payload, self.errors = compress(delta, self.errors, self.cfg.sparseloco)
            return payload

    def return_unsent(self, payload: Payload) -> None:
        """A payload that missed the commit goes back into the error buffer: nothing is lost."""
        with self.lock:
            self.errors = restore_unsent(self.errors, decompress(payload))

    def apply_round(self, committed: Sequence[Payload], embed_update: torch.Tensor | None) -> ClipStats:
        """θ ← θ_start − η·mean(clip(Δ̂)) over the committed set (in its given order); next outer step.

        Each Δ̂ is norm-clipped against the round's median (`clip_to_median`); the stats are
        returned and kept as `last_clip`.
        """
        slc = self.cfg.sparseloco
        with self.lock:
            clip = ClipStats(0, (), 0.0, 0.0)
            if committed:
                decoded, clip = clip_to_median([decompress(p) for p in committed], slc.clip_median_factor)
                if clip.n_clipped:
                    log.info(
                        "stage %d round %d: clipped %d of %d contributions (max norm %.3g x median %.3g)",
                        self.stage,
                        self.outer_step,
                        clip.n_clipped,
                        len(decoded),
                        clip.max_ratio,
                        clip.median,
                    )
                agg = {k: v.to(self.device) for k, v in aggregate(decoded, len(decoded), slc.aggregation).items()}
                if embed_update is not None and not self.is_first:
                    embed_update = embed_update.to(self.device)
                apply_outer_update(
                    self.module,
                    self.start,
                    agg,
                    slc.outer_lr,
                    self.U,
                    embed_update=None if self.is_first else embed_update,
                )
            else:
                self.load_params(self.start)
            self.outer_step += 1
            self.start = stage_state(self.module)
            self.last_clip = clip
            return clip

    @staticmethod
    def embed_update(committed: Sequence[Payload], cfg: RunConfig) -> torch.Tensor:
        """The committed change of embed.weight (−η·Δ̄) from stage 0's payloads.

        Clipped exactly as stage 0's `apply_round` clips them (norms over the whole payload), so
        T⊥ moves by the same bits on every stage.
        """
        clipped, _ = clip_to_median([decompress(p) for p in committed], cfg.sparseloco.clip_median_factor)
        decoded = [{EMBED: d[EMBED]} for d in clipped]
        return -cfg.sparseloco.outer_lr * aggregate(decoded, len(decoded), cfg.sparseloco.aggregation)[EMBED]

    # ---------------------------------------------------------------- state
    def snapshot(self) -> dict[str, torch.Tensor]:
        """Parameters and T⊥ for a late joiner (the committed θ_start of the current outer step)."""
        with self.lock:
            out = {k: v.detach().cpu().clone() for k, v in self.start.items()}
            out["perp"] = perp_of(self.module).detach().cpu().clone()
            return out

    def load_snapshot(self, tensors: Mapping[str, torch.Tensor], outer_step: int, keep_errors: bool = False) -> None:
        """Adopt a downloaded state; a late joiner starts with an empty error buffer, a peer that
        re-syncs after a disagreement keeps its own (what it has not sent yet is not lost)."""
        with self.lock:
            expected = set(self.start) | {"perp"}
            if set(tensors) != expected:
                missing, extra = expected - set(tensors), set(tensors) - expected
                raise ValueError(
                    f"state for stage {self.stage} does not match: missing {sorted(missing)[:3]}, "
                    f"unexpected {sorted(extra)[:3]}"
                )
            self.load_params({k: v for k, v in tensors.items() if k != "perp"})
            perp_of(self.module).copy_(tensors["perp"].to(self.device))
            self.outer_step = outer_step
            self.start = stage_state(self.module)
            if not keep_errors:
                self.errors = None
            self.optimizer = build_adamw(self.module.named_parameters(), self.cfg.train)

    def load_params(self, params: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            own = dict(self.module.named_parameters())
            for name, value in params.items():
                if own[name].shape != value.shape:
                    raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(own[name].shape)}")
                own[name].copy_(value.to(own[name].device))

    def optimizer_param_names(self) -> list[list[str]]:
        """Global parameter names of each AdamW param group, in the optimizer's order."""
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """AdamW state by global name: ({"<param>/<exp_avg|exp_avg_sq|step>": tensor}, param groups).

        The groups are JSON-serialisable: hyperparameters plus "params" as global names. Tensors
        are the optimizer's own (not copied).
        """
        with self.lock:
            names = {id(p): n for n, p in self.module.named_parameters()}
            tensors = {
                f"{names[id(p)]}/{key}": value.detach()
                for p, st in self.optimizer.state.items()
                for key, value in st.items()
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
                for g, names_ in zip(self.optimizer.param_groups, self.optimizer_param_names())
            ]
            return tensors, groups

    def load_optimizer_state(self, tensors: Mapping[str, torch.Tensor], groups: Sequence[Mapping]) -> None:
        """Restore what `optimizer_state` returned (into a fresh AdamW over this module)."""
        with self.lock:
            optimizer = build_adamw(self.module.named_parameters(), self.cfg.train)
            order = [n for g in self.optimizer_param_names() for n in g]
            if [list(g["params"]) for g in groups] != self.optimizer_param_names():
                raise ValueError(f"stage {self.stage}: optimizer parameter groups do not match this model")
            index = {name: i for i, name in enumerate(order)}
            state: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in tensors.items():
                name, field = key.rsplit("/", 1)
                state.setdefault(index[name], {})[field] = value
            template = optimizer.state_dict()["param_groups"]
            merged = [
                {**tg, **{k: (tuple(v) if isinstance(tg.get(k), tuple) else v) for k, v in g.items() if k != "params"}}
                for tg, g in zip(template, groups)
            ]
            optimizer.load_state_dict({"state": state, "param_groups": merged})
            self.optimizer = optimizer

    def param_hash(self) -> str:
        """Hash of the committed parameters θ_start (published in every record refresh)."""
        return self._hashes()[0]

    def perp_hash(self) -> str:
        return self._hashes()[1]

    def _hashes(self) -> tuple[str, str]:
        """(θ_start, T⊥) hashes, computed once per committed state: `start` is re-assigned whenever
        θ_start or T⊥ change, and every assignment bumps `_start_version`, which keys the cache."""
        with self.lock:
            key = (self._start_version, self.outer_step)
            if getattr(self, "_hash_key", None) != key:
                self._hash_value = (state_hash(self.start), state_hash({"perp": perp_of(self.module)}))
                self._hash_key = key
            return self._hash_value
