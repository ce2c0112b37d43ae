"""`peer bench memory`: the memory estimate (`peer.core.memory`) against the measured peak.

Each case runs the real code on the CPU: a pipeline stage is a `StageWorker` that runs K
micro-batches forward (their activations wait in `pending`, as the in-flight window keeps them),
then their backward, the optimizer step, a round (`contribute` → `apply_round` with its own
payload), and a second inner step with the round's state in place (θ_start and the state committed
from, the error buffer); a full replica chains every stage's `StageWorker` uncompressed through
`peer.core.model.inner.accumulate`, steps each with the global norm, and runs every stage's round, as
`peer.node.trainer` does.

What is measured: the peak of live CPU tensor bytes, from torch's own allocator accounting
(`torch.profiler.profile(profile_memory=True)`: every CPU allocation and free is reported with the
running total, "Total Allocated"), plus the memory numpy owns at the end (tensors made with
`torch.from_numpy` by the portable commit and the codec are invisible to torch's allocator; numpy
reports its buffers to `tracemalloc`, and that state — θ_start, the error buffer — is alive at the
peak of the second inner step, so it is added to it). That is what the estimate counts (tensors),
without what RSS adds and removes at random: glibc keeping freed arenas, fragmentation, ~220 MiB
of lazily loaded kernels and thread pools on first use, the Python heap. Peak RSS of the same
cases is reported beside it by `--rss` (a fresh process per case: VmHWM after minus before
building the stage; dominated by those libraries for tiny and small stages).

bf16 and activation checkpointing are applied here by `_worker` (autocast around the stage's
forward; each block under non-reentrant `torch.utils.checkpoint`) — the same ops the real options
of `StageWorker` switch on.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from peer.config import RunConfig, build_config
from peer.core.memory import StageMemory, estimate_replica, estimate_stage
from peer.core.model.chain import global_grad_norm
from peer.core.model.inner import accumulate
from peer.node.replica.data_parallel import chain_loss
from peer.node.stage.worker import StageWorker

NUMPY_DOMAIN = 389047  # numpy's tracemalloc domain of array data (NPY_TRACE_DOMAIN)


@dataclass(frozen=True)
class Case:
    """One measured configuration: `stage` None is a full replica of `stages` stages."""

    preset: str
    stages: int
    stage: int | None
    precision: str = "fp32"
    checkpointing: bool = False
    in_flight: int = 2
    microbatch_size: int = 4
    seq_len: int = 64

    @property
    def name(self) -> str:
        who = "full" if self.stage is None else f"{self.stage}/{self.stages}"
        ckpt = "+ckpt" if self.checkpointing else ""
        return f"{self.preset} {who} {self.precision}{ckpt} K={self.in_flight}"


def run_config(case: Case) -> RunConfig:
    """The run of a case: K micro-batches per inner step, all of them in flight at once."""
    return build_config(
        overrides={
            "preset": case.preset,
            "stages": case.stages,
            "train.microbatches": case.in_flight,
            "train.batch_size": case.in_flight * case.microbatch_size,
            "train.seq_len": case.seq_len,
        }
    )


def estimate(case: Case) -> StageMemory:
    cfg = run_config(case)
    shape: dict[str, Any] = {
        "microbatch_size": case.microbatch_size,
        "seq_len": case.seq_len,
        "precision": case.precision,
    }
    modes: dict[str, Any] = {"checkpointing": case.checkpointing, "k": cfg.k, "replicas": 1, **shape}
    if case.stage is None:
        return estimate_replica(cfg.model, case.stages, **modes)
    return estimate_stage(cfg.model, case.stage, case.stages, in_flight=case.in_flight, **modes)


def _worker(cfg: RunConfig, stage: int, compressed: bool, precision: str, checkpointing: bool) -> StageWorker:
    """A StageWorker computing in `precision`, its blocks checkpointed when asked (as `peer join` builds it)."""
    return StageWorker(cfg, stage, compressed, "cpu", precision, checkpointing)


def _stage_steps(case: Case, cfg: RunConfig) -> list[StageWorker]:
    """Two inner steps of K micro-batches in flight on one stage, with a round between them."""
    assert case.stage is not None
    torch.manual_seed(0)
    worker = _worker(cfg, case.stage, True, case.precision, case.checkpointing)
    b, L, K = case.microbatch_size, case.seq_len, case.in_flight
    for h in range(2):
        tokens = [torch.randint(0, cfg.model.vocab_size, (b, L)) for _ in range(K)]
        hidden = None if worker.is_first else torch.randn(b, L, cfg.k)
        for mb in range(K):
            worker.forward(("p", mb), tokens[mb], hidden, tokens[mb] if worker.is_last else None)
        if not worker.is_last:
            for mb in range(K):
                worker.backward(("p", mb), torch.randn(b, L, cfg.k) * 1e-3)
        worker.step(0, h)
        if h == 0:
            worker.apply_round([worker.contribute("r0")], None, ["r0"])
    return [worker]


def _replica_steps(case: Case, cfg: RunConfig) -> list[StageWorker]:
    """A full replica's two inner steps (micro-batches one after another) with a round between."""
    torch.manual_seed(0)
    chain = [_worker(cfg, s, False, case.precision, case.checkpointing) for s in range(case.stages)]
    n = case.in_flight
    for h in range(2):
        x = torch.randint(0, cfg.model.vocab_size, (n * case.microbatch_size, case.seq_len + 1))
        accumulate(lambda mx, my: (chain_loss(chain, mx, my), 0), x[:, :-1], x[:, 1:], n)
        norm = global_grad_norm(w.grad_sq_norm() for w in chain)
        for w in chain:
            w.step(0, h, norm)
        if h == 0:
            for w in chain:
                w.apply_round([w.contribute("r0")], None, ["r0"])
    return chain


