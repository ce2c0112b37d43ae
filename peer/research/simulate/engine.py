"""Single-process M × S simulator of the paper's experiments (arXiv 2601.02360, Tables 2, 4, 5).

Runs, on the same data, seed and number of steps:
- `adamw`                  H = 1 with dense gradient averaging (data-parallel AdamW),
- `sparseloco`             M uncompressed replicas, SparseLoCo every H steps,
- `pp-compress`            every replica's stage boundaries go through the k-dim subspace,
- `het-pp-compress`        a fraction α of the replicas is uncompressed, the rest compressed,
- `adamw-pp-compress`      data-parallel AdamW, every replica compressed (Table 4),
- `adamw-het-pp-compress`  data-parallel AdamW, a fraction α uncompressed (Table 4),
- `het-bw-pp-compress`     each replica on a link (`SimOptions.links`), its mode chosen every outer step by
                           the node's rule (issue 39, `peer.research.simulate.links`).

Every replica is S stage views of the decoder (`peer.research.simulate.replica.LocalReplica`), so the chain
forward (`peer.core.model.chain`), the stage boundaries, the inner step (`peer.core.model.inner.accumulate`,
`adamw_step`) and the per-stage SparseLoCo rounds (`peer.core.sparseloco.commit.commit_round`) are the ones a
real swarm runs; only the network is missing. Gradients are clipped by the norm over all stages;
the round's rule is the run's `[sparseloco]` section, as in the swarm: median clipping
(`clip_median_factor`; the clipped mass goes back to the sender's error buffer, `peer.core.sparseloco.feedback`,
as on every holder) and outlier screening (`screening`, unless `SimOptions.robust` forces a rule; a
contribution it drops goes back whole). `peer simulate` turns both off (`SIMULATE_DEFAULTS`).
`SimOptions.attack` makes the last replica an attacker (`peer.research.simulate.attacks`): every round it
sends the poisoned contribution instead of its own. T⊥ decays at every commit as AdamW decays the
rest of the embedding. `SimOptions.round_rule` "ranges" commits every stage's round range by range
instead (`peer.research.simulate.ranges`, issue 24): owners' re-sparsified shards, assembled; the share of
‖Δ̄‖² the shards drop is recorded per round (`ConfigResult.dropped_mass`). `SimOptions.overlap` = N runs
overlapped outer steps (issue 36, `peer.research.simulate.overlap`): round t lands after the first N inner
steps of t + 1, each replica rebased onto the committed state keeping that progress; the metric is taken
on the committed model.

The metric is the paper's: after every outer step, the validation loss averaged over the M
replicas, each on its OWN forward path (compressed or not), on `val_tokens` held-out tokens.
After a commit all replicas hold the same weights, so each distinct path is evaluated once and
weighted by its number of replicas. `delta_pct` compares that replica mean with the baseline of
the config's family (`sparseloco`, or `adamw` for the adamw-* configs) of the same seed.
This module does no I/O but the optional checkpoint, and prints and draws nothing: progress goes
through a callback; `peer.cli.plots.plot_curves` draws the curves.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from peer.config import RunConfig
from peer.core.data.loader import Corpus
from peer.core.subspace.compression import k_from_ratio
from peer.errors import ConfigError
from peer.node.checkpoints.model import save_model_checkpoint
from peer.research.simulate.checkpoint import run_key
from peer.research.simulate.loops import StageRound, commit_stage, run_adamw, run_diloco
from peer.research.simulate.overlap import check_overlap
from peer.research.simulate.results import (
    BASELINES,
    CONFIGS,
    SIMULATE_DEFAULTS,
    VAL_BATCH,
    ConfigResult,
    Progress,
    SimOptions,
)
from peer.research.simulate.runtime import current

__all__ = [
    "BASELINES",
    "CONFIGS",
    "SIMULATE_DEFAULTS",
    "VAL_BATCH",
    "ConfigResult",
    "Progress",
    "SimOptions",
    "StageRound",
    "_commit_stage",
    "assign_deltas",
    "check_configs",
    "run_adamw",
    "run_config",
    "run_diloco",
    "simulate",
    "with_overrides",
]
_commit_stage = commit_stage  # the name the tests know
log = logging.getLogger(__name__)


def _final(curve: list[tuple[int, float]], last: int) -> float:
    tail = [v for _, v in curve[-last:]]
    return sum(tail) / max(1, len(tail))


def check_configs(configs: Sequence[str]) -> None:
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ConfigError(f"unknown simulator config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")


def run_config(
    cfg: RunConfig,
    data: Corpus,
    name: str,
    opts: SimOptions,
    progress: Progress | None = None,
    save_dir: Path | None = None,
) -> ConfigResult:
    """One configuration at cfg's seed and k/d (checkpointed under save_dir/name if given)."""
    check_overlap(opts.overlap, cfg.train.inner_steps, [name], opts.grassmann)
    rt, key = current(), run_key(cfg, name, opts)
    if (stored := rt.finished(key)) is not None:  # a resumed sweep: this run finished before
        if progress:
            progress(name, len(stored.train_curve), len(stored.train_curve), stored.final_loss)
        return stored  # type: ignore[no-any-return]
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    if name.startswith("adamw"):
        res, model = run_adamw(cfg, data, name, opts, progress)
    else:
        res, model = run_diloco(cfg, data, name, opts, progress)
    res.wall_s = time.perf_counter() - started
    res.final_loss = _final(res.train_curve, cfg.train.inner_steps)
    log.info("%s: train %.4f val %.4f in %.1fs", name, res.final_loss, res.final_val_loss, res.wall_s)
    rt.save(key, res, done=True)
    if save_dir is not None:
        meta = {"simulate": res.summary(), "run": cfg.to_dict()}
        tok = data.tokenizer.path if data.tokenizer is not None else None
        save_model_checkpoint(Path(save_dir) / name, model.full_state(), cfg.model, tok, meta)
    return res


def assign_deltas(results: Sequence[ConfigResult]) -> None:
    """Δ % of each result against its family's baseline of the same seed (else the seed's first)."""
    for r in results:
        same_seed = [b for b in results if b.seed == r.seed]
        family = "adamw" if r.name.startswith("adamw") else "sparseloco"
        base = next((b for b in same_seed if b.name == family), same_seed[0])
        if r.attack is not None:  # an attacked run against the same config's honest run
            honest = (b for b in same_seed if b.attack is None and b.config == r.config and b.k == r.k)
            base = next(honest, base)
        r.delta_pct = 100.0 * (r.final_val_loss - base.final_val_loss) / base.final_val_loss


def simulate(
    cfg: RunConfig,
    data: Corpus,
    replicas: int,
    configs: Sequence[str] = CONFIGS[:4],
    het_fraction: float = 0.5,
    progress: Progress | None = None,
    save_dir: Path | None = None,
    options: SimOptions | None = None,
) -> list[ConfigResult]:
    """Run each configuration on the same data and steps (one seed, one k/d); Δ% as `assign_deltas`."""
    check_configs(configs)
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    k_from_ratio(cfg.model.d_model, cfg.subspace.k_ratio)
    opts = dataclasses.replace(options or SimOptions(), replicas=replicas, het_fraction=het_fraction)
    results = [run_config(cfg, data, name, opts, progress, save_dir) for name in configs]
    assign_deltas(results)
    return results


def with_overrides(cfg: RunConfig, **train_overrides: Any) -> RunConfig:
    """Convenience for tests and the CLI: a copy of cfg with some TrainConfig fields replaced."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train_overrides))
