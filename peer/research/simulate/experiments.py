"""Seeds × k/d sweeps of the simulator and their Table-2-shaped summary (arXiv 2601.02360).

`run_sweep` runs, for every seed, the k-independent baselines (`adamw`, `sparseloco`) once and the
subspace configs once per k/d; every result carries its seed, k/d and actual k. `summarize` gives,
per k/d, the mean ± sample std over seeds of each config's Δ % (against its family's baseline of
the same seed) and the paired differences het − uniform (`het-pp-compress` − `pp-compress`, the
AdamW pair of Table 4, and by link − by role: `het-bw-pp-compress` − `het-pp-compress`) in nats,
with a 95 % Student-t interval over seeds and, per seed, the standard error of the difference over
the shared held-out sequences. Pure: no printing.

With `SimOptions.attacks` (`peer simulate --attacks random,flip,negate`) every SparseLoCo config
also runs once per attack with its last replica poisoning every round (`peer.research.simulate.attacks`):
with median clipping alone and with clipping + outlier screening (`peer.core.sparseloco.robust`); its honest
run then screens too, so its drops are the false-drop rate. `poison_tables` renders them.

The paper's settings and the other named settings (`--paper-settings`, `--setting`, `--token-budget`)
are resolved by `peer.research.simulate.paper_settings`; Table 3's token-budget mode (`--extend`) runs through
`peer.research.simulate.experiments_budget`, and `summarize(results, own_budget=…)` adds its columns.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.core.data.loader import Corpus
from peer.core.sparseloco.robust import DEFAULT as SCREEN
from peer.core.sparseloco.robust import OFF as NO_SCREEN
from peer.core.subspace.compression import distinct_ks
from peer.errors import ConfigError
from peer.research.simulate.ablations import check_ablations
from peer.research.simulate.attacks import check_attack
from peer.research.simulate.engine import (
    BASELINES,
    CONFIGS,
    ConfigResult,
    Progress,
    SimOptions,
    assign_deltas,
    check_configs,
    run_config,
)
from peer.research.simulate.links import check_links, mode_summary
from peer.research.simulate.overlap import check_overlap
from peer.research.simulate.paper_settings import Resolved, resolve
from peer.research.simulate.ranges import check_ranges
from peer.research.simulate.results import perplexity, robust_rule
from peer.research.simulate.round_designs import design_mass_line

PAIRS = (
    ("het-pp-compress", "pp-compress"),
    ("adamw-het-pp-compress", "adamw-pp-compress"),
    ("het-bw-pp-compress", "het-pp-compress"),  # issue 39: compression by the link against by role
)

# two-sided 95 % Student-t quantiles by degrees of freedom (df > 30: the normal 1.96)
_T95: tuple[float, ...] = (
    *(12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131),
    *(2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042),
)


def t95(df: int) -> float:
    """Two-sided 95 % quantile of Student's t with df degrees of freedom."""
    if df < 1:
        return math.nan
    return _T95[df - 1] if df <= len(_T95) else 1.96


