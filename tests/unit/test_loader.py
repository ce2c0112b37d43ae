"""peer.core.data.loader and peer.core.data.permutation: the one deterministic, disjoint loader.

Positional corpora make every batch show what it read: token = 100_000·(file + 1) + offset, so a
window's first token names its shard file and offset, and a window that crossed a file would
jump. Prepared folders are written to disk (`write_prepared`) and read through memory maps, as
a peer reads them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.core.data.corpus import DataConfig
from peer.core.data.loader import (
    Corpus,
    claim_bounds,
    load_corpus,
    needed_shards,
    open_corpus,
    train_batch,
    val_batches,
)
from peer.core.data.permutation import keys, permute
from peer.core.data.shards import DatasetIndex, PreparedDataset, ShardWriter, write_index, write_prepared
from peer.core.data.tokenizer import train_tokenizer
from peer.errors import ConfigError, DataError
from peer.node.replica.data_parallel import rank_batch_index

VOCAB = 1 << 20  # uint32 shards: room for positional ids
TRAIN_FILES = (53, 40, 7, 81, 1, 66)  # tokens per train shard file: not multiples of L, one too short
VAL_FILES = (30, 25)


def _positional(root: Path, train=TRAIN_FILES, val=VAL_FILES) -> PreparedDataset:
    """One shard file per length (ShardWriter with shard_tokens = its length), ids positional."""
    shards = []
    for split, lengths, first in (("train", train, 0), ("val", val, 50)):
        for f, n in enumerate(lengths):
            writer = ShardWriter(root, split, "uint32", n, first=f)
            writer.add(100_000 * (first + f + 1) + np.arange(n))
            shards += writer.close()
    index = DatasetIndex("uint32", VOCAB, 2, "", tuple(shards))
    write_index(root, index)
    return PreparedDataset(root, index)


def _where(x: torch.Tensor) -> list[tuple[int, int]]:
    """(train file, offset) of each row's first token."""
    return [(int(v) // 100_000 - 1, int(v) % 100_000) for v in x[:, 0]]


@pytest.fixture
def corpus(tmp_path) -> Corpus:
    return open_corpus(_positional(tmp_path / "pos"), seed=7)


# ------------------------------------------------------------------------------------ permutation


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 16, 17, 100, 1000, 4097])
def test_permutation_is_a_bijection(n):
    for k in (keys(0, 0, 0), keys(1, 2, 3), keys(-5, 10**12)):
        out = permute(np.arange(n), n, k)
        assert out.dtype == np.int64 and sorted(out.tolist()) == list(range(n))
        assert np.array_equal(permute(np.arange(n)[::-1], n, k), out[::-1])  # pure, elementwise
    if n >= 5:
        assert not np.array_equal(permute(np.arange(n), n, keys(0)), permute(np.arange(n), n, keys(1)))
    with pytest.raises(ValueError):
        permute(np.array([n]), n, keys(0))


def test_permutation_shuffles():
    n = 10_000
    out = permute(np.arange(n), n, keys(3))
    assert abs(np.corrcoef(np.arange(n), out)[0, 1]) < 0.05  # no trace of the identity
    assert np.mean(np.abs(np.diff(out))) > n / 5  # neighbours land far apart


# ------------------------------------------------------------------------------------ layout


