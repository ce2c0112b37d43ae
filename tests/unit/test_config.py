"""Unit tests for peer.config: defaults, precedence (defaults < TOML < PEER_* env < CLI), strictness,
cross-field checks, the fingerprint, and the to_dict / config_from_dict round trip."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from peer.config import RunConfig, build_config, config_from_dict, env_overrides
from peer.core.model.decoder import PRESETS
from peer.errors import ConfigError, PeerError


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def _error(**kwargs) -> str:
    """Build a config that must fail; the ConfigError's message."""
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError) as info:
        build_config(**kwargs)
    assert isinstance(info.value, PeerError)
    message = str(info.value)
    assert "\n" not in message
    return message


# ------------------------------------------------------------------------------------ defaults


def test_defaults_build():
    cfg = build_config(environ={})
    assert isinstance(cfg, RunConfig)
    assert cfg.preset == "tiny" and cfg.model == PRESETS["tiny"]
    assert cfg.stages == 2 and cfg.seed == 0
    assert cfg.train.inner_steps == 20 and cfg.train.batch_size % cfg.train.microbatches == 0
    # derived data fields follow the model and the trainer
    assert cfg.data.vocab_size == cfg.model.vocab_size
    assert cfg.data.seq_len == cfg.train.seq_len
    assert cfg.k == cfg.model.d_model // 8
    assert [len(r) for r in cfg.layer_ranges] == [2, 2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1  # type: ignore[misc]  # assigning to a frozen dataclass is the error under test


def test_environ_is_read_from_argument_not_process(monkeypatch):
    monkeypatch.setenv("PEER_SEED", "5")
    assert build_config(environ={}).seed == 0
    assert build_config(environ={"PEER_SEED": "6"}).seed == 6


# ---------------------------------------------------------------------------------- precedence


def test_precedence_defaults_toml_env_cli(tmp_path):
    toml = _toml(
        tmp_path,
        """
seed = 3
[train]
inner_steps = 5
outer_steps = 7
lr = 0.01
[sparseloco]
topk = 16
""",
    )
    only_toml = build_config(toml, environ={})
    assert (only_toml.seed, only_toml.train.inner_steps, only_toml.train.outer_steps) == (3, 5, 7)
    assert only_toml.train.lr == 0.01 and only_toml.sparseloco.topk == 16
    assert only_toml.train.batch_size == 8  # untouched default

    env = {"PEER_TRAIN__INNER_STEPS": "9", "PEER_SEED": "4", "PEER_SPARSELOCO__TOPK": "8"}
    with_env = build_config(toml, environ=env)
    assert (with_env.seed, with_env.train.inner_steps, with_env.sparseloco.topk) == (4, 9, 8)
    assert with_env.train.outer_steps == 7  # TOML value not overridden by env stays

    with_cli = build_config(toml, {"train.inner_steps": 11, "seed": None}, environ=env)
    assert with_cli.train.inner_steps == 11
    assert with_cli.seed == 4  # a None override (flag not given) leaves the env value
    assert with_cli.sparseloco.topk == 8 and with_cli.train.outer_steps == 7 and with_cli.train.lr == 0.01


def test_nested_overrides_equal_dotted(tmp_path):
    dotted = build_config(None, {"train.inner_steps": 3, "subspace.k_ratio": "1/4"}, environ={})
    nested = build_config(None, {"train": {"inner_steps": 3}, "subspace": {"k_ratio": "1/4"}}, environ={})
    assert dotted == nested
    assert dotted.k == 16


def test_env_strings_coerced_to_field_types():
    cfg = build_config(
        environ={
            "PEER_TRAIN__LR": "0.02",
            "PEER_SPARSELOCO__DENSE_1D": "false",
            "PEER_SWARM__RPC_TIMEOUT_S": "5",
            "PEER_RUN_NAME": "exp1",
        }
    )
    assert cfg.train.lr == 0.02 and cfg.sparseloco.dense_1d is False
    assert cfg.swarm.rpc_timeout_s == 5.0 and cfg.run_name == "exp1"


def test_env_ignores_non_config_variables():
    env = {"PEER_CACHE_DIR": "/tmp/x", "PEER_LOG_LEVEL": "DEBUG", "HOME": "/root", "PEERLESS": "1"}
    assert env_overrides(env) == {}
    assert build_config(environ=env) == build_config(environ={})


def test_env_with_three_parts_is_an_error():
    assert "PEER_TRAIN__X__Y" in _error(environ={"PEER_TRAIN__X__Y": "1"})


def test_preset_flag_wins_over_toml_model_preset(tmp_path):
    toml = _toml(tmp_path, '[model]\npreset = "small"\n')
    assert build_config(toml, environ={}).preset == "small"
    assert build_config(toml, environ={}).model == PRESETS["small"]
    assert build_config(toml, environ={"PEER_PRESET": "tiny"}).model == PRESETS["tiny"]
    assert build_config(toml, {"preset": "tiny"}, environ={}).model == PRESETS["tiny"]


def test_model_override_applies_to_preset(tmp_path):
    toml = _toml(tmp_path, 'preset = "small"\n[model]\nn_layers = 4\n')
    cfg = build_config(toml, environ={})
    assert cfg.model == dataclasses.replace(PRESETS["small"], n_layers=4)


def test_missing_and_invalid_toml(tmp_path):
    assert "--config" in _error(toml_path=tmp_path / "absent.toml")
    bad = _toml(tmp_path, "[train\ninner_steps = 1\n")
    assert "not valid TOML" in _error(toml_path=bad)


# ------------------------------------------------------------------------------- strictness


def test_unknown_top_level_key(tmp_path):
    message = _error(toml_path=_toml(tmp_path, "bogus = 1\n"))
    assert "'bogus'" in message and "stages" in message  # names the key and lists valid ones


def test_unknown_section(tmp_path):
    assert "'nosuch'" in _error(toml_path=_toml(tmp_path, "[nosuch]\nx = 1\n"))


def test_unknown_section_key(tmp_path):
    message = _error(toml_path=_toml(tmp_path, "[train]\ninner_step = 5\n"))
    assert "train.inner_step" in message and "inner_steps" in message


def test_unknown_key_from_env_and_cli():
    assert "train.bogus" in _error(environ={"PEER_TRAIN__BOGUS": "1"})
    assert "model.width" in _error(overrides={"model.width": 3})


def test_section_given_as_value(tmp_path):
    assert "'train'" in _error(toml_path=_toml(tmp_path, "train = 5\n"))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"train.inner_steps": "abc"}, "train.inner_steps"),
        ({"train.inner_steps": 2.5}, "train.inner_steps"),
        ({"train.inner_steps": True}, "train.inner_steps"),
        ({"train.lr": "fast"}, "train.lr"),
        ({"train.lr": True}, "train.lr"),
        ({"seed": "one"}, "seed"),
        ({"stages": "two"}, "stages"),
        ({"model.d_model": "wide"}, "model.d_model"),
        ({"sparseloco.dense_1d": "maybe"}, "sparseloco.dense_1d"),
        ({"swarm.rpc_timeout_s": "soon"}, "swarm.rpc_timeout_s"),
    ],
)
def test_wrong_type_names_field(overrides, field):
    assert field in _error(overrides=overrides)


