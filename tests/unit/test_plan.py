"""Unit tests for peer.research.plan.command: byte counts come from the wire code, stage shapes from the real model,
and utilisation behaves as the paper's Fig. 2/3 say it must."""

from __future__ import annotations

import dataclasses
import json
import math
from itertools import pairwise

import pytest
import torch

from peer.core.model.decoder import build_stage, get_preset, stage_shapes
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.format import SparseLoCoConfig, payload_nbytes
from peer.core.sparseloco.codec.sections import view_bytes
from peer.errors import ConfigError
from peer.net.transport.codec import encoded_size, to_bytes
from peer.net.transport.messages import BackwardRequest, ForwardRequest
from peer.research.plan.command import (
    PLAN_PRESETS,
    PlanInputs,
    boundary_bytes,
    plan_rows,
    resolve_model,
    stage_payloads,
    with_inputs,
)
from peer.research.plan.round import parse_tokens, round_holders, round_seconds, stage0_fetch_nbytes
from peer.research.plan.schedule import payload_entries

SMALL = PlanInputs(
    preset="small",
    stages=2,
    k_ratio="1/8",
    inner_steps=10,
    microbatch_size=2,
    microbatches=4,
    seq_len=64,
    flops=1e12,
    replicas=4,
    wire_dtype="bf16",
)
BWS = [1.0, 10.0, 100.0, 1000.0]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _messages(
    b: int, L: int, width: int, dtype: torch.dtype, pipeline_id: str = "p", step: int = 0
) -> tuple[ForwardRequest, BackwardRequest]:
    """The largest forward message (into the last stage: tokens, hidden, targets) and a backward one."""
    tokens = torch.randint(0, 100, (b, L), dtype=torch.int32)  # (b, L)
    hidden = torch.randn(b, L, width).to(dtype)  # (b, L, width)
    fwd = ForwardRequest(pipeline_id, step, step, step, 1, tokens, hidden, targets=tokens)
    bwd = BackwardRequest(pipeline_id, step, step, step, 0, hidden)
    return fwd, bwd


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_boundary_bytes_equal_wire_encoding(wire):
    inputs = with_inputs(SMALL, wire_dtype=wire)
    row = plan_rows(inputs, [100.0])[0]
    cfg = get_preset("small")
    k = cfg.d_model // 8
    assert row["k"] == k
    b, L = inputs.microbatch_size, inputs.seq_len
    for width, key in ((k, "boundary_bytes_compressed"), (cfg.d_model, "boundary_bytes_uncompressed")):
        fwd, bwd = _messages(b, L, width, DTYPES[wire])
        expected = encoded_size(fwd, wire) + encoded_size(bwd, wire)
        assert expected == len(to_bytes(fwd, wire)) + len(to_bytes(bwd, wire))
        assert row[key] == expected, (key, row[key], expected)
        # real ids and step counters only add a few header bytes to what the plan counts
        real = sum(encoded_size(m, wire) for m in _messages(b, L, width, DTYPES[wire], "pipeline-7f3a", 12345))
        assert 0 < real - row[key] < 64


def test_boundary_bytes_follow_wire_dtype_and_width():
    rows = {w: plan_rows(with_inputs(SMALL, wire_dtype=w), [100.0])[0] for w in ("fp32", "bf16")}
    d, k = get_preset("small").d_model, get_preset("small").d_model // 8
    values = SMALL.microbatch_size * SMALL.seq_len
    # each of the two messages carries values × width boundary numbers: fp32 costs 2 bytes more each
    for key, width in (("boundary_bytes_compressed", k), ("boundary_bytes_uncompressed", d)):
        extra = rows["fp32"][key] - rows["bf16"][key]
        # up to a few bytes of dtype names and length prefixes
        assert extra == pytest.approx(2 * 2 * values * width, abs=8)
    ratio = rows["bf16"]["boundary_bytes_uncompressed"] / rows["bf16"]["boundary_bytes_compressed"]
    assert 6 < ratio < 8  # close to d/k = 8, less because token ids do not shrink


