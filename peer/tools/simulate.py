"""Single-process M × S simulator of the paper's experiments (arXiv 2601.02360, Table 2).

Runs, on the same data, seed and number of steps:
- `adamw`           H = 1 with dense gradient averaging (data-parallel AdamW),
- `sparseloco`      M uncompressed replicas, SparseLoCo every H steps,
- `pp-compress`     every replica's stage boundaries go through the k-dim subspace,
- `het-pp-compress` a fraction α of the replicas is uncompressed, the rest compressed.

Every replica is S stage views of the decoder (`peer.tools.sim_replica.LocalReplica`), so the stage
boundaries, the inner step (`peer.core.outer.accumulate`, `adamw_step`) and the per-stage SparseLoCo rounds
(`peer.core.outer.commit_round`) are the ones a real swarm runs; only the network is missing.
Pseudo-gradients are serialised with the real payload format and counted in bytes; activation
bytes count the values that cross stage boundaries (forward and backward) at the configured wire
dtype, tokens as int32.

`final_val_loss` is the held-out loss of replica 0 on its own forward path (compressed for
`pp-compress`, uncompressed otherwise — in `het-pp-compress` replica 0 is an uncompressed one).
This module does no I/O but the optional checkpoint and plot, and prints nothing: progress goes
through a callback.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peer.config import WIRE_DTYPES, RunConfig
from peer.core.data import TokenData, train_batch, val_batches
from peer.core.outer import commit_round, stage_state
from peer.core.sparseloco import Payload, compress, decompress, pseudo_gradient
from peer.core.subspace import k_from_ratio, make_basis
from peer.errors import ConfigError
from peer.node.checkpoints.model import save_model_checkpoint
from peer.tools.plots import figure
from peer.tools.sim_replica import LocalReplica

log = logging.getLogger(__name__)

CONFIGS = ("adamw", "sparseloco", "pp-compress", "het-pp-compress")

Progress = Callable[[str, int, int, float], None]  # (config, done steps, total steps, last loss)


@dataclass
class ConfigResult:
    name: str
    k_ratio: str | None
    het_fraction: float | None
    final_loss: float
    final_val_loss: float
    delta_pct: float = 0.0
    pg_bytes: int = 0  # pseudo-gradient (or dense gradient) bytes sent per replica
    act_bytes: int = 0  # stage-boundary bytes sent per replica (forward + backward)
    wall_s: float = 0.0
    clipped: int = 0  # contributions norm-clipped against their round's median, over the run
    train_curve: list[tuple[int, float]] = field(default_factory=list)  # (global step, loss)
    val_curve: list[tuple[int, float]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        keys = ("name", "k_ratio", "het_fraction", "final_loss", "final_val_loss", "delta_pct", "pg_bytes", "act_bytes")
        return {k: getattr(self, k) for k in keys} | {"wall_s": round(self.wall_s, 2)}


def _n_uncompressed(kind: str, replicas: int, het_fraction: float) -> int:
    if kind in ("adamw", "sparseloco"):
        return replicas
    if kind == "pp-compress":
        return 0
    n = round(het_fraction * replicas)
    if not 0 < n < replicas:
        raise ConfigError(
            f"--het-fraction {het_fraction} with {replicas} replicas gives {n} uncompressed replicas; "
            "choose a fraction that leaves at least one of each kind"
        )
    return n


def _boundary_bytes(stats_values: int, cfg: RunConfig, tokens: int, compressed: bool) -> int:
    """Bytes for boundary values at the wire dtype plus the int32 token ids a compressed hop carries."""
    per_value = WIRE_DTYPES[cfg.subspace.wire_dtype].itemsize if compressed else 4
    hops = cfg.stages - 1
    return stats_values * per_value + (4 * tokens * hops if compressed else 0)


def run_adamw(
    cfg: RunConfig, data: TokenData, replicas: int, progress: Progress | None
) -> tuple[ConfigResult, LocalReplica]:
    """Data-parallel AdamW: gradients of M shards averaged every step (dense fp32 on the wire)."""
    train = cfg.train
    total = train.inner_steps * train.outer_steps
    model = LocalReplica.build(cfg, compressed=False, U=None)
    n_params = sum(p.numel() for s in model.stages for p in s.parameters())
    result = ConfigResult("adamw", None, None, 0.0, 0.0)
    val = val_batches(data, train.batch_size, train.seq_len, max_batches=4)
    act_values = 0
    for step in range(total):
        model.zero_grad()
        loss = 0.0
        for m in range(replicas):
            x, y = train_batch(data, m, replicas, step, train.batch_size, train.seq_len)
            stats = model.accumulate(x, y, scale=1.0 / replicas)
            loss += stats.loss / replicas
            act_values += stats.boundary_values
        model.apply_step(step)
        result.train_curve.append((step, loss))
        if (step + 1) % train.inner_steps == 0:
            result.val_curve.append((step + 1, model.eval_loss(val)))
        if progress:
            progress("adamw", step + 1, total, loss)
    result.pg_bytes = 4 * n_params * total
    tokens = train.batch_size * train.seq_len * total
    result.act_bytes = _boundary_bytes(act_values // replicas, cfg, tokens, compressed=False)
    return result, model


def run_diloco(
    cfg: RunConfig,
    data: TokenData,
    kind: str,
    replicas: int,
    het_fraction: float,
    progress: Progress | None,
) -> tuple[ConfigResult, LocalReplica]:
    """SparseLoCo over M replicas of S stages, some or all with subspace-compressed boundaries."""
    train, slc = cfg.train, cfg.sparseloco
    n_unc = _n_uncompressed(kind, replicas, het_fraction)
    uses_subspace = kind != "sparseloco"
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed) if uses_subspace else None
    reps = [LocalReplica.build(cfg, compressed=(m >= n_unc), U=U) for m in range(replicas)]
    errors: list[list[dict[str, torch.Tensor] | None]] = [[None] * cfg.stages for _ in range(replicas)]
    result = ConfigResult(
        kind,
        cfg.subspace.k_ratio if uses_subspace else None,
        (n_unc / replicas) if kind == "het-pp-compress" else None,
        0.0,
        0.0,
    )
    val = val_batches(data, train.batch_size, train.seq_len, max_batches=4)
    total = train.inner_steps * train.outer_steps
    pg_bytes = [0] * replicas
    act_bytes = [0] * replicas
    for t in range(train.outer_steps):
        starts = [stage_state(st) for st in reps[0].stages]
        for h in range(train.inner_steps):
            step = t * train.inner_steps + h
            losses = []
            for m, rep in enumerate(reps):
                x, y = train_batch(data, m, replicas, step, train.batch_size, train.seq_len)
                stats = rep.inner_step(x, y, step)
                losses.append(stats.loss)
                act_bytes[m] += _boundary_bytes(stats.boundary_values, cfg, stats.tokens, rep.compressed)
            loss = sum(losses) / replicas
            result.train_curve.append((step, loss))
            if progress:
                progress(kind, step + 1, total, loss)
        embed_update = None
        for s in range(cfg.stages):
            decoded = []
            for m, rep in enumerate(reps):
                delta = pseudo_gradient(starts[s], stage_state(rep.stages[s]))
                payload, errors[m][s] = compress(delta, errors[m][s], slc)
                wire = payload.to_bytes()
                pg_bytes[m] += len(wire)
                decoded.append(decompress(Payload.from_bytes(wire)))
            done = commit_round([rep.stages[s] for rep in reps], starts[s], decoded, slc, U, embed_update)
            result.clipped += done.clip.n_clipped
            if s == 0:
                embed_update = done.embed_update
        result.val_curve.append(((t + 1) * train.inner_steps, reps[0].eval_loss(val)))
    result.pg_bytes = sum(pg_bytes) // replicas
    result.act_bytes = sum(act_bytes) // replicas
    return result, reps[0]


def _final(curve: list[tuple[int, float]], last: int) -> float:
    tail = [v for _, v in curve[-last:]]
    return sum(tail) / max(1, len(tail))


def simulate(
    cfg: RunConfig,
    data: TokenData,
    replicas: int,
    configs: Sequence[str] = CONFIGS,
    het_fraction: float = 0.5,
    progress: Progress | None = None,
    save_dir: Path | None = None,
) -> list[ConfigResult]:
    """Run each configuration on the same data and steps; Δ% is relative to `sparseloco` (or the first)."""
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ConfigError(f"unknown simulator config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    k_from_ratio(cfg.model.d_model, cfg.subspace.k_ratio)
    results = []
    for name in configs:
        torch.manual_seed(cfg.seed)
        started = time.perf_counter()
        if name == "adamw":
            res, model = run_adamw(cfg, data, replicas, progress)
        else:
            res, model = run_diloco(cfg, data, name, replicas, het_fraction, progress)
        res.wall_s = time.perf_counter() - started
        res.final_loss = _final(res.train_curve, cfg.train.inner_steps)
        res.final_val_loss = res.val_curve[-1][1] if res.val_curve else float("nan")
        log.info("%s: train %.4f val %.4f in %.1fs", name, res.final_loss, res.final_val_loss, res.wall_s)
        if save_dir is not None:
            meta = {"simulate": res.summary(), "run": cfg.to_dict()}
            tok = data.tokenizer.path if data.tokenizer is not None else None
            save_model_checkpoint(Path(save_dir) / name, model.full_state(), cfg.model, tok, meta)
        results.append(res)
    base = next((r for r in results if r.name == "sparseloco"), results[0])
    for r in results:
        r.delta_pct = 100.0 * (r.final_val_loss - base.final_val_loss) / base.final_val_loss
    return results


def with_overrides(cfg: RunConfig, **train_overrides: Any) -> RunConfig:
    """Convenience for tests and the CLI: a copy of cfg with some TrainConfig fields replaced."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train_overrides))


def plot_curves(results: Sequence[ConfigResult], path: Path, title: str = "peer simulate") -> Path:
    """Train (thin) and validation (markers) loss against the global inner step, one colour per config."""
    with figure(path, title) as ax:
        for i, r in enumerate(results):
            color = f"C{i}"
            steps, losses = zip(*r.train_curve, strict=True)
            window = max(1, len(losses) // 50)
            smooth = [
                sum(losses[max(0, j - window + 1) : j + 1]) / len(losses[max(0, j - window + 1) : j + 1])
                for j in range(len(losses))
            ]
            ax.plot(steps, smooth, color=color, alpha=0.6, linewidth=1, label=f"{r.name} train")
            if r.val_curve:
                vs, vl = zip(*r.val_curve, strict=True)
                ax.plot(vs, vl, "o-", color=color, markersize=3, label=f"{r.name} val")
    return Path(path)