def parse_list(text: str, what: str) -> list[str]:
    """ "0,1,2" → ["0", "1", "2"], without blanks; at least one item."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ConfigError(f"{what}: give at least one value (comma-separated)")
    return items


def attack_list(text: str | None) -> tuple[str, ...]:
    """ "random,flip" → ("random", "flip"), each a known attack; None → ()."""
    if not text:
        return ()
    names = tuple(parse_list(text, "--attacks"))
    for name in names:
        check_attack(name)
    return names


def plan_sweep(
    config: Path | None,
    overrides: dict[str, Any],
    configs: str,
    k_ratios: str | None,
    seeds: str | None,
    settings: Sequence[str],
    replicas: int | None,
    opts: SimOptions,
    token_budget: float | None = None,
) -> tuple[RunConfig, list[str], list[int], list[str], SimOptions, Resolved]:
    """What `peer simulate` will run, checked before any data is prepared.

    Returns (config, config names, seeds, k/d ratios, options with the replica count and AdamW lr
    filled in, what the settings set: `peer.research.simulate.paper_settings.resolve`); raises ConfigError
    naming the flag for an unknown config or setting, bad seeds, k/d ratios that round to the same
    k, or fewer than one replica.
    """
    names = [c.strip() for c in configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise ConfigError(f"--configs: unknown config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    ratios = parse_list(k_ratios, "--k-ratio") if k_ratios else None
    overrides = overrides | {"subspace.k_ratio": ratios[0] if ratios else None}
    res = resolve(config, overrides, settings, replicas, opts.adamw_lr, token_budget)
    cfg = res.cfg
    try:
        seed_list = [int(x) for x in parse_list(seeds, "--seeds")] if seeds else [cfg.seed]
    except ValueError:
        raise ConfigError(f"--seeds: expected integers like 0,1,2, got {seeds!r}") from None
    ratio_list = ratios or [cfg.subspace.k_ratio]
    distinct_ks(cfg.model.d_model, ratio_list)
    check_ranges(opts.round_rule, robust_rule(opts, cfg), opts.attacks[0] if opts.attacks else None)
    check_ablations(names, opts)  # B: --grassmann / --modified-adamw only on the SparseLoCo configs
    check_overlap(opts.overlap, cfg.train.inner_steps, names, opts.grassmann)
    opts = dataclasses.replace(opts, replicas=res.replicas, adamw_lr=res.adamw_lr)
    fixed = "--grassmann" if opts.grassmann else "--modified-adamw" if opts.modified_adamw else ""
    check_links(names, opts.links, opts.replicas, fixed, opts.overlap)  # issue 39: one link per replica
    return cfg, names, seed_list, ratio_list, opts, res


def run_sweep(
    cfg: RunConfig,
    data: Corpus,
    configs: Sequence[str],
    seeds: Sequence[int],
    ratios: Sequence[str],
    opts: SimOptions,
    progress: Progress | None = None,
    save_dir: Path | None = None,
) -> list[ConfigResult]:
    """Every config at every seed and k/d (baselines once per seed); Δ % against each seed's baseline.

    With `save_dir`, each final model goes under save_dir/<config> (one seed and k/d), else under
    save_dir/k<k>-s<seed>/<config> (save_dir/s<seed>/<config> for the baselines).
    """
    check_configs(configs)
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds lists a seed twice: {list(seeds)}")
    distinct_ks(cfg.model.d_model, ratios)  # every row a different k, named honestly
    sweep = len(seeds) > 1 or len(ratios) > 1
    results: list[ConfigResult] = []

    def one(run_cfg: RunConfig, name: str, ratio: str | None) -> None:
        where = None if save_dir is None else Path(save_dir)
        if where is not None and sweep:
            where = where / (f"k{run_cfg.k}-s{run_cfg.seed}" if ratio else f"s{run_cfg.seed}")
        if not opts.attacks or name.startswith("adamw"):
            results.append(run_config(run_cfg, data, name, opts, _label(progress, name, ratio, run_cfg.seed), where))
            return
        honest = dataclasses.replace(opts, robust=SCREEN, attack=None)
        results.append(run_config(run_cfg, data, name, honest, _label(progress, name, ratio, run_cfg.seed), where))
        for attack in opts.attacks:  # checkpoints only of honest runs
            for screen in (NO_SCREEN, SCREEN):
                attacked = dataclasses.replace(opts, robust=screen, attack=attack)
                label = _label(progress, f"{name}+{attack}{'' if screen.enabled else ' clip'}", ratio, run_cfg.seed)
                results.append(run_config(run_cfg, data, name, attacked, label))

    for seed in seeds:
        seeded = dataclasses.replace(cfg, seed=seed)
        for name in configs:
            if name in BASELINES:
                one(seeded, name, None)
        for ratio in ratios:
            at_k = dataclasses.replace(seeded, subspace=dataclasses.replace(cfg.subspace, k_ratio=ratio))
            for name in configs:
                if name not in BASELINES:
                    one(at_k, name, ratio)
    assign_deltas(results)
    return results


def sweep_args(
    cfg: RunConfig,
    opts: SimOptions,
    configs: Sequence[str],
    seeds: Sequence[int],
    ratios: Sequence[str],
    paper_settings: bool,
    resolved: Resolved | None = None,
    extend: float | None = None,
) -> dict[str, Any]:
    """The "args" of `peer simulate --json`: every setting the sweep ran with (`settings`: what the
    named settings set, with the source of each value; `outer_steps`: of the F·N runs with --extend)."""
    table = resolved.table if resolved is not None else []
    return {
        "preset": cfg.preset,
        "replicas": opts.replicas,
        "stages": cfg.stages,
        "k_ratio": list(ratios),
        "het_fraction": opts.het_fraction,
        "inner_steps": cfg.train.inner_steps,
        "outer_steps": cfg.train.outer_steps,
        "batch_size": cfg.train.batch_size,
        "seq_len": cfg.train.seq_len,
        "seed": cfg.seed,
        "configs": list(configs),
        "seeds": list(seeds),
        "lr": cfg.train.lr,
        "adamw_lr": opts.adamw_lr,
        "quant_bits": cfg.sparseloco.quant_bits,
        "clip_median": cfg.sparseloco.clip_median_factor,
        "val_tokens": opts.val_tokens,
        "te_adaptation": opts.te_adaptation,
        "weight_projection": opts.weight_projection,
        "grassmann": opts.grassmann,  # B: Table 5c / 5d
        "grassmann_lr": opts.grassmann_lr,
        "modified_adamw": opts.modified_adamw,
        "paper_settings": paper_settings,
        "round_rule": opts.round_rule,
        "overlap": opts.overlap,
        "links": None if opts.links is None else opts.links.to_json(),
        "settings": [{"key": r.key, "value": r.value, "source": r.source} for r in table],
        "token_budget": resolved.budget if resolved is not None else None,
        "extend": extend,
    }


def _label(progress: Progress | None, name: str, ratio: str | None, seed: int) -> Progress | None:
    if progress is None:
        return None
    label = f"{name} {ratio or '—'} s{seed}"

    def relay(_name: str, done: int, total: int, loss: float) -> None:
        progress(label, done, total, loss)

    return relay


def _mean_std(xs: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else math.nan)


def summarize(results: Sequence[ConfigResult], own_budget: Sequence[ConfigResult] = ()) -> list[dict[str, Any]]:
    """One row per k/d: Δ % mean ± std over seeds per config, and the paired het − uniform rows.

    With `own_budget` (Table 3: the baselines run at the shorter budget N), each row also has every
    config's Δ % against its family's baseline at N (`delta_pct_own_budget`) and that SparseLoCo loss."""
    ratios = list(dict.fromkeys(r.k_ratio for r in results if r.k_ratio is not None))
    base = [r for r in results if r.name == "sparseloco"]
    rows = []
    for ratio in ratios:
        at = [r for r in results if r.k_ratio == ratio]
        row: dict[str, Any] = {"k_ratio": ratio, "k": at[0].k, "seeds": sorted({r.seed for r in at})}
        if base:
            m, s = _mean_std([b.val_loss_replica_mean for b in base])
            row["sparseloco_val_loss"] = {"mean": m, "std": s, "n": len(base)}
            m, s = _mean_std([perplexity(b.val_loss_replica_mean) for b in base])  # B: perplexity beside loss
            row["sparseloco_val_perplexity"] = {"mean": m, "std": s, "n": len(base)}
        row["delta_pct"], row["val_perplexity"] = {}, {}
        for name in dict.fromkeys(r.name for r in at):
            vals = [r.delta_pct for r in at if r.name == name]
            m, s = _mean_std(vals)
            row["delta_pct"][name] = {"mean": m, "std": s, "n": len(vals)}
            m, s = _mean_std([perplexity(r.val_loss_replica_mean) for r in at if r.name == name])
            row["val_perplexity"][name] = {"mean": m, "std": s, "n": len(vals)}
        row["pairs"] = [p for a, b in PAIRS if (p := _paired(at, a, b)) is not None]
        if own_budget:  # Table 3 (`peer.research.simulate.experiments_budget`)
            row |= _own_budget_columns(at, own_budget)
        rows.append(row)
    return rows


def _own_budget_columns(at: Sequence[ConfigResult], own_budget: Sequence[ConfigResult]) -> dict[str, Any]:
    """Table 3's part of a summary row: SparseLoCo's loss at the budget N and every config's Δ %
    against its family's baseline at N, mean ± std over seeds."""
    out: dict[str, Any] = {"delta_pct_own_budget": {}}
    if short := [b.val_loss_replica_mean for b in own_budget if b.config == "sparseloco"]:
        m, s = _mean_std(short)
        out["sparseloco_val_loss_own_budget"] = {"mean": m, "std": s, "n": len(short)}
    for name in dict.fromkeys(r.name for r in at):
        vals = [d for r in at if r.name == name and (d := own_budget_delta(r, own_budget)) is not None]
        if vals:
            m, s = _mean_std(vals)
            out["delta_pct_own_budget"][name] = {"mean": m, "std": s, "n": len(vals)}
    return out


