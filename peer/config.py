"""Typed, strict configuration of a `peer` run.

One `RunConfig` describes a run: the model (a preset plus overrides), the pipeline split, the
subspace compression (k/d), SparseLoCo, data and the inner optimizer. The bootstrap publishes it as
the run's manifest; every peer builds the same objects from it.

Precedence: defaults < TOML file < `PEER_*` environment variables < CLI flags. Environment
variables name a section and a field with a double underscore, e.g. `PEER_TRAIN__INNER_STEPS=20`,
`PEER_SEED=3`. Unknown sections and keys, wrong types and bad cross-field combinations raise
`ConfigError` naming the field. The math's sections live beside the code that uses them, and this
module assembles them (core never imports it): `ModelConfig` (peer.core.model.decoder), `TrainConfig`
(peer.core.model.optim), `SparseLoCoConfig` (peer.core.sparseloco.codec.format), `DataConfig` (peer.core.data.corpus);
`SubspaceConfig` and `SwarmConfig` are defined here. Each section checks its own fields
(ModelConfig, SparseLoCoConfig and DataConfig in their `__post_init__`); `validate` checks the rest
and the combinations.

Kept by hand, not pydantic: pydantic's lax mode reads True as 1 / 1.0 (an error here), the sections
are core's plain dataclasses (core does not depend on pydantic), and every error must name the field
and the layer it came from, so the ~40 lines of coercion below would only move into validators.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import tomllib
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import torch

from peer.core.data.corpus import DataConfig
from peer.core.model.decoder import ModelConfig, get_preset, stage_layers
from peer.core.model.optim import TrainConfig
from peer.core.sparseloco.codec.format import QUANT_BITS, SparseLoCoConfig
from peer.core.subspace.compression import k_from_ratio
from peer.errors import ConfigError

# The one wire-dtype table: boundary activations and gradients travel in one of these.
WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# The paper's round rule as dotted overrides (arXiv 2601.02360 §3): what `--paper-settings` sets on
# both sides, the bootstrap's manifest and `peer simulate`. The swarm's defaults depart from it
# where a public swarm needs a defence or a home link (docs/configuration.md, "Where the defaults
# depart from the paper").
PAPER_ALGORITHM: dict[str, object] = {
    "sparseloco.quant_bits": 0,  # float32 values (Table 9: no quantization)
    "sparseloco.clip_median_factor": 0.0,  # every contribution at its own norm
    "sparseloco.screening": False,  # no outlier dropped
    "sparseloco.dense_1d": False,  # top-k per chunk on all parameters, 1-D ones too
    "swarm.round_rule": "all",  # every contribution aggregated exactly, never range shards
}


@dataclass(frozen=True)
class SubspaceConfig:
    """Boundary compression of compressed pipelines: k = k_ratio · d columns of U."""

    k_ratio: str = field(default="1/8", metadata={"help": "Subspace width k/d of compressed boundaries."})
    wire_dtype: str = field(  # dtype of boundary activations and gradients on the wire
        default="bf16", metadata={"help": "Boundary dtype on the wire: fp32, bf16, fp16."}
    )
    # a head runs an outer step uncompressed when its measured links keep the stages busy at least
    # this fraction of the time with the full boundary (peer.node.pipeline.mode; paper §2.3)
    uncompressed_min_util: float = 0.95


@dataclass(frozen=True)
class SwarmConfig:
    """Deadlines and record lifetimes of the swarm (DESIGN §3); every network wait has one."""

    rpc_timeout_s: float = 30.0  # one gRPC call (forward, backward, step, payload, state)
    round_timeout_s: float = 120.0  # an outer round waits this long for expected payloads
    record_ttl_s: float = 30.0  # DHT records expire unless refreshed
    announce_interval_s: float = 2.0  # how often peers refresh their records
    claim_timeout_s: float = 120.0  # a head waits this long for a ready peer of each stage
    # a head replays an inner step at most this many times after failed stage peers, then pauses
    # its pipeline and starts the outer step over (a head's own choice: not in the fingerprint)
    inner_step_replays: int = 3
    n_shards: int = 16  # data shards; each head / full replica claims a free one
    min_replicas: int = 1  # replicas (pipelines + full replicas) to wait for before the first step
    checkpoint_every_rounds: int = 1  # save <data-dir>/checkpoints every N committed rounds (0 = never)
    keep_checkpoints: int = 2  # newest checkpoints kept on disk
    # A replica dropped as an outlier in `ban_after` consecutive rounds of a stage is not fetched
    # from for the next `ban_rounds` rounds of that stage (peer.node.round.bans; 0 = never ban)
    ban_after: int = 3
    ban_rounds: int = 10
    # round_rule "all" | "ranges" | "auto" (ranges from ranges_from); shard "exact" | "topk" | "voted" (protocol.md)
    round_rule: str = "auto"
    ranges_from: int = 14
    range_backups: int = 1  # owners per range beyond the primary, each computing the same shard
    owner_grace_s: float = 3.0  # a range's silent co-owner is waited for this long after the first hash
    # the roster (and an owner's values) close once roster_quorum are in and none came for this long (0: off)
    roster_quiet_s: float = 2.0
    roster_quorum: float = 0.9
    shard: str = "voted"
    shard_topk: int = 0  # entries per tile a "topk" shard keeps (0: sparseloco.topk); "voted": k′ (0: 2·topk)
    mean_bits: int = 8  # a "voted" round's mean shards: bits per value (0: float32; docs/protocol.md VOTED)
    # Joining by replay (docs/protocol.md): holders keep their committed links and payloads of the last
    # `history_rounds` rounds (`history_ttl_s`), so a joiner recomputes the state instead of counting
    history_rounds: int = 16
    # Peer ids whose stage records attest a state (docs/protocol.md, "Joining by replay"): a joiner
    # whose trusted state is older than the history window downloads a state one of them claims,
    # checked against its id, and replays on from there. Empty: nobody's (such a joiner waits).
    attesters: tuple[str, ...] = ()
    # Who may take part, set at the bootstrap: "open", "secret" (peers prove they know a shared
    # secret; the secret itself is never in the config) or "allowlist" (only these peer ids).
    admission: str = "open"
    allowlist: tuple[str, ...] = ()  # peer ids admitted when admission == "allowlist"


def history_ttl_s(swarm: SwarmConfig) -> float:
    """How long a round's signed records (payload announcements, committed links) live: past the
    round (4 deadlines, at least 2 minutes) and through the history window a joiner replays
    (`history_rounds` deadlines; a signature cannot be re-checked after its record expired)."""
    return max(120.0, 4 * swarm.round_timeout_s, swarm.history_rounds * swarm.round_timeout_s)


@dataclass(frozen=True)
class RunConfig:
    """Everything that must agree across all peers of one run."""

    run_name: str = field(default="peer-run", metadata={"help": "Human name of the run (part of the run id)."})
    seed: int = field(default=0, metadata={"help": "Run seed: init, U, data order."})
    preset: str = field(default="tiny", metadata={"help": "Model preset: tiny, small, 178M, 512M, 1B."})
    stages: int = field(default=2, metadata={"help": "S: pipeline stages of a compressed pipeline or replica."})
    model: ModelConfig = field(default_factory=lambda: get_preset("tiny"))
    subspace: SubspaceConfig = field(default_factory=SubspaceConfig)
    sparseloco: SparseLoCoConfig = field(default_factory=SparseLoCoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)

    @property
    def k(self) -> int:
        return k_from_ratio(self.model.d_model, self.subspace.k_ratio)

    @property
    def layer_ranges(self) -> list[range]:
        return stage_layers(self.model, self.stages)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["data"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in out["data"].items()}
        return out

    def fingerprint(self) -> str:
        """Hash of everything that must match across peers (cache paths excluded)."""
        d = self.to_dict()
        d["data"].pop("cache_dir", None)
        d["data"].pop("tokenizer", None)  # checked by the tokenizer's own sha256
        d["train"].pop("in_flight", None)  # a head's local schedule choice; the math does not depend on it
        if d["train"].get("overlap") == 0:  # the synchronous schedule: fingerprints from before the option
            d["train"].pop("overlap")
        d["swarm"].pop("inner_step_replays", None)  # a head's retry budget; the math does not depend on it
        if d["swarm"].get("shard") == "topk":  # re-sparsified shards: fingerprints from before the option
            d["swarm"].pop("shard")
        if d["subspace"].get("uncompressed_min_util") == 0.95:  # the default target: fingerprints from before it
            d["subspace"].pop("uncompressed_min_util")
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


_RUN_FIELDS: dict[str, Any] = get_type_hints(RunConfig)
# Sections are the dataclass-typed fields of RunConfig (model, subspace, ...); the rest are top-level values.
_SECTIONS: dict[str, type] = {
    f.name: _RUN_FIELDS[f.name] for f in fields(RunConfig) if dataclasses.is_dataclass(_RUN_FIELDS[f.name])
}
_TOP_LEVEL: dict[str, Any] = {f.name: _RUN_FIELDS[f.name] for f in fields(RunConfig) if f.name not in _SECTIONS}
_SECTION_FIELDS: dict[str, dict[str, Any]] = {name: get_type_hints(cls) for name, cls in _SECTIONS.items()}


def _base_type(annotation: Any) -> Any:
    """The type a value is converted to: int for `int | None`, tuple for `tuple[str, ...]`."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or get_origin(annotation) is Union:
        return _base_type(args[0]) if len(args) == 1 else annotation
    return get_origin(annotation) or annotation


