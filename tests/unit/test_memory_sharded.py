"""Per-rank memory of a sharded full replica (`peer.core.memory.sharded`, planned by issue 40), the
fewest sharded ranks per GPU (`peer plan --memory`) and the join's check of a replica over N ranks.

- at one rank the sharded state (weights, gradients, AdamW, the bf16 copy, θ_start, the error
  buffer, buffers) is the unsharded replica's to the byte;
- at N ranks a rank holds (unsharded − unshardable)/N + unshardable, above it by at most FSDP2's
  dim-0 padding (less than one row per parameter and byte of state), and never more at more ranks;
- the fewest ranks per GPU is the fewest (the one below does not fit), and never more on a larger GPU;
- a 7B replica does not fit one 80 GiB GPU (DDP: every rank the whole replica) but fits 80 GiB at
  some N <= 8 sharded;
- `check_fit` of a sharded replica fits at enough ranks and names the fewest ranks that fit; DDP's
  check does not change with the rank count.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from peer.cli.main import app
from peer.config import build_config
from peer.core.memory import estimate_replica, estimate_sharded_replica
from peer.core.memory.activations import F32, compute_bytes
from peer.core.memory.sharded import replica_shards, unsharded_terms
from peer.core.model.decoder import stage_shapes
from peer.errors import ConfigError
from peer.node.fit import Ask, check_fit, estimate
from peer.research.plan.command import PLAN_PRESETS
from peer.research.plan.ranks import DEVICES_GIB, FIT_MODES, fewest_ranks, fit_rows, rank_rows, replica_rank

STATE = ("weights", "gradients", "optimizer", "casts", "start", "errors", "buffers", "prev")
SHAPE = dict(microbatch_size=1, seq_len=256)


def _both(name: str, S: int, N: int, precision: str = "bf16", checkpointing: bool = False):
    cfg = PLAN_PRESETS[name]
    kw = dict(SHAPE, precision=precision, checkpointing=checkpointing, device_kind="cuda")
    return cfg, estimate_replica(cfg, S, **kw), estimate_sharded_replica(cfg, S, ranks=N, **kw)


@pytest.mark.parametrize(("name", "S", "precision"), [("tiny", 1, "fp32"), ("tiny", 2, "bf16"), ("small", 4, "bf16")])
def test_one_sharded_rank_holds_the_unsharded_replicas_state(name, S, precision):
    _, whole, one = _both(name, S, 1, precision)
    for part in STATE:
        assert getattr(one, part) == getattr(whole, part), part
    assert one.weights == F32 * PLAN_PRESETS[name].n_params and one.gathered > 0 == whole.gathered


def _padding_rows(cfg, S: int) -> int:
    """Elements of one dim-0 row of every parameter: FSDP2's padding adds less than this per rank."""
    return sum(math.prod(shape[1:]) for s in range(S) for shape in stage_shapes(cfg, s, S).values())


@pytest.mark.parametrize(("name", "S", "precision"), [("small", 2, "fp32"), ("7B", 1, "bf16"), ("13B", 4, "fp32")])
def test_a_rank_holds_the_shardable_terms_over_n_and_the_rest_whole(name, S, precision):
    _, whole, _ = _both(name, S, 1, precision)
    slack = _padding_rows(PLAN_PRESETS[name], S) * (6 * F32 + compute_bytes(precision))  # 6 float32 states + copy
    previous = None
    for N in (1, 2, 3, 4, 8, 16, 64, 512):
        cfg, _, rank = _both(name, S, N, precision)
        fixed = unsharded_terms(rank, S, cfg)
        target = (whole.inner_step - unsharded_terms(whole, S, cfg)) / N + fixed
        assert 0 <= rank.inner_step - target <= slack, N
        assert fixed < rank.inner_step <= whole.inner_step + rank.gathered
        if previous is not None:  # more ranks never need more (the bisection relies on it)
            assert rank.device <= previous.device and rank.host <= previous.host
        previous = rank


def test_the_shards_are_fsdp2s_dim0_chunks():
    cfg = PLAN_PRESETS["tiny"]
    P, stage_P, matmuls, largest, unit = replica_shards(cfg, 1, 3)
    shapes = stage_shapes(cfg, 0, 1)
    assert P == stage_P == sum(math.ceil(s[0] / 3) * math.prod(s[1:]) for s in shapes.values())
    assert largest == math.ceil(1024 / 3) * 64  # the embedding's (and the head's) 342 rows of 64
    assert unit == 1024 * 64  # the largest unit: the head, or the embedding (a block is smaller)
    linear = [s for n, s in shapes.items() if ".attn.w" in n or ".ffn.w" in n or n == "head.weight"]
    assert len(linear) == 4 * 7 + 1 and matmuls == sum(math.ceil(s[0] / 3) * math.prod(s[1:]) for s in linear)


