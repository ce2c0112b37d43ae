"""The commit is portable: one round's bytes give one state on every kernel set and thread count.

Two rounds are written once (`peer.research.bench.commit.make_round`): both stages of `small` (4
contributions: clipping and outlier screening run; stage 0's change moves stage 1's T⊥) and stage 0
of `178M` split in 4 (its 32000 × 1024 embedding: the T_S/T⊥ re-projection at full width; 2
contributions). Each configuration below is a fresh process that builds the initial state itself
(the canonical initialisation is under test too), decodes the payloads and commits, as a holder on
that hardware would; every one must report the same state ids. Kernel sets are emulated as on a
CPU without AVX2/FMA: torch's default kernels, MKL's instruction set lowered, numba compiling for a
generic x86-64 (no AVX, no FMA), with 1, 2 and 4 threads (torch's thread count, which sizes the
commit's kernels' pool too: `peer.core.sparseloco.codec.fused.n_workers`). The state ids are also
pinned: if they change, the commit's arithmetic changed (say so in CHANGELOG.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from peer.research.bench.commit import commit_portable, make_round

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {
    "best kernels, 2 threads": {"PEER_COMMIT_THREADS": "2"},
    "best kernels, 4 threads": {"PEER_COMMIT_THREADS": "4"},
    "avx2, 1 thread": {"ATEN_CPU_CAPABILITY": "avx2", "PEER_COMMIT_THREADS": "1"},
    "no AVX (torch default, MKL SSE4.2, numba generic), 1 thread": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "NUMBA_CPU_NAME": "generic",
        "PEER_COMMIT_THREADS": "1",
    },
    "torch default, MKL SSE4.2, 2 threads": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "PEER_COMMIT_THREADS": "2",
    },
}


@pytest.fixture(scope="module")
def rounds(tmp_path_factory):
    root = tmp_path_factory.mktemp("rounds")
    small = make_round(root / "small", {"model.preset": "small", "stages": 2}, [0, 1], replicas=4)
    wide = make_round(root / "wide", {"model.preset": "178M", "stages": 4}, [0], replicas=2)
    return small, wide


def _child(paths: list[Path], env: dict[str, str]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "peer.research.bench.commit", *map(str, paths)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_round_gives_one_state_on_every_kernel_set_and_thread_count(rounds):
    small, wide = rounds
    here = {"small": commit_portable(small)["states"], "wide": commit_portable(wide)["states"]}
    seen = {}
    for name, env in CONFIGS.items():
        got = _child([small.path, wide.path], env)
        assert got["rounds"] == here, f"{name} ({got['cpu_capability']}, {got['threads']} threads) differs"
        seen[name] = (got["cpu_capability"], got["threads"])
    capabilities = {cap for cap, _ in seen.values()}
    assert "DEFAULT" in capabilities and len(capabilities) >= 2 and {t for _, t in seen.values()} == {1, 2, 4}
    assert here == PINS


PINS = {
    "small": {"0": "76110e86283027a6", "1": "0418e35a572a55e7"},
    "wide": {"0": "e277dc157e6db535"},
}