def coerce_value(value: Any, annotation: Any, where: str) -> Any:
    """Convert strings from env/CLI to the field's type; check types of TOML values (by hand: see the
    module docstring for why not pydantic)."""
    kind = _base_type(annotation)
    if value is None:
        return None
    try:
        if kind is bool:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if kind is Path:
            return Path(value).expanduser()
        if kind is str:
            return str(value)
        if kind is tuple:  # of str: a TOML list, or "a,b" from env / CLI
            items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
                raise ValueError(value)
            return tuple(items)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: expected {getattr(kind, '__name__', kind)}, got {value!r}") from None
    return value


def _section_kwargs(values: Mapping[str, Any], section: str) -> dict[str, Any]:
    known = _SECTION_FIELDS[section]
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ConfigError(f"unknown key '{section}.{key}'; valid keys: {', '.join(sorted(known))}")
        out[name] = coerce_value(value, known[name], f"{section}.{name}")
    return out


def _merge(into: dict[str, Any], layer: Mapping[str, Any]) -> None:
    for key, value in layer.items():
        if isinstance(value, Mapping):
            into.setdefault(key, {})
            if not isinstance(into[key], dict):
                raise ConfigError(f"'{key}' is a section, not a value")
            into[key].update(value)
        else:
            into[key] = value