def own_budget_delta(r: ConfigResult, own_budget: Sequence[ConfigResult]) -> float | None:
    """Table 3: Δ % of r against its family's baseline of the same seed in `own_budget` (None: none)."""
    family = "adamw" if r.config.startswith("adamw") else "sparseloco"
    base = next((b for b in own_budget if b.seed == r.seed and b.config == family), None)
    if base is None:
        return None
    return 100.0 * (r.final_val_loss - base.final_val_loss) / base.final_val_loss


def _paired(at: Sequence[ConfigResult], a: str, b: str) -> dict[str, Any] | None:
    """a − b in nats of replica-mean val loss, paired by seed, with a 95 % t interval over seeds."""
    by_seed = {r.seed: r for r in at if r.name == b}
    stderr = [_paired_stderr(r, by_seed[r.seed]) for r in at if r.name == a and r.seed in by_seed]
    diffs = [
        r.val_loss_replica_mean - by_seed[r.seed].val_loss_replica_mean for r in at if r.name == a and r.seed in by_seed
    ]
    if not diffs:
        return None
    m, s = _mean_std(diffs)
    half = t95(len(diffs) - 1) * s / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    return {
        "a": a,
        "b": b,
        "diff_mean": m,
        "diff_std": s,
        "ci95": [m - half, m + half],
        "n": len(diffs),
        "a_ahead": sum(d < 0 for d in diffs),
        "diffs": diffs,
        "val_stderr": stderr,  # per seed: standard error of the difference over held-out sequences
    }


