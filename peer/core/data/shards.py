"""A prepared dataset on disk: raw token shards and the index that names them.

`peer data prepare` writes a folder once; every head and full replica opens it as a
`PreparedDataset` and reads its batches through `peer.core.data.loader` (positional reads, so memory
does not grow with the corpus), and peers that lack it fetch its shards from peers that hold
them, by sha256. `write_prepared` makes a folder in one go from token arrays already split.

Layout of a prepared folder:
    index.json          `DatasetIndex`: token dtype, vocabulary, EOS id, tokenizer sha256, the
                        split's seed and fraction, and per shard its name, split, token count and
                        sha256; plus the train and validation fingerprints
    tokenizer.model     the sentencepiece model the tokens were made with
    train-00000.bin …   raw little-endian uint16 (vocabulary ≤ 65,536) or uint32 token ids,
    val-00000.bin …     documents back to back, each followed by EOS

The fingerprint of a split is the sha256 of its shards' (sha256, tokens) in order, with the dtype,
vocabulary, EOS id and tokenizer sha256: two folders with the same fingerprint hold the same tokens
in the same order. The signed manifest names both fingerprints (`peer.node.manifest`).

Invariants:
- A shard file appears under its final name only when complete (written to a temporary sibling,
  fsynced, renamed), and the index only after every shard it names.
- `DatasetIndex.from_json` recomputes both fingerprints and refuses an index whose stored ones
  differ, so an index fetched from another peer is checked against the manifest by comparing one
  string.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from peer.core.files import atomic_write_bytes, file_sha256
from peer.errors import DataError, one_line

__all__ = [
    "FORMAT_VERSION",
    "INDEX_FILE",
    "TOKENIZER_FILE",
    "DatasetIndex",
    "PreparedDataset",
    "ShardInfo",
    "ShardWriter",
    "is_prepared",
    "split_fingerprint",
    "token_dtype",
    "write_index",
    "write_prepared",
]

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
TOKENIZER_FILE = "tokenizer.model"
SPLITS = ("train", "val")
_DTYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> str:
    """The narrowest shard dtype that holds every id of the vocabulary: uint16 or uint32."""
    if vocab_size < 1:
        raise DataError(f"vocabulary size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: its name inside the folder, split, token count and sha256 of its bytes."""

    name: str
    split: str
    tokens: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "split": self.split, "tokens": self.tokens, "sha256": self.sha256}


