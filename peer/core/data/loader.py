"""The one loader: which tokens a replica trains on at each step, read from a prepared dataset.

Heads, full replicas (every torchrun rank), `peer simulate` and `peer demo` take their batches
from here, out of the shard files of a prepared dataset (`peer.core.data.shards`):

- A sequence is a window of seq_len + 1 tokens. Windows never cross a shard file: file f holds
  floor((tokens_f - 1) / seq_len) windows at offsets 0, L, 2L, … (consecutive windows share one
  token). Sequences are numbered globally in train-shard order, N in all.
- Data shard m of n (a replica's claim) owns sequences [m·N/n, (m+1)·N/n), n_m of them: claims
  are disjoint and together cover all N.
- Row i of batch `step` is position p = step·b + i: epoch e = p // n_m, r = p % n_m, and it reads
  sequence m·N/n + π(r), π the keyed permutation of [0, n_m) named by (seed, n, m, e)
  (`peer.core.data.permutation`). A new epoch reshuffles; each `Corpus` logs it once per claim.
- Validation: the first max_batches·b windows of the val shards, in order.

Invariants:
- A batch is a pure function of (dataset, seed, shard, n_shards, step, batch_size, seq_len): a
  fresh `Corpus` gives what a long-running one gives, so a resumed peer continues exactly where
  it stopped (its step derives from (t, h)). In one epoch every sequence of a claim is read
  exactly once and no two claims read the same sequence.
- Memory does not grow with the corpus: windows are read into the batch with positional reads
  (the file pages stay in the shared, reclaimable page cache, never in this process's resident
  set: `_Reader`); besides, one cumulative count per shard file and a few cached slices
  (PERM_CHUNK positions each) of the current permutations. Nothing per sequence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from peer.core.data.corpus import DataConfig
from peer.core.data.permutation import keys, permute
from peer.core.data.prepare import prepared_for
from peer.core.data.shards import DatasetIndex, PreparedDataset, ShardInfo
from peer.core.data.tokenizer import Tokenizer
from peer.errors import ConfigError, DataError, one_line

log = logging.getLogger(__name__)

__all__ = [
    "Corpus",
    "claim_bounds",
    "load_corpus",
    "needed_shards",
    "open_corpus",
    "train_batch",
    "val_batches",
]

PERM_CHUNK = 1 << 14  # positions of a permutation computed (and cached) at once
_PERM_CACHE = 8  # cached permutation chunks per corpus

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Windows:
    """The windows of one split at one seq_len: `starts[f]` = first sequence id of shard file f."""

    shards: tuple[ShardInfo, ...]
    starts: np.ndarray  # (F + 1,) int64, cumulative
    seq_len: int

    @classmethod
    def of(cls, shards: tuple[ShardInfo, ...], seq_len: int) -> _Windows:
        counts = [max(0, (s.tokens - 1) // seq_len) for s in shards]
        return cls(shards, np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64), seq_len)

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard file, token offset in it) of each sequence id."""
        files = np.searchsorted(self.starts, ids, side="right") - 1  # (b,)
        return files, (ids - self.starts[files]) * self.seq_len


def claim_bounds(n_sequences: int, shard: int, n_shards: int) -> tuple[int, int]:
    """[start, end) of the sequence ids data shard `shard` of `n_shards` owns."""
    if n_shards < 1 or not 0 <= shard < n_shards:
        raise ConfigError(f"data shard {shard} out of range for {n_shards} shard(s)")
    return shard * n_sequences // n_shards, (shard + 1) * n_sequences // n_shards


def needed_shards(index: DatasetIndex, seq_len: int, shard: int, n_shards: int) -> list[ShardInfo]:
    """The train shard files data shard `shard` of `n_shards` reads at this seq_len, then every
    val shard file: what a head or full replica must hold to train and validate."""
    win = _Windows.of(index.train, seq_len)
    lo, hi = claim_bounds(win.total, shard, n_shards)
    starts = win.starts.tolist()
    train = [s for f, s in enumerate(win.shards) if max(starts[f], lo) < min(starts[f + 1], hi)]  # overlaps
    return train + list(index.val)


