"""Per-rank memory of a sharded full replica: N ranks, FSDP2-style `fully_shard` (issue 40).

A model of issue 40's second design. What runs (`peer join --sharded`, `peer.node.replica.sharded`)
is the first: its followers hold the weights, gradients and AdamW terms below, and its rank 0 also
holds the whole replica, θ_start and the error buffer (`estimate_replica`) for today's round.
The sharded replica of issue 40 wraps each transformer block, the embedding, the head and the rest
of a stage (its final norm) as their own `fully_shard` unit over the N ranks, with float32 master
weights and the inner step reducing gradients on every micro-batch, and runs the round on shards
(each rank keeps θ_start and the error buffer of its own shard and encodes and commits its shard's
tiles). One rank holds (P_N: its shard of the replica's P parameters):

    sharded 1/N (FSDP2's dim-0 layout: ⌈rows/N⌉ rows of every parameter, padded, as `fully_shard`
    allocates it; rank 0's shard is the largest):
    weights 4·P_N, gradients 4·P_N, AdamW exp_avg + exp_avg_sq 8·P_N         device
    casts: its shard of the matmul weights in the compute dtype, 2 bytes    device (fp32: none)
      each (what FSDP2's param_dtype casts before each all-gather)
    θ_start 4·P_N, the state committed from 4·P_N, the error buffer 4·P_N:   host
      its own shard's only (the sharded round)
    a round's transients for its shard of the largest stage                  host
      (`round_transients` of that shard: θ and Δ while encoding, the
      decoded payloads' tiles of the shard and the new state at the commit)

    not sharded (every rank, whatever N):
    T⊥, U, RoPE per stage (buffers, not parameters: `fully_shard` leaves them whole); T⊥ also
      in the committed-from state (host) and the round's CPU copy
    gathered: the all-gathered parameters of the largest unit in the compute dtype, twice (the unit
      computing and the next one, whose all-gather FSDP2 prefetches to overlap it), and that unit's
      unsharded float32 gradient before its reduce-scatter
    activations: one micro-batch's stash through every block (each rank trains its own b × L;
      `stash_bytes`)
    workspace: the backward's transient peak (`workspace_bytes`) with AdamW's temporary of the
      largest shard; the embedding's dense gradient is that unit's unsharded gradient, in `gathered`

Reducing gradients on every micro-batch is what keeps gradients sharded: accumulating without the
reduce-scatter (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync(False)`) keeps every unit's
unsharded gradient, 4·P per rank. The round's 64×64 tiles straddle two ranks' shards where ⌈rows/N⌉
is not a multiple of 64 (e.g. the embedding's 32000 rows over 8 ranks): the sharded round settles
who owns those tiles; at most one tile row per parameter and rank, left out here.

Invariants: pure arithmetic on shapes; at N = 1 weights, gradients, AdamW, casts, θ_start, the
error buffer are `estimate_replica`'s to the byte; as N grows the per-rank figure tends to the
unsharded terms above.
"""

from __future__ import annotations

import functools
import math

from peer.core.memory.activations import F32, MicroBatch, compute_bytes, stash_bytes, workspace_bytes
from peer.core.memory.estimate import StageMemory, round_transients, stage_buffers
from peer.core.model.decoder import ModelConfig, stage_shapes

MAX_RANKS = 512  # the most ranks a search for the fewest that fit tries (`peer plan --memory`, the join)
MATMULS = (".attn.w", ".ffn.w", "head.weight")  # the weights `CastWeights` casts (names contain these)


def shard_elements(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of the largest dim-0 shard of a parameter over `ranks` (`fully_shard`'s layout)."""
    return math.ceil(shape[0] / ranks) * math.prod(shape[1:])


def unit_of(name: str) -> str:
    """The `fully_shard` unit a parameter belongs to: its block, the embedding, the head, or the stage's
    own (the final norm)."""
    module = name.split(".", 1)[0]
    if module == "layers":
        return ".".join(name.split(".")[:2])
    return module if module in ("embed", "head") else "stage"


@functools.lru_cache(maxsize=64)
def _replica_shapes(cfg: ModelConfig, n_stages: int) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]:
    """Every stage's (name, shape) pairs, from the real stages built on `meta`."""
    return tuple(tuple(stage_shapes(cfg, s, n_stages).items()) for s in range(n_stages))


@functools.lru_cache(maxsize=1024)
def replica_shards(cfg: ModelConfig, n_stages: int, ranks: int) -> tuple[int, int, int, int, int]:
    """(P_N, the largest stage's P_N, matmul weights' P_N, the largest shard, the largest unit's
    unsharded elements) of one rank of a replica sharded over `ranks`."""
    stages = _replica_shapes(cfg, n_stages)
    per_stage = [sum(shard_elements(s, ranks) for _, s in st) for st in stages]
    matmuls = sum(shard_elements(s, ranks) for st in stages for n, s in st if any(m in n for m in MATMULS))
    largest = max(shard_elements(s, ranks) for st in stages for _, s in st)
    units: dict[str, int] = {}
    for st in stages:
        for name, shape in st:
            units[unit_of(name)] = units.get(unit_of(name), 0) + math.prod(shape)
    return sum(per_stage), max(per_stage), matmuls, largest, max(units.values())


def estimate_sharded_replica(
    cfg: ModelConfig,
    n_stages: int,
    *,
    ranks: int,
    microbatch_size: int,
    seq_len: int,
    precision: str = "fp32",
    checkpointing: bool = False,
    k: int | None = None,
    replicas: int = 2,
    device_kind: str = "cpu",
    per_step: bool = False,
) -> StageMemory:
    """One rank of a full replica of `n_stages` stages sharded over `ranks` ranks, each rank training
    micro-batches of (microbatch_size, seq_len); `k`, `replicas` as in `estimate_replica`; `per_step`:
    parameters gathered and gradients reduced once per inner step (`--gather-per-step`), so `gathered`
    is every unit's parameters in the compute dtype and its whole float32 gradient during the step."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    mb = MicroBatch(cfg, microbatch_size, seq_len, precision)
    P, stage_P, matmuls, largest, unit = replica_shards(cfg, n_stages, ranks)
    c = compute_bytes(precision)
    perp = F32 * cfg.vocab_size * cfg.d_model
    per_mb = stash_bytes(mb, cfg.n_layers, True, checkpointing)
    return StageMemory(
        label=(f"each of {ranks} sharded ranks" if ranks > 1 else "one sharded rank")
        + f" of a full replica of {n_stages} stage{'s' if n_stages > 1 else ''}",
        weights=F32 * P,
        gradients=F32 * P,
        optimizer=2 * F32 * P,
        buffers=stage_buffers(cfg, k, n_stages),
        start=F32 * P,
        prev=F32 * P + n_stages * perp,
        errors=F32 * P,
        casts=0 if c == F32 else c * matmuls,
        activations=per_mb,
        per_microbatch=per_mb,
        stashed=1,
        workspace=workspace_bytes(mb, False, True, largest, checkpointing),
        round=round_transients(cfg, stage_P, replicas),
        on_cuda=device_kind == "cuda",
        gathered=(c + F32) * replica_shards(cfg, n_stages, 1)[0] if per_step else 2 * c * unit + F32 * unit,
    )


def unsharded_terms(m: StageMemory, n_stages: int, cfg: ModelConfig) -> int:
    """Bytes of `m`'s inner step that sharding does not divide: buffers, T⊥ in the committed-from
    state, the gathered units, activations and workspace."""
    return m.buffers + n_stages * F32 * cfg.vocab_size * cfg.d_model + m.gathered + m.activations + m.workspace
