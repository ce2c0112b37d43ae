"""A sharded full replica (FSDP2 over torchrun's gloo ranks) against unsharded ones, as real processes.

Each run is `tests/integration/replica_rounds.py` under torchrun: the `tiny` preset, 3 outer steps of 2
inner steps, rank 0 committing each round from its own payloads (no swarm: the round's input is what
the replica trained). The committed hashes must match an unsharded replica's given the same batches (the
unsharded one runs after the sharded one in the same torchrun, `MODE` "sharded+ddp": 6 torchruns, not 10):
- 2 ranks, one micro-batch per step: sharded == DDP (one average of two gradients either way);
- 1 rank, two micro-batches: sharded == a plain one-process replica;
- 2 ranks, two micro-batches, gathered and reduced once per step (`--gather-per-step`): sharded == DDP
  (the local sum over the micro-batches, then one average: DDP's `no_sync` order);
- a 2-rank sharded replica resumed from rank 0's state saved after round 1 commits round 2 as if never stopped
  (one micro-batch per step: the state and the 3-round run are the DDP test's).
- the round on the bands alone (`--banded-round`, `peer.node.replica.bands`: each rank encodes and commits
  its rows of every tensor) == rank 0's whole round, at 2 ranks, and == DDP at 4 ranks (both average
  gradients in rank order: `peer.node.replica.reduce`).
And each rank of the 2-rank sharded replica holds half the parameters and AdamW state (FSDP2's dim-0
shards: ⌈rows/2⌉ of every parameter), within 1/N + 10 % of the whole replica's. At 2 and 4 ranks every
rank also encodes each round from its bands of θ_start and the error buffer (`--banded`,
`peer.node.replica.bands`): the payload is rank 0's whole stages' byte for byte, the error buffer the
same bits, and each rank holds its share of the two (within 1/N + 10 % of 2 × the parameters).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "integration" / "replica_rounds.py"
SAVED = "state-after-round-1.pt"


def _run(tmp_path: Path, ranks: int, mode: str, microbatches: int, *flags: str, name: str = "") -> list[dict]:
    """Every rank's report of one torchrun of `replica_rounds.py` (`mode` "a+b": b's under "beside")."""
    out = tmp_path / (name or f"{mode}-{ranks}")
    args = ["--nproc-per-node", str(ranks), "--standalone", "--max-restarts", "0", str(SCRIPT), mode, str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *args, "--microbatches", str(microbatches), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,  # a torchrun of 2 or 4 ranks on a loaded 2-core machine: imports, gloo, 3 rounds
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(Path(f"{out}-rank{r}.json").read_text()) for r in range(ranks)]


@pytest.fixture(scope="module")
def two_sharded(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One 2-rank sharded run of 3 rounds (one micro-batch per step), then a DDP one in the same torchrun
    (each rank's under "beside"), for the DDP and the resume tests (the sharded rank 0's state saved after
    round 1: `SAVED`)."""
    tmp = tmp_path_factory.mktemp("sharded2")
    return tmp, _run(tmp, 2, "sharded+ddp", 1, "--banded", "--save", str(tmp / SAVED), "--save-after", "1")


def _beside(ranks: list[dict], mode: str) -> list[dict]:
    """Each rank's report of the replica of `mode` that ran beside (after) the first in one torchrun."""
    return [r["beside"][mode] for r in ranks]


def _check_banded(sharded: list[dict], whole_params: int) -> None:
    """Every round's payload of every stage encoded from the bands is rank 0's, its error buffer too,
    and each rank holds about 1/N of θ_start and the error buffer (2 × the parameters' bytes)."""
    rounds = sharded[0]["banded"]
    assert rounds and all(same == [True, True] for r in rounds.values() for same in r.values()), rounds
    n = len(sharded)
    assert sum(r["band_bytes"] for r in sharded) == 2 * whole_params  # the bands tile θ_start and e
    for rank in sharded:
        assert rank["band_bytes"] <= 2 * whole_params * (1 / n + 0.1), (rank["band_bytes"], whole_params)


