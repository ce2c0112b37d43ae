"""How much memory a stage (or a whole replica) needs: its state, its stash, its transients.

One holder of stage s keeps (P = the stage's parameters, from the real stage built on `meta`):

    weights P·4, gradients P·4, AdamW exp_avg + exp_avg_sq 2·P·4      on the device (float32 master
                                                                       weights in every precision)
    T⊥ V·d·4 (every stage of every run holds it), U d·k·4, RoPE       on the device
    θ_start P·4 (`StartCache`), the state committed from (`prev`:     on the host (CPU, float32)
    θ_start P·4 + T⊥ V·d·4), the SparseLoCo error buffer P·4
    activations: `stash_bytes` per micro-batch × the micro-batches    on the device
    stashed (a pipeline stage before the last: the in-flight window,
    and its output (b, L, d) waits for its gradient too; the last
    stage runs backward in the same call: one; a full replica runs
    its micro-batches one after another: one, through every stage)
    bf16/fp16: the matmul weights' copy in the compute dtype          on the device
    (`cast_bytes`: cast once per inner step, shared by every micro-batch)
    the backward's transient peak (`workspace_bytes`; with              on the device
    checkpointing, one block's recompute is part of it)
    a round: pseudo-gradient, the decoded payloads, the new state      on the host

The peak is the larger of an inner step (everything but the round's transients) and a round
(state without gradients or activations, plus the round's transients). On a CPU device host and
device are the same memory: the peak is the sum.

Invariants: pure arithmetic on shapes (no allocation; 70B shapes are fine); master weights, the
optimizer state, θ_start and the error buffer do not depend on precision or checkpointing.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields

from peer.core.memory.activations import (
    F32,
    MicroBatch,
    cast_bytes,
    stash_bytes,
    workspace_bytes,
)
from peer.core.model.decoder import ModelConfig, stage_layers, stage_shapes


def round_transients(cfg: ModelConfig, P: int, replicas: int) -> int:
    """A round's host transients: encoding holds a clone of θ and Δ (2·P; the error buffer is
    updated in place), then the commit holds every decoded payload, the committed state before it
    replaces θ_start ((replicas + 1)·P) and a CPU copy of T⊥ (measured: `peer bench memory`)."""
    return F32 * (max(2, replicas + 1) * P + cfg.vocab_size * cfg.d_model)


@dataclass(frozen=True)
class StageMemory:
    """Bytes of one holder, by part; `peak` is the worst moment (an inner step or a round)."""

    label: str  # "stage 1 of 4", "full replica of 4 stages"
    weights: int
    gradients: int
    optimizer: int
    buffers: int  # T⊥, U, RoPE tables
    start: int  # θ_start (host)
    prev: int  # the state the last round was committed from (host)
    errors: int  # the SparseLoCo error buffer (host)
    casts: int  # bf16/fp16: the matmul weights in the compute dtype, once per stage (`CastWeights`)
    activations: int  # per_microbatch × stashed
    per_microbatch: int
    stashed: int  # micro-batches whose activations wait for backward at once
    workspace: int  # the backward's transient peak (with checkpointing: one block's recompute in it)
    round: int  # a round's transients (host)
    on_cuda: bool = False
    gathered: int = 0  # a sharded rank: the all-gathered largest unit and its gradient (`peer.core.memory.sharded`)

    @property
    def state(self) -> int:
        """What is held between inner steps (no gradients, activations or transients)."""
        return self.weights + self.optimizer + self.buffers + self.start + self.prev + self.errors

    @property
    def inner_step(self) -> int:
        return self.state + self.gradients + self.casts + self.gathered + self.activations + self.workspace

    @property
    def device(self) -> int:
        """Peak on the training device (on CUDA; on a CPU device everything is one memory)."""
        if not self.on_cuda:
            return self.peak
        return self.inner_step - self.start - self.prev - self.errors

    @property
    def host(self) -> int:
        """Peak in host memory: the CPU-side state and a round's transients (CUDA), or `peak` (CPU)."""
        if not self.on_cuda:
            return self.peak
        return self.start + self.prev + self.errors + self.round

    @property
    def peak(self) -> int:
        return max(self.inner_step, self.state + self.round)

    def parts(self) -> dict[str, int]:
        """Every byte count by name, and the totals (JSON-friendly)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("label", "on_cuda")}
        return {**out, "state": self.state, "device": self.device, "host": self.host, "peak": self.peak}


@functools.lru_cache(maxsize=512)
def _stage_params(cfg: ModelConfig, stage: int, n_stages: int) -> tuple[int, int]:
    """(parameters, the largest parameter's elements) of the real stage, built on `meta`."""
    sizes = [math.prod(s) for s in stage_shapes(cfg, stage, n_stages).values()]
    return sum(sizes), max(sizes)


def estimate_stage(
    cfg: ModelConfig,
    stage: int,
    n_stages: int,
    *,
    microbatch_size: int,
    seq_len: int,
    in_flight: int,
    precision: str = "fp32",
    checkpointing: bool = False,
    k: int | None = None,
    replicas: int = 2,
    device_kind: str = "cpu",
) -> StageMemory:
    """One pipeline stage's holder with `in_flight` micro-batches of (microbatch_size, seq_len) in
    the pipeline; `k` the boundary width of U (None: d/8); `replicas` whose payloads a round decodes."""
    mb = MicroBatch(cfg, microbatch_size, seq_len, precision)
    layers = stage_layers(cfg, n_stages)[stage]
    has_embed, has_head = stage == 0, stage == n_stages - 1
    P, largest = _stage_params(cfg, stage, n_stages)
    stashed = 1 if has_head else max(1, in_flight)
    output = 0 if has_head else F32 * mb.N * cfg.d_model  # waits in `pending` for its gradient
    per_mb = stash_bytes(mb, len(layers), has_head, checkpointing) + output
    return _holder(
        f"stage {stage} of {n_stages}",
        cfg,
        P,
        k,
        casts=cast_bytes(cfg, precision, len(layers), has_head),
        activations=(per_mb, stashed),
        workspace=workspace_bytes(mb, has_embed, has_head, largest, checkpointing),
        round_bytes=round_transients(cfg, P, replicas),
        on_cuda=device_kind == "cuda",
    )


def estimate_replica(
    cfg: ModelConfig,
    n_stages: int,
    *,
    microbatch_size: int,
    seq_len: int,
    precision: str = "fp32",
    checkpointing: bool = False,
    k: int | None = None,
    replicas: int = 2,
    device_kind: str = "cpu",
) -> StageMemory:
    """A full replica: every stage in one process, uncompressed, micro-batches one after another
    (one micro-batch's stash through the whole model); each stage keeps its own state and T⊥."""
    mb = MicroBatch(cfg, microbatch_size, seq_len, precision)
    counts = [_stage_params(cfg, s, n_stages) for s in range(n_stages)]
    P = sum(p for p, _ in counts)
    return _holder(
        f"full replica of {n_stages} stage{'s' if n_stages > 1 else ''}",
        cfg,
        P,
        k,
        casts=cast_bytes(cfg, precision, cfg.n_layers, True),
        activations=(stash_bytes(mb, cfg.n_layers, True, checkpointing), 1),
        workspace=workspace_bytes(mb, True, True, max(lg for _, lg in counts), checkpointing),
        round_bytes=round_transients(cfg, max(p for p, _ in counts), replicas),
        on_cuda=device_kind == "cuda",
        copies=n_stages,
    )


def stage_buffers(cfg: ModelConfig, k: int | None, copies: int = 1) -> int:
    """`copies` stages' buffers: T⊥ (V·d), U (d·k; k None: d/8) and the RoPE tables, float32."""
    d = cfg.d_model
    width = k if k is not None else max(1, d // 8)
    return copies * F32 * (cfg.vocab_size * d + d * width + 2 * cfg.max_seq_len * cfg.head_dim)


def _holder(
    label: str,
    cfg: ModelConfig,
    P: int,
    k: int | None,
    *,
    casts: int,
    activations: tuple[int, int],
    workspace: int,
    round_bytes: int,
    on_cuda: bool,
    copies: int = 1,
) -> StageMemory:
    """The state of P parameters plus `copies` stages' buffers (T⊥, U, RoPE) and the given transients."""
    perp = F32 * cfg.vocab_size * cfg.d_model
    buffers = stage_buffers(cfg, k, copies)
    per_mb, stashed = activations
    return StageMemory(
        label=label,
        weights=F32 * P,
        gradients=F32 * P,
        optimizer=2 * F32 * P,
        buffers=buffers,
        start=F32 * P,
        prev=F32 * P + copies * perp,
        errors=F32 * P,
        casts=casts,
        activations=per_mb * stashed,
        per_microbatch=per_mb,
        stashed=stashed,
        workspace=workspace,
        round=round_bytes,
        on_cuda=on_cuda,
    )
