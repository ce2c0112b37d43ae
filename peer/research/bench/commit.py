"""`peer bench commit`: what committing one round costs at a preset's stage shapes, by device and threads, and its bits.

A round (`make_round`): a stage's initial state (θ_start and T⊥, the run's canonical initialisation)
and M synthetic contributions — canonical-normal pseudo-gradients at a realistic scale (1e-3),
compressed with the run's SparseLoCo settings — saved as files, so every process commits the same
bytes. Two commits of it are timed, each from the wire bytes to the state's hash:
- `portable`: `peer.node.stage.commit.compute` → `peer.core.sparseloco.commit.commit_state`, what every
  holder runs (the fused clip, screen and aggregate of the payloads — no dense Δ̂, issue 24 —,
  θ_start − η·Δ̄, the float64 fixed-order T_S/T⊥ re-projection, T⊥ decay, hashes and the ban
  state), once per device (`--device`: where the elementwise steps run) and thread count
  (`--threads`: torch's thread count, which also sizes the codec's pool), the configurations taken
  in turn `repeats` times so that a machine's drift falls on all of them alike; each reports its
  median seconds and the state id it committed, which must be one id for all (the commit's bits
  depend on neither; docs/protocol.md, "The portable commit");
- `legacy`: the commit as it was before issue 20 (every payload decoded densely, then the dense
  clip, screen and aggregation, then torch's vectorised outer step and the T_S/T⊥ re-projection by
  two BLAS matmuls per Π, as `embedding_outer_update` computed it then), for the before/after
  figure, at the process's own thread count.

`python -m peer.research.bench.commit DIR...` commits the rounds saved in each DIR in a fresh process
and writes one JSON line to stdout, its wire protocol with the parent (state ids, seconds, torch's CPU
capability, threads): the multi-kernel test
(tests/integration/test_portable_commit.py) runs it under other kernel sets and thread counts,
building the initial state itself each time, and expects one state id.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peer.config import RunConfig, build_config
from peer.core.model.decoder import build_stage, stage_shapes
from peer.core.model.state import stage_state, state_hash
from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import perp_decay, robust_aggregate
from peer.core.sparseloco.portable import canonical_normal
from peer.core.subspace.compression import make_basis
from peer.core.subspace.state import EMBED, initial_split
from peer.node.round.bans import NONE as NO_BANS
from peer.node.stage.commit import compute

META = "round.json"


@dataclass(frozen=True)
class Round:
    """A saved round: where, the run's overrides, the stages committed in order, M contributions."""

    path: Path
    overrides: dict[str, Any]
    stages: tuple[int, ...]
    replicas: int

    @property
    def cfg(self) -> RunConfig:
        return build_config(overrides=self.overrides, environ={})

    def payloads(self, stage: int) -> list[Payload]:
        return [Payload.from_bytes((self.path / f"s{stage}-{m}.bin").read_bytes()) for m in range(self.replicas)]

    @classmethod
    def load(cls, path: Path) -> Round:
        meta = json.loads((path / META).read_text())
        return cls(path, meta["overrides"], tuple(meta["stages"]), int(meta["replicas"]))


def initial_state(cfg: RunConfig, stage: int) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(θ_start, T⊥, U) of a stage at outer step 0, as every holder builds it."""
    module = build_stage(cfg.model, stage, cfg.stages, cfg.seed)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    w, perp = initial_split(cfg, U)
    start = stage_state(module)
    if EMBED in start:
        start[EMBED] = w
    return start, perp, U


def make_round(path: Path, overrides: Mapping[str, Any], stages: Sequence[int], replicas: int) -> Round:
    """Write a round of `replicas` contributions to each of `stages` under `path` (see the module)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = build_config(overrides=dict(overrides), environ={})
    for s in stages:
        module = build_stage(cfg.model, s, cfg.stages, cfg.seed)
        for m in range(replicas):
            delta = {
                name: canonical_normal(1_000_003 * (m + 1) + 7919 * s + i, tuple(p.shape), 1e-3)
                for i, (name, p) in enumerate(module.named_parameters())
            }
            payload, _ = compress(delta, None, cfg.sparseloco)
            (path / f"s{s}-{m}.bin").write_bytes(payload.to_bytes())
    meta = {"overrides": dict(overrides), "stages": list(stages), "replicas": replicas}
    (path / META).write_text(json.dumps(meta))
    return Round.load(path)


def commit_portable(rnd: Round, device: str | None = None) -> dict[str, Any]:
    """Commit the round's stages in order (stage 0's change moves the others' T⊥), the elementwise
    steps on `device` (None: the CPU): state ids, seconds, and the CPU seconds of all the process's
    threads (on a machine others share, wall seconds over CPU seconds says how much of it we got)."""
    cfg, out, seconds, cpu, update = rnd.cfg, {}, 0.0, 0.0, None
    for s in rnd.stages:
        start, perp, U = initial_state(cfg, s)
        payloads = rnd.payloads(s)
        ids = [f"replica-{m:02d}-{'x' * 16}" for m in range(rnd.replicas)]
        began, began_cpu = time.perf_counter(), time.process_time()
        done = compute(cfg, s, U, 0, start, perp, NO_BANS, payloads, ids, update if s else None, device)
        seconds += time.perf_counter() - began
        cpu += time.process_time() - began_cpu
        out[str(s)] = done.state
        if s == 0:
            update = done.committed.commit.embed_update
    return {"states": out, "seconds": seconds, "cpu_s": cpu}


