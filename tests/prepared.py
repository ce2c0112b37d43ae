"""Small prepared datasets for tests, made with the real parts: a sentencepiece tokenizer trained
on a few documents (`peer.core.data.tokenizer.train_tokenizer`), `ShardWriter` and `write_index`.

`make_prepared(root, docs)` tokenizes `docs` (EOS after each), holds out the last one for
validation and writes `shard_tokens`-token shards; `synthetic_prepared(root, n_tokens)` writes
random ids of a real tokenizer's vocabulary (for throughput figures where the text does not matter).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from peer.core.data.shards import (
    TOKENIZER_FILE,
    DatasetIndex,
    PreparedDataset,
    ShardWriter,
    token_dtype,
    write_index,
)
from peer.core.data.tokenizer import Tokenizer, train_tokenizer

VOCAB = 300  # the smallest comfortable sentencepiece vocabulary (259 ids are reserved)


def corpus(seed: int, n_docs: int = 24) -> list[str]:
    """Plain-English documents that differ with `seed` (two seeds: two corpora)."""
    rng = np.random.default_rng(seed)
    words = ["the", "a", "swarm", "peer", "trains", "model", "on", "shard", "data", "token", "of", "each", "round"]
    return [" ".join(rng.choice(words, size=int(rng.integers(40, 120)))) + "." for _ in range(n_docs)]


def tokenizer_for(docs: Sequence[str], path: Path, vocab_size: int = VOCAB) -> Tokenizer:
    return train_tokenizer(list(docs), vocab_size, path)


def make_prepared(
    root: Path, docs: Sequence[str], shard_tokens: int = 256, tokenizer: Tokenizer | None = None
) -> PreparedDataset:
    """A prepared folder at `root` of `docs` (the last one held out for validation)."""
    root.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or tokenizer_for(docs, root / TOKENIZER_FILE)
    if tok.path != root / TOKENIZER_FILE:
        shutil.copyfile(tok.path, root / TOKENIZER_FILE)
    dtype = token_dtype(tok.vocab_size)
    shards = []
    for split, part in (("train", docs[:-1]), ("val", docs[-1:])):
        writer = ShardWriter(root, split, dtype, shard_tokens)
        for ids in tok.encode_batch(list(part)):
            writer.add(np.asarray([*ids, tok.eos_id]))
        shards += writer.close()
    index = DatasetIndex(dtype, tok.vocab_size, tok.eos_id, tok.sha256, tuple(shards), 0, 0.05, "tests")
    write_index(root, index)
    return PreparedDataset.open(root)


def synthetic_prepared(
    root: Path, n_tokens: int, tokenizer: Tokenizer, shard_tokens: int = 1 << 24, seed: int = 0
) -> PreparedDataset:
    """A prepared folder of `n_tokens` random train ids (and 1 % validation) of `tokenizer`'s vocabulary."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer.path, root / TOKENIZER_FILE)
    dtype = token_dtype(tokenizer.vocab_size)
    rng = np.random.default_rng(seed)
    shards = []
    for split, count in (("train", n_tokens), ("val", max(1, n_tokens // 100))):
        writer = ShardWriter(root, split, dtype, shard_tokens)
        for start in range(0, count, 1 << 22):
            writer.add(rng.integers(0, tokenizer.vocab_size, size=min(1 << 22, count - start), dtype=np.uint16))
        shards += writer.close()
    index = DatasetIndex(dtype, tokenizer.vocab_size, tokenizer.eos_id, tokenizer.sha256, tuple(shards), seed, 0.01)
    write_index(root, index)
    return PreparedDataset.open(root)
