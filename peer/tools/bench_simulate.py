"""Benchmark of `peer simulate`'s speed: the same sweep on the old path and the new one, bit for bit.

    PYTHONPATH=. python -m peer.tools.bench_simulate            (or: peer bench simulate)

Runs M = 4 replicas of the tiny preset through adamw, sparseloco, pp-compress and het-pp-compress
(H = 10, T outer steps) three ways, in this order: `old` — in this process with every payload
decoded densely before the commit (the simulator before issue 25); `fused` — in this process with the
fused commit of parsed payloads; `new` — the replicas on worker processes (all cores, at most M) with
the fused commit. It checks that every train and validation curve value, every held-out sequence
loss and every byte count is the same bits on all three, then prints the wall times and speed-ups.
A timing, not a test: the machine's load moves it (say which when quoting it).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from peer.core.loader import load_corpus
from peer.tools import experiments as ex
from peer.tools.sim_pool import default_workers
from peer.tools.sim_results import ConfigResult, SimOptions
from peer.tools.sim_runtime import session

CONFIGS = "adamw,sparseloco,pp-compress,het-pp-compress"


def fingerprint(results: list[ConfigResult]) -> list[Any]:
    """Everything a run measured, as exact values (float hex, bytes of the held-out losses)."""
    out = []
    for r in results:
        seqs = None if r.val_sequences is None else r.val_sequences.double().numpy().tobytes().hex()
        out.append(
            (
                r.name,
                [(s, v.hex()) for s, v in r.train_curve],
                [(s, v.hex()) for s, v in r.val_curve],
                seqs,
                r.pg_bytes,
                r.act_bytes,
                r.clipped,
                r.dropped,
            )
        )
    return out


def bench(outer_steps: int = 6, inner_steps: int = 10, replicas: int = 4, workers: int | None = None) -> dict[str, Any]:
    """Wall seconds of the three paths and whether their results are the same bits."""
    overrides = {"preset": "tiny", "train.outer_steps": outer_steps, "train.inner_steps": inner_steps}
    cfg, names, seeds, ratios, opts = ex.plan_sweep(None, overrides, CONFIGS, None, None, False, replicas, SimOptions())
    data = load_corpus(cfg.data)
    n = workers or default_workers(replicas)
    paths = {"old": (1, False), "fused": (1, True), "new": (n, True)}
    walls: dict[str, float] = {}
    prints: dict[str, list[Any]] = {}
    for name, (w, fused) in paths.items():
        started = time.perf_counter()
        with session(workers=w, fused_commit=fused):
            results = ex.run_sweep(cfg, data, names, seeds, ratios, opts)
        walls[name] = time.perf_counter() - started
        prints[name] = fingerprint(results)
    same = prints["old"] == prints["fused"] == prints["new"]
    return {
        "configs": CONFIGS,
        "replicas": replicas,
        "inner_steps": inner_steps,
        "outer_steps": outer_steps,
        "workers": n,
        "wall_s": {k: round(v, 2) for k, v in walls.items()},
        "speedup_fused": walls["old"] / walls["fused"],
        "speedup_new": walls["old"] / walls["new"],
        "bit_identical": same,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outer-steps", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=10)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--workers", type=int, default=None)
    a = parser.parse_args(argv)
    out = bench(a.outer_steps, a.inner_steps, a.replicas, a.workers)
    w = out["wall_s"]
    print(
        f"peer simulate, tiny, M={out['replicas']}, H={out['inner_steps']}, T={out['outer_steps']}, {out['configs']}\n"
        f"  old   (in process, dense decode then commit): {w['old']:8.2f} s\n"
        f"  fused (in process, fused commit):              {w['fused']:8.2f} s   {out['speedup_fused']:.2f}x\n"
        f"  new   ({out['workers']} workers, fused commit):            {w['new']:8.2f} s   {out['speedup_new']:.2f}x\n"
        f"  results bit-identical on all three: {out['bit_identical']}"
    )
    return 0 if out["bit_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
