"""Named settings of `peer simulate`: the paper's Table 9 / §3 (`paper`) and the tuned rows we know.

A *setting* is a list of rows (key, value, where from). A key is a dotted run-config key
(`train.batch_size`, `stages`, `sparseloco.quant_bits`, …) or one of the simulator's own keys
`replicas` (M), `adamw_lr` (the adamw* configs' inner learning rate) and `token_budget` (tokens per
run: the outer steps follow from it). `--setting a,b` applies the rows of a, then b (later wins);
`--paper-settings` is `--setting paper`. A setting is a name of `SETTINGS` or a TOML file of dotted
keys (`"train.lr" = 6e-4`, `replicas = 8`). The rows go in the command's defaults layer, so a
`--config` TOML, a `PEER_*` variable or a flag still wins; the printed table says which did.

Outer steps come from the token budget N: T = ceil(N / (M·H·B·L)) with the run's final M, H,
batch B and context L (after any override), unless the outer steps are set (flag, TOML, env).

What the `paper` setting takes from where (arXiv 2601.02360; its text is not readable here, so the
values are those issue 25 quotes from it):
- Table 9: batch 32, context 2048, H = 50, inner lr 1e-3, the AdamW baseline's tuned (*) lr 3e-4,
  warmup 500, outer steps 116 (178M) and 391 (512M) at M = 8, H = 50, B = 32, L = 2048.
- §3: M = 8, S = 4, the round rule `peer.config.PAPER_ALGORITHM` (no quantization, no median clip…).
- Our rules where the paper has none: the token budgets reproduce Table 9's outer steps
  (178M: 116 × 26,214,400 = 3.04e9 tokens, 17.1 per nominal parameter; 512M: 391 × 26,214,400 =
  1.02e10, 20.0 per nominal parameter); 1B gets 20 tokens per nominal parameter; `tiny` and `small`
  (no such model in the paper) 20 tokens per actual parameter and their own max_seq_len as context.
  A setting's warmup is capped at 10 % of the run's inner steps (Table 9's 500 warmup steps are 8.6 %
  of 178M's 5,800 and 2.6 % of 512M's 19,550; a short run would otherwise never leave warmup).

The tuned (*) rows of Table 9 other than the AdamW baseline's learning rate are not known here;
add them with a TOML file (`--setting paper,tuned.toml`).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.config import PAPER_ALGORITHM, RunConfig, build_config
from peer.core.model.optim import TrainConfig
from peer.errors import ConfigError
from peer.research.simulate.results import SIMULATE_DEFAULTS

SIM_KEYS = ("replicas", "adamw_lr", "token_budget")  # the simulator's keys; the rest are run-config keys
PAPER_REPLICAS = 8  # M (§3)
PAPER_ADAMW_LR = 3e-4  # Table 9's tuned (*) learning rate of the AdamW baseline
PAPER_WARMUP = 500  # Table 9
WARMUP_SHARE = 0.1  # our cap: a setting's warmup is at most this share of the run's inner steps
PAPER_CONTEXT = 2048  # Table 9, for the paper's models
TABLE9_OUTER = {"178M": 116, "512M": 391}  # Table 9's outer steps at M = 8, H = 50, B = 32, L = 2048
NOMINAL_PARAMS = {"178M": 178e6, "512M": 512e6, "1B": 1e9}
TOKENS_PER_PARAM = 20


@dataclass(frozen=True)
class Row:
    """One setting: a dotted key, its value and where the value comes from."""

    key: str
    value: Any
    source: str


def tokens_per_outer(replicas: int, train: TrainConfig) -> int:
    """Tokens one outer step trains on over all replicas: M·H·B·L."""
    return replicas * train.inner_steps * train.batch_size * train.seq_len


def outer_steps_for(budget: float, replicas: int, train: TrainConfig) -> int:
    """T = ceil(N / (M·H·B·L)), at least 1."""
    return max(1, math.ceil(budget / tokens_per_outer(replicas, train)))


def paper_budget(cfg: RunConfig) -> Row:
    """The token budget of the `paper` setting for cfg's preset (module docstring: our rule)."""
    per = PAPER_REPLICAS * 50 * 32 * PAPER_CONTEXT
    if cfg.preset in TABLE9_OUTER:
        outer = TABLE9_OUTER[cfg.preset]
        per_param = outer * per / NOMINAL_PARAMS[cfg.preset]
        return Row("token_budget", outer * per, f"Table 9: {outer} outer steps × 8·50·32·2048 ({per_param:.1f}/param)")
    if cfg.preset in NOMINAL_PARAMS:
        return Row("token_budget", int(TOKENS_PER_PARAM * NOMINAL_PARAMS[cfg.preset]), "20 tokens/nominal param (ours)")
    n = cfg.model.n_params
    return Row("token_budget", TOKENS_PER_PARAM * n, f"20 tokens/param × {n:,} params (ours; not a paper model)")