def test_payload_bytes_equal_payload_nbytes_and_a_real_payload():
    slc = SparseLoCoConfig()
    for inputs in (SMALL, with_inputs(SMALL, preset="tiny", stages=3)):
        row = plan_rows(inputs, [100.0])[0]
        cfg = get_preset(inputs.preset)
        sizes = [payload_nbytes(stage_shapes(cfg, s, inputs.stages), slc) for s in range(inputs.stages)]
        assert row["payload_bytes_per_stage"] == max(sizes)
    # and payload_nbytes is what a real payload of those shapes serialises to (tiny: 3 stages)
    gen = torch.Generator().manual_seed(0)
    for s, size in enumerate(sizes):
        delta = {n: torch.randn(*shape, generator=gen) for n, shape in stage_shapes(cfg, s, 3).items()}
        payload, _ = compress(delta, None, slc)
        assert len(payload.to_bytes()) == size


@pytest.mark.parametrize(("overrides", "n_stages"), [({}, 1), ({}, 2), ({}, 3), ({"n_layers": 5, "n_heads": 2}, 3)])
def test_stage_shapes_match_real_stages(overrides, n_stages):
    cfg = get_preset("tiny", **overrides)
    seen = set()
    for s in range(n_stages):
        real = {name: tuple(p.shape) for name, p in build_stage(cfg, s, n_stages, seed=0).named_parameters()}
        planned = stage_shapes(cfg, s, n_stages)
        assert planned == real
        assert not seen & planned.keys()
        seen |= planned.keys()
    assert (
        sum(
            math.prod(shape)
            for shape in (shp for s in range(n_stages) for shp in stage_shapes(cfg, s, n_stages).values())
        )
        == cfg.n_params
    )


def test_utilisation_shape():
    bws = [1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1e3, 1e4, 1e5, 1e7, 1e9]
    rows = plan_rows(with_inputs(SMALL, flops=1e13), bws)
    assert [r["bandwidth_mbps"] for r in rows] == bws
    for kind in ("compressed", "uncompressed"):
        utils = [r[f"util_{kind}"] for r in rows]
        assert all(0 < u <= 1 for u in utils)
        assert all(a <= b for a, b in pairwise(utils)), (kind, utils)
    # slow links: the boundary dominates and compression matters; on fast ones the compressed pipeline's
    # larger round (stage 0's payloads, test_later_stages_fetch_stage_0s_payloads) can cost it a little
    assert rows[0]["util_compressed"] > rows[0]["util_uncompressed"]
    assert all(r["round_s_compressed"] > r["round_s_uncompressed"] for r in rows[:-1])
    # compute-bound limit: no time on links or in the round, only the holders' own encode and commit
    compute_s = SMALL.inner_steps * SMALL.microbatches * rows[-1]["compute_s_per_microbatch"]
    for kind in ("compressed", "uncompressed"):
        own_s = rows[-1][f"encode_s_{kind}"] + rows[-1][f"commit_s_{kind}"]
        assert rows[-1][f"outer_s_{kind}"] == pytest.approx(compute_s + own_s, rel=1e-4)
    # ... and with a commit device without cost, utilisation 1 (the bubble is left out)
    fast = plan_rows(with_inputs(SMALL, flops=1e13, commit_gbps=1e12), bws[-1:])[0]
    assert fast["util_compressed"] == pytest.approx(1.0, abs=1e-4)
    assert fast["util_uncompressed"] == pytest.approx(1.0, abs=1e-4)


def test_compute_time_formula():
    row = plan_rows(SMALL, [100.0])[0]
    n = get_preset("small").n_params
    assert row["n_params"] == n
    expected = 6 * n / SMALL.stages * SMALL.microbatch_size * SMALL.seq_len / SMALL.flops
    assert row["compute_s_per_microbatch"] == pytest.approx(expected)