class _Reader:
    """Positional reads (`os.preadv`) of a dataset's shard files, each opened on first read.

    Why not memory maps: a mapped page counts in the process's resident set from the first
    touch, and the kernel maps whole page-cache folios (up to megabytes) around every fault, so
    a head's RSS grew with the part of the corpus it had read (`peer bench data`, memory-mapped:
    peak RSS 791 MiB after 2,000 batches of a 1 B-token corpus, 517 MiB for 10 M; handing the
    pages back with MADV_DONTNEED every 16 MiB read did not bound it). A read copies the window
    into this process's buffer and leaves the file's pages in the page cache, shared and
    reclaimable: resident memory is the batch, whatever the corpus size (510.7 against 509.9
    MiB). One system call per row.
    """

    def __init__(self, dataset: PreparedDataset) -> None:
        self.dataset = dataset
        self.dtype = np.dtype(dataset.index.dtype).newbyteorder("<")
        self._fds: dict[str, int] = {}
        weakref.finalize(self, _close_all, self._fds)

    def fd(self, shard: ShardInfo) -> int:
        fd = self._fds.get(shard.name)
        if fd is None:
            path = self.dataset.path(shard)
            if self.dataset.missing([shard]):
                raise DataError(
                    f"shard {path} is missing or incomplete; fetch it again (join the swarm) "
                    "or prepare the dataset again"
                )
            try:
                fd = self._fds[shard.name] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise DataError(f"cannot read shard {path}: {exc.strerror or one_line(exc)}") from exc
        return fd

    def gather(self, win: _Windows, ids: np.ndarray) -> Batch:
        """(inputs, targets), each (len(ids), seq_len) int64: the windows `ids`, targets one token on."""
        files, offsets = win.locate(ids)
        L = win.seq_len
        tokens = np.empty((len(ids), L + 1), dtype=self.dtype)  # (b, L + 1), the shard's dtype
        want = (L + 1) * self.dtype.itemsize
        for row, f, o in zip(tokens, files.tolist(), (offsets * self.dtype.itemsize).tolist(), strict=True):
            if os.preadv(self.fd(win.shards[f]), [row], o) != want:
                raise DataError(
                    f"shard {self.dataset.path(win.shards[f])} is shorter than its index says; "
                    "delete it to fetch it again or prepare the dataset again"
                )
        x = tokens[:, :-1].astype(np.int64, order="C")  # (b, L)
        y = tokens[:, 1:].astype(np.int64, order="C")  # (b, L)
        return torch.from_numpy(x), torch.from_numpy(y)


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


@dataclass
class Corpus:
    """A prepared dataset opened for reading, with the run's seed: what heads, full replicas,
    `peer simulate` and `peer demo` read. `tokenizer` is None only for a folder that holds no
    tokenizer.model (synthetic token streams)."""

    dataset: PreparedDataset
    tokenizer: Tokenizer | None
    seed: int  # the manifest's seed (cfg.data.seed)
    _reader: _Reader = field(init=False, repr=False)
    _windows: dict[tuple[str, int], _Windows] = field(init=False, repr=False, default_factory=dict)
    _orders: OrderedDict[tuple[int, ...], np.ndarray] = field(init=False, repr=False, default_factory=OrderedDict)
    _epochs: dict[tuple[int, int, int], int] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._reader = _Reader(self.dataset)

    @property
    def fingerprint(self) -> str:
        """The train split's fingerprint (`DatasetIndex.fingerprint`)."""
        return self.dataset.index.fingerprint

    @property
    def val_fingerprint(self) -> str:
        return self.dataset.index.val_fingerprint

    def windows(self, split: str, seq_len: int) -> _Windows:
        win = self._windows.get((split, seq_len))
        if win is None:
            win = self._windows[(split, seq_len)] = _Windows.of(self.dataset.index.split(split), seq_len)
        return win

    def gather(self, win: _Windows, ids: np.ndarray) -> Batch:
        """The windows `ids` of `win` as (inputs, targets) (`_Reader.gather`)."""
        return self._reader.gather(win, ids)

    def sequences(self, seq_len: int, split: str = "train") -> int:
        """How many windows of seq_len + 1 tokens the split holds (N for train)."""
        return self.windows(split, seq_len).total

    def order(self, key: tuple[int, int], n: int, epochs: np.ndarray, r: np.ndarray) -> np.ndarray:
        """π_{seed, key, e}(r) for each (epoch, position) pair, computed PERM_CHUNK positions at a
        time and cached (the next batches of the same epoch read the same chunk)."""
        chunks = r // PERM_CHUNK
        if epochs[0] == epochs[-1] and chunks[0] == chunks[-1]:  # the usual case: one chunk of one epoch
            one: np.ndarray = self._chunk(key, n, int(epochs[0]), int(chunks[0]))[r - int(chunks[0]) * PERM_CHUNK]
            return one
        out = np.empty_like(r)
        for e, c in sorted(set(zip(epochs.tolist(), chunks.tolist(), strict=True))):
            rows = (epochs == e) & (chunks == c)
            out[rows] = self._chunk(key, n, e, c)[r[rows] - c * PERM_CHUNK]
        return out

    def _chunk(self, key: tuple[int, int], n: int, epoch: int, chunk: int) -> np.ndarray:
        """π(r) for r in [chunk·PERM_CHUNK, (chunk + 1)·PERM_CHUNK) ∩ [0, n), from the cache."""
        name = (*key, n, epoch, chunk)
        perm = self._orders.get(name)
        if perm is None:
            lo = chunk * PERM_CHUNK
            perm = permute(np.arange(lo, min(lo + PERM_CHUNK, n)), n, keys(self.seed, *key, epoch))
            self._orders[name] = perm
            if len(self._orders) > _PERM_CACHE:
                self._orders.popitem(last=False)
        else:
            self._orders.move_to_end(name)
        return perm

    def note_epoch(self, shard: int, n_shards: int, seq_len: int, epoch: int, n_m: int) -> None:
        """Log the claim's first epoch, then once each time a later one begins."""
        claim = (shard, n_shards, seq_len)
        last = self._epochs.get(claim)
        if last is None:
            log.info(
                "data shard %d of %d: %d sequences of %d tokens, reading epoch %d", shard, n_shards, n_m, seq_len, epoch
            )
        elif epoch > last:
            log.info("data shard %d: epoch %d begins, reshuffled", shard, epoch)
        self._epochs[claim] = epoch


