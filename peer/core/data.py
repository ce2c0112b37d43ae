"""Token data: the held-out split, the cached token streams, shards and batches.

`build_token_data` loads the corpus (`peer.core.corpus`), gets its tokenizer
(`peer.core.tokenizer`), holds out whole documents for validation, tokenizes with an EOS after
every document and caches the two int64 token streams. `train_batch` cuts the train stream into
`n_shards` disjoint contiguous slices (replica m reads shard m) and walks a shard in
non-overlapping windows of seq_len + 1 tokens, so a batch is a pure function of
(shard, n_shards, step) -- the data offsets of DESIGN §3 ("derive from (t, inner step)").

Invariants:
- Same corpus + same config => bit-identical token tensors (no RNG but the seeded document
  permutation of the split).
- Shards are disjoint and together cover train[0 : len(train)]; val documents never appear in train.

`DataConfig` (defined in `peer.core.corpus`) is re-exported here: it configures the whole data
pipeline, and callers that build token data import it from this module.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from peer.core.corpus import CACHE_VERSION, DataConfig, corpus_fingerprint, load_documents, write_cache_file
from peer.core.tokenizer import Tokenizer, get_tokenizer
from peer.errors import ConfigError, DataError, one_line

log = logging.getLogger(__name__)

__all__ = [
    "DataConfig",
    "TokenData",
    "build_token_data",
    "shard_bounds",
    "split_documents",
    "train_batch",
    "val_batches",
]


@dataclass
class TokenData:
    """Train and validation token streams (int64, 1-D, EOS after every document) and their tokenizer."""

    train: torch.Tensor  # (N_train,)
    val: torch.Tensor  # (N_val,)
    tokenizer: Tokenizer
    fingerprint: str = ""  # sha256 of the corpus documents


def split_documents(lengths: Sequence[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) indices of whole documents, given their lengths in characters.

    Walks a seeded permutation of the documents and holds one out whenever it fits, until the
    held-out part reaches val_fraction of the characters; a document that would push it past
    twice that is skipped, so one huge file cannot swallow the corpus. At least one document on
    each side. Train keeps the permuted order (shards then mix files); val is sorted.
    """
    n_docs = len(lengths)
    if n_docs < 2:
        raise DataError(
            f"the corpus has {n_docs} document(s); a held-out validation split needs at least 2 "
            "(separate documents by blank lines, or pass more files with --dataset)"
        )
    perm = torch.randperm(n_docs, generator=torch.Generator().manual_seed(seed)).tolist()
    target = val_fraction * sum(lengths)
    val: list[int] = []
    held = 0
    for i in perm:
        if held >= target or len(val) == n_docs - 1:
            break
        if held + lengths[i] <= 2 * target:
            val.append(i)
            held += lengths[i]
    if not val:  # every document alone is larger than twice the target: hold out the smallest
        val = [min(range(n_docs), key=lambda i: (lengths[i], i))]
    chosen = set(val)
    return [i for i in perm if i not in chosen], sorted(val)


def _tokens(tok: Tokenizer, docs: Sequence[str]) -> torch.Tensor:
    parts: list[np.ndarray] = []
    chunk = 512
    for i in range(0, len(docs), chunk):
        for ids in tok.encode_batch(docs[i : i + chunk]):
            parts.append(np.asarray([*ids, tok.eos_id], dtype=np.int64))
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(flat)  # (N,)


def build_token_data(cfg: DataConfig) -> TokenData:
    """Load, split, tokenize and cache the corpus; a second call with the same inputs reads the cache."""
    docs = load_documents(cfg)
    fingerprint = corpus_fingerprint(docs)
    tok = get_tokenizer(cfg, docs, fingerprint)
    key = hashlib.sha256(
        f"tokens-{CACHE_VERSION}|{fingerprint}|{tok.sha256}|{cfg.val_fraction!r}|{cfg.seed}".encode()
    ).hexdigest()[:20]
    path = Path(cfg.cache_dir).expanduser() / "tokens" / f"tokens-{key}.pt"
    if path.is_file():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            log.info("using cached tokens %s (%d train, %d val)", path, blob["train"].numel(), blob["val"].numel())
            return TokenData(blob["train"], blob["val"], tok, fingerprint)
        except Exception as exc:  # a truncated or foreign file: rebuild it
            log.warning("token cache %s unreadable (%s); rebuilding it", path, one_line(exc))
    t0 = time.perf_counter()
    train_idx, val_idx = split_documents([len(d) for d in docs], cfg.val_fraction, cfg.seed)
    train = _tokens(tok, [docs[i] for i in train_idx])
    val = _tokens(tok, [docs[i] for i in val_idx])
    log.info(
        "tokenized %d train / %d val documents into %d / %d tokens in %.2fs",
        len(train_idx),
        len(val_idx),
        train.numel(),
        val.numel(),
        time.perf_counter() - t0,
    )
    buf = io.BytesIO()
    torch.save({"train": train, "val": val}, buf)
    write_cache_file(path, buf.getvalue())
    return TokenData(train, val, tok, fingerprint)


# ---------------------------------------------------------------------------------------- batches


def shard_bounds(n_tokens: int, shard: int, n_shards: int) -> tuple[int, int]:
    """[start, end) of shard `shard` of n_shards balanced contiguous slices of n_tokens."""
    if n_shards < 1 or not 0 <= shard < n_shards:
        raise ConfigError(f"data shard {shard} out of range for {n_shards} shard(s)")
    return shard * n_tokens // n_shards, (shard + 1) * n_tokens // n_shards


def _windows(tokens: torch.Tensor, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]  # (b, L+1)
    chunk = tokens[idx]  # (b, L+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (b, L), (b, L)


def train_batch(
    data: TokenData, shard: int, n_shards: int, step: int, batch_size: int, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch_size, seq_len) int64: rows step·b … step·b+b-1 of the shard's
    non-overlapping windows (wrapping around), targets shifted by one token."""
    if batch_size < 1 or seq_len < 1 or step < 0:
        raise ConfigError(
            f"train_batch needs batch_size >= 1, seq_len >= 1, step >= 0; got {batch_size}, {seq_len}, {step}"
        )
    start, end = shard_bounds(data.train.numel(), shard, n_shards)
    n_windows = (end - start - 1) // seq_len
    if n_windows < 1:
        raise DataError(
            f"data shard {shard}/{n_shards} has {end - start} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "use a larger corpus (--max-chars, --dataset), fewer replicas or a shorter --seq-len"
        )
    rows = (step * batch_size + torch.arange(batch_size)) % n_windows  # (b,)
    return _windows(data.train, start + rows * seq_len, seq_len)


def val_batches(
    data: TokenData, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first max_batches batches of non-overlapping val windows (the last one may be smaller)."""
    n_windows = (data.val.numel() - 1) // seq_len
    if n_windows < 1:
        raise DataError(
            f"the validation split has {data.val.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
            "raise data.val_fraction, use a larger corpus or a shorter --seq-len"
        )
    n = min(n_windows, max_batches * batch_size)
    starts = torch.arange(n) * seq_len  # (n,)
    return [_windows(data.val, starts[i : i + batch_size], seq_len) for i in range(0, n, batch_size)]
