"""Table 3 of arXiv 2601.02360: does extra training make up for compression? (`peer simulate --extend F`).

The baselines (`adamw`, `sparseloco`) run at the token budget N and at F·N, the subspace configs
at F·N only. Each subspace config then has two Δ %: against its family's baseline at F·N (the
same token count: `ConfigResult.delta_pct`, as in every sweep) and against that baseline at N,
its own budget (`experiments.own_budget_delta`, the `… Δ % vs own budget` columns).

A run's tokens are M·H·B·L·T with T = ceil(budget / (M·H·B·L)), so the F·N runs have
ceil(F·N / (M·H·B·L)) outer steps. N is `--token-budget`, else a setting's budget (`--paper-settings`),
else the tokens of the configured T outer steps. Every run has its own learning-rate schedule over
its own length (`peer.core.model.optim.lr_at`: warmup, then cosine to the run's last step); the warmup
steps are the same in both (the N run's, as `peer.research.simulate.paper_settings.resolve` capped them).
This module plans the two budgets and runs `experiments.run_sweep` once per budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.core.data.loader import Corpus
from peer.errors import ConfigError
from peer.research.simulate.experiments import own_budget_delta, run_sweep
from peer.research.simulate.paper_settings import outer_steps_for, tokens_per_outer
from peer.research.simulate.results import BASELINES, ConfigResult, Progress, SimOptions

SHORT = " @N"  # the name suffix of the baselines' runs at the budget N


@dataclass(frozen=True)
class Budgets:
    """The two budgets of a Table 3 run: the baselines at N (`short`), every config at F·N (`long`)."""

    short: RunConfig
    long: RunConfig
    extend: float  # F
    replicas: int

    def tokens(self, cfg: RunConfig) -> int:
        return tokens_per_outer(self.replicas, cfg.train) * cfg.train.outer_steps


def plan_budgets(
    cfg: RunConfig, opts: SimOptions, budget: float | None, extend: float, configs: Sequence[str]
) -> Budgets:
    """Check --extend and the configs, and give the N and F·N run configs; ConfigError naming the flag."""
    if isinstance(extend, bool) or not math.isfinite(extend) or extend <= 1:
        raise ConfigError(f"--extend must be a number > 1 (the longer budget is F·N), got {extend}")
    if opts.attacks:
        raise ConfigError("--extend runs honest configs only; drop --attacks")
    missing = {"adamw" if c.startswith("adamw") else "sparseloco" for c in configs if c not in BASELINES}
    missing -= set(configs)
    if missing:
        raise ConfigError(
            f"--extend compares every config with its baseline at both budgets: add {sorted(missing)} to --configs"
        )
    n = budget if budget is not None else tokens_per_outer(opts.replicas, cfg.train) * cfg.train.outer_steps
    t_short = outer_steps_for(n, opts.replicas, cfg.train)
    t_long = outer_steps_for(extend * n, opts.replicas, cfg.train)
    if t_long <= t_short:
        raise ConfigError(
            f"--extend {extend}: F·N rounds to the same {t_short} outer steps as N; give a larger --extend or budget"
        )
    short = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, outer_steps=t_short))
    long = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, outer_steps=t_long))
    return Budgets(short, long, extend, opts.replicas)


def run_budgets(
    b: Budgets,
    data: Corpus,
    configs: Sequence[str],
    seeds: Sequence[int],
    ratios: Sequence[str],
    opts: SimOptions,
    progress: Progress | None = None,
    save_dir: Path | None = None,
) -> tuple[list[ConfigResult], list[ConfigResult]]:
    """(every config at F·N, the baselines at N, named `<baseline> @N`); Δ % of the first list is
    against the baseline at F·N (the same tokens). Checkpoints of the N runs go under save_dir/own-budget."""
    baselines = [c for c in configs if c in BASELINES]

    def short_progress(label: str, done: int, total: int, loss: float) -> None:
        if progress is not None:
            progress(label + SHORT, done, total, loss)

    short_dir = None if save_dir is None else Path(save_dir) / "own-budget"
    short = run_sweep(b.short, data, baselines, seeds, ratios, opts, progress=short_progress, save_dir=short_dir)
    for r in short:
        r.name += SHORT
    long = run_sweep(b.long, data, configs, seeds, ratios, opts, progress=progress, save_dir=save_dir)
    return long, short


def budget_title(b: Budgets, seeds: Sequence[int]) -> str:
    """The title of the Table 3 summary: both budgets and what each Δ % compares."""
    c, t = b.long, b.long.train
    return (
        f"Table 3 shape — {c.preset}, M={b.replicas}, S={c.stages}, H={t.inner_steps}: baselines at "
        f"N={b.tokens(b.short):,} tokens (T={b.short.train.outer_steps}) and F·N={b.tokens(b.long):,} "
        f"(F={b.extend:g}, T={t.outer_steps}); configs at F·N; Δ % vs the baseline at F·N and at its own "
        f"budget N; seeds {','.join(map(str, seeds))}: mean ± std over seeds"
    )


def budget_json(b: Budgets, long: Sequence[ConfigResult], short: Sequence[ConfigResult]) -> list[dict[str, Any]]:
    """Every run's summary with its tokens, its budget ("F·N" or "N") and, for the subspace configs,
    Δ % against the baseline at its own budget N."""
    out = []
    for runs, cfg, label in ((long, b.long, "F·N"), (short, b.short, "N")):
        for r in runs:
            own = own_budget_delta(r, short) if r.k_ratio is not None else None
            out.append(r.summary() | {"tokens": b.tokens(cfg), "budget": label, "delta_pct_own_budget": own})
    return out