# PEER_* variables that set one peer's own options (its `peer join` flags), not the run's config
_NOT_RUN_ENV = (
    "PEER_CACHE_DIR",
    "PEER_LOG_LEVEL",
    "PEER_SWARM_SECRET",
    "PEER_PRECISION",
    "PEER_ACTIVATION_CHECKPOINTING",
)


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`PEER_SEED=1`, `PEER_TRAIN__INNER_STEPS=20` → nested dict."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for key, value in environ.items():
        if not key.startswith("PEER_") or key in _NOT_RUN_ENV:
            continue
        if key.startswith("PEER_LINK__"):  # this peer's own link (peer.node.link_config), not the run's
            continue
        parts = key[len("PEER_") :].lower().split("__")
        if len(parts) == 1:
            out[parts[0]] = value
        elif len(parts) == 2:
            out.setdefault(parts[0], {})[parts[1]] = value
        else:
            raise ConfigError(f"environment variable {key}: use PEER_SECTION__FIELD")
    return out


def dotted_to_nested(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """{"train.inner_steps": 5, "seed": 1} → {"train": {"inner_steps": 5}, "seed": 1}; None skipped."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if "." in key:
            section, name = key.split(".", 1)
            out.setdefault(section, {})[name] = value
        else:
            out[key] = value
    return out


def build_config(
    toml_path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Resolve defaults < TOML < env < CLI overrides (a nested dict or dotted keys) into a RunConfig.

    `defaults` (dotted keys) replace the dataclass defaults for one command, e.g. the simulator's
    shorter runs; they are still overridden by TOML, env and flags.

    Each layer's values are type-checked on their own, so a malformed `PEER_*` variable or TOML
    value is an error even where a later layer overrides it.
    """
    layers: list[tuple[str, dict[str, Any]]] = [("in the command's defaults", dotted_to_nested(defaults or {}))]
    if toml_path is not None:
        path = Path(toml_path)
        try:
            layers.append((f"in {path}", tomllib.loads(path.read_text())))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found; pass an existing TOML file with --config") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    layers.append(("from PEER_* environment variables", env_overrides(environ)))
    layers.append(("from command-line flags", dotted_to_nested(overrides or {})))
    merged: dict[str, Any] = {}
    for source, layer in layers:
        layer = _hoist_preset(layer)
        try:
            _check_types(layer)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({source})") from None
        _merge(merged, layer)
    return config_from_dict(merged)


def setting(cfg: RunConfig, key: str) -> Any:
    """The value of a dotted key of a config ("sparseloco.screening", "seed")."""
    value: Any = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def setting_changes(before: RunConfig, after: RunConfig, keys: Iterable[str]) -> list[str]:
    """One line `key: before -> after` (values as JSON writes them) per dotted key whose value differs
    between two configs, in `keys` order: what a set of settings such as `--paper-settings` changed."""
    show = functools.partial(json.dumps, default=str)
    changed = [k for k in keys if setting(before, k) != setting(after, k)]
    return [f"{k}: {show(setting(before, k))} -> {show(setting(after, k))}" for k in changed]


def paper_algorithm_config(
    toml_path: str | Path | None, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> tuple[RunConfig, list[str]]:
    """`build_config` with `PAPER_ALGORITHM` as the command's defaults (TOML, env and flags still
    override it), and one line per setting that changed (`setting_changes`): `peer bootstrap
    --paper-settings`."""
    plain = build_config(toml_path, overrides, environ)
    paper = build_config(toml_path, overrides, environ, defaults=PAPER_ALGORITHM)
    return paper, setting_changes(plain, paper, PAPER_ALGORITHM)


def _check_types(layer: Mapping[str, Any]) -> None:
    """Coerce every known value of one layer (results dropped); unknown keys are left to config_from_dict."""
    for key, value in layer.items():
        name = key.replace("-", "_")
        if name in _SECTIONS and isinstance(value, Mapping):
            known = _SECTION_FIELDS[name]
            _section_kwargs({k: v for k, v in value.items() if k.replace("-", "_") in known}, name)
        elif name in _TOP_LEVEL:
            coerce_value(value, _TOP_LEVEL[name], name)


def _hoist_preset(layer: dict[str, Any]) -> dict[str, Any]:
    """Read `model.preset` (an alias) as top-level `preset` within one layer, so precedence holds:
    a TOML `[model] preset` must not win over a later `PEER_PRESET` or `--preset`."""
    model = layer.get("model")
    if not isinstance(model, Mapping) or "preset" not in model:
        return layer
    model = dict(model)
    preset = model.pop("preset")
    if "preset" in layer and layer["preset"] != preset:
        raise ConfigError(f"preset={layer['preset']!r} and model.preset={preset!r} disagree; set preset only")
    return {**layer, "model": model, "preset": preset}


def config_from_dict(values: Mapping[str, Any]) -> RunConfig:
    """Strictly build a RunConfig from a nested mapping (also used to read a manifest)."""
    top: dict[str, Any] = {}
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in _SECTIONS:
            if not isinstance(value, Mapping):
                raise ConfigError(f"'{name}' must be a section (a table in TOML)")
            sections[name] = dict(value)
        elif name in _TOP_LEVEL:
            top[name] = coerce_value(value, _TOP_LEVEL[name], name)
        else:
            valid = sorted([*_TOP_LEVEL, *_SECTIONS])
            raise ConfigError(f"unknown key '{key}'; valid top-level keys: {', '.join(valid)}")

    model_values = dict(sections.pop("model", {}))
    preset = model_values.pop("preset", top.get("preset", "tiny"))
    top["preset"] = preset
    model = get_preset(preset, **_section_kwargs(model_values, "model"))
    built = {
        name: cls(**_section_kwargs(sections.get(name, {}), name)) for name, cls in _SECTIONS.items() if name != "model"
    }
    train: TrainConfig = built["train"]
    data: DataConfig = built["data"]
    # data.vocab_size, data.seq_len and data.seed are derived; an explicit value must agree.
    seed = top.get("seed", 0)
    for name, source, value in (
        ("vocab_size", "model.vocab_size", model.vocab_size),
        ("seq_len", "train.seq_len", train.seq_len),
        ("seed", "seed", seed),
    ):
        if name in sections.get("data", {}) and getattr(data, name) != value:
            raise ConfigError(f"data.{name}={getattr(data, name)} disagrees with {source}={value}; set {source} only")
    data = dataclasses.replace(data, vocab_size=model.vocab_size, seq_len=train.seq_len, seed=seed)
    cfg = RunConfig(model=model, data=data, **{k: v for k, v in built.items() if k not in ("data",)}, **top)
    validate(cfg)
    return cfg


def validate(cfg: RunConfig) -> None:
    """Cross-field checks; each error names the fields involved."""
    t = cfg.train
    if cfg.stages < 1:
        raise ConfigError(f"stages must be >= 1, got {cfg.stages}")
    if cfg.stages > cfg.model.n_layers:
        raise ConfigError(
            f"stages={cfg.stages} exceeds model.n_layers={cfg.model.n_layers}; use at most {cfg.model.n_layers} stages"
        )
    if cfg.subspace.wire_dtype not in WIRE_DTYPES:
        raise ConfigError(
            f"subspace.wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {cfg.subspace.wire_dtype!r}"
        )
    if not 0 < cfg.subspace.uncompressed_min_util <= 1:
        raise ConfigError(f"subspace.uncompressed_min_util must be in (0, 1], got {cfg.subspace.uncompressed_min_util}")
    try:
        _ = cfg.k  # k_from_ratio validates k_ratio against d_model
    except ConfigError as exc:
        raise ConfigError(f"subspace.k_ratio: {exc}") from None
    for name in ("inner_steps", "outer_steps", "batch_size", "microbatches", "seq_len"):
        if getattr(t, name) < 1:
            raise ConfigError(f"train.{name} must be >= 1, got {getattr(t, name)}")
    if t.overlap not in (0, 1):
        raise ConfigError(f"train.overlap must be 0 (synchronous) or 1 (one round in flight), got {t.overlap}")
    if t.in_flight < 0:
        raise ConfigError(f"train.in_flight must be >= 0 (0 = auto), got {t.in_flight}")
    if t.batch_size % t.microbatches:
        raise ConfigError(f"train.batch_size={t.batch_size} must be a multiple of train.microbatches={t.microbatches}")
    if t.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={cfg.model.max_seq_len}")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
    if t.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    w = cfg.swarm
    for name in ("rpc_timeout_s", "round_timeout_s", "record_ttl_s", "announce_interval_s", "claim_timeout_s"):
        if not getattr(w, name) > 0:
            raise ConfigError(f"swarm.{name} must be > 0 seconds, got {getattr(w, name)}")
    for name in ("n_shards", "min_replicas", "history_rounds"):
        if getattr(w, name) < 1:
            raise ConfigError(f"swarm.{name} must be >= 1, got {getattr(w, name)}")
    if w.inner_step_replays < 0:
        raise ConfigError(f"swarm.inner_step_replays must be >= 0, got {w.inner_step_replays}")
    if w.admission not in ("open", "secret", "allowlist"):
        raise ConfigError(f"swarm.admission must be open, secret or allowlist, got {w.admission!r}")
    if w.admission == "allowlist" and not w.allowlist:
        raise ConfigError("swarm.admission='allowlist' needs at least one peer id in swarm.allowlist (--allow-peer ID)")
    if w.allowlist and w.admission != "allowlist":
        raise ConfigError(f"swarm.allowlist is set but swarm.admission is {w.admission!r}; use admission 'allowlist'")
    for name, peer_id in [("attesters", p) for p in w.attesters] + [("allowlist", p) for p in w.allowlist]:
        if not re.fullmatch(r"[1-9A-HJ-NP-Za-km-z]{32,128}", peer_id):
            raise ConfigError(
                f"swarm.{name} entry {peer_id!r} is not a peer id; print one with "
                "`peer bootstrap --identity FILE --print-peer-id`"
            )
    if w.checkpoint_every_rounds < 0:
        raise ConfigError(f"swarm.checkpoint_every_rounds must be >= 0 (0 = never), got {w.checkpoint_every_rounds}")
    if w.keep_checkpoints < 1:
        raise ConfigError(f"swarm.keep_checkpoints must be >= 1, got {w.keep_checkpoints}")
    for name in ("ban_after", "ban_rounds"):
        if getattr(w, name) < 0:
            raise ConfigError(f"swarm.{name} must be >= 0 (0 = never ban), got {getattr(w, name)}")
    _validate_round_rule(w)


def _validate_round_rule(w: SwarmConfig) -> None:
    """The checks of how a stage's round aggregates (rule, ranges, owners, shards, waits)."""
    for name, ok, want in (
        ("round_rule", w.round_rule in ("all", "ranges", "auto"), "'all', 'ranges' or 'auto'"),
        ("ranges_from", w.ranges_from >= 2, ">= 2"),
        ("range_backups", w.range_backups >= 0, ">= 0"),
        ("shard_topk", w.shard_topk >= 0, ">= 0"),
        ("owner_grace_s", w.owner_grace_s >= 0, ">= 0 (0: off)"),
        ("roster_quiet_s", w.roster_quiet_s >= 0, ">= 0 (0: off)"),
        ("roster_quorum", 0 < w.roster_quorum <= 1, "in (0, 1]"),
        ("mean_bits", w.mean_bits in QUANT_BITS, "0 (float32), 2, 4 or 8"),
        ("shard", w.shard in ("exact", "topk", "voted"), "'exact', 'topk' or 'voted'"),
    ):
        if not ok:
            raise ConfigError(f"swarm.{name} must be {want}, got {getattr(w, name)!r}")
    if w.shard == "exact" and w.shard_topk:
        raise ConfigError(
            f"swarm.shard_topk = {w.shard_topk} applies to swarm.shard = 'topk' or 'voted' only; "
            "set it to 0 or shard = 'topk' or 'voted'"
        )