def test_wrong_type_in_toml_and_env(tmp_path):
    toml = _toml(tmp_path, '[train]\ninner_steps = "abc"\n')
    message = _error(toml_path=toml)
    assert "train.inner_steps" in message and str(toml) in message
    message = _error(environ={"PEER_TRAIN__INNER_STEPS": "abc"})
    assert "train.inner_steps" in message and "PEER_" in message


def test_wrong_type_is_an_error_even_when_a_later_layer_overrides_it(tmp_path):
    # a CLI that always passes its flag defaults must not hide a malformed PEER_* variable
    message = _error(overrides={"train.inner_steps": 10}, environ={"PEER_TRAIN__INNER_STEPS": "abc"})
    assert "train.inner_steps" in message and "PEER_" in message
    toml = _toml(tmp_path, '[train]\nlr = "fast"\n')
    assert "train.lr" in _error(toml_path=toml, environ={"PEER_TRAIN__LR": "0.1"})


# -------------------------------------------------------------------------- cross-field checks


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        ({"train.batch_size": 5, "train.microbatches": 2}, ("train.batch_size", "train.microbatches")),
        ({"train.seq_len": 129}, ("train.seq_len", "model.max_seq_len")),
        ({"stages": 5}, ("stages", "model.n_layers")),
        ({"stages": 0}, ("stages",)),
        ({"subspace.wire_dtype": "int8"}, ("subspace.wire_dtype",)),
        ({"subspace.k_ratio": "0"}, ("subspace.k_ratio",)),
        ({"subspace.k_ratio": "3/2"}, ("subspace.k_ratio",)),
        ({"subspace.k_ratio": "one-eighth"}, ("subspace.k_ratio",)),
        ({"sparseloco.aggregation": "median"}, ("sparseloco.aggregation",)),
        ({"sparseloco.quant_bits": 3}, ("sparseloco.quant_bits",)),
        ({"sparseloco.topk": 0}, ("sparseloco.topk",)),
        ({"sparseloco.beta": 1.0}, ("sparseloco.beta",)),
        ({"train.inner_steps": 0}, ("train.inner_steps",)),
        ({"train.lr": 0.0}, ("train.lr",)),
        ({"train.min_lr_ratio": 1.5}, ("train.min_lr_ratio",)),
        ({"swarm.round_timeout_s": 0}, ("swarm.round_timeout_s",)),
        ({"swarm.n_shards": 0}, ("swarm.n_shards",)),
        ({"swarm.inner_step_replays": -1}, ("swarm.inner_step_replays",)),
        ({"model.head_dim": 15}, ("head_dim",)),
        ({"preset": "huge"}, ("huge", "tiny")),
    ],
)
def test_bad_combination_names_field(overrides, fields):
    message = _error(overrides=overrides)
    for field in fields:
        assert field in message, message


