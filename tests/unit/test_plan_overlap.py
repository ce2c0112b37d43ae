"""`peer plan --overlap` and the commit's time by device (`peer.research.plan.schedule`, issue 36)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from peer.core.model.decoder import build_stage, get_preset, stage_shapes
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.decode import entry_values
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.errors import ConfigError
from peer.research.plan.command import PlanInputs, plan_rows, with_inputs
from peer.research.plan.round import round_holders
from peer.research.plan.schedule import (
    CPU_BYTES_PER_S,
    GPU_BYTES_PER_S,
    CommitDevice,
    HolderWork,
    holder_work,
    outer_step,
    payload_entries,
)

SMALL = PlanInputs(preset="small", stages=2, inner_steps=10, microbatch_size=2, microbatches=4, seq_len=64, flops=1e12)
FIG2 = PlanInputs(preset="70B", stages=4, inner_steps=50, k_ratio="1/8")  # the issue's target rows
WORK = [HolderWork(0, 1.0, 2.0, 0.5), HolderWork(1, 0.5, 3.0, 0.25)]  # the slowest: encode 1, commit 3, rebase 0.5


def test_a_round_shorter_than_the_inner_steps_hides_behind_them():
    sync = outer_step(100.0, 50, 20.0, WORK, overlap=False)
    assert (sync.outer_s, sync.rebase_s, sync.overlap_steps) == (100 + 1 + 20 + 3, 0.0, 0)
    free = outer_step(100.0, 50, 20.0, WORK, overlap=True)
    assert free.outer_s == 100 + 1 + 0.5 and free.landed_s == 20.0
    assert free.overlap_steps == math.ceil(23 * 50 / 100)  # 12: the round and the commit, in inner steps
    # the pipeline keeps the link busy half the time: the round takes twice as long beside it
    half = outer_step(100.0, 50, 20.0, WORK, overlap=True, busy=0.5)
    assert half.landed_s == 40.0 and half.outer_s == free.outer_s and half.overlap_steps == 22


def test_a_round_longer_than_the_inner_steps_sets_the_pace():
    step = outer_step(100.0, 50, 150.0, WORK, overlap=True, busy=0.2)
    # 80 s of link while the inner steps run carry 80 of the 150 s; the other 70 s after them
    assert step.landed_s == pytest.approx(170.0)
    assert step.outer_s == pytest.approx(170 + 3 + 1 + 0.5) and step.overlap_steps == 50
    # inner steps bound by the link (busy 1): overlapping gains nothing, the rebase costs a little
    bound = outer_step(100.0, 50, 20.0, WORK, overlap=True, busy=1.0)
    assert bound.outer_s == outer_step(100.0, 50, 20.0, WORK, overlap=False).outer_s + 0.5


def test_the_issue_target_rows_70b_4_stages_h50():
    rows = {r["bandwidth_mbps"]: r for r in plan_rows(with_inputs(FIG2, overlap=1), [100.0, 1000.0])}
    before = {r["bandwidth_mbps"]: r for r in plan_rows(FIG2, [100.0, 1000.0])}
    for bw in (100.0, 1000.0):  # the synchronous rows are the same either way
        assert rows[bw]["util_sync_compressed"] == before[bw]["util_compressed"]
    # synchronous, a GPU's commit counted, stage 0 read as embedding views by the later stages (protocol 13),
    # stages 2 and 3 taking them from the stage before theirs: 67.5 % and 95.2 % (66.9 % and 95.1 % with every
    # view from its sender; 32.4 % and 82.6 % while they fetched stage 0's payloads whole)
    assert round(100 * before[100.0]["util_compressed"], 1) == 67.5
    assert round(100 * before[1000.0]["util_compressed"], 1) == 95.2
    fast, slow = rows[1000.0], rows[100.0]
    assert fast["util_compressed"] >= 0.97 and fast["overlap_steps_compressed"] < FIG2.inner_steps
    # at 100 Mbit/s the round (each holder's 1.44 GB, on a link the boundary messages keep 56 % busy) lands
    # after the 50 inner steps: 96.1 % (94.8 % when stage 0's holders served every later holder its views)
    assert slow["round_landed_s_compressed"] > slow["inner_s_compressed"] > slow["round_s_compressed"]
    assert slow["overlap_steps_compressed"] == FIG2.inner_steps
    assert round(100 * slow["util_compressed"], 1) == 96.1 and slow["util_compressed"] >= 0.95
    # the commit on a GPU is a fraction of a second for a 17.5B-parameter stage
    assert 0.1 < fast["commit_s_compressed"] < 1.0


def test_the_commit_device_sets_the_holders_own_seconds():
    gpu = plan_rows(SMALL, [100.0])[0]
    cpu = plan_rows(with_inputs(SMALL, commit_device="cpu"), [100.0])[0]
    ratio = GPU_BYTES_PER_S / CPU_BYTES_PER_S
    for key in ("encode_s_compressed", "commit_s_compressed", "commit_s_uncompressed"):
        assert cpu[key] == pytest.approx(gpu[key] * ratio)
    mine = plan_rows(with_inputs(SMALL, commit_device="cpu", commit_gbps=CPU_BYTES_PER_S / 1e9 / 2), [100.0])[0]
    assert mine["commit_s_compressed"] == pytest.approx(2 * cpu["commit_s_compressed"])
    assert cpu["outer_s_compressed"] > gpu["outer_s_compressed"]


def test_the_cpu_figure_reproduces_its_calibration():
    """`peer bench commit --preset 178M --stages 2 --replicas 8`: stage 0, 95,037,440 parameters, 8 payloads
    of 752,640 entries, committed in 1.31 s on the machine the figure was calibrated on."""
    cfg = get_preset("178M")
    shapes = [stage_shapes(cfg, s, 2) for s in range(2)]
    params = [sum(math.prod(v) for v in sh.values()) for sh in shapes]
    entries = [payload_entries(sh, SparseLoCoConfig()) for sh in shapes]
    assert params[0] == 95_037_440 and entries[0] == 752_640
    holders = round_holders([1, 1], 8, compressed=False)  # M = 8: each holder decodes its own stage's 8
    work = holder_work(params, entries, holders, CommitDevice.of("cpu"))
    assert work[0].commit_s == pytest.approx(1.31, rel=0.02)


def test_payload_entries_count_what_compress_sends():
    cfg, slc = get_preset("tiny"), SparseLoCoConfig()
    stage = build_stage(cfg, 0, 2, seed=0)
    g = torch.Generator().manual_seed(0)
    delta = {n: torch.randn(p.shape, generator=g) for n, p in stage.named_parameters()}
    payload, _ = compress(delta, None, slc)
    sent = sum(len(entry_values(e, slc.chunk, slc.topk)[1]) for e in payload.entries)
    assert payload_entries(stage_shapes(cfg, 0, 2), slc) == sent


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"overlap": 2}, "--overlap"),
        ({"commit_device": "tpu"}, "--commit-device"),
        ({"commit_gbps": 0.0}, "--commit-gbps"),
        ({"commit_gbps": float("nan")}, "--commit-gbps"),
    ],
)
def test_bad_schedule_inputs_name_the_flag(changes, needle):
    with pytest.raises(ConfigError, match=needle):
        plan_rows(with_inputs(SMALL, **changes), [100.0])


def test_the_cli_shows_the_overlapped_and_the_synchronous_utilisation(tmp_path):
    from typer.testing import CliRunner

    from peer.cli.main import app

    out = tmp_path / "plan.json"
    argv = ["plan", "--preset", "small", "--stages", "2", "--bandwidth-mbps", "10,1000", "--overlap", "1"]
    result = CliRunner().invoke(app, [*argv, "--commit-device", "cpu", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "overlapped outer steps" in result.output and "sync" in result.output
    data = json.loads(out.read_text())
    assert data["inputs"]["overlap"] == 1 and data["inputs"]["commit_device"] == "cpu"
    row = data["rows"][1]
    compute_s = row["util_sync_compressed"] * row["outer_s_sync_compressed"]  # H·m·compute, either schedule
    assert row["util_compressed"] == pytest.approx(compute_s / row["outer_s_compressed"])
    # on this CPU the rebase (4 passes, not hidden) outweighs the round it hides on a 1 Gbit/s link
    assert row["rebase_s_compressed"] > row["round_s_compressed"]
    assert row["util_compressed"] < row["util_sync_compressed"]
    assert data["figure2"]["curves"]["uncompressed"][1] == row["util_uncompressed"]  # Fig. 2 draws the schedule asked
