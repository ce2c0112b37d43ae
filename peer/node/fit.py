"""Does the stage fit? `peer join` checks before it builds a stage or announces a record.

The estimate (`peer.core.memory.estimate_stage` / `estimate_replica`) at the run's micro-batch
shape and the largest in-flight window this peer can be asked to hold is logged as one line, then
compared with `--max-memory` or the device's free memory (CUDA: `torch.cuda.mem_get_info`; CPU:
MemAvailable through psutil). A stage that does not fit is a one-line `ConfigError` that names
what would make it fit, each with its estimate: fewer micro-batches in flight, activation
checkpointing, bf16, or another stage.

A full replica over N ranks is checked per rank. DDP holds the whole replica on
every rank, whatever N; a sharded replica (`sharded=True`, FSDP2 ranks of issue 40,
`peer.core.memory.sharded`: what a follower of `peer join --sharded` is checked against) holds
1/N of its state per rank, and the smallest rank count that fits
is one more remedy.

The precision is the one `peer join` computes in (`peer.core.model.precision.resolve_precision`: `auto`
is bf16 on a GPU that supports it, fp32 elsewhere).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

from peer.config import RunConfig
from peer.core.memory import (
    MAX_RANKS,
    StageMemory,
    estimate_replica,
    estimate_sharded_replica,
    estimate_stage,
    format_bytes,
)
from peer.core.model.precision import resolve_precision
from peer.errors import ConfigError
from peer.node.pipeline.schedule import MAX_STASH, with_in_flight

if TYPE_CHECKING:
    from peer.node.session import SessionOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ask:
    """What a joining peer would hold: a stage (None: a full replica, on each of `ranks` ranks,
    sharded over them or whole on each) in a mode."""

    stage: int | None
    in_flight: int
    precision: str
    checkpointing: bool
    ranks: int = 1
    sharded: bool = False
    per_step: bool = False  # sharded, gathered once per inner step (`peer join --gather-per-step`)


def largest_window(cfg: RunConfig) -> int:
    """The most micro-batches a stage may stash at once: the configured window (`train.in_flight`, with
    this peer's `--in-flight` already applied by `with_in_flight`), or for auto the schedule's cap
    (`choose_in_flight`)."""
    m = cfg.train.microbatches
    configured = cfg.train.in_flight
    if configured > 0:
        return max(1, min(configured, m))
    return 1 if cfg.stages == 1 else max(1, min(m, MAX_STASH))


def estimate(cfg: RunConfig, ask: Ask, device_kind: str) -> StageMemory:
    """The estimate of `ask` on this run's shapes."""
    shape: dict[str, Any] = {
        "microbatch_size": cfg.train.batch_size // cfg.train.microbatches,
        "seq_len": cfg.train.seq_len,
        "precision": resolve_precision(ask.precision, device_kind),
        "checkpointing": ask.checkpointing,
        "k": cfg.k,
        "replicas": max(2, cfg.swarm.min_replicas),
        "device_kind": device_kind,
    }
    if ask.stage is None and ask.sharded:
        return estimate_sharded_replica(cfg.model, cfg.stages, ranks=ask.ranks, per_step=ask.per_step, **shape)
    if ask.stage is None:
        return estimate_replica(cfg.model, cfg.stages, **shape)
    return estimate_stage(cfg.model, ask.stage, cfg.stages, in_flight=ask.in_flight, **shape)


def free_memory(device: str) -> tuple[int, int]:
    """(device, host) bytes free now; on a CPU device both are MemAvailable."""
    host = int(psutil.virtual_memory().available)
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), host
    return host, host


def check_join(
    cfg: RunConfig, stage: int | None, opts: SessionOptions, ranks: int = 1, sharded: bool = False
) -> StageMemory:
    """`check_fit` with `peer join`'s options (the device already resolved from "auto")."""
    cfg = with_in_flight(cfg, opts.in_flight)
    return check_fit(
        cfg,
        stage,
        opts.device,
        opts.precision,
        opts.activation_checkpointing,
        opts.max_memory,
        ranks,
        sharded,
        opts.gather_per_step,
    )