def measure(case: Case) -> int:
    """Peak live CPU tensor bytes while the case runs (torch's allocator accounting), plus what
    numpy holds at its end (see the module docstring)."""
    cfg = run_config(case)
    run: Callable[[Case, RunConfig], list[StageWorker]] = _replica_steps if case.stage is None else _stage_steps
    gc.collect()  # what an earlier case left in reference cycles, freed during this one, would hide bytes
    tracemalloc.start()
    try:
        numpy_before = _numpy_bytes()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            held = run(case, cfg)
        numpy_held = _numpy_bytes() - numpy_before
        del held
    finally:
        tracemalloc.stop()
    return _torch_peak(prof) + numpy_held


def _numpy_bytes() -> int:
    """Bytes numpy's buffers hold now (numpy traces them in its own tracemalloc domain)."""
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.DomainFilter(True, NUMPY_DOMAIN)])
    return sum(stat.size for stat in snapshot.statistics("filename"))


PHASE = "phase: "  # the prefix of a `torch.profiler.record_function` range that `_torch_peaks` reports on


def _torch_peak(prof: torch.profiler.profile) -> int:
    """The largest running total of live CPU tensor bytes during a profile, from its start."""
    return _torch_peaks(prof)[""]


def _torch_peaks(prof: torch.profiler.profile) -> dict[str, int]:
    """`_torch_peak` ("") and the same peak within each range the profiled code named `PHASE` + name
    (`torch.profiler.record_function`), by name: which part of a run sets the peak."""
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events: list[dict[str, Any]] = json.loads(trace.read_text())["traceEvents"]
    memory = [e for e in events if e.get("name") == "[memory]" and e["args"]["Device Type"] == 0]
    named = (e for e in events if str(e.get("name", "")).startswith(PHASE) and e.get("ph") == "X")
    phases = sorted(named, key=lambda e: float(e["ts"]))
    if not memory:
        return {"": 0, **{e["name"][len(PHASE) :]: 0 for e in phases}}
    # the running total is process-wide and kept between profiles: count from where this one began
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    out = {"": max(m["args"]["Total Allocated"] for m in memory) - start}
    for ph in phases:
        a, b = float(ph["ts"]), float(ph["ts"]) + float(ph["dur"])
        inside = [m["args"]["Total Allocated"] for m in memory if a <= float(m["ts"]) <= b]
        out[ph["name"][len(PHASE) :]] = max(inside, default=start) - start
    return out


def _hwm_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def measure_rss(case: Case) -> int:
    """Peak RSS growth of the case in a fresh process (VmHWM after − before the stage is built)."""
    code = (
        "import json, sys; from peer.research.bench.memory import Case, _rss_child; "
        "print(_rss_child(Case(**json.loads(sys.argv[1]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(asdict(case))],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ,
    )
    return int(out.stdout.strip().splitlines()[-1])


def _rss_child(case: Case) -> int:
    cfg = run_config(case)
    before = _hwm_kib()
    (_replica_steps if case.stage is None else _stage_steps)(case, cfg)
    return 1024 * (_hwm_kib() - before)


def default_cases(presets: tuple[str, ...] = ("tiny", "small")) -> Iterator[Case]:
    """Stage 0, a middle or last stage, the last stage and a full replica of each preset; fp32 and
    bf16, with and without checkpointing."""
    for preset in presets:
        stages, shape = (2, {"seq_len": 64}) if preset == "tiny" else (4, {"seq_len": 128})
        for precision in ("fp32", "bf16"):
            for ckpt in (False, True):
                for stage in (0, 1, stages - 1, None) if stages > 2 else (0, 1, None):
                    yield Case(preset, stages, stage, precision, ckpt, in_flight=4, **shape)


def warm_up() -> None:
    """Run one tiny case unmeasured: what the first run in a process creates once (lazily built
    tables and caches of the codec and the commit, a few MiB) is not any stage's memory."""
    _stage_steps(Case("tiny", 2, 0, in_flight=1, microbatch_size=1, seq_len=8), run_config(Case("tiny", 2, 0)))


def bench_memory(cases: list[Case], rss: bool = False) -> list[dict[str, Any]]:
    """One row per case: the estimate, the measured peak and the error."""
    warm_up()
    rows = []
    for case in cases:
        est = estimate(case).peak
        measured = measure(case)
        row = {"case": case.name, "estimate": est, "measured": measured, "error": est / measured - 1}
        if rss:
            row["rss"] = measure_rss(case)
        rows.append(row)
    return rows