def test_two_sharded_ranks_commit_ddps_hashes_and_each_holds_half_the_state(two_sharded):
    _, sharded = two_sharded
    ddp = _beside(sharded, "ddp")
    assert len(sharded[0]["hashes"]) == 3
    assert sharded[0]["hashes"] == ddp[0]["hashes"]
    assert len({h for r in sharded[0]["hashes"].values() for h in r.values()}) == 6  # every round moved
    whole = ddp[0]["held"]["params"] + ddp[0]["held"]["optimizer"]
    for rank in sharded:
        held = rank["held"]["params"] + rank["held"]["optimizer"]
        assert whole / 2 <= held <= whole * (1 / 2 + 0.1), (held, whole)
    assert sum(r["held"]["params"] for r in sharded) == ddp[0]["held"]["params"]  # the shards tile the replica
    _check_banded(sharded, ddp[0]["held"]["params"])


def test_a_round_on_the_bands_alone_commits_ddps_hashes_at_two_and_four_ranks(two_sharded):
    """The whole round on each rank's bands (`--banded-round`: encode, rank 0's plan, each rank commits
    its rows into θ_start and the shards; no rank holds a whole stage) commits what the unsharded
    replica commits. Four ranks average gradients alike sharded and data-parallel only because both
    add them in rank order (gloo's own reduce-scatter and all-reduce do not)."""
    tmp_path, sharded = two_sharded
    two = _run(tmp_path, 2, "sharded", 1, "--banded-round", name="banded-round-2")
    assert two[0]["hashes"] == sharded[0]["hashes"]  # the two-rank run's rank 0 committed whole (== DDP's)
    four = _run(tmp_path, 4, "sharded+ddp", 1, "--rounds", "2", "--banded-round", name="banded-round-4")
    ddp = _beside(four, "ddp")
    assert len(four[0]["hashes"]) == 2 and four[0]["hashes"] == ddp[0]["hashes"]
    whole = ddp[0]["held"]["params"]
    for rank in four:  # θ_start and the error buffer: each rank its bands
        assert rank["band_bytes"] <= 2 * whole * (1 / 4 + 0.1), (rank["band_bytes"], whole)
    assert sum(r["band_bytes"] for r in four) == 2 * whole


def test_one_sharded_rank_commits_a_plain_replicas_hashes(tmp_path):
    (sharded,) = _run(tmp_path, 1, "sharded+plain", 2)
    plain = sharded["beside"]["plain"]
    assert len(sharded["hashes"]) == 3 and sharded["hashes"] == plain["hashes"]


def test_a_resumed_sharded_replica_continues_bit_for_bit(two_sharded, tmp_path):
    """Rank 0's state saved after round 1 of the 3-round run (a checkpoint's content); a new replica resumes
    it for round 2: round 2 commits what the run that went on committed (parameters and AdamW state came back
    through the scatter)."""
    whole = two_sharded[1][0]["hashes"]
    after = _run(tmp_path, 2, "sharded", 1, "--resume", str(two_sharded[0] / SAVED), name="after")[0]["hashes"]
    assert sorted(whole) == ["0", "1", "2"] and sorted(after) == ["2"]
    assert after["2"] == whole["2"] and after["2"] != whole["1"]


def test_two_ranks_gathering_once_per_step_commit_ddps_hashes_with_two_micro_batches(tmp_path):
    """Per step, each unit's gradient is summed over the micro-batches on each rank and reduce-scattered
    once: DDP's float order, so the same bits with several micro-batches (per micro-batch they differ)."""
    per_step = _run(tmp_path, 2, "sharded+ddp", 2, "--gather-per-step", name="per-step")
    ddp = _beside(per_step, "ddp")
    assert len(per_step[0]["hashes"]) == 3 and per_step[0]["hashes"] == ddp[0]["hashes"]
    whole = ddp[0]["held"]["params"] + ddp[0]["held"]["optimizer"]
    for rank in per_step:  # between steps a rank holds its shards only
        assert whole / 2 <= rank["held"]["params"] + rank["held"]["optimizer"] <= whole * (1 / 2 + 0.1)
