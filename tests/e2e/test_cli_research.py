"""The research commands as real processes: `peer simulate`, `peer export`, `peer plan`, `peer bench payload`,
and the CLI's error contract (exit code 2, `error: …` on stderr, no traceback).

`peer simulate` runs once per module (tiny model, M=2, S=2, H=3, T=2 on a 200k-character corpus); the
export test loads what it saved. Every command gets its own PEER_CACHE_DIR and runs offline.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from peer.cli.main import main
from peer.core.model.decoder import build_model, get_preset, stage_shapes
from peer.core.sparseloco.codec.format import SparseLoCoConfig, payload_nbytes
from peer.node.checkpoints.model import load_model_checkpoint

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

PEER = [sys.executable, "-m", "peer"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CONFIGS = ["adamw", "sparseloco", "pp-compress", "het-pp-compress"]
SUMMARY_KEYS = {
    "name",
    "overlap",
    "val_perplexity",
    "bias",
    "k_ratio",
    "het_fraction",
    "final_loss",
    "final_val_loss",
    "delta_pct",
    "pg_bytes",
    "act_bytes",
    "wall_s",
    "k",
    "seed",
    "val_loss_replica_mean",
    "val_loss_compressed_path",
    "val_loss_uncompressed_path",
    "val_loss_stderr",
    "val_tokens",
    "clipped",
    "attack",  # the poisoning fields (docs/poisoning.md): the attack run, whether screening was on,
    "screening",  # the rounds committed and the contributions screening dropped
    "rounds",
    "dropped",
    "round_rule",  # "all", "ranges" or "exact" (issues 24, 37; a ranges run adds dropped_mass_mean and _max)
    "modes",  # per outer step, each replica's mode: F full, U uncompressed pipeline, C compressed (issue 39)
}
ARGS_KEYS = {
    "preset",
    "overlap",
    "grassmann",
    "grassmann_lr",
    "modified_adamw",
    "replicas",
    "stages",
    "k_ratio",
    "het_fraction",
    "inner_steps",
    "outer_steps",
    "batch_size",
    "seq_len",
    "seed",
    "configs",
    "seeds",
    "lr",
    "adamw_lr",
    "quant_bits",
    "clip_median",
    "val_tokens",
    "te_adaptation",
    "weight_projection",
    "paper_settings",
    "round_rule",
    "settings",  # what --paper-settings / --setting set: key, value, source (issue 25)
    "token_budget",
    "extend",
    "links",  # het-bw-pp-compress's links per phase and FLOP/s (issue 39); null without --links
}
SIM_ARGS = [
    "--preset",
    "tiny",
    "--replicas",
    "2",
    "--stages",
    "2",
    "--inner-steps",
    "3",
    "--outer-steps",
    "2",
    "--batch-size",
    "4",
    "--seq-len",
    "32",
]
RUN_TIMEOUT_S = 280


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("peer-cache")


def _env(cache_dir: Path, **extra: str) -> dict[str, str]:
    """The caller's environment without PEER_* settings or a terminal width, plus the test's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PEER_") and k not in ("COLUMNS", "LINES")}
    env.update(
        PEER_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PEER_DATA__MAX_CHARS="200000"
    )
    env.update(extra)
    return env


def _peer(args: list[str], cache_dir: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PEER, *args], cwd=cwd, env=_env(cache_dir, **env), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    )
    return proc


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


@pytest.fixture(scope="module")
def simulated(tmp_path_factory, cache_dir) -> dict:
    work = tmp_path_factory.mktemp("simulate")
    out, save = work / "out" / "sim.json", work / "ckpt"
    _ok(_peer(["simulate", *SIM_ARGS, "--json", str(out), "--save", str(save)], cache_dir, work))
    return {"json": json.loads(out.read_text()), "png": out.with_suffix(".png"), "save": save, "work": work}


# ------------------------------------------------------------------------------------------ simulate


