"""`peer simulate`'s checkpoint of a sweep: every run's state after every outer step (`--resume`).

A folder holds `args.json` (the sweep's settings, compared on resume) and one file per run, named by
a hash of what the run is (its config, name and options): the run's loop state after its last
finished outer step (every replica pickled whole — weights, optimizer state, any other field —, the
error buffers, byte counters, the `ConfigResult` so far, the torch RNG state), or its final result.
Each file is written atomically (`peer.core.files.atomic_write_bytes`): an interrupted write leaves
the previous one. Resuming skips finished runs (their stored results are used) and continues an
interrupted one from its last outer step, with the same bits as an uninterrupted sweep: the state
is read back by `peer.research.simulate.pool`'s unpickling, into torch's own 64-byte aligned storages with
the strides, offsets and sharing they had, so a kernel that picks its code path by where its
operands sit (MKL on Intel CPUs) sees what the uninterrupted sweep's kernels saw (issue 34).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.core.files import atomic_write_bytes
from peer.errors import ConfigError
from peer.research.simulate.pool import dumps

ARGS_FILE = "args.json"
SUFFIX = ".ckpt"


def run_key(cfg: RunConfig, name: str, opts: Any) -> str:
    """A stable name for one run of a sweep: its config, configuration name and options."""
    text = json.dumps([cfg.to_dict(), name, repr(opts)], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class SweepCheckpoint:
    """The checkpoint folder of one sweep; `args` are the settings a resume must match."""

    def __init__(self, folder: Path, args: dict[str, Any], resume: bool) -> None:
        self.folder = Path(folder)
        args = json.loads(json.dumps(args, default=str))  # as it reads back
        if resume:
            self._check(args)
        else:
            for old in self.folder.glob(f"*{SUFFIX}"):
                old.unlink()
            atomic_write_bytes(self.folder / ARGS_FILE, json.dumps(args, indent=1, sort_keys=True).encode())

    def _check(self, args: dict[str, Any]) -> None:
        path = self.folder / ARGS_FILE
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError):
            raise ConfigError(f"--resume: no sweep checkpoint in {self.folder} (run without --resume first)") from None
        for name in sorted(set(stored) | set(args)):
            if stored.get(name) != args.get(name):
                raise ConfigError(
                    f"--resume: the checkpoint in {self.folder} was made with {name} = {stored.get(name)!r}, "
                    f"this run has {args.get(name)!r}; give the same settings, or run without --resume"
                )

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def load(self, key: str) -> dict[str, Any] | None:
        """The stored record of run `key` ({"done": bool, "state": ...}), or None."""
        try:
            raw = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        record: dict[str, Any] = pickle.loads(raw)
        return record

    def save(self, key: str, state: Any, done: bool = False) -> None:
        raw = dumps({"done": done, "state": state})
        atomic_write_bytes(self._path(key), raw)
