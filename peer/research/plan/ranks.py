"""`peer plan --memory` for a full replica over N ranks: memory per rank, and the fewest sharded ranks per GPU.

A datacenter joins with one full replica over N ranks (`torchrun --nproc-per-node N -m peer join
--full-replica`). Today that is DDP: every rank holds the whole replica (`estimate_replica`), so
N does not change what one device needs. The sharded replica that issue 40 plans (FSDP2
`fully_shard` over the N ranks, the round on shards; not built yet) holds 1/N of the state per rank
(`estimate_sharded_replica`, which says term by term what shards and what does not).

`rank_rows`: per preset, one rank's GPU memory in each mode for `--ranks N` (`--sharded` or DDP),
its host RAM beside it, and the peak when the device is the CPU. `fit_rows`: per preset, DDP's
per-rank GPU memory and for 24, 40 and 80 GiB devices the fewest sharded ranks whose per-rank
memory fits (None: not even `MAX_RANKS`), in bf16, bf16 with checkpointing and fp32. Both size a
replica of a one-stage run at the flags' micro-batch (sequence length capped at each preset's
context): a run of S stages adds S − 1 copies of T⊥ (4·V·d bytes each) on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from peer.core.memory import MAX_RANKS, StageMemory, estimate_replica, estimate_sharded_replica
from peer.core.model.decoder import ModelConfig
from peer.core.subspace.compression import k_from_ratio
from peer.errors import ConfigError
from peer.research.plan.command import PLAN_PRESETS
from peer.research.plan.memory import MODES, mode_name

DEVICES_GIB = (24, 40, 80)  # GPUs people have: 24 GB (RTX 3090/4090, A10), 40 GB (A100), 80 GB (A100, H100)
FIT_MODES = (("bf16", False), ("bf16", True), ("fp32", False))


def replica_rank(
    cfg: ModelConfig, microbatch_size: int, seq_len: int, k: int, mode: tuple[str, bool], ranks: int, sharded: bool
) -> StageMemory:
    """One rank of a one-stage run's full replica over `ranks` ranks on a GPU (DDP: the whole replica)."""
    precision, checkpointing = mode
    shape: dict[str, Any] = {
        "microbatch_size": microbatch_size,
        "seq_len": min(seq_len, cfg.max_seq_len),
        "precision": precision,
        "checkpointing": checkpointing,
        "k": k,
        "device_kind": "cuda",
    }
    if sharded:
        return estimate_sharded_replica(cfg, 1, ranks=ranks, **shape)
    return estimate_replica(cfg, 1, **shape)


def fewest_ranks(
    cfg: ModelConfig, microbatch_size: int, seq_len: int, k: int, mode: tuple[str, bool], budget: int
) -> int | None:
    """The fewest sharded ranks whose per-rank GPU memory is at most `budget` (None: not even
    `MAX_RANKS`). Every term of a rank is non-increasing in N, so a bisection finds it."""

    def need(n: int) -> int:
        return replica_rank(cfg, microbatch_size, seq_len, k, mode, n, True).device

    if need(MAX_RANKS) > budget:
        return None
    lo, hi = 1, MAX_RANKS  # need(hi) fits
    while lo < hi:
        mid = (lo + hi) // 2
        if need(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return lo


def rank_rows(microbatch_size: int, seq_len: int, k_ratio: str, ranks: int, sharded: bool) -> list[dict[str, Any]]:
    """One row per preset: one rank's GPU memory per mode (`MODES`), its host RAM (θ_start, the
    previous state, the error buffer, a round's transients: the rank's shard of them when sharded)
    and the peak on a CPU device (`cpu <mode>`)."""
    if ranks < 1:
        raise ConfigError(f"--ranks must be >= 1, got {ranks}")
    rows = []
    for name, cfg in PLAN_PRESETS.items():
        k = k_from_ratio(cfg.d_model, k_ratio)
        row: dict[str, Any] = {"model": name, "n_params": cfg.n_params, "seq_len": min(seq_len, cfg.max_seq_len)}
        row.update(ranks=ranks, sharded=sharded)
        for mode in MODES:
            m = replica_rank(cfg, microbatch_size, seq_len, k, mode, ranks, sharded)
            row[mode_name(*mode)] = m.device
            row["host"] = m.host  # the same in every mode
            row["cpu " + mode_name(*mode)] = m.peak
        rows.append(row)
    return rows


def fit_rows(microbatch_size: int, seq_len: int, k_ratio: str) -> list[dict[str, Any]]:
    """One row per preset: `ddp <mode>`, one DDP rank's GPU memory (the whole replica), and
    `<mode> <G>GiB`, the fewest sharded ranks that fit a G GiB device (None: not even `MAX_RANKS`)."""
    rows = []
    for name, cfg in PLAN_PRESETS.items():
        k = k_from_ratio(cfg.d_model, k_ratio)
        row: dict[str, Any] = {"model": name, "n_params": cfg.n_params, "seq_len": min(seq_len, cfg.max_seq_len)}
        for mode in FIT_MODES:
            row["ddp " + mode_name(*mode)] = replica_rank(cfg, microbatch_size, seq_len, k, mode, 1, False).device
            for gib in DEVICES_GIB:
                row[f"{mode_name(*mode)} {gib}GiB"] = fewest_ranks(cfg, microbatch_size, seq_len, k, mode, gib * 2**30)
        rows.append(row)
    return rows


def plan_ranks(args: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """`peer plan --memory`'s replica part: its inputs, `rank_rows` for `--ranks N` / `--sharded`
    (None without them) and `fit_rows`."""
    inputs = {n: args[n] for n in ("microbatch_size", "seq_len", "k_ratio")}
    ranks, sharded = int(args.get("ranks", 1)), bool(args.get("sharded", False))
    per_rank = rank_rows(**inputs, ranks=ranks, sharded=sharded) if ranks > 1 or sharded else None
    return {**inputs, "ranks": ranks, "sharded": sharded}, per_rank, fit_rows(**inputs)
