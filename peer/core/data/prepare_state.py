"""The record of a prepare in progress: `prepare.state.json` and its pending-token files.

`peer data prepare` saves a `PrepareState` after every finished shard: the arguments it was asked
for, the tokenizer's sha256, how many documents of the stream it has consumed, and per split the
finished shards and the tokens past them (each split's writer holds up to one shard of them; they
go to `prepare.pending-<split>.<generation>.bin`). An interrupted prepare (Ctrl-C, kill -9, a lost
machine) re-run with the same arguments skips the consumed documents, puts the pending tokens back
and continues; what it writes is byte-identical to an uninterrupted run. The record stays in a
finished folder (`finished: true`, no pending files) so a re-run knows what the folder holds.

Invariants:
- The pending files are written before the state that names them and removed only after a newer
  state is in place (`generation` numbers them), so the state on disk always has its files.
- Every document the state counts as consumed is in a finished shard or in a pending file.
- The state is written atomically; a damaged one is a one-line DataError (pass --restart).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from peer.core.data.shards import INDEX_FILE, SPLITS, TOKENIZER_FILE, ShardInfo
from peer.core.files import atomic_write_bytes
from peer.errors import DataError, one_line

__all__ = ["STATE_FILE", "PrepareState", "SplitProgress", "load_pending", "load_state", "own_files", "save_state"]

STATE_FILE = "prepare.state.json"
_PENDING = re.compile(r"prepare\.pending-(train|val)\.(\d+)\.bin")
_OWN = re.compile(r"(train|val)-\d{5}\.bin|prepare\.pending-(train|val)\.\d+\.bin")


@dataclass
class SplitProgress:
    """One split so far: its finished shards, and its documents and tokens (pending ones included)."""

    shards: list[ShardInfo] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"shards": [s.to_dict() for s in self.shards], "documents": self.documents, "tokens": self.tokens}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SplitProgress:
        shards = [ShardInfo(str(s["name"]), str(s["split"]), int(s["tokens"]), str(s["sha256"])) for s in d["shards"]]
        return cls(shards, int(d["documents"]), int(d["tokens"]))


@dataclass
class PrepareState:
    """Where a prepare stands; see the module docstring."""

    arguments: dict[str, Any]
    tokenizer_sha256: str = ""  # "" until the tokenizer is in place
    documents: int = 0  # documents of the stream consumed
    splits: dict[str, SplitProgress] = field(default_factory=lambda: {s: SplitProgress() for s in SPLITS})
    generation: int = 0  # number of the pending files that go with this state
    finished: bool = False

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.splits.values())

    def to_json(self) -> bytes:
        body = {
            "arguments": self.arguments,
            "tokenizer_sha256": self.tokenizer_sha256,
            "documents": self.documents,
            "splits": {name: p.to_dict() for name, p in self.splits.items()},
            "generation": self.generation,
            "finished": self.finished,
        }
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> PrepareState:
        try:
            d = json.loads(raw)
            return cls(
                arguments=dict(d["arguments"]),
                tokenizer_sha256=str(d["tokenizer_sha256"]),
                documents=int(d["documents"]),
                splits={name: SplitProgress.from_dict(d["splits"][name]) for name in SPLITS},
                generation=int(d["generation"]),
                finished=bool(d["finished"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"{where} is damaged ({one_line(exc, 100)}); pass --restart to prepare again") from exc


def _pending_path(root: Path, split: str, generation: int) -> Path:
    return root / f"prepare.pending-{split}.{generation}.bin"


def load_state(root: Path) -> PrepareState | None:
    """The state in `root`, or None when there is none."""
    path = root / STATE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or one_line(exc)}") from exc
    return PrepareState.from_json(raw, str(path))


def save_state(root: Path, state: PrepareState, pending: dict[str, np.ndarray]) -> None:
    """Write the pending tokens of each split, then the state naming them (its generation goes up
    by one), then remove older pending files."""
    state.generation += 1
    try:
        for split in SPLITS:
            tokens = pending.get(split)
            if tokens is not None and tokens.size:
                raw = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False).tobytes()
                atomic_write_bytes(_pending_path(root, split, state.generation), raw)
        atomic_write_bytes(root / STATE_FILE, state.to_json())
    except OSError as exc:
        raise DataError(f"cannot write in {root}: {exc.strerror or one_line(exc)}; pass a writable --out") from exc
    for path in root.iterdir():
        m = _PENDING.fullmatch(path.name)
        if m and int(m.group(2)) != state.generation:
            with contextlib.suppress(OSError):
                path.unlink()


def load_pending(root: Path, state: PrepareState, split: str, dtype: str) -> np.ndarray:
    """The tokens of `split` past its finished shards, as the state left them."""
    wanted = state.splits[split].tokens - sum(s.tokens for s in state.splits[split].shards)
    if wanted == 0:
        return np.zeros(0, dtype=dtype)
    path = _pending_path(root, split, state.generation)
    try:
        arr = np.fromfile(path, dtype=np.dtype(dtype).newbyteorder("<"))
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or one_line(exc)}; pass --restart") from exc
    if arr.size != wanted:
        raise DataError(f"{path} holds {arr.size} tokens, not the {wanted} its state names; pass --restart")
    return arr.astype(dtype, copy=False)


def own_files(root: Path) -> list[Path]:
    """Every file a prepare writes in `root` (shards, index, tokenizer, state, pending and their
    temporary siblings): what --restart removes."""
    names = {INDEX_FILE, TOKENIZER_FILE, STATE_FILE}
    out = []
    for path in root.iterdir():
        name = path.name
        tmp = re.fullmatch(r"\.(.+)\.\d+\.tmp", name)  # peer.core.files.atomic_write_bytes' temporary files
        base = tmp.group(1) if tmp else name
        if path.is_file() and (base in names or _OWN.fullmatch(base)):
            out.append(path)
    return sorted(out)
