"""A checkpoint that does not fit the disk (a real 1 MiB tmpfs, mounted for the test) is a one-line
error that names the disk and the previous checkpoint, which stays loadable; no temp folder is left.

Mounting is an operation on the machine, not pure code, so this sits in the integration tier
(it skips itself where mounting a tmpfs is not permitted).
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from peer.errors import CheckpointError
from peer.node.checkpoints.stage import checkpoint_fingerprint, load_latest_stage_checkpoint, save_stage_checkpoint
from tests.unit.test_stage_checkpoint import SMALL, _as_dict, _cfg, _make, _pipeline_step, _train


def test_disk_full_keeps_the_previous_checkpoint(tmp_path):
    mnt = tmp_path / "tiny-disk"
    mnt.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot run mount: {exc}")
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        small = _cfg(**SMALL)
        workers = _make(small, True)
        _train(workers, _pipeline_step, 1)
        previous = save_stage_checkpoint(mnt, _as_dict(workers), {})
        assert (previous / "state.safetensors").stat().st_size < 500_000
        big = _make(_cfg(), True)  # the tiny preset: megabytes, more than the disk holds
        _train(big, _pipeline_step, 2)
        with pytest.raises(CheckpointError) as info:
            save_stage_checkpoint(mnt, _as_dict(big), {})
        msg = str(info.value)
        assert "disk full" in msg and str(previous) in msg and str(mnt) in msg and "\n" not in msg
        assert sorted(p.name for p in mnt.iterdir()) == ["step-000001"]  # no temp dir left behind
        fresh = _make(small, True)
        meta = load_latest_stage_checkpoint(mnt, _as_dict(fresh), checkpoint_fingerprint(small))
        assert meta["outer_step"] == 1 and fresh[1].param_hash() == workers[1].param_hash()
    finally:
        unmounted = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=10)
        if unmounted.returncode != 0:  # something still holds a file there (a leaked mmap?)
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=10)
    assert unmounted.returncode == 0, f"the test tmpfs stayed busy: {unmounted.stderr.strip()}"
    shutil.rmtree(mnt, ignore_errors=True)