def open_corpus(dataset: PreparedDataset, seed: int, tokenizer: Tokenizer | None = None) -> Corpus:
    """A prepared dataset read with the run's seed; its tokenizer is `tokenizer`, else the folder's
    tokenizer.model when present. DataError when that tokenizer is not the one the index names."""
    index = dataset.index
    if tokenizer is None and Path(dataset.tokenizer_path).is_file():
        tokenizer = Tokenizer.load(dataset.tokenizer_path)
    if tokenizer is not None and index.tokenizer_sha256 and tokenizer.sha256 != index.tokenizer_sha256:
        raise DataError(
            f"tokenizer {tokenizer.path} is not the one {dataset.root} was prepared with "
            f"(sha256 {tokenizer.sha256[:12]}…, the index says {index.tokenizer_sha256[:12]}…); "
            "prepare the dataset again with this tokenizer"
        )
    return Corpus(dataset, tokenizer, seed)


def load_corpus(cfg: DataConfig) -> Corpus:
    """The run's corpus: `cfg.dataset` prepared (once, cached) or opened (`prepared_for`), read
    with `cfg.seed`."""
    return open_corpus(prepared_for(cfg), cfg.seed)


def _check_shape(batch_size: int, seq_len: int, step: int = 0) -> None:
    if batch_size < 1 or seq_len < 1 or step < 0:
        raise ConfigError(f"batches need batch_size >= 1, seq_len >= 1, step >= 0; got {batch_size}, {seq_len}, {step}")


def train_batch(corpus: Corpus, shard: int, n_shards: int, step: int, batch_size: int, seq_len: int) -> Batch:
    """(inputs, targets), each (batch_size, seq_len) int64: batch `step` of data shard `shard` of
    `n_shards` (rows at positions step·b … step·b + b - 1 of the claim's epochs), targets one token on."""
    _check_shape(batch_size, seq_len, step)
    win = corpus.windows("train", seq_len)
    lo, hi = claim_bounds(win.total, shard, n_shards)
    n_m = hi - lo
    if n_m < 1:
        raise DataError(
            f"data shard {shard}/{n_shards} holds no sequence of seq_len + 1 = {seq_len + 1} tokens "
            f"(the train split has {win.total} in all); use a larger corpus, fewer shards or a shorter --seq-len"
        )
    pos = step * batch_size + np.arange(batch_size, dtype=np.int64)  # (b,)
    epochs, r = pos // n_m, pos % n_m
    corpus.note_epoch(shard, n_shards, seq_len, int(epochs[-1]), n_m)
    ids = lo + corpus.order((n_shards, shard), n_m, epochs, r)  # (b,)
    return corpus.gather(win, ids)


def val_batches(corpus: Corpus, batch_size: int, seq_len: int, max_batches: int) -> list[Batch]:
    """The first max_batches batches of the val split's windows in order (the last may be smaller)."""
    _check_shape(batch_size, seq_len)
    win = corpus.windows("val", seq_len)
    if win.total < 1:
        raise DataError(
            f"the validation split has {corpus.dataset.index.tokens('val')} tokens and no window of "
            f"seq_len + 1 = {seq_len + 1} in one shard; prepare it with a larger --val-fraction "
            "or use a shorter --seq-len"
        )
    n = min(win.total, max_batches * batch_size)
    return [corpus.gather(win, np.arange(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
