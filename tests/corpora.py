"""Small prepared corpora for tests, written to disk as real prepared folders (`write_prepared`)
and read through the one loader (`peer.core.data.loader`), exactly as a peer reads its data."""

from __future__ import annotations

from pathlib import Path

import torch

from peer.core.data.loader import Corpus, open_corpus
from peer.core.data.shards import write_prepared


def pattern_corpus(root: Path, vocab_size: int, tokens: int = 50_000, period: int = 97, val: int = 4_000) -> Corpus:
    """A learnable stream: `arange % period` with 10 % of the tokens replaced by seeded noise;
    validation is a copy of its first `val` tokens. No tokenizer (synthetic ids)."""
    g = torch.Generator().manual_seed(0)
    base = torch.arange(tokens) % period
    noise = torch.randint(0, vocab_size, (tokens,), generator=g)
    train = torch.where(torch.rand(tokens, generator=g) < 0.1, noise, base)
    splits = {"train": [train.numpy()], "val": [train[:val].numpy()]}
    return open_corpus(write_prepared(Path(root), splits, vocab_size, eos_id=2), seed=0)
