"""Benchmark of `peer simulate`'s speed: the same sweep on the old path and the new one, bit for bit.

    peer bench simulate            (`bench` returns the figures; the CLI prints them)

Runs M = 4 replicas of the tiny preset through adamw, sparseloco, pp-compress and het-pp-compress
(H = 10, T outer steps) three ways: `old` — in this process with every payload
decoded densely before the commit (the simulator before issue 25); `fused` — in this process with the
fused commit of parsed payloads; `new` — the replicas on worker processes (all cores, at most M) with
the fused commit; old and new again (`--repeats`), interleaved, since the machine's load changes. It
checks that every train and validation curve value, every held-out sequence loss and every byte count is
the same bits on every run, and returns the wall times and the speed-ups (fastest against fastest).
A timing, not a test: the machine's load moves it (say which when quoting it).
"""

from __future__ import annotations

import time
from typing import Any

from peer.core.data.loader import load_corpus
from peer.research.simulate import experiments as ex
from peer.research.simulate.pool import default_workers
from peer.research.simulate.results import ConfigResult, SimOptions
from peer.research.simulate.runtime import session

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
                r.modes,
            )
        )
    return out


def bench(
    outer_steps: int = 4, inner_steps: int = 10, replicas: int = 4, workers: int | None = None, repeats: int = 2
) -> dict[str, Any]:
    """Wall seconds of the three paths (old and new `repeats` times, interleaved, against the machine's
    changing load; the fastest of each counts) and whether their results are the same bits."""
    overrides = {"preset": "tiny", "train.outer_steps": outer_steps, "train.inner_steps": inner_steps}
    cfg, names, seeds, ratios, opts, _ = ex.plan_sweep(None, overrides, CONFIGS, None, None, (), replicas, SimOptions())
    data = load_corpus(cfg.data)
    n = workers or default_workers(replicas)
    paths = {"old": (1, False), "fused": (1, True), "new": (n, True)}
    order = ["old", "fused", "new"] + ["old", "new"] * (repeats - 1)
    walls: dict[str, list[float]] = {name: [] for name in paths}
    prints: dict[str, list[Any]] = {}
    for name in order:
        w, fused = paths[name]
        started = time.perf_counter()
        with session(workers=w, fused_commit=fused):
            results = ex.run_sweep(cfg, data, names, seeds, ratios, opts)
        walls[name].append(time.perf_counter() - started)
        same = prints.setdefault(name, fingerprint(results)) == fingerprint(results)
        prints[name] = prints[name] if same else []
    best = {k: min(v) for k, v in walls.items()}
    return {
        "configs": CONFIGS,
        "replicas": replicas,
        "inner_steps": inner_steps,
        "outer_steps": outer_steps,
        "workers": n,
        "wall_s": {k: [round(x, 2) for x in v] for k, v in walls.items()},
        "speedup_fused": best["old"] / best["fused"],
        "speedup_new": best["old"] / best["new"],
        "bit_identical": prints["old"] == prints["fused"] == prints["new"] != [],
    }