def split_fingerprint(
    shards: Sequence[ShardInfo], dtype: str, vocab_size: int, eos_id: int, tokenizer_sha256: str
) -> str:
    """sha256 (hex) naming the tokens of `shards` in order, made by this tokenizer."""
    body = {
        "format_version": FORMAT_VERSION,
        "dtype": dtype,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer_sha256": tokenizer_sha256,
        "shards": [[s.sha256, s.tokens] for s in shards],
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class DatasetIndex:
    """What `index.json` says: the shards of a prepared dataset and how they were made."""

    dtype: str
    vocab_size: int
    eos_id: int
    tokenizer_sha256: str
    shards: tuple[ShardInfo, ...]
    seed: int = 0  # the document split's seed
    val_fraction: float = 0.0  # share of the documents held out for validation
    source: str = ""  # what was prepared (for people; not part of any fingerprint)
    documents: dict[str, int] = field(default_factory=dict)  # documents per split (for people)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise DataError(f"prepared dataset has token dtype {self.dtype!r}; expected one of {', '.join(_DTYPES)}")
        if token_dtype(self.vocab_size) == "uint32" and self.dtype == "uint16":
            raise DataError(f"a vocabulary of {self.vocab_size} ids does not fit uint16 shards")
        names = [s.name for s in self.shards]
        if len(set(names)) != len(names):
            raise DataError("prepared dataset index names a shard twice")
        for s in self.shards:
            if s.split not in SPLITS or s.tokens < 0 or "/" in s.name or s.name.startswith("."):
                raise DataError(f"prepared dataset index has a malformed shard entry {s.to_dict()}")

    def split(self, name: str) -> tuple[ShardInfo, ...]:
        """The shards of split `name` ("train" or "val"), in reading order."""
        return tuple(s for s in self.shards if s.split == name)

    @property
    def train(self) -> tuple[ShardInfo, ...]:
        return self.split("train")

    @property
    def val(self) -> tuple[ShardInfo, ...]:
        return self.split("val")

    def tokens(self, split: str) -> int:
        return sum(s.tokens for s in self.split(split))

    def _fingerprint(self, split: str) -> str:
        return split_fingerprint(self.split(split), self.dtype, self.vocab_size, self.eos_id, self.tokenizer_sha256)

    @property
    def fingerprint(self) -> str:
        """The train split's fingerprint: which tokens the run trains on."""
        return self._fingerprint("train")

    @property
    def val_fingerprint(self) -> str:
        """The validation split's fingerprint: which tokens the run validates on."""
        return self._fingerprint("val")

    def by_sha256(self, sha256: str) -> ShardInfo | None:
        return next((s for s in self.shards if s.sha256 == sha256), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "peer-tokens",
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "tokenizer_sha256": self.tokenizer_sha256,
            "tokenizer_file": TOKENIZER_FILE,
            "seed": self.seed,
            "val_fraction": self.val_fraction,
            "source": self.source,
            "documents": dict(self.documents),
            "tokens": {split: self.tokens(split) for split in SPLITS},
            "fingerprint": self.fingerprint,
            "val_fingerprint": self.val_fingerprint,
            "shards": [s.to_dict() for s in self.shards],
        }

    def to_json(self) -> bytes:
        """Canonical JSON bytes (sorted keys): the same index always gives the same bytes."""
        return (json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, raw: bytes | str, where: str = "index.json") -> DatasetIndex:
        """Parse and check an index; DataError naming `where` when it is malformed or its stored
        fingerprints are not the ones its shards give."""
        try:
            d = json.loads(raw)
            if d.get("format_version") != FORMAT_VERSION:
                raise DataError(
                    f"{where} has format version {d.get('format_version')}; this peer reads version "
                    f"{FORMAT_VERSION}: prepare the dataset again with this peer version"
                )
            shards = tuple(
                ShardInfo(str(s["name"]), str(s["split"]), int(s["tokens"]), str(s["sha256"])) for s in d["shards"]
            )
            index = cls(
                dtype=str(d["dtype"]),
                vocab_size=int(d["vocab_size"]),
                eos_id=int(d["eos_id"]),
                tokenizer_sha256=str(d["tokenizer_sha256"]),
                shards=shards,
                seed=int(d.get("seed", 0)),
                val_fraction=float(d.get("val_fraction", 0.0)),
                source=str(d.get("source", "")),
                documents={str(k): int(v) for k, v in dict(d.get("documents", {})).items()},
            )
        except DataError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(
                f"{where} is not a prepared dataset index ({one_line(exc, 120)}); prepare it again"
            ) from exc
        for key, value in (("fingerprint", index.fingerprint), ("val_fingerprint", index.val_fingerprint)):
            if d.get(key) != value:
                raise DataError(f"{where} states {key} {str(d.get(key))[:16]}… but its shards give {value[:16]}…")
        return index


def write_index(root: Path, index: DatasetIndex) -> Path:
    """Write `root/index.json` atomically (after the shards it names); returns its path."""
    path = Path(root) / INDEX_FILE
    try:
        atomic_write_bytes(path, index.to_json())
    except OSError as exc:
        raise DataError(f"cannot write {path}: {exc.strerror or one_line(exc)}; pass a writable --out") from exc
    return path


class ShardWriter:
    """Appends token arrays to the shards of one split, `shard_tokens` tokens per file.

    A shard is written to a temporary sibling and renamed when full (or at `close`), with its
    sha256 computed while writing; `shards` lists the finished ones in order.
    """

    def __init__(self, root: Path, split: str, dtype: str, shard_tokens: int, first: int = 0) -> None:
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        if shard_tokens < 1:
            raise DataError(f"shard size must be at least one token, got {shard_tokens}")
        self.root, self.split, self.dtype, self.shard_tokens = Path(root), split, np.dtype(dtype), shard_tokens
        self.root.mkdir(parents=True, exist_ok=True)
        self.shards: list[ShardInfo] = []
        self._next = first  # number of the next shard file
        self._buf: list[np.ndarray] = []
        self._held = 0

    def add(self, tokens: np.ndarray) -> None:
        """Append ids (any integer dtype; must fit the shard dtype)."""
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise DataError(f"token ids outside {self.dtype} given to the {self.split} shard writer")
        arr = arr.astype(self.dtype, copy=False).ravel()
        while arr.size:
            take = min(arr.size, self.shard_tokens - self._held)
            self._buf.append(arr[:take])
            self._held += take
            arr = arr[take:]
            if self._held == self.shard_tokens:
                self._flush()

    @property
    def pending(self) -> np.ndarray:
        """Tokens added but not yet in a finished shard."""
        return np.concatenate(self._buf) if self._buf else np.zeros(0, dtype=self.dtype)

    def close(self) -> list[ShardInfo]:
        """Write the last, partial shard (if any) and return every finished shard."""
        if self._held:
            self._flush()
        return list(self.shards)

    def _flush(self) -> None:
        name = f"{self.split}-{self._next:05d}.bin"
        data = np.concatenate(self._buf).astype(self.dtype.newbyteorder("<"), copy=False)
        raw = data.tobytes()
        try:
            atomic_write_bytes(self.root / name, raw)
        except OSError as exc:
            raise DataError(f"cannot write {self.root / name}: {exc.strerror or one_line(exc)}") from exc
        self.shards.append(ShardInfo(name, self.split, int(data.size), hashlib.sha256(raw).hexdigest()))
        self._next += 1
        self._buf, self._held = [], 0


def is_prepared(path: Path | str) -> bool:
    """Whether `path` is a prepared dataset folder (it holds index.json)."""
    return (Path(path).expanduser() / INDEX_FILE).is_file()


class PreparedDataset:
    """A prepared folder opened for reading: its index and read-only memory maps of its shards."""

    def __init__(self, root: Path, index: DatasetIndex) -> None:
        self.root, self.index = Path(root), index
        self._maps: dict[str, np.ndarray] = {}

    @classmethod
    def open(cls, root: Path | str) -> PreparedDataset:
        """Read `root/index.json` (checked); the shards are mapped lazily (`tokens`)."""
        root = Path(root).expanduser()
        path = root / INDEX_FILE
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise DataError(
                f"{root} is not a prepared dataset ({exc.strerror or one_line(exc)} reading {INDEX_FILE}); "
                "make one with `peer data prepare SOURCE --out DIR`"
            ) from exc
        return cls(root, DatasetIndex.from_json(raw, str(path)))

    @property
    def tokenizer_path(self) -> Path:
        return self.root / TOKENIZER_FILE

    def path(self, shard: ShardInfo) -> Path:
        return self.root / shard.name

    def nbytes(self, shard: ShardInfo) -> int:
        return shard.tokens * np.dtype(self.index.dtype).itemsize

    def missing(self, shards: Iterable[ShardInfo] | None = None) -> list[ShardInfo]:
        """The shards (default: all) whose file is absent or has the wrong size."""
        out = []
        for s in self.index.shards if shards is None else shards:
            try:
                size = os.stat(self.path(s)).st_size
            except OSError:
                size = -1
            if size != self.nbytes(s):
                out.append(s)
        return out

    def verify(self, shards: Iterable[ShardInfo] | None = None) -> None:
        """Hash every shard named (default: all); DataError naming the first that differs."""
        for s in self.index.shards if shards is None else shards:
            try:
                digest = file_sha256(self.path(s))
            except OSError as exc:
                raise DataError(f"cannot read shard {self.path(s)}: {exc.strerror or one_line(exc)}") from exc
            if digest != s.sha256:
                raise DataError(
                    f"shard {self.path(s)} does not match its sha256 in {INDEX_FILE}; delete it to fetch it again"
                )

    def tokens(self, shard: ShardInfo) -> np.ndarray:
        """The shard's ids as a read-only 1-D memory map (pages are read only when touched)."""
        m = self._maps.get(shard.name)
        if m is None:
            if self.missing([shard]):
                raise DataError(
                    f"shard {self.path(shard)} is missing or incomplete; fetch it again (join the swarm) "
                    "or prepare the dataset again"
                )
            dtype = np.dtype(self.index.dtype).newbyteorder("<")
            m = (
                np.memmap(self.path(shard), dtype=dtype, mode="r", shape=(shard.tokens,))
                if shard.tokens
                else (np.zeros(0, dtype=dtype))
            )
            self._maps[shard.name] = m
        return m


def write_prepared(
    root: Path,
    splits: Mapping[str, Iterable[np.ndarray]],
    vocab_size: int,
    eos_id: int,
    *,
    tokenizer: Path | None = None,
    shard_tokens: int = 1 << 24,
    source: str = "",
    seed: int = 0,
    val_fraction: float = 0.0,
) -> PreparedDataset:
    """A prepared folder made in one go from token arrays already split ({"train": chunks, "val":
    chunks}, each an iterable of 1-D id arrays), `tokenizer` copied in when given; opened.

    For token streams made elsewhere (tests, `peer bench data`'s synthetic corpora, a one-process
    preparation): not resumable; the index is written last, so an interrupted call leaves no
    prepared folder.
    """
    root = Path(root)
    dtype = token_dtype(vocab_size)
    tok_sha = ""
    if tokenizer is not None:
        raw = Path(tokenizer).read_bytes()
        tok_sha = hashlib.sha256(raw).hexdigest()
        try:
            atomic_write_bytes(root / TOKENIZER_FILE, raw)
        except OSError as exc:
            raise DataError(f"cannot write {root / TOKENIZER_FILE}: {exc.strerror or one_line(exc)}") from exc
    shards: list[ShardInfo] = []
    for split in SPLITS:
        writer = ShardWriter(root, split, dtype, shard_tokens)
        for chunk in splits.get(split, ()):
            writer.add(chunk)
        shards += writer.close()
    index = DatasetIndex(
        dtype, vocab_size, eos_id, tok_sha, tuple(shards), seed=seed, val_fraction=val_fraction, source=source
    )
    write_index(root, index)
    return PreparedDataset(root, index)
