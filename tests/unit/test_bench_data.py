"""`peer bench data` (peer.research.bench.data): its sizes and synthetic corpora (valid prepared
datasets). The whole benchmark on tiny corpora: tests/integration/test_bench_data.py."""

from __future__ import annotations

import pytest

from peer.core.data.loader import open_corpus, train_batch
from peer.core.data.shards import PreparedDataset
from peer.errors import ConfigError
from peer.research.bench.data import VOCAB, parse_size, write_synthetic


def test_sizes_parse():
    assert [parse_size(s) for s in ("10M", "1B", "1g", "500k", "123456")] == [10**7, 10**9, 10**9, 500_000, 123_456]
    for bad in ("ten", "10"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_synthetic_corpus_is_a_prepared_dataset(tmp_path):
    dataset = write_synthetic(tmp_path / "c", 300_000)
    again = PreparedDataset.open(tmp_path / "c")
    again.verify()
    assert again.index.tokens("train") == 300_000 and again.index.vocab_size == VOCAB
    x, _ = train_batch(open_corpus(dataset, seed=0), 0, 2, 0, 4, 16)
    assert int(x.max()) < VOCAB
