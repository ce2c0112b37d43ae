"""The pipelined schedule (micro-batches in flight, stage-to-stage streaming) against the sequential one.

Real stage processes on 127.0.0.1 (`peer.research.bench.pipeline_peers`), the head in this process: after
two inner steps the losses and every stage's parameters are bit-identical whatever the schedule,
and with streaming the head's link carries the same boundary bytes per micro-batch at S = 3 as at
S = 2 (only the route's addresses are added).
"""

from __future__ import annotations

import json

import pytest

from peer.config import RunConfig, build_config
from peer.research.bench.pipeline_peers import StageProcesses, run_head

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def _cfg(stages: int, in_flight: int) -> RunConfig:
    return build_config(
        overrides={
            "stages": stages,
            "train.inner_steps": 4,
            "train.batch_size": 8,
            "train.microbatches": 4,
            "train.seq_len": 32,
            "train.in_flight": in_flight,
            "swarm.rpc_timeout_s": 60,
        },
        environ={},
    )


def _run(cfg: RunConfig, tmp_path, name: str) -> tuple[dict, dict]:
    work = tmp_path / name
    work.mkdir()
    path = work / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    with StageProcesses(path, cfg.stages, work) as procs:
        addresses = procs.start()
        result = run_head(cfg, addresses, warmup=0, steps=2)
        reports = procs.stop()
    assert sorted(reports) == list(range(1, cfg.stages))
    return result, reports


def test_in_flight_is_bit_identical_to_sequential_and_the_head_link_carries_one_boundary(tmp_path):
    seq, seq_reports = _run(_cfg(3, 1), tmp_path, "sequential")
    pipe, pipe_reports = _run(_cfg(3, 4), tmp_path, "pipelined")
    assert seq["in_flight"] == 1 and pipe["in_flight"] == 4
    assert pipe["losses"] == seq["losses"]  # exact floats
    assert pipe["head_param_hash"] == seq["head_param_hash"]
    for s in (1, 2):
        assert pipe_reports[s]["param_hash"] == seq_reports[s]["param_hash"], f"stage {s} differs"

    two, _ = _run(_cfg(2, 4), tmp_path, "two-stages")
    cfg = _cfg(3, 4)
    per_mb = cfg.train.batch_size * cfg.train.seq_len // cfg.train.microbatches  # tokens per micro-batch
    head3, head2 = pipe["bytes_per_token"][0] * per_mb, two["bytes_per_token"][0] * per_mb
    # the same boundary each way; S = 3 adds only the route (one "127.0.0.1:port" address + framing)
    assert head2 > 1000 and 0 <= head3 - head2 <= 64, (head2, head3)
    # sequential at S = 3: the head relays stage 1's output and stage 2's gradient too
    assert seq["bytes_per_token"][0] * per_mb > 1.8 * head3
    assert pipe["bytes_per_token"][1] > 0.9 * pipe["bytes_per_token"][0]  # stage 1 -> 2 carries its own