def test_one_stage_has_no_boundary_traffic():
    row = plan_rows(with_inputs(SMALL, stages=1), [1.0])[0]
    assert row["boundary_bytes_compressed"] == row["boundary_bytes_uncompressed"] == 0
    assert row["util_compressed"] == row["util_uncompressed"]


def test_round_time_counts_every_other_holder():
    one, many = (plan_rows(with_inputs(SMALL, replicas=r), [10.0])[0] for r in (1, 5))
    assert one["round_s_uncompressed"] == 0.0
    assert many["round_s_uncompressed"] == pytest.approx(4 * many["payload_bytes_per_stage"] * 8 / 10e6)
    # a compressed pipeline of one replica still moves stage 0's payload's embedding view to stage 1 (T⊥)
    view = stage0_fetch_nbytes(get_preset("small"), 2, SparseLoCoConfig())
    assert one["round_s_compressed"] == pytest.approx(view * 8 / 10e6)


def test_paper_fig2_70b_compression_wins_at_100_mbps():
    inputs = PlanInputs(preset="70B", stages=4, inner_steps=50)
    row = plan_rows(inputs, [100.0])[0]
    assert row["model"] == "70B" and row["k"] == 8192 // 8
    assert row["util_compressed"] > row["util_uncompressed"]
    # 32.4 % vs 20.3 %: the boundary saving outweighs the stage-0 payloads the later stages fetch
    assert row["util_compressed"] > 1.5 * row["util_uncompressed"]
    assert row["boundary_bytes_uncompressed"] > 7 * row["boundary_bytes_compressed"]


def test_params_picks_nearest_shape():
    assert resolve_model(PlanInputs(params=7e9)) == ("7B", PLAN_PRESETS["7B"])
    assert resolve_model(PlanInputs(params=7e10))[0] == "70B"
    assert resolve_model(PlanInputs(params=1.2e10))[0] == "13B"
    assert resolve_model(PlanInputs(params=2e8))[0] == "178M"
    assert resolve_model(PlanInputs(params=1e3))[0] == "tiny"
    # --params overrides --preset
    assert resolve_model(PlanInputs(preset="tiny", params=1e9))[0] == "1B"
    assert plan_rows(PlanInputs(params=7e9, stages=4), [100.0])[0]["model"] == "7B"
    for name, cfg in PLAN_PRESETS.items():  # a preset's own count maps to itself
        assert resolve_model(PlanInputs(params=float(cfg.n_params)))[0] == name


@pytest.mark.parametrize(
    ("changes", "bws", "needle"),
    [
        ({"preset": "huge"}, BWS, "huge"),
        ({"stages": 9}, BWS, "stages"),
        ({"stages": 0}, BWS, "--stages"),
        ({"k_ratio": "0"}, BWS, "--k-ratio"),
        ({"k_ratio": "x"}, BWS, "--k-ratio"),
        ({"k_ratio": "1/8,1/8"}, BWS, "--k-ratio"),
        ({"k_ratio": "1/8,0.125"}, BWS, "--k-ratio"),
        ({"k_ratio": "1/8,,1/16"}, BWS, "--k-ratio"),
        ({"k_ratio": "1/8,2"}, BWS, "--k-ratio"),
        ({"k_ratio": "1/8,x"}, BWS, "--k-ratio"),
        ({"k_ratio": ""}, BWS, "--k-ratio"),
        ({"tokens": 0.0}, BWS, "--tokens"),
        ({"tokens": float("inf")}, BWS, "--tokens"),
        ({"wire_dtype": "int8"}, BWS, "--wire-dtype"),
        ({"inner_steps": 0}, BWS, "--inner-steps"),
        ({"microbatches": 0}, BWS, "--microbatches"),
        ({"seq_len": 0}, BWS, "--seq-len"),
        ({"replicas": 0}, BWS, "--replicas"),
        ({"flops": 0.0}, BWS, "--flops"),
        ({"params": -5.0}, BWS, "--params"),
        ({}, [], "--bandwidth-mbps"),
        ({}, [100.0, 0.0], "--bandwidth-mbps"),
        ({}, [float("nan")], "--bandwidth-mbps"),
    ],
)
def test_bad_inputs_raise_config_error(changes, bws, needle):
    with pytest.raises(ConfigError) as info:
        plan_rows(with_inputs(SMALL, **changes), bws)
    assert needle in str(info.value)