def test_simulate_json_has_documented_keys(simulated):
    result = simulated["json"]
    assert set(result) == {"configs", "summary", "args", "bias"}
    assert [c["name"] for c in result["configs"]] == CONFIGS
    for c in result["configs"]:
        assert set(c) == SUMMARY_KEYS, c.keys()
        assert math.isfinite(c["final_loss"]) and math.isfinite(c["final_val_loss"])
        assert 0 < c["final_val_loss"] < math.log(1024) + 1  # near or below uniform over the vocabulary
        assert c["final_val_loss"] == c["val_loss_replica_mean"]  # the paper's metric
        assert 0 < c["val_tokens"] <= 16384 and 0 < c["val_loss_stderr"] < 0.1  # a 200k-character corpus
        assert isinstance(c["pg_bytes"], int) and isinstance(c["act_bytes"], int)
    assert set(result["args"]) == ARGS_KEYS
    assert result["args"] == {
        "preset": "tiny",
        "replicas": 2,
        "stages": 2,
        "k_ratio": ["1/8"],
        "het_fraction": 0.5,
        "inner_steps": 3,
        "outer_steps": 2,
        "batch_size": 4,
        "seq_len": 32,
        "seed": 0,
        "configs": CONFIGS,
        "seeds": [0],
        "lr": 3e-3,
        "adamw_lr": None,
        "quant_bits": 2,
        "clip_median": 0.0,
        "val_tokens": 16384,
        "te_adaptation": True,
        "weight_projection": False,
        "grassmann": False,
        "grassmann_lr": 0.5,
        "modified_adamw": False,
        "paper_settings": False,
        "round_rule": "all",
        "settings": [],
        "token_budget": None,
        "extend": None,
        "overlap": 0,
        "links": None,
    }
    (row,) = result["summary"]
    assert row["k_ratio"] == "1/8" and row["k"] == 8 and row["pairs"][0]["a"] == "het-pp-compress"
    by = {c["name"]: c for c in result["configs"]}
    assert by["sparseloco"]["bias"] == [] and len(by["het-pp-compress"]["bias"]) == 2  # eq. 5, per outer step
    assert result["bias"][0]["k_ratio"] == "1/8" and "het-pp-compress" in result["bias"][0]["configs"]
    assert by["pp-compress"]["val_perplexity"] == math.exp(by["pp-compress"]["final_val_loss"])
    assert by["het-pp-compress"]["modes"] == ["FC", "FC"] and by["sparseloco"]["modes"] == ["FF", "FF"]


def test_simulate_configs_and_bytes(simulated):
    by = {c["name"]: c for c in simulated["json"]["configs"]}
    assert by["adamw"]["k_ratio"] is None and by["sparseloco"]["k_ratio"] is None
    assert by["pp-compress"]["k_ratio"] == by["het-pp-compress"]["k_ratio"] == "1/8"
    assert by["pp-compress"]["k"] == 8 and by["sparseloco"]["k"] is None  # the k actually run
    assert by["het-pp-compress"]["val_loss_compressed_path"] is not None
    assert by["het-pp-compress"]["val_loss_uncompressed_path"] is not None
    assert by["het-pp-compress"]["het_fraction"] == 0.5 and by["pp-compress"]["het_fraction"] is None
    assert by["sparseloco"]["delta_pct"] == 0.0
    # dense fp32 gradients every step vs a 2-bit top-k payload every H steps
    assert by["adamw"]["pg_bytes"] > 100 * by["sparseloco"]["pg_bytes"] > 0
    # the same payload shapes in every SparseLoCo config
    assert by["sparseloco"]["pg_bytes"] == by["pp-compress"]["pg_bytes"] == by["het-pp-compress"]["pg_bytes"]
    # k = d/8 boundaries: compressed replicas send far fewer activation bytes, the mixed swarm in between
    assert 0 < by["pp-compress"]["act_bytes"] < by["het-pp-compress"]["act_bytes"] < by["sparseloco"]["act_bytes"]
    assert by["pp-compress"]["act_bytes"] < by["sparseloco"]["act_bytes"] / 4


def test_simulate_writes_png_and_checkpoints(simulated):
    assert _is_png(simulated["png"])
    for name in CONFIGS:
        folder = simulated["save"] / name
        assert {"meta.json", "model.safetensors", "tokenizer.model"} <= {p.name for p in folder.iterdir()}
        assert json.loads((folder / "meta.json").read_text())["simulate"]["name"] == name


# -------------------------------------------------------------------------------------------- export


