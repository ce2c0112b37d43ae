"""An owner's shard is portable: the same parts give the same shard bytes on every kernel set and thread count.

The round: stage 0 of `small` (2 stages), 8 contributions cut into R = 16 ranges (`encode_parts`), one
of them 30× larger (so median clipping runs) and one not fetched. Each configuration below is a fresh
process that parses the parts (`RangePlan.validator`) and aggregates every range (`aggregate_range`,
topk and exact shards),
as an owner on that hardware would; every one must report the same shard hashes as this process.
Kernel sets are emulated as in test_portable_commit: torch's default kernels, MKL's instruction set
lowered, numba compiling for a generic x86-64 (no AVX, no FMA), with 1 and 2 threads.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "best kernels, 2 threads": {"RANGES_THREADS": "2", "OMP_NUM_THREADS": "2"},
    "avx2, 1 thread": {"ATEN_CPU_CAPABILITY": "avx2", "RANGES_THREADS": "1", "OMP_NUM_THREADS": "1"},
    "no AVX (torch default, MKL SSE4.2, numba generic), 1 thread": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "NUMBA_CPU_NAME": "generic",
        "RANGES_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    },
}
R, M, BIG, MISSING = 16, 8, 3, 5


def _setup():
    from peer.config import build_config
    from peer.core.model.decoder import build_stage

    cfg = build_config(overrides={"model.preset": "small", "stages": 2}, environ={})
    shapes = {n: tuple(p.shape) for n, p in build_stage(cfg.model, 0, cfg.stages, cfg.seed).named_parameters()}
    return cfg.sparseloco, shapes


def make_parts(path: Path) -> None:
    """Write part r of contribution m to path/m-r.bin (contribution MISSING is left out)."""
    from peer.core.sparseloco.portable import canonical_normal
    from peer.core.sparseloco.ranges import encode_parts, plan_ranges

    cfg, shapes = _setup()
    plan = plan_ranges(shapes, cfg.chunk, R)
    path.mkdir(parents=True, exist_ok=True)
    for m in range(M):
        std = 3e-2 if m == BIG else 1e-3
        delta = {n: canonical_normal(1_000_003 * (m + 1) + i, s, std) for i, (n, s) in enumerate(shapes.items())}
        parts, _ = encode_parts(delta, None, cfg, plan)
        if m != MISSING:
            for r, part in enumerate(parts):
                (path / f"{m}-{r}.bin").write_bytes(part.to_bytes())


def aggregate_all(path: Path) -> dict:
    """Aggregate every range of the parts under `path`: {"shards": [sha256 of the topk and the exact
    shard per range], "seconds", ...}."""
    import torch

    from peer.core.sparseloco.ranges import aggregate_range, plan_ranges, roster_digest

    cfg, shapes = _setup()
    plan = plan_ranges(shapes, cfg.chunk, R)
    roster = roster_digest([(f"replica-{m}", "ab" * 32) for m in range(M)])
    hashes, seconds, dropped = [], 0.0, 0.0
    for r in range(R):
        check = plan.validator(r, cfg)
        parts = [check((path / f"{m}-{r}.bin").read_bytes()) if m != MISSING else None for m in range(M)]
        began = time.perf_counter()
        shard, stats = aggregate_range(4, 0, r, plan, parts, roster, cfg)
        seconds += time.perf_counter() - began
        assert stats.n_clipped >= 1 and stats.n_included == M - 1
        hashes.append(hashlib.sha256(shard.to_bytes()).hexdigest()[:16])
        exact, _ = aggregate_range(4, 0, r, plan, parts, roster, cfg, exact=True)  # swarm.shard = "exact"
        hashes.append(hashlib.sha256(exact.to_bytes()).hexdigest()[:16])
        dropped += stats.dropped_sq / stats.dense_sq / R
    cap = torch.backends.cpu.get_cpu_capability()
    return {"shards": hashes, "seconds": seconds, "cpu_capability": cap, "threads": torch.get_num_threads()}


def _child(path: Path, env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, str(path)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_one_range_gives_one_shard_on_every_kernel_set_and_thread_count(tmp_path):
    make_parts(tmp_path / "parts")
    here = aggregate_all(tmp_path / "parts")
    seen = {}
    for name, env in CONFIGS.items():
        got = _child(tmp_path / "parts", env)
        assert got["shards"] == here["shards"], f"{name} ({got['cpu_capability']}, {got['threads']} threads) differs"
        seen[name] = (got["cpu_capability"], got["threads"])
    capabilities = {cap for cap, _ in seen.values()}
    assert "DEFAULT" in capabilities and len(capabilities) >= 2 and {t for _, t in seen.values()} == {1, 2}


def main(path: str) -> None:
    threads = int(os.environ.get("RANGES_THREADS", "0"))
    if threads:
        import torch

        torch.set_num_threads(threads)
        if hasattr(os, "sched_setaffinity"):  # torch's thread count sizes the codec's pool; the cores follow it
            os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:threads])
    print(json.dumps(aggregate_all(Path(path))))


if __name__ == "__main__":
    main(sys.argv[1])