def test_stages_equal_to_layers_is_fine():
    cfg = build_config(None, {"stages": 4}, environ={})
    assert [list(r) for r in cfg.layer_ranges] == [[0], [1], [2], [3]]


def test_seq_len_may_reach_max_seq_len():
    assert build_config(None, {"train.seq_len": 128}, environ={}).data.seq_len == 128


@pytest.mark.parametrize("preset", ["178M", "512M", "1B"])
def test_paper_presets_take_the_papers_context(preset):
    """Table 9 trains with a context of 2048 tokens; `--preset 178M --seq-len 2048` is accepted."""
    cfg = build_config(None, {"preset": preset, "train.seq_len": 2048}, environ={})
    assert (cfg.model.max_seq_len, cfg.train.seq_len, cfg.data.seq_len) == (2048, 2048, 2048)
    assert "model.max_seq_len" in _error(overrides={"preset": preset, "train.seq_len": 2049})


def test_data_vocab_size_must_agree_with_model(tmp_path):
    message = _error(toml_path=_toml(tmp_path, "[data]\nvocab_size = 999\n"))
    assert "data.vocab_size" in message and "model.vocab_size" in message
    # agreeing values are accepted, and model.vocab_size drives the tokenizer's size
    same = build_config(_toml(tmp_path, "[model]\nvocab_size = 512\n[data]\nvocab_size = 512\n"), environ={})
    assert same.model.vocab_size == same.data.vocab_size == 512
    only_model = build_config(None, {"model.vocab_size": 2048}, environ={})
    assert only_model.data.vocab_size == 2048


def test_data_seq_len_and_seed_are_derived_not_silently_dropped():
    assert "train.seq_len" in _error(overrides={"data.seq_len": 32})
    assert "data.seed" in _error(overrides={"data.seed": 7})
    cfg = build_config(None, {"seed": 7, "train.seq_len": 32}, environ={})
    assert (cfg.data.seed, cfg.data.seq_len) == (7, 32)