def test_scheduled_step_has_the_1f1b_bubble_and_the_sequential_hops():
    from peer.research.plan.command import scheduled_step_s

    t, m, S = 0.1, 8, 2
    assert scheduled_step_s([t] * S, 0.0, 0.0, m, S) == pytest.approx((m + S - 1) * t)  # bubble m/(m+S-1)
    assert scheduled_step_s([t] * S, 0.0, 0.0, m, 1) == pytest.approx(m * S * t)
    # sequential at S = 3: 6 messages and 3 round trips through the head per micro-batch
    assert scheduled_step_s([t] * 3, 0.01, 0.05, m, 1) == pytest.approx(m * (3 * t + 6 * 0.01 + 3 * 0.05))
    # a slow link is the bottleneck once it exceeds the compute of a stage
    assert scheduled_step_s([t] * S, 2 * t, 0.0, m, S) > scheduled_step_s([t] * S, 0.0, 0.0, m, S)
    # too few in flight for the round trip: more in flight is faster
    assert scheduled_step_s([t] * S, 0.0, 0.3, m, S) > scheduled_step_s([t] * S, 0.0, 0.3, m, 2 * S)


def test_predicted_efficiency_of_a_balanced_fast_pipeline_is_its_bubble():
    from peer.research.plan.command import PLAN_PRESETS, predict_pipeline

    out = predict_pipeline(PLAN_PRESETS["small"], 2, 8, 16, 128, "1/8", 1e10, in_flight=2)
    assert 0.5 < out["efficiency"] <= 8 / 9 + 1e-9
    assert out["tokens_per_s"] > out["one_device_tokens_per_s"]


def test_per_call_overhead_and_the_optimizer_step_lengthen_the_step():
    from peer.research.plan.command import scheduled_step_s

    t, m = 0.1, 8
    base = scheduled_step_s([t, t], 0.0, 0.0, m, 2)
    # each micro-batch costs every stage one call end (the head's call, stage 1's answer)
    assert scheduled_step_s([t, t], 0.0, 0.0, m, 2, t_rpc=0.002) == pytest.approx((m + 1) * (t + 0.002))
    # in flight every stage steps at once (the head does not wait for the others' answers)
    stepped = scheduled_step_s([t, t, t], 0.05, 0.05, m, 3, t_rpc=0.0, t_opt=[0.03, 0.01, 0.02])
    assert stepped == pytest.approx(scheduled_step_s([t, t, t], 0.05, 0.05, m, 3) + 0.03)
    # sequential: the later stages step in parallel, then the head: max(later) + head + one round trip
    stepped = scheduled_step_s([t, t, t], 0.0, 0.05, m, 1, t_rpc=0.0, t_opt=[0.03, 0.01, 0.02])
    assert stepped == pytest.approx(scheduled_step_s([t, t, t], 0.0, 0.05, m, 1) + 0.02 + 0.03 + 0.05)
    # sequential: 2S − 3 calls per micro-batch, both ends on the critical path
    seq = scheduled_step_s([t, t, t], 0.0, 0.0, m, 1, t_rpc=0.001)
    assert seq == pytest.approx(m * (3 * t + 3 * 2 * 0.001))
    assert scheduled_step_s([t], 0.0, 0.0, m, 1, t_rpc=0.5, t_opt=[0.01]) == pytest.approx(m * t + 0.01)
    assert base < scheduled_step_s([t, t], 0.0, 0.0, m, 2, t_rpc=0.001)


