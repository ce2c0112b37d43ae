"""`peer bench replica --memory`: the peak memory of each rank of a sharded full replica against one
unsharded replica (issue 40's target: each rank within 1/N + 10 % of the unsharded peak).

Measured as `peer bench memory` measures (`peer.research.bench.memory.measure`): the peak of live CPU
tensor bytes from torch's own allocator accounting, plus what numpy holds at the end, each in a fresh
process. The unsharded replica is `peer bench memory`'s full-replica case: every stage's `StageWorker`,
two inner steps with a round between them (its own payloads committed). Each of the N sharded ranks
(torchrun, gloo) runs the same: `ShardedChain` (FSDP2 shards of parameters, gradients and AdamW
state) and every stage's `BandedStage` (its rows of θ_start and the error buffer), two inner steps
with the round on the bands between them (`round_alone`: encode, rank 0's plan, every rank commits
its rows). Each rank draws a batch of the same size as the unsharded replica's, so activations are
alike and the difference is the state.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from peer.config import RunConfig
from peer.core.subspace.compression import make_basis
from peer.node.replica.bands import BandedStage, round_alone
from peer.node.replica.group import ReplicaGroup
from peer.node.replica.ranks import exit_now
from peer.node.replica.sharded import ShardedChain
from peer.research.bench.memory import PHASE, Case, _numpy_bytes, _torch_peaks, measure
from peer.research.bench.replica import bench_config


def sharded_rank(cfg: RunConfig, report: Path) -> None:
    """This rank's peak over building the sharded replica, two inner steps and a round on the bands
    between them, and within each of those phases; rank 0 writes every rank's {"peak", "phases", "held",
    "bands"} to `report`."""
    torch.set_num_threads(1)
    group = ReplicaGroup.from_env()
    group.open("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    b, L, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    gen = torch.Generator().manual_seed(1000 + rank)
    gc.collect()
    tracemalloc.start()
    numpy_before = _numpy_bytes()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function(PHASE + "build"):
            chain = ShardedChain(cfg, "cpu", "fp32")
            U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
            bands = [BandedStage(m, cfg, U) for m in chain.stages]
        for h in range(2):
            tokens = torch.randint(V, (b, L + 1), generator=gen)  # (b, L+1)
            with record_function(PHASE + f"step {h}"):
                chain.step(0, h, tokens[:, :-1], tokens[:, 1:])
            if h == 0:
                with record_function(PHASE + "round"):
                    round_alone(bands, 0)
    numpy_held = _numpy_bytes() - numpy_before
    tracemalloc.stop()
    peaks = _torch_peaks(prof)
    mine = {"peak": peaks.pop("") + numpy_held, "phases": peaks, "held": chain.held_bytes()}
    mine["bands"] = sum(x.held_bytes() for x in bands)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        report.write_text(json.dumps({"ranks": every}))
    dist.barrier()
    exit_now(0)  # as `peer join --sharded` exits (torch 2.13's exit after FSDP2 on gloo can abort)


def whole_case(cfg: RunConfig) -> Case:
    """`peer bench memory`'s full-replica case of the same model, batch and micro-batches."""
    micro = cfg.train.microbatches
    return Case(
        cfg.preset,
        cfg.stages,
        None,
        in_flight=micro,
        microbatch_size=cfg.train.batch_size // micro,
        seq_len=cfg.train.seq_len,
    )


def run_bench(ranks: int, args: list[str], progress: Callable[[str], None]) -> dict[str, Any]:
    """The unsharded replica's peak (one process) and each of `ranks` sharded ranks' (torchrun)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    me = [sys.executable, "-m", "peer.research.bench.replica_memory"]
    with tempfile.TemporaryDirectory(prefix="peer-bench-replica-memory-") as tmp:
        report = Path(tmp) / "report.json"
        progress("the unsharded replica (one process)")
        _check([*me, "whole", *args, str(report)], env)
        whole = json.loads(report.read_text())
        progress(f"{ranks} sharded ranks (torchrun, gloo)")
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
        _check([*torchrun, "-m", "peer.research.bench.replica_memory", "sharded", *args, str(report)], env)
        sharded = json.loads(report.read_text())["ranks"]
    peaks = [r["peak"] for r in sharded]
    return {
        "ranks": ranks,
        "whole_peak": whole["peak"],
        "rank_peaks": peaks,
        "rank_held": [r["held"] for r in sharded],
        "rank_bands": [r["bands"] for r in sharded],
        "rank_phases": [r["phases"] for r in sharded],  # each rank's peak in build, step 0, round, step 1
        "worst_share": max(peaks) / whole["peak"],  # the target: ≤ 1/N + 0.1
        "target_share": 1 / ranks + 0.1,
    }


def _check(cmd: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{_first_traceback(done.stderr)}")


def _first_traceback(stderr: str, limit: int = 4000) -> str:
    """The first worker's traceback in torchrun's stderr (the cause; what follows is the other ranks
    and torchrun's summary of them), or the end of stderr when there is none."""
    start = stderr.find("Traceback (most recent call last)")
    if start < 0:
        return stderr.strip()[-limit:]
    end = stderr.find("Traceback (most recent call last)", start + 1)
    return stderr[start : end if end > 0 else None].strip()[:limit]


def main(argv: list[str]) -> int:
    """`python -m peer.research.bench.replica_memory whole|sharded PRESET STAGES BATCH SEQ MICRO REPORT`:
    `whole` writes {"peak": bytes} to REPORT; `sharded` (under torchrun) every rank's figures."""
    if len(argv) != 7 or argv[0] not in ("whole", "sharded"):
        sys.stderr.write(f"usage: {main.__doc__}\n")
        return 2
    preset, stages, batch, seq, micro = argv[1], *map(int, argv[2:6])
    cfg, report = bench_config(preset, stages, batch, seq, micro), Path(argv[6])
    if argv[0] == "whole":
        torch.set_num_threads(1)
        report.write_text(json.dumps({"peak": measure(whole_case(cfg))}))
        return 0
    sharded_rank(cfg, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