def _paired_stderr(a: ConfigResult, b: ConfigResult) -> float | None:
    """Standard error of mean(a − b) over the same held-out sequences (None without them)."""
    if a.val_sequences is None or b.val_sequences is None or a.val_sequences.shape != b.val_sequences.shape:
        return None
    d = a.val_sequences - b.val_sequences
    return float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else None


def summary_title(cfg: RunConfig, replicas: int, seeds: Sequence[int], round_rule: str = "all") -> str:
    """The title of the Table-2-shaped summary: the setting every row shares."""
    t = cfg.train
    rounds = "" if round_rule == "all" else f", {round_rule} rounds"
    return (
        f"Table 2 shape — {cfg.preset}, M={replicas}, S={cfg.stages}, H={t.inner_steps}, T={t.outer_steps}{rounds}, "
        f"seeds {','.join(map(str, seeds))}: mean ± std over seeds"
    )


def dropped_mass_lines(results: Sequence[ConfigResult]) -> list[str]:
    """One line per range-sharded run: the share of ‖Δ̄‖² its shards dropped per stage round."""
    lines = []
    for r in results:
        s = r.summary()
        if "dropped_mass_mean" in s and r.round_rule != "ranges":  # a design (round_designs): its own shares
            lines.append(design_mass_line(r.name, r.seed, r.round_rule, s))
        elif "dropped_mass_mean" in s:
            lines.append(
                f"{r.name} s{r.seed}: the range shards dropped {s['dropped_mass_mean']:.1%} of ‖Δ̄‖² per stage round "
                f"(mean of {len(r.dropped_mass)}; max {s['dropped_mass_max']:.1%}); error feedback returns it "
                f"to the senders; their quantization changed {s['quant_error_mean']:.1%} (returned to nobody)"
            )
    return lines


def mode_lines(results: Sequence[ConfigResult]) -> list[str]:
    """One line per het-bw-pp-compress run: each replica's mode per outer step, as runs of equal steps."""
    return [
        f"{r.name} s{r.seed}: modes per outer step (F full replica, U uncompressed pipeline, C compressed) "
        f"{mode_summary(r.modes)}"
        for r in results
        if r.config == "het-bw-pp-compress"
    ]