def test_a_calibrated_optimizer_step_counts_for_the_one_device_baseline_too():
    from peer.research.plan.command import PLAN_PRESETS, predict_pipeline

    small = PLAN_PRESETS["small"]
    bare = predict_pipeline(small, 2, 8, 16, 128, "1/8", 1e10, in_flight=2)
    real = predict_pipeline(small, 2, 8, 16, 128, "1/8", 1e10, 2, rpc_overhead_s=0.002, opt_s_per_param=3e-9)
    assert real["one_device_tokens_per_s"] < bare["one_device_tokens_per_s"]
    assert real["tokens_per_s"] < bare["tokens_per_s"] and real["efficiency"] < bare["efficiency"]


# ---------------------------------------------------------------------------- Fig. 2 and 3, the stage-0 payloads


def test_several_k_ratios_give_one_row_group_each():
    rows = plan_rows(with_inputs(SMALL, k_ratio="1/8, 1/16,1/32"), BWS)
    d = get_preset("small").d_model
    assert [(r["k_ratio"], r["bandwidth_mbps"]) for r in rows] == [(k, b) for k in ("1/8", "1/16", "1/32") for b in BWS]
    assert {r["k_ratio"]: r["k"] for r in rows} == {"1/8": d // 8, "1/16": d // 16, "1/32": d // 32}
    groups = [rows[i : i + len(BWS)] for i in range(0, len(rows), len(BWS))]
    # each group is what a call with that k/d alone gives
    assert groups[1] == plan_rows(with_inputs(SMALL, k_ratio="1/16"), BWS)
    # the uncompressed pipeline does not depend on k; narrower boundaries send fewer bytes
    for a, b in pairwise(groups):
        assert [r["util_uncompressed"] for r in a] == [r["util_uncompressed"] for r in b]
        assert a[0]["boundary_bytes_compressed"] > b[0]["boundary_bytes_compressed"]
        assert all(x["util_compressed"] <= y["util_compressed"] for x, y in zip(a, b, strict=True))


def test_the_cli_draws_fig2_and_fig3_with_one_curve_per_k(tmp_path):
    from typer.testing import CliRunner

    from peer.cli.main import app

    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "small", "--stages", "2", "--k-ratio", "1/8,1/16,1/32,1/64"]
    argv += ["--bandwidth-mbps", "10,100,1000", "--tokens", "2M", "--json", str(out)]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert (tmp_path / "plan.png").stat().st_size > 0
    assert (tmp_path / "plan-wallclock.png").stat().st_size > 0
    data = json.loads(out.read_text())
    assert data["k_ratios"] == ["1/8", "1/16", "1/32", "1/64"] and len(data["rows"]) == 4 * 3
    assert data["inputs"]["tokens"] == 2e6
    d = get_preset("small").d_model
    for fig in ("figure2", "figure3"):
        curves = data[fig]["curves"]
        assert list(curves) == [f"k/d={r} (k={d // int(r[2:])})" for r in data["k_ratios"]] + ["uncompressed"]
        assert data[fig]["bandwidth_mbps"] == [10, 100, 1000] and all(len(y) == 3 for y in curves.values())
    row = data["rows"][0]
    assert data["figure2"]["curves"][f"k/d=1/8 (k={d // 8})"][0] == row["util_compressed"]
    assert data["figure3"]["curves"]["uncompressed"][0] == row["wallclock_h_uncompressed"]
    assert [h["stage0_fetched"] for h in data["round"]["compressed"]] == [0, 8]
    assert "stage 0" in result.output and "hours" in result.output
    # without --tokens: Fig. 2 only
    result = CliRunner().invoke(app, ["plan", "--preset", "small", "--stages", "2", "--png", str(tmp_path / "u.png")])
    assert result.exit_code == 0 and not (tmp_path / "u-wallclock.png").exists()