def test_export_loads_in_transformers_with_same_logits(simulated, cache_dir):
    transformers = pytest.importorskip("transformers")
    ckpt, hf_dir = simulated["save"] / "het-pp-compress", simulated["work"] / "hf"
    _ok(_peer(["export", str(ckpt), "--out", str(hf_dir)], cache_dir, simulated["work"]))
    assert {"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} <= {
        p.name for p in hf_dir.iterdir()
    }

    state, cfg, _meta = load_model_checkpoint(ckpt)
    assert cfg == get_preset("tiny")
    ours = build_model(cfg, seed=123)  # different init: every value must come from the checkpoint
    ours.load_state_dict(state)
    ours.eval()
    hf = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))  # (b, L)
    with torch.no_grad():
        want = ours(ids)  # (b, L, V)
        got = hf(input_ids=ids).logits
    assert got.shape == want.shape == (2, 32, cfg.vocab_size)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max().item()
    # the trained model is not the initial one (the export carries the training)
    fresh = build_model(cfg, seed=0).eval()
    with torch.no_grad():
        assert not torch.allclose(fresh(ids), want, atol=1e-4)


def test_export_of_the_save_folder_lists_its_configurations(simulated, cache_dir, tmp_path):
    proc = _peer(["export", str(simulated["save"]), "--out", str(tmp_path / "hf")], cache_dir, tmp_path)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    assert "holds 4 configurations" in err and all(name in err for name in CONFIGS), err
    assert "meta.json" not in err, err
    assert not (tmp_path / "hf").exists()


def test_simulate_without_output_flags_writes_under_runs(cache_dir, tmp_path):
    _ok(_peer(["simulate", *SIM_ARGS, "--configs", "adamw"], cache_dir, tmp_path))
    assert _is_png(tmp_path / "runs" / "simulate.png")
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]  # nothing else in the current directory


# ---------------------------------------------------------------------------------------------- plan


def test_plan_70b_writes_rows_and_png(tmp_path, cache_dir):
    out, png = tmp_path / "plan.json", tmp_path / "plots" / "plan.png"
    proc = _ok(
        _peer(
            ["plan", "--preset", "70B", "--stages", "4", "--inner-steps", "50", "--json", str(out), "--png", str(png)],
            cache_dir,
            tmp_path,
        )
    )
    assert "70B" in proc.stdout
    result = json.loads(out.read_text())
    assert result["inputs"]["preset"] == "70B" and result["inputs"]["stages"] == 4
    rows = result["rows"]
    assert [r["bandwidth_mbps"] for r in rows] == [10, 30, 100, 300, 1000]
    for r in rows:
        assert r["model"] == "70B" and r["k"] == 1024
        assert 0 < r["util_uncompressed"] <= 1 and 0 < r["util_compressed"] <= 1
    # on home links the compressed pipeline wins; on fast links its round (stage 0's payloads fetched by
    # every later stage) can cost more than the uncompressed pipeline's boundary traffic saves
    slow = [r for r in rows if r["bandwidth_mbps"] <= 100]
    assert all(r["util_compressed"] > r["util_uncompressed"] for r in slow)
    assert _is_png(png)


# --------------------------------------------------------------------------------------------- bench


def test_bench_payload_bytes_per_param(tmp_path, cache_dir):
    out = tmp_path / "bench.json"
    _ok(_peer(["bench", "payload", "--params", "2e6", "--json", str(out)], cache_dir, tmp_path))
    result = json.loads(out.read_text())
    assert result["ratio_vs_fp32"] > 250
    assert result["roundtrip_exact"] is True
    assert 0.5 < result["n_params"] / 2e6 < 2
    # the measured bytes are exactly the wire format's size for these shapes
    model = get_preset("small", **{k: v for k, v in result["model"].items()})
    shapes = stage_shapes(model, 0, 1)
    assert result["n_params"] == sum(math.prod(s) for s in shapes.values())
    assert result["payload_bytes"] == payload_nbytes(shapes, SparseLoCoConfig())
    # At ~2.9M parameters the fixed costs (1-D norms sent dense at ~1.2 B/param, 688-wide ragged tiles,
    # per-tensor headers) put the payload at 0.01418 B/param, just above the 0.014 budget.
    assert result["bytes_per_param"] <= 0.0142
    # The DESIGN budget (<= 0.014 B/param) holds for the paper's model shapes, from the 178M preset up.
    for name in ("178M", "512M", "1B"):
        cfg = get_preset(name)
        assert payload_nbytes(stage_shapes(cfg, 0, 1), SparseLoCoConfig()) / cfg.n_params <= 0.014


# ------------------------------------------------------------------------------------- error contract