# --------------------------------------------------------------------------------- fingerprint


def test_fingerprint_stable_and_sensitive(tmp_path):
    base = build_config(environ={})
    assert base.fingerprint() == build_config(environ={}).fingerprint()
    assert len(base.fingerprint()) == 16
    for overrides in (
        {"train.inner_steps": 21},
        {"subspace.k_ratio": "1/4"},
        {"seed": 1},
        {"sparseloco.topk": 16},
        {"model.n_layers": 6},
        {"data.max_chars": 1000},
        {"swarm.shard": "exact"},
        {"swarm.shard_topk": 8},
        {"swarm.mean_bits": 4},
        {"swarm.owner_grace_s": 9.0},
    ):
        assert build_config(None, overrides, environ={}).fingerprint() != base.fingerprint(), overrides
    # local paths do not change what peers must agree on
    elsewhere = build_config(None, {"data.cache_dir": str(tmp_path / "cache")}, environ={})
    assert elsewhere.data.cache_dir == tmp_path / "cache"
    assert elsewhere != base
    assert elsewhere.fingerprint() == base.fingerprint()
    # nor do a head's own schedule and retry budget
    for local in ({"train.in_flight": 3}, {"swarm.inner_step_replays": 7}):
        assert build_config(None, local, environ={}).fingerprint() == base.fingerprint(), local


@pytest.mark.parametrize(
    "bad",
    [
        {"swarm.mean_bits": 3},
        {"swarm.mean_bits": 16},
        {"swarm.owner_grace_s": -1.0},
        {"swarm.roster_quiet_s": -0.5},
        {"swarm.roster_quorum": 0.0},
        {"swarm.roster_quorum": 1.5},
    ],
)
def test_the_voted_rounds_settings_are_checked(bad):
    (name,) = bad
    assert name in _error(overrides=bad)
    assert build_config(None, {"swarm.mean_bits": 0}, environ={}).swarm.mean_bits == 0  # float32 means


def test_the_shard_rule_is_checked():
    """swarm.shard is "exact", "topk" or "voted"; shard_topk belongs to "topk" shards and to "voted" (k′)."""
    assert build_config(None, {"swarm.shard": "exact"}, environ={}).swarm.shard == "exact"
    voted = build_config(None, {"swarm.shard": "voted", "swarm.shard_topk": 48}, environ={}).swarm
    assert (voted.shard, voted.shard_topk) == ("voted", 48)
    for bad, field in (
        ({"swarm.shard": "dense"}, "swarm.shard"),
        ({"swarm.shard": "exact", "swarm.shard_topk": 8}, "shard_topk"),
    ):
        with pytest.raises(ConfigError, match=field):
            build_config(None, bad, environ={})


# ------------------------------------------------------------------------------------ round trip


def test_to_dict_round_trip(tmp_path):
    toml = _toml(
        tmp_path,
        f"""
run_name = "rt"
seed = 2
preset = "small"
stages = 3
[model]
n_layers = 6
[subspace]
k_ratio = "1/4"
wire_dtype = "bf16"
[sparseloco]
aggregation = "mean-over-contributors"
quant_bits = 4
[data]
tokenizer = "{tmp_path / "sp.model"}"
max_chars = 12345
[train]
batch_size = 6
microbatches = 3
seq_len = 96
[swarm]
n_shards = 4
""",
    )
    cfg = build_config(toml, environ={"PEER_DATA__CACHE_DIR": str(tmp_path / "c")})
    back = config_from_dict(cfg.to_dict())
    assert back == cfg
    assert back.fingerprint() == cfg.fingerprint()
    assert back.data.tokenizer == tmp_path / "sp.model" and back.data.cache_dir == tmp_path / "c"
    assert isinstance(back.data.tokenizer, Path)
    assert config_from_dict(build_config(environ={}).to_dict()) == build_config(environ={})


def test_config_from_dict_is_strict():
    d = build_config(environ={}).to_dict()
    d["train"]["bogus"] = 1
    with pytest.raises(ConfigError, match="train.bogus"):
        config_from_dict(d)
