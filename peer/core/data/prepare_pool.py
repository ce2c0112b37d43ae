"""Tokenizing a stream of documents on worker processes, in order, a bounded number of batches at a time.

`peer.core.data.prepare` cuts the document stream into `Batch`es (the ordinal of the first document and
the documents) and reads back one `Encoded` per batch: every document's ids followed by EOS, routed
to the train or the validation split, packed as arrays of the shard dtype.

The split is by document and depends only on (seed, document ordinal): document 0 is validation,
document 1 is train (so any corpus of two or more documents has both), and every later document j
is validation when a keyed hash of j falls below `val_fraction` -- decided while streaming, without
knowing the corpus size, and the same on every machine.

Invariants:
- `encode_in_order` yields results in submission order, so the output is byte-identical for any
  number of workers (one worker encodes in this process).
- At most `in_flight` batches are submitted and not yet taken (multiprocessing's own `imap` reads
  its whole input ahead): memory does not grow with the corpus.
- Each worker loads the sentencepiece model once; workers are spawned (never forked from a parent
  that may hold threads) and ignore SIGINT, so Ctrl-C reaches only the parent, which stops them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import multiprocessing as mp
import signal
from collections import deque
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import sentencepiece as spm

__all__ = ["Batch", "Encoded", "Encoder", "encode_in_order", "is_val", "pack"]

_SPLIT_KEY = "peer-prepare-val-split-v1"


def is_val(seed: int, ordinal: int, val_fraction: float) -> bool:
    """Whether document `ordinal` of the stream belongs to the validation split."""
    if ordinal < 2:
        return ordinal == 0
    h = hashlib.blake2b(ordinal.to_bytes(8, "little"), key=_split_key(seed), digest_size=8).digest()
    return int.from_bytes(h, "little") < val_fraction * 2.0**64


@functools.lru_cache(maxsize=8)
def _split_key(seed: int) -> bytes:
    return hashlib.sha256(f"{_SPLIT_KEY}|{seed}".encode()).digest()


@dataclass(frozen=True)
class Batch:
    """Consecutive documents of the stream, the first one at ordinal `first`."""

    first: int
    documents: list[str]


@dataclass(frozen=True)
class Encoded:
    """One batch tokenized: the train and validation ids (EOS after each document) and the counts."""

    first: int
    train: np.ndarray  # (n_train_tokens,) shard dtype
    val: np.ndarray  # (n_val_tokens,) shard dtype
    train_docs: int
    val_docs: int

    @property
    def documents(self) -> int:
        return self.train_docs + self.val_docs

    @property
    def tokens(self) -> int:
        return int(self.train.size + self.val.size)


def pack(ids: Iterable[list[int]], eos_id: int, dtype: str) -> np.ndarray:
    """Documents' ids back to back, each followed by EOS, as one array of `dtype`."""
    flat: list[int] = []
    for doc in ids:
        flat += doc
        flat.append(eos_id)
    return np.fromiter(flat, dtype=np.dtype(dtype), count=len(flat))


class Encoder:
    """Encodes batches with one sentencepiece model, splitting documents by (seed, ordinal)."""

    def __init__(self, model: bytes, dtype: str, seed: int, val_fraction: float) -> None:
        self._sp = spm.SentencePieceProcessor(model_proto=model)
        self.eos_id = int(self._sp.eos_id())
        self.dtype, self.seed, self.val_fraction = dtype, seed, val_fraction

    def __call__(self, batch: Batch) -> Encoded:
        ids: list[list[int]] = self._sp.encode(batch.documents, num_threads=1)
        val = [is_val(self.seed, batch.first + i, self.val_fraction) for i in range(len(ids))]
        return Encoded(
            first=batch.first,
            train=pack((d for d, v in zip(ids, val, strict=True) if not v), self.eos_id, self.dtype),
            val=pack((d for d, v in zip(ids, val, strict=True) if v), self.eos_id, self.dtype),
            train_docs=val.count(False),
            val_docs=val.count(True),
        )


_WORKER: Encoder | None = None  # the worker process's encoder, loaded once by `_start_worker`


def _start_worker(model: bytes, dtype: str, seed: int, val_fraction: float) -> None:
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops the pool
    _WORKER = Encoder(model, dtype, seed, val_fraction)


def _encode(batch: Batch) -> Encoded:
    assert _WORKER is not None, "worker started without its encoder"
    return _WORKER(batch)


def encode_in_order(
    batches: Iterable[Batch],
    model: bytes,
    dtype: str,
    seed: int,
    val_fraction: float,
    workers: int,
    in_flight: int | None = None,
) -> Generator[Encoded, None, None]:
    """Encode `batches` on `workers` processes and yield the results in order, keeping at most
    `in_flight` (default 2 per worker) batches submitted and not yet taken."""
    if workers <= 1:
        encoder = Encoder(model, dtype, seed, val_fraction)
        yield from map(encoder, batches)
        return
    limit = in_flight or 2 * workers
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, initializer=_start_worker, initargs=(model, dtype, seed, val_fraction)) as pool:
        pending: deque[Any] = deque()
        try:
            for batch in batches:
                pending.append(pool.apply_async(_encode, (batch,)))
                if len(pending) >= limit:
                    yield pending.popleft().get()
            while pending:
                yield pending.popleft().get()
        finally:
            with contextlib.suppress(Exception):
                pool.terminate()  # an interrupted consumer: stop the workers now, not at garbage collection