def paper_rows(cfg: RunConfig) -> list[Row]:
    """Table 9 and §3 for cfg's preset (first-pass config: its preset and model)."""
    if cfg.preset in NOMINAL_PARAMS:
        context = Row("train.seq_len", PAPER_CONTEXT, "Table 9 (context)")
    else:
        context = Row("train.seq_len", cfg.model.max_seq_len, "the preset's max_seq_len (not a paper model)")
    return [
        Row("replicas", PAPER_REPLICAS, "paper §3 (M)"),
        Row("stages", 4, "paper §3 (S)"),
        Row("train.inner_steps", 50, "Table 9 (H)"),
        Row("train.batch_size", 32, "Table 9"),
        context,
        Row("train.lr", 1e-3, "Table 9 (inner lr)"),
        Row("adamw_lr", PAPER_ADAMW_LR, "Table 9 (AdamW baseline, tuned *)"),
        Row("train.warmup_steps", PAPER_WARMUP, "Table 9"),
        *(Row(k, v, "paper §3 round rule (PAPER_ALGORITHM)") for k, v in PAPER_ALGORITHM.items()),
        paper_budget(cfg),
    ]


def adamw_tuned_rows(_cfg: RunConfig) -> list[Row]:
    return [Row("adamw_lr", PAPER_ADAMW_LR, "Table 9 (AdamW baseline, tuned *)")]


# name -> rows for the first-pass config; `--setting FILE.toml` adds a file's rows
SETTINGS: dict[str, Callable[[RunConfig], list[Row]]] = {"paper": paper_rows, "adamw-tuned": adamw_tuned_rows}


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def toml_rows(path: Path) -> list[Row]:
    """A TOML file's dotted keys as rows, sourced to the file; ConfigError naming --setting."""
    try:
        values = _flatten(tomllib.loads(path.read_text()))
    except FileNotFoundError:
        raise ConfigError(f"--setting: file {path} not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--setting: {path} is not valid TOML: {exc}") from None
    return [Row(k, v, str(path)) for k, v in values.items()]


def setting_rows(name: str, cfg: RunConfig) -> list[Row]:
    """The rows of one named setting or TOML file; ConfigError naming --setting for anything else."""
    if name in SETTINGS:
        rows = SETTINGS[name](cfg)
    elif name.endswith(".toml"):
        rows = toml_rows(Path(name))
    else:
        raise ConfigError(f"--setting: unknown setting {name!r}; choose from {', '.join(SETTINGS)} or a .toml file")
    for row in rows:
        if row.key == "replicas" and (isinstance(row.value, bool) or not isinstance(row.value, int) or row.value < 1):
            raise ConfigError(f"--setting {name}: replicas must be an integer >= 1, got {row.value!r}")
        if row.key in ("adamw_lr", "token_budget") and not _positive(row.value):
            raise ConfigError(f"--setting {name}: {row.key} must be a positive number, got {row.value!r}")
    return rows


