"""`peer bench replica`: a full replica's tokens/s on one rank and one core against N ranks under
torchrun, each rank on its own core with one torch thread (issue 22's target: 2 ranks ≥ 1.7×);
`--sharded`: the N ranks shard the replica (`peer.node.replica.sharded`, issue 40: ≥ 1.6×).

Both run the code `peer join --full-replica` runs for its inner steps, without a swarm: the stage
workers of every stage, `peer.node.replica.data_parallel.chain_step` with the one-process micro-batch
forward (`peer.node.replica.data_parallel.chain_loss`), or with N ranks the DDP forward the ranks of a replica
use (`peer.node.replica.ranks.parallel_chain`, gloo). Each rank draws its own batch of random
tokens every step; tokens/s counts every rank's tokens over the measured steps (after warm-up).
A worker is `python -m peer.research.bench.replica worker …` (under torchrun for N ranks); `command`
runs both `repeats` times, alternating, and reports the medians and their ratio.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from peer.config import RunConfig, build_config
from peer.node.replica.data_parallel import DataParallel, chain_loss, chain_step
from peer.node.replica.group import ReplicaGroup, launched_ranks
from peer.node.replica.ranks import exit_now, parallel_chain
from peer.node.replica.sharded import ShardedChain
from peer.node.stage.worker import StageWorker


def bench_config(preset: str, stages: int, batch_size: int, seq_len: int, microbatches: int) -> RunConfig:
    return build_config(
        overrides={
            "preset": preset,
            "stages": stages,
            "train.batch_size": batch_size,
            "train.seq_len": seq_len,
            "train.microbatches": microbatches,
            "train.inner_steps": 1000,
        },
        environ={},
    )


def worker(
    cfg: RunConfig, warmup: int, steps: int, report: Path, sharded: bool = False, per_step: bool = False
) -> None:
    """This rank's inner steps; rank 0 writes {"tokens_per_s", "ranks", "step_s", "held"} to `report`
    ("held": the bytes of parameters and AdamW state each rank holds after the last step)."""
    torch.set_num_threads(1)
    ranks = launched_ranks()
    rank = int(os.environ.get("RANK", "0"))
    if ranks > 1 and hasattr(os, "sched_setaffinity"):  # one core per rank (torchrun does not pin)
        os.sched_setaffinity(0, {int(os.environ.get("LOCAL_RANK", "0")) % (os.cpu_count() or 1)})
    shards: ShardedChain | None = None
    parallel: DataParallel | None = None
    chain = [] if sharded and ranks > 1 else [StageWorker(cfg, s, compressed=False) for s in range(cfg.stages)]
    if ranks > 1:
        group = ReplicaGroup.from_env()
        group.open("cpu")
        if sharded:
            shards = ShardedChain(cfg, "cpu", "fp32", per_step)
        else:
            parallel = parallel_chain(chain, group)
        forward: Callable[[], Any] = parallel.forward if parallel is not None else lambda: None
    else:
        forward = lambda: lambda x, y: (chain_loss(chain, x, y), 0)  # noqa: E731 - `_Full.forward`'s
    gen = torch.Generator().manual_seed(1000 + rank)
    b, L, V = cfg.train.batch_size, cfg.train.seq_len, cfg.model.vocab_size
    t0 = 0.0
    for h in range(warmup + steps):
        if h == warmup:
            if ranks > 1:
                dist.barrier()  # the ranks start the measured steps together
            t0 = time.perf_counter()
        tokens = torch.randint(V, (b, L + 1), generator=gen)  # (b, L+1)
        if shards is not None:
            shards.step(0, h, tokens[:, :-1], tokens[:, 1:])
        else:
            chain_step(chain, forward(), 0, h, tokens[:, :-1], tokens[:, 1:])
    measured = time.perf_counter() - t0
    held = [_held(chain, shards)]
    if ranks > 1:
        dist.barrier()
        every: list[Any] = [None] * ranks
        dist.all_gather_object(every, held[0])
        held = every
    if rank == 0:
        result = {"ranks": ranks, "tokens_per_s": steps * b * L * ranks / measured, "step_s": measured / steps}
        report.write_text(json.dumps(result | {"held": held, "sharded": shards is not None}))
    if ranks > 1:
        forward, parallel = lambda: None, None  # DDP's reducer goes before its process group (its teardown can hang)
        if shards is not None:
            exit_now(0)  # as `peer join --sharded` exits
        group.close()


def _held(chain: list[StageWorker], shards: ShardedChain | None) -> int:
    """Bytes of parameters and AdamW state this rank holds (its shards, or every stage whole)."""
    if shards is not None:
        held = shards.held_bytes()
        return held["params"] + held["optimizer"]
    params = [p for w in chain for p in w.module.parameters()]
    moments = [v for w in chain for st in w.optim.adamw.state.values() for v in st.values() if v.ndim > 0]
    return sum(p.nbytes for p in params) + sum(v.nbytes for v in moments)


def _run(ranks: int, args: list[str], report: Path) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    worker_cmd = ["-m", "peer.research.bench.replica", "worker", *args, "--report", str(report)]  # args: `main`
    if ranks == 1:
        cmd = ["taskset", "-c", "0", sys.executable, *worker_cmd]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"]
        cmd += worker_cmd
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(report.read_text())
    report.unlink()
    return out


def run_bench(ranks: int, repeats: int, args: list[str], progress: Callable[[str], None]) -> dict[str, Any]:
    """1 rank and `ranks` ranks, `repeats` times each (alternating); the medians and the speed-up."""
    if (os.cpu_count() or 1) < ranks:
        progress(f"only {os.cpu_count()} cores for {ranks} ranks: ranks share cores, the speed-up is not meaningful")
    report = Path(tempfile.mkdtemp(prefix="peer-bench-replica-")) / "report.json"
    runs: dict[int, list[float]] = {1: [], ranks: []}
    held: dict[int, list[int]] = {}
    for i in range(repeats):
        for n in (1, ranks):
            r = _run(n, args, report)
            runs[n].append(r["tokens_per_s"])
            held[n] = r["held"]
            rate, step_s = r["tokens_per_s"], r["step_s"]
            progress(f"run {i + 1}/{repeats}: {n} rank(s): {rate:,.0f} tokens/s ({step_s:.3f} s per inner step)")
    one, many = statistics.median(runs[1]), statistics.median(runs[ranks])
    return {
        "ranks": ranks,
        "tokens_per_s": {"1": runs[1], str(ranks): runs[ranks]},
        "median_1": one,
        f"median_{ranks}": many,
        "speedup": many / one,
        "held_bytes": {str(n): h for n, h in held.items()},  # per rank: parameters + AdamW state
        "load_avg": os.getloadavg()[0],
    }


def main(argv: list[str]) -> int:
    """`python -m peer.research.bench.replica worker PRESET STAGES BATCH SEQ MICRO WARMUP STEPS [--sharded]
    [--gather-per-step] --report F`."""
    sharded, per_step = "--sharded" in argv, "--gather-per-step" in argv
    argv = [a for a in argv if a not in ("--sharded", "--gather-per-step")]
    if len(argv) != 10 or argv[0] != "worker" or argv[8] != "--report":
        sys.stderr.write(f"usage: {main.__doc__}\n")
        return 2
    preset, stages, batch, seq, micro, warmup, steps = argv[1], *map(int, argv[2:8])
    worker(bench_config(preset, stages, batch, seq, micro), warmup, steps, Path(argv[9]), sharded, per_step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