def test_token_budget_wallclock_on_a_hand_computed_case():
    inputs = with_inputs(SMALL, tokens=1e6)
    row = plan_rows(inputs, [10.0])[0]
    # one outer step: M·H·m·b·L = 4·10·4·2·64 = 20,480 tokens; 1e6 tokens → ⌈48.83⌉ = 49 outer steps
    assert row["tokens_per_outer_step"] == 20_480
    assert row["outer_steps_compressed"] == row["outer_steps_uncompressed"] == 49
    cfg, bps = get_preset("small"), 10e6 / 8
    p0, p1 = (payload_nbytes(stage_shapes(cfg, s, 2), SparseLoCoConfig()) for s in (0, 1))
    v = stage0_fetch_nbytes(cfg, 2, SparseLoCoConfig())  # stage 0's embedding view
    t_comp = 6 * cfg.n_params / 2 * 2 * 64 / 1e12
    # the holders' own math on the default commit device, a GPU at 3.0e12 bytes/s: 4 bytes × 11 passes to
    # encode, × 7 to commit, and 64 bytes per entry of the payloads it gathers (its own stage's 4, stage 0's 4)
    n0, n1 = (sum(math.prod(v) for v in stage_shapes(cfg, s, 2).values()) for s in (0, 1))
    e0, e1 = (payload_entries(stage_shapes(cfg, s, 2), SparseLoCoConfig()) for s in (0, 1))
    encode = 11 * 4 * max(n0, n1) / 3.0e12
    commit = {
        "compressed": max(7 * 4 * n0 + 4 * e0 * 64, 7 * 4 * n1 + (4 * e1 + 4 * e0) * 64) / 3.0e12,
        "uncompressed": max(7 * 4 * n0 + 4 * e0 * 64, 7 * 4 * n1 + 4 * e1 * 64) / 3.0e12,
    }
    for kind, round_bytes in (("compressed", max(3 * p0 + 4 * v, 3 * p1 + 4 * v)), ("uncompressed", 3 * max(p0, p1))):
        msg = max(boundary_bytes(2, 64, row["k"] if kind == "compressed" else cfg.d_model, "bf16"))
        assert row[f"encode_s_{kind}"] == pytest.approx(encode) and row[f"commit_s_{kind}"] == pytest.approx(
            commit[kind]
        )
        outer_s = 10 * 4 * max(t_comp, msg / bps) + round_bytes / bps + encode + commit[kind]
        assert row[f"outer_s_{kind}"] == pytest.approx(outer_s)
        assert row[f"wallclock_h_{kind}"] == pytest.approx(49 * outer_s / 3600)
    assert "wallclock_h_compressed" not in plan_rows(SMALL, [10.0])[0]  # no budget, no wall-clock


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("3e9", 3e9),
        ("3B", 3e9),
        ("1.5T", 1.5e12),
        ("500M", 5e8),
        ("20k", 2e4),
        (" 2 G ", 2e9),
        (1e12, 1e12),
        (None, None),
    ],
)
def test_token_budgets_read_floats_and_suffixes(text, tokens):
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "nan", "inf", "3X", "1e3e3", "0.5"])
def test_bad_token_budgets_name_the_flag(text):
    with pytest.raises(ConfigError, match="--tokens"):
        parse_tokens(text)


def test_later_stages_fetch_stage_0s_embedding_views_of_the_size_sent():
    """A view's size is what a real stage-0 payload's view measures, with screening on (the embedding is
    screened apart from the rest, so u reads views alone)."""
    cfg, M, S, slc = get_preset("tiny"), 4, 3, SparseLoCoConfig()
    assert slc.screening
    shapes0 = stage_shapes(cfg, 0, S)
    payload = compress({n: torch.randn(v) for n, v in shapes0.items()}, None, slc)[0]
    assert stage0_fetch_nbytes(cfg, S, slc) == len(view_bytes(payload.to_bytes(), payload)) < payload.nbytes
    payloads = [payload_nbytes(stage_shapes(cfg, s, S), slc) for s in range(S)]
    view = stage0_fetch_nbytes(cfg, S, slc)
    comp = round_holders(payloads, M, compressed=True, stage0_fetch=view)
    # stage 0 serves its view to stage 1's M holders; stage 1's relay M views on average to stage 2's
    assert comp[0].served_bytes == 3 * payloads[0] + 4 * view
    assert comp[1].served_bytes == 3 * payloads[1] + 4 * view and comp[2].served_bytes == 3 * payloads[2]
    assert all(h.fetched_bytes == 3 * h.payload_bytes + 4 * view for h in comp[1:])
    whole = round_holders(payloads, M, compressed=True)  # whole payloads (no views) all come from their senders
    assert whole[0].served_bytes == 3 * payloads[0] + 4 * 2 * payloads[0]
    assert [h.served_bytes for h in whole[1:]] == [3 * p for p in payloads[1:]]