def test_windows_never_cross_shard_files(corpus):
    L = 8
    expected = sum((n - 1) // L for n in TRAIN_FILES)
    assert corpus.sequences(L) == expected
    seen = set()
    for step in range(expected):  # one shard, batch 1: every sequence once
        x, y = train_batch(corpus, 0, 1, step, 1, L)
        assert torch.equal(y, x + 1)
        assert torch.equal(x[0], x[0, 0] + torch.arange(L))  # consecutive ids: one file
        ((f, o),) = _where(x)
        assert o % L == 0 and o + L < TRAIN_FILES[f]  # window at a multiple of L, target inside the file
        seen.add((f, o))
    assert seen == {(f, k * L) for f, n in enumerate(TRAIN_FILES) for k in range((n - 1) // L)}


def test_claims_are_disjoint_and_each_reads_every_sequence_once_per_epoch(corpus):
    L, b, n_shards = 4, 3, 3
    N = corpus.sequences(L)
    everything: list[tuple[int, int]] = []
    for m in range(n_shards):
        lo, hi = claim_bounds(N, m, n_shards)
        n_m = hi - lo
        rows = [r for s in range(-(-n_m // b)) for r in _where(train_batch(corpus, m, n_shards, s, b, L)[0])]
        epoch0 = rows[:n_m]
        assert len(set(epoch0)) == n_m  # each sequence of the claim once
        everything += epoch0
    assert len(everything) == len(set(everything)) == N  # claims disjoint, together everything


def test_ranks_of_a_replica_read_disjoint_batches(corpus):
    L, b, H, R = 4, 2, 3, 2
    read = [
        _where(train_batch(corpus, 1, 2, rank_batch_index(t, h, H, R, r), b, L)[0])
        for t in range(2)
        for h in range(H)
        for r in range(R)
    ]
    flat = [w for batch in read for w in batch]
    n_m = -np.subtract(*claim_bounds(corpus.sequences(L), 1, 2))
    assert len(flat) <= n_m and len(set(flat)) == len(flat)  # within one epoch: no window twice


def test_batches_are_a_pure_function_and_a_resumed_loader_continues(tmp_path):
    dataset = _positional(tmp_path / "pos")
    long_running = open_corpus(dataset, seed=7)
    L, b = 4, 5
    history = [train_batch(long_running, 1, 2, s, b, L) for s in range(40)]  # several epochs
    for s in (0, 1, 7, 13, 39):
        fresh = open_corpus(PreparedDataset.open(dataset.root), seed=7)  # a restarted peer
        x, y = train_batch(fresh, 1, 2, s, b, L)
        assert torch.equal(x, history[s][0]) and torch.equal(y, history[s][1])
    again = train_batch(long_running, 1, 2, 13, b, L)
    assert torch.equal(again[0], history[13][0])
    other_seed = open_corpus(dataset, seed=8)
    assert not all(torch.equal(train_batch(other_seed, 1, 2, s, b, L)[0], history[s][0]) for s in range(4))


def test_a_new_epoch_reshuffles_the_same_sequences_and_says_so_once(corpus, caplog):
    L, m, n_shards = 4, 0, 2
    n_m = -np.subtract(*claim_bounds(corpus.sequences(L), m, n_shards))
    with caplog.at_level(logging.INFO, logger="peer.core.data.loader"):
        epochs = [
            _where(train_batch(corpus, m, n_shards, e * n_m + r, 1, L)[0])[0] for e in range(3) for r in range(n_m)
        ]
        for r in range(n_m):  # reading epoch 2 again logs nothing more
            train_batch(corpus, m, n_shards, 2 * n_m + r, 1, L)
    e0, e1, e2 = epochs[:n_m], epochs[n_m : 2 * n_m], epochs[2 * n_m :]
    assert set(e0) == set(e1) == set(e2) and len(set(e0)) == n_m
    assert e0 != e1 and e1 != e2
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs.count("data shard 0: epoch 1 begins, reshuffled") == 1
    assert msgs.count("data shard 0: epoch 2 begins, reshuffled") == 1
    assert sum("reading epoch 0" in msg for msg in msgs) == 1


def test_val_batches_are_the_first_windows_in_order(corpus):
    L, b = 4, 3
    n_val = sum((n - 1) // L for n in VAL_FILES)  # 7 + 6 = 13
    batches = val_batches(corpus, b, L, max_batches=10)
    assert [len(x) for x, _ in batches] == [3, 3, 3, 3, 1]
    firsts = [int(v) for x, _ in batches for v in x[:, 0]]
    expected = [100_000 * (50 + f + 1) + k * L for f, n in enumerate(VAL_FILES) for k in range((n - 1) // L)]
    assert firsts == expected and len(firsts) == n_val
    assert all(torch.equal(y, x + 1) for x, y in batches)
    assert [len(x) for x, _ in val_batches(corpus, b, L, max_batches=2)] == [3, 3]
    assert all(torch.equal(a[0], c[0]) for a, c in zip(batches, val_batches(corpus, b, L, 10), strict=True))
    with pytest.raises(DataError, match="validation split"):
        val_batches(corpus, b, 40, max_batches=1)


def test_needed_shards_are_exactly_what_a_claim_reads(tmp_path):
    dataset = _positional(tmp_path / "pos")
    L, b, n_shards = 4, 4, 3
    N = open_corpus(dataset, seed=1).sequences(L)
    for m in range(n_shards):
        need = needed_shards(dataset.index, L, m, n_shards)
        train_need = {s.name for s in need if s.split == "train"}
        assert [s for s in need if s.split == "val"] == list(dataset.index.val)
        lo, hi = claim_bounds(N, m, n_shards)
        corpus = open_corpus(dataset, seed=1)
        read = {f for s in range(-(-(hi - lo) // b)) for f, _ in _where(train_batch(corpus, m, n_shards, s, b, L)[0])}
        assert {f"train-{f:05d}.bin" for f in read} == train_need
    # a peer that holds only what its claim needs trains and validates
    keep = {s.name for s in needed_shards(dataset.index, L, 2, n_shards)}
    for s in dataset.index.shards:
        if s.name not in keep:
            dataset.path(s).unlink()
    sparse = open_corpus(PreparedDataset.open(dataset.root), seed=1)
    for step in range(10):
        train_batch(sparse, 2, n_shards, step, b, L)
    val_batches(sparse, b, L, 4)
    with pytest.raises(DataError, match="missing or incomplete") as info:
        for step in range(10):
            train_batch(sparse, 0, n_shards, step, b, L)
    assert "\n" not in str(info.value)


def test_bad_claims_and_shapes(corpus):
    with pytest.raises(ConfigError):
        train_batch(corpus, 3, 3, 0, 2, 4)
    with pytest.raises(ConfigError):
        train_batch(corpus, 0, 1, -1, 2, 4)
    with pytest.raises(ConfigError):
        val_batches(corpus, 0, 4, 1)
    with pytest.raises(DataError, match="holds no sequence"):
        train_batch(corpus, 0, 1, 0, 2, 100)  # no file has 101 tokens
    N = corpus.sequences(4)
    with pytest.raises(DataError, match="holds no sequence"):  # more claims than sequences
        train_batch(corpus, 0, N + 1, 0, 1, 4)


# ------------------------------------------------------------------------------------ corpora


def _docs(n: int) -> list[str]:
    return [f"<doc {i}> " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(40 + i)) for i in range(n)]


def test_the_folder_tokenizer_is_loaded_and_checked(tmp_path):
    tok = train_tokenizer(_docs(30), 280, tmp_path / "a.model")
    ids = [np.asarray([*tok.encode(d), tok.eos_id]) for d in _docs(30)]
    dataset = write_prepared(tmp_path / "ds", {"train": ids[:25], "val": ids[25:]}, 280, tok.eos_id, tokenizer=tok.path)
    corpus = open_corpus(dataset, seed=0)
    assert corpus.tokenizer is not None and corpus.tokenizer.sha256 == tok.sha256
    assert corpus.fingerprint == dataset.index.fingerprint
    x, _ = train_batch(corpus, 0, 1, 0, 2, 16)
    assert "word" in corpus.tokenizer.decode(x[0])
    other = train_tokenizer(_docs(30)[::-1] + ["zzz qqq"] * 5, 280, tmp_path / "b.model")
    with pytest.raises(DataError, match="not the one"):
        open_corpus(dataset, seed=0, tokenizer=other)


def test_load_corpus_prepares_once_then_opens(tmp_path):
    path = tmp_path / "rows.txt"
    path.write_text("\n\n".join(_docs(40)))
    cfg = DataConfig(dataset=str(path), vocab_size=280, val_fraction=0.1, cache_dir=tmp_path / "cache")
    first = load_corpus(cfg)
    again = load_corpus(cfg)
    assert again.dataset.root == first.dataset.root and again.fingerprint == first.fingerprint
    assert torch.equal(train_batch(first, 0, 2, 3, 2, 8)[0], train_batch(again, 0, 2, 3, 2, 8)[0])
    by_folder = load_corpus(DataConfig(dataset=str(first.dataset.root), vocab_size=280, cache_dir=tmp_path / "c"))
    assert by_folder.fingerprint == first.fingerprint
    with pytest.raises(DataError, match="vocabulary of 280 ids"):
        load_corpus(DataConfig(dataset=str(first.dataset.root), vocab_size=270, cache_dir=tmp_path / "c"))