def commit_legacy(rnd: Round) -> dict[str, Any]:
    """The pre-issue-20 commit of the same round (see the module docstring): hashes, seconds."""
    cfg, out, seconds = rnd.cfg, {}, 0.0
    slc = cfg.sparseloco
    for s in rnd.stages:
        start, perp, U = initial_state(cfg, s)
        payloads = rnd.payloads(s)
        began = time.perf_counter()
        decoded = [decompress(p) for p in payloads]
        keys = [f"replica-{m:02d}-{'x' * 16}" for m in range(rnd.replicas)]
        summed, _, _ = robust_aggregate(decoded, slc, keys=keys)
        perp = perp * perp_decay(cfg.train, 0)
        params = {n: v - slc.outer_lr * summed[n] if n in summed else v.clone() for n, v in start.items()}
        if EMBED in start:
            update = -slc.outer_lr * summed[EMBED]
            residual = update - (update @ U) @ U.T  # perp_outer_update's Π
            perp = perp + residual
            params[EMBED] = start[EMBED] + (update - (update - (update @ U) @ U.T))  # and again for T_S
        out[str(s)] = state_hash(params) + state_hash({"perp": perp})
        seconds += time.perf_counter() - began
    return {"states": out, "seconds": seconds}


def bench_commit(
    path: Path,
    preset: str = "178M",
    stages: int = 2,
    stage: int = 0,
    replicas: int = 4,
    repeats: int = 3,
    threads: Sequence[int] = (),
    devices: Sequence[str] = ("cpu",),
) -> dict[str, Any]:
    """Time the portable commit of one round of `stage` on each device × thread count (`threads`
    empty: torch's own count) and the legacy commit; medians of `repeats`, the configurations taken
    in turn. `runs` holds one row per configuration (seconds, each run, the state id)."""
    overrides = {"model.preset": preset, "stages": stages}
    rnd = make_round(path, overrides, [stage], replicas)
    n_params = sum(math.prod(shape) for shape in stage_shapes(rnd.cfg.model, stage, stages).values())
    own = torch.get_num_threads()
    configs = [(d, n) for d in devices for n in (threads or [own])]
    seconds: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    cpu: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    states: dict[tuple[str, int], str] = {}
    legacy = []
    try:
        for _ in range(repeats):
            for device, n in configs:
                torch.set_num_threads(n)
                p = commit_portable(rnd, None if device == "cpu" else device)
                seconds[(device, n)].append(p["seconds"])
                cpu[(device, n)].append(p["cpu_s"])
                states[(device, n)] = p["states"][str(stage)]
            torch.set_num_threads(own)
            legacy.append(commit_legacy(rnd)["seconds"])
    finally:
        torch.set_num_threads(own)
    runs = [
        {"device": d, "threads": n, "seconds": statistics.median(seconds[(d, n)]), "runs_s": seconds[(d, n)],
         "cpu_s": statistics.median(cpu[(d, n)]), "state": states[(d, n)]}
        for d, n in configs
    ]  # fmt: skip
    first = runs[0]
    return {
        "preset": preset,
        "stages": stages,
        "stage": stage,
        "params": n_params,
        "replicas": replicas,
        "portable_s": first["seconds"],
        "legacy_s": statistics.median(legacy),
        "ratio": first["seconds"] / statistics.median(legacy),
        "legacy_runs_s": legacy,
        "state": first["state"],
        "one_state": len({r["state"] for r in runs}) == 1,
        "runs": runs,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": own,
    }


def check_flags(
    replicas: int, repeats: int, stages: int, threads: str = "", devices: str = "cpu"
) -> tuple[list[int], list[str]]:
    """`peer bench commit`'s flags: each count 1 or more, `threads` a comma-separated list of them
    (empty: torch's own), `devices` of "cpu" and CUDA devices this machine has. Returns both lists."""
    from peer.errors import ConfigError

    if replicas < 1 or repeats < 1 or stages < 1:
        raise ConfigError("--replicas, --repeats and --stages must be 1 or more")
    try:
        counts = [int(x) for x in threads.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--threads takes thread counts separated by commas, like 1,2,4; got {threads!r}") from None
    if any(n < 1 for n in counts):
        raise ConfigError(f"--threads: every thread count must be 1 or more, got {threads!r}")
    names = [d.strip() for d in devices.split(",") if d.strip()] or ["cpu"]
    for d in names:
        if d != "cpu" and not (d.startswith("cuda") and torch.cuda.is_available()):
            raise ConfigError(f"--device {d}: use cpu, or cuda on a machine where torch sees a CUDA device")
    return counts, names


def commit_rounds(paths: Sequence[Path]) -> dict[str, Any]:
    """Commit each round saved in `paths`: {"rounds": {directory name: {stage: state id}}, "seconds": ...,
    "cpu_capability": ..., "threads": ...}."""
    rounds, seconds = {}, 0.0
    for path in paths:
        done = commit_portable(Round.load(Path(path)))
        rounds[Path(path).name] = done["states"]
        seconds += done["seconds"]
    result: dict[str, Any] = {"rounds": rounds, "seconds": seconds}
    result.update(cpu_capability=torch.backends.cpu.get_cpu_capability(), threads=torch.get_num_threads())
    return result


def main(argv: Sequence[str]) -> int:
    """A child: `commit_rounds(argv)` as one JSON line on stdout — the wire protocol with the parent
    that started it (tests/integration/test_portable_commit.py), not output for a person.
    $PEER_COMMIT_THREADS sets torch's thread count (which sizes the commit's kernel pool too) and
    limits the cores this process may use to as many (all there are, when it has fewer)."""
    threads = int(os.environ.get("PEER_COMMIT_THREADS", "0"))
    if threads:
        torch.set_num_threads(threads)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    print(json.dumps(commit_rounds([Path(a) for a in argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