BAD_INPUTS = [
    pytest.param(["simulate", *SIM_ARGS, "--configs", "nonsense"], {}, "nonsense", id="unknown-config"),
    pytest.param(["simulate", *SIM_ARGS, "--k-ratio", "0"], {}, "k_ratio", id="k-ratio-zero"),
    pytest.param(["simulate", *SIM_ARGS, "--k-ratio", "1/256"], {}, "smallest valid ratio", id="k-ratio-below-one"),
    pytest.param(["simulate", *SIM_ARGS, "--k-ratio", "1/8,1/64,1/100"], {}, "both give k = 1", id="k-ratio-same-k"),
    pytest.param(["simulate", *SIM_ARGS, "--seeds", "0,x"], {}, "--seeds", id="bad-seeds"),
    pytest.param(["simulate", *SIM_ARGS, "--links", "full,fast"], {}, "--links", id="bad-links"),
    pytest.param(["simulate", *SIM_ARGS, "--configs", "het-bw-pp-compress"], {}, "--links", id="het-bw-no-links"),
    pytest.param(
        ["simulate", *SIM_ARGS, "--configs", "het-bw-pp-compress", "--links", "full,10,10"],
        {},
        "the run has 2",
        id="links-for-other-m",
    ),
    pytest.param(["export", "/nonexistent", "--out", "X"], {}, "/nonexistent", id="missing-checkpoint"),
    pytest.param(["simulate"], {"PEER_TRAIN__INNER_STEPS": "abc"}, "train.inner_steps", id="env-wrong-type"),
    pytest.param(["simulate", *SIM_ARGS, "--stages", "9"], {}, "stages", id="too-many-stages"),
    pytest.param(["plan", "--stages", "0", "--png", "p.png"], {}, "--stages", id="plan-zero-stages"),
    pytest.param(
        ["plan", "--bandwidth-mbps", "abc", "--png", "p.png"], {}, "--bandwidth-mbps", id="plan-bad-bandwidth"
    ),
    pytest.param(["bench", "payload", "--params", "0"], {}, "--params", id="bench-zero-params"),
]


def _check_clean_error(code: object, out: str, err: str, needle: str, where: Path) -> None:
    assert code == 2, f"exit {code}\nstderr:\n{err[-3000:]}"
    assert "Traceback" not in err and "Traceback" not in out
    err = err.strip()
    assert err.startswith("error: "), err
    assert len(err.splitlines()) == 1, err  # one line even past 80 columns on a non-terminal stderr
    assert needle in err, err
    assert not (where / "X").exists() and not (where / "p.png").exists()


def test_bad_input_is_a_clean_error_from_a_process(tmp_path, cache_dir):
    """The contract end to end once, as a user meets it: `python -m peer`, exit status 2, one line."""
    proc = _peer(["simulate"], cache_dir, tmp_path, PEER_TRAIN__INNER_STEPS="abc")
    _check_clean_error(proc.returncode, proc.stdout, proc.stderr, "train.inner_steps", tmp_path)


@pytest.mark.parametrize(("args", "env", "needle"), BAD_INPUTS)
def test_bad_input_is_a_clean_error(args, env, needle, tmp_path, cache_dir, monkeypatch, capsys):
    """Every case through `peer.cli.main` in this process (the code a process runs, without paying
    a torch import per case: the process path is checked above)."""
    for key in [k for k in os.environ if k.startswith("PEER_") or k in ("COLUMNS", "LINES")]:
        monkeypatch.delenv(key)
    for key, value in _env(cache_dir, **env).items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["peer", *args])
    with pytest.raises(SystemExit) as exit_:
        main()
    captured = capsys.readouterr()
    _check_clean_error(exit_.value.code, captured.out, captured.err, needle, tmp_path)


def test_python_m_peer_version(tmp_path, cache_dir):
    from importlib import metadata

    proc = _ok(_peer(["--version"], cache_dir, tmp_path))
    assert proc.stdout.strip() == f"peer {metadata.version('peer')}"


def test_python_m_peer_help(tmp_path, cache_dir):
    proc = _ok(_peer(["--help"], cache_dir, tmp_path))
    for command in ("simulate", "plan", "bench", "export", "bootstrap", "join"):
        assert command in proc.stdout
    bench = _ok(_peer(["bench", "--help"], cache_dir, tmp_path))
    assert "payload" in bench.stdout