def test_the_fewest_ranks_is_the_fewest_and_never_more_on_a_larger_gpu():
    rows = fit_rows(microbatch_size=1, seq_len=2048, k_ratio="1/8")
    assert [r["model"] for r in rows] == list(PLAN_PRESETS)
    for r in rows:
        cfg = PLAN_PRESETS[r["model"]]
        for mode in FIT_MODES:
            name = " ".join((mode[0], "ckpt")) if mode[1] else mode[0]
            counts = [r[f"{name} {g}GiB"] for g in DEVICES_GIB]
            as_int = [math.inf if n is None else n for n in counts]
            assert as_int == sorted(as_int, reverse=True), (r["model"], mode, counts)
            for g, n in zip(DEVICES_GIB, counts, strict=True):
                if n is None:
                    continue
                need = [replica_rank(cfg, 1, 2048, cfg.d_model // 8, mode, k, True).device for k in (max(1, n - 1), n)]
                assert need[1] <= g * 2**30 and (n == 1 or need[0] > g * 2**30)
    small = next(r for r in rows if r["model"] == "small")
    assert all(small[f"bf16 {g}GiB"] == 1 for g in DEVICES_GIB)


def test_a_7b_replica_does_not_fit_one_80gib_gpu_but_fits_at_most_8_sharded_ranks():
    cfg, budget = PLAN_PRESETS["7B"], 80 * 2**30
    row = next(r for r in fit_rows(1, 2048, "1/8") if r["model"] == "7B")
    assert (
        row["ddp bf16"] > budget
        and row["ddp bf16"] == replica_rank(cfg, 1, 2048, 512, ("bf16", False), 8, False).device
    )
    n = row["bf16 80GiB"]
    assert n is not None and 1 < n <= 8
    assert fewest_ranks(cfg, 1, 2048, 512, ("bf16", False), budget) == n
    kw = dict(microbatch_size=1, seq_len=2048, precision="bf16", k=512, device_kind="cuda")
    assert estimate_sharded_replica(cfg, 1, ranks=n, **kw).device <= budget < estimate_replica(cfg, 1, **kw).device


def _run(**over):
    return build_config(
        overrides={"preset": "small", "stages": 2, "train.batch_size": 8, "train.microbatches": 2, **over}
    )


def test_the_join_check_counts_a_sharded_rank_and_leaves_ddp_as_it_is():
    cfg = _run()
    ddp = check_fit(cfg, None, "cpu", "fp32", False, 2**40)
    assert check_fit(cfg, None, "cpu", "fp32", False, 2**40, ranks=4).peak == ddp.peak  # DDP: the whole replica
    four = check_fit(cfg, None, "cpu", "fp32", False, 2**40, ranks=4, sharded=True)
    assert four.weights == F32 * replica_shards(cfg.model, 2, 4)[0] and four.peak < ddp.peak / 2
    budget = (four.peak + ddp.peak) // 2  # 4 sharded ranks fit, one rank (sharded or DDP) does not
    assert check_fit(cfg, None, "cpu", "fp32", False, budget, ranks=4, sharded=True) == four
    with pytest.raises(ConfigError) as err:
        check_fit(cfg, None, "cpu", "fp32", False, budget, ranks=4)
    assert "sharded ranks" not in str(err.value)  # DDP: more ranks do not help, none is offered
    with pytest.raises(ConfigError) as err:
        check_fit(cfg, None, "cpu", "fp32", False, budget, ranks=1, sharded=True)
    line = str(err.value)
    assert "\n" not in line and line.startswith("one sharded rank of a full replica of 2 stages of small does not fit")
    fewest = next(n for n in range(2, 5) if estimate(cfg, Ask(None, 1, "fp32", False, n, True), "cpu").peak <= budget)
    assert f"{fewest} sharded ranks (~" in line
    with pytest.raises(ConfigError, match="only a full replica is sharded"):
        check_fit(cfg, 1, "cpu", "fp32", False, 2**40, ranks=2, sharded=True)
    with pytest.raises(ConfigError, match="at least one rank"):
        check_fit(cfg, None, "cpu", "fp32", False, 2**40, ranks=0)


def test_the_cli_prints_per_rank_memory_and_the_fewest_ranks(tmp_path):
    out = tmp_path / "plan-ranks.json"
    result = CliRunner().invoke(app, ["plan", "--memory", "--ranks", "4", "--sharded", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "per rank of a full replica of 4" in result.output and "which presets fit" in result.output
    data = json.loads(out.read_text())
    assert data["inputs"]["ranks"] == 4 and data["inputs"]["sharded"] is True
    assert data["ranks"] == rank_rows(1, 2048, "1/8", 4, True) and data["fit"] == fit_rows(1, 2048, "1/8")
    plain = CliRunner().invoke(app, ["plan", "--memory", "--json", str(out)])
    assert plain.exit_code == 0 and "ranks" not in json.loads(out.read_text()) and "which presets fit" in plain.output
    alone = CliRunner().invoke(app, ["plan", "--ranks", "4", "--sharded"])
    assert isinstance(alone.exception, ConfigError) and "pass them with --memory" in str(alone.exception)


def test_gathering_once_per_step_holds_the_whole_replicas_parameters_and_gradients_during_the_step():
    """`--gather-per-step`: every unit's parameters (compute dtype) and float32 gradient are whole during
    the step, so a rank holds them beside its shards; the shards themselves do not change."""
    cfg = _run()
    per_unit = check_fit(cfg, None, "cpu", "fp32", False, 2**40, ranks=2, sharded=True)
    per_step = check_fit(cfg, None, "cpu", "fp32", False, 2**40, ranks=2, sharded=True, per_step=True)
    whole = replica_shards(cfg.model, cfg.stages, 1)[0]
    assert per_step.gathered == (F32 + F32) * whole > per_unit.gathered
    for part in STATE:
        assert getattr(per_step, part) == getattr(per_unit, part), part
    assert per_step.peak - per_unit.peak == per_step.gathered - per_unit.gathered
    budget = (per_unit.peak + per_step.peak) // 2  # per unit fits, per step does not
    check_fit(cfg, None, "cpu", "fp32", False, budget, ranks=2, sharded=True)
    with pytest.raises(ConfigError, match="without --gather-per-step"):  # the remedy is named
        check_fit(cfg, None, "cpu", "fp32", False, budget, ranks=2, sharded=True, per_step=True)