def check_fit(
    cfg: RunConfig,
    stage: int | None,
    device: str,
    precision: str,
    checkpointing: bool,
    max_memory: int | None,
    ranks: int = 1,
    sharded: bool = False,
    per_step: bool = False,
) -> StageMemory:
    """Log the estimate; a one-line ConfigError naming the remedies when it does not fit. `ranks`,
    `sharded`: a full replica's ranks and whether they shard it (per rank; DDP: the whole replica);
    `per_step`: sharded ranks that gather once per inner step (`--gather-per-step`)."""
    if ranks < 1:
        raise ConfigError(f"a replica needs at least one rank, got {ranks}")
    if sharded and stage is not None:
        raise ConfigError(f"stage {stage} is one process: only a full replica is sharded over ranks")
    kind = "cuda" if device.startswith("cuda") else "cpu"
    window = largest_window(cfg) if stage != cfg.stages - 1 else 1
    ask = Ask(stage, window, precision, checkpointing, ranks, sharded, per_step)
    need = estimate(cfg, ask, kind)
    device_free, host_free = free_memory(device)
    budget = max_memory if max_memory is not None else device_free
    where = "--max-memory" if max_memory is not None else f"free on {device}"
    log.info("%s; %s %s", describe(cfg, need), format_bytes(budget), where)
    short = need.device > budget or (kind == "cuda" and need.host > host_free)
    if not short:
        return need
    fixes = remedies(cfg, ask, kind, budget)
    hint = "; would fit with " + ", ".join(fixes) if fixes else "; nothing here makes it fit: use a larger device"
    raise ConfigError(
        f"{need.label} of {cfg.preset} does not fit: needs ~{format_bytes(need.device)}, "
        f"{format_bytes(budget)} {where}{hint}"
    )


def describe(cfg: RunConfig, need: StageMemory) -> str:
    """'stage 1 of 4 of small: needs ~312 MiB (weights 40 MiB, AdamW 80 MiB, …)'."""
    parts = [
        ("weights", need.weights),
        ("gradients", need.gradients),
        ("AdamW", need.optimizer),
        ("θ_start + last round", need.start + need.prev),
        ("error buffer", need.errors),
        ("T⊥/U", need.buffers),
        *([("bf16/fp16 weight copy", need.casts)] if need.casts else []),
        *([("all-gathered unit", need.gathered)] if need.gathered else []),
    ]
    acts = f"activations {format_bytes(need.per_microbatch)} × {need.stashed} in flight"
    shown = ", ".join(f"{name} {format_bytes(n)}" for name, n in parts)
    work = format_bytes(need.workspace)
    return f"{need.label} of {cfg.preset}: needs ~{format_bytes(need.peak)} ({shown}, {acts}, workspace {work})"


def remedies(cfg: RunConfig, ask: Ask, kind: str, budget: int) -> list[str]:
    """Each change that alone makes `ask` fit in `budget`, as the flag to pass and its estimate."""
    found: list[str] = []

    def fits(other: Ask) -> int | None:
        need = estimate(cfg, other, kind).device
        return need if need <= budget else None

    if ask.stage is not None and ask.in_flight > 1:
        for k in range(ask.in_flight - 1, 0, -1):
            need = fits(dataclasses.replace(ask, in_flight=k))
            if need is not None:
                flag = f"--in-flight {k}" if ask.stage == 0 else f"the head's --in-flight {k}"
                found.append(f"{flag} (~{format_bytes(need)})")
                break
    if not ask.checkpointing and (need := fits(dataclasses.replace(ask, checkpointing=True))) is not None:
        found.append(f"--activation-checkpointing (~{format_bytes(need)})")
    if ask.precision in ("auto", "fp32") and (need := fits(dataclasses.replace(ask, precision="bf16"))) is not None:
        found.append(f"--precision bf16 (~{format_bytes(need)})")
    for s in range(cfg.stages):
        if s == ask.stage:
            continue
        window = 1 if s == cfg.stages - 1 else largest_window(cfg)
        need = fits(dataclasses.replace(ask, stage=s, in_flight=window))
        if need is not None:
            found.append(f"--stage {s} (~{format_bytes(need)})")
    if ask.per_step and (need := fits(dataclasses.replace(ask, per_step=False))) is not None:
        found.append(f"without --gather-per-step (~{format_bytes(need)})")
    if ask.sharded:  # the fewest ranks (each a device like this one) that hold it
        for n in range(ask.ranks + 1, MAX_RANKS + 1):
            if (need := fits(dataclasses.replace(ask, ranks=n))) is not None:
                found.append(f"{n} sharded ranks (~{format_bytes(need)} each)")
                break
    return found