def _positive(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def check_budget(token_budget: float | None, outer_flag: int | None) -> None:
    """--token-budget: positive, and not together with --outer-steps (the budget sets them)."""
    if token_budget is None:
        return
    if not _positive(token_budget) or token_budget < 1:
        raise ConfigError(f"--token-budget must be a positive number of tokens, got {token_budget}")
    if outer_flag is not None:
        raise ConfigError("--token-budget sets the outer steps: give --token-budget or --outer-steps, not both")


def settings_names(setting: str | None, paper: bool) -> list[str]:
    """--paper-settings and --setting a,b as the list of settings to apply, in order."""
    names = [x.strip() for x in (setting or "").split(",") if x.strip()]
    return (["paper"] if paper and "paper" not in names else []) + names


@dataclass(frozen=True)
class Resolved:
    """The run config and simulator values after the settings, and the table of what they set."""

    cfg: RunConfig
    replicas: int
    adamw_lr: float | None
    budget: float | None  # tokens per run, when the outer steps come from a budget (else None)
    table: list[Row]  # final value of every key a setting (or the budget) set, and where it came from


def resolve(
    config: Path | None,
    overrides: Mapping[str, Any],
    names: Sequence[str],
    replicas: int | None,
    adamw_lr: float | None,
    token_budget: float | None,
) -> Resolved:
    """Build the run config with the settings `names` in the defaults layer and the outer steps
    from the token budget (the flag's, else a setting's); flags, TOML and env still win."""
    check_budget(token_budget, overrides.get("train.outer_steps"))
    first = build_config(config, overrides, defaults=SIMULATE_DEFAULTS)
    rows = {r.key: r for name in names for r in setting_rows(name, first)}  # later wins
    run = {k: r.value for k, r in rows.items() if k not in SIM_KEYS}
    m = replicas if replicas is not None else int(_get(rows, "replicas") or 4)
    if m < 1:
        raise ConfigError(f"--replicas must be >= 1, got {m}")
    if token_budget is not None:
        was = f" (the setting: {rows['token_budget'].value:,})" if "token_budget" in rows else ""
        rows["token_budget"] = Row("token_budget", int(token_budget), f"--token-budget{was}")
    budget = _get(rows, "token_budget")
    derived: dict[str, Row] = {}
    cfg = _build(config, overrides, run, names)
    if budget is not None:
        source = f"ceil({budget:.4g} / (M·H·B·L = {tokens_per_outer(m, cfg.train):,}))"
        derived["train.outer_steps"] = Row("train.outer_steps", outer_steps_for(budget, m, cfg.train), source)
        cfg = _build(config, overrides, run | {"train.outer_steps": derived["train.outer_steps"].value}, names)
    cap = max(1, int(WARMUP_SHARE * cfg.train.inner_steps * cfg.train.outer_steps))
    if "train.warmup_steps" in run and run["train.warmup_steps"] > cap:
        warm = rows["train.warmup_steps"]
        derived["train.warmup_steps"] = Row(
            "train.warmup_steps", cap, f"{warm.source}: {warm.value}, ≤ 10 % of run (ours)"
        )
        cfg = _build(config, overrides, run | {k: r.value for k, r in derived.items()}, names)
    if "train.outer_steps" in derived and cfg.train.outer_steps != derived["train.outer_steps"].value:
        budget = None  # the outer steps came from --outer-steps, a --config TOML or PEER_*, not the budget
    final_lr = adamw_lr if adamw_lr is not None else _get(rows, "adamw_lr")
    sim = {"replicas": m, "adamw_lr": final_lr, "token_budget": budget}
    flags = {"replicas": replicas, "adamw_lr": adamw_lr} | dict(overrides)
    table = [_final(row, cfg, sim, flags) for row in (rows | derived).values()]
    return Resolved(cfg, m, final_lr, budget, table)


def _get(rows: Mapping[str, Row], key: str) -> Any:
    return rows[key].value if key in rows else None


def _build(
    config: Path | None, overrides: Mapping[str, Any], run: Mapping[str, Any], names: Sequence[str]
) -> RunConfig:
    try:
        return build_config(config, overrides, defaults=SIMULATE_DEFAULTS | dict(run))
    except ConfigError as exc:
        if not names:
            raise
        raise ConfigError(f"{exc} (with --setting {','.join(names)})") from None


def value_at(cfg: RunConfig, key: str) -> Any:
    """cfg's value at a dotted key (`train.lr`, `stages`); the alias `model.preset` is `preset`."""
    node: Any = cfg.to_dict() | {"preset": cfg.preset}
    for part in key.replace("-", "_").split("."):
        node = node[part] if isinstance(node, Mapping) and part in node else None
    return node


def _final(row: Row, cfg: RunConfig, sim: Mapping[str, Any], flags: Mapping[str, Any]) -> Row:
    value = sim[row.key] if row.key in SIM_KEYS else value_at(cfg, row.key)
    if value == row.value:
        return Row(row.key, value, row.source)
    who = "a flag" if flags.get(row.key) is not None else "--config / PEER_*"
    return Row(row.key, value, f"{who} (the setting: {row.value})")