def test_later_stages_fetch_stage_0s_payloads():
    cfg, M, S = get_preset("tiny"), 4, 3
    payloads = [payload_nbytes(stage_shapes(cfg, s, S), SparseLoCoConfig()) for s in range(S)]
    comp, unc = round_holders(payloads, M, compressed=True), round_holders(payloads, M, compressed=False)
    p0 = payloads[0]
    # stage 0: its M − 1 peers' payloads in; its own out to them and to the M·(S − 1) later holders
    assert (comp[0].stage0_fetched, comp[0].fetched_bytes, comp[0].served_bytes) == (0, 3 * p0, (3 + 4 * 2) * p0)
    for h in comp[1:]:  # s > 0: its own stage's M − 1 and all M of stage 0's
        assert (h.own_fetched, h.stage0_fetched) == (M - 1, M)
        assert (h.fetched_bytes, h.served_bytes) == (3 * h.payload_bytes + 4 * p0, 3 * h.payload_bytes)
    for h in unc:  # no T⊥, no stage-0 payloads
        assert h.stage0_fetched == 0 and h.fetched_bytes == h.served_bytes == 3 * payloads[h.stage]
    assert round_seconds(comp, 8.0) == pytest.approx(11 * p0 * 8 / 8e6)  # stage 0's upload is the busiest
    row = plan_rows(PlanInputs(preset="tiny", stages=S, replicas=M), [8.0])[0]
    assert (row["stage0_payloads_fetched_compressed"], row["stage0_payloads_fetched_uncompressed"]) == (M, 0)
    viewed = round_holders(payloads, M, compressed=True, stage0_fetch=stage0_fetch_nbytes(cfg, S, SparseLoCoConfig()))
    assert row["round_bytes_compressed"] == max(h.link_bytes for h in viewed) < 11 * p0  # the planner counts views
    assert row["round_s_compressed"] == pytest.approx(round_seconds(viewed, 8.0))
    # one stage: nobody observes stage 0, both pipelines round alike
    one = plan_rows(PlanInputs(preset="tiny", stages=1, replicas=M), [8.0])[0]
    assert one["round_s_compressed"] == one["round_s_uncompressed"]


def test_memory_takes_one_k_ratio():
    from peer.cli.plan import plan_memory_command

    args = {"microbatch_size": 1, "seq_len": 128, "microbatches": 2, "k_ratio": "1/8,1/16"}
    with pytest.raises(ConfigError, match="--k-ratio"):
        plan_memory_command(print, args, None, lambda p, d: None)


def test_the_planner_counts_stage_0s_embedding_views_and_the_round_shrinks():
    row = plan_rows(dataclasses.replace(PlanInputs(), overlap=1), [100.0])[0]
    key = next(k for k in row if k.startswith("round_s"))
    inputs = PlanInputs()
    payloads = stage_payloads(resolve_model(inputs)[1], inputs.stages)
    whole = round_seconds(round_holders(payloads, inputs.replicas, compressed=True), 100.0)  # stage 0 fetched whole
    assert row[key] < whole / 3  # 70B: a 2.7 MB view instead of a 203 MB payload, M·(S − 1) times
