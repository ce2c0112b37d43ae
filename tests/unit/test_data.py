"""peer.core.corpus, peer.core.tokenizer and peer.core.data: corpus loading (txt/jsonl/parquet/stdlib/hub),
the sentencepiece tokenizer, the token cache, the held-out split and deterministic disjoint shards."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from peer.core.corpus import BUILTIN_STDLIB, DataConfig, default_corpus_files, load_documents
from peer.core.data import (
    TokenData,
    build_token_data,
    shard_bounds,
    split_documents,
    train_batch,
    val_batches,
)
from peer.core.tokenizer import Tokenizer, get_tokenizer
from peer.errors import ConfigError, DataError

SMALL = 300_000  # characters of builtin:stdlib used by the tests
VOCAB = 300  # 259 reserved (specials + byte fallback) + 41 pieces


def _docs(n: int) -> list[str]:
    return [f"<doc {i}> " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(40 + i)) for i in range(n)]


@pytest.fixture(scope="module")
def stdlib_data(tmp_path_factory) -> TokenData:
    cfg = DataConfig(vocab_size=VOCAB, max_chars=SMALL, cache_dir=tmp_path_factory.mktemp("cache"))
    return build_token_data(cfg)


# ---------------------------------------------------------------------------------------- loading


def test_txt_file_yields_one_document_per_paragraph(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first para\nline two\n\nsecond para\n\n\nthird para\n")
    docs = load_documents(DataConfig(dataset=str(path), cache_dir=tmp_path))
    assert [d.strip() for d in docs] == ["first para\nline two", "second para", "third para"]


def test_jsonl_uses_text_field_and_max_chars_caps(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(_docs(5))))
    docs = load_documents(DataConfig(dataset=str(path), text_field="content", cache_dir=tmp_path))
    assert docs == _docs(5)
    capped = load_documents(DataConfig(dataset=str(path), text_field="content", max_chars=300, cache_dir=tmp_path))
    assert sum(map(len, capped)) == 300
    assert "".join(capped) == "".join(_docs(5))[:300]


def test_parquet_file_and_folder(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    docs = _docs(6)
    pq.write_table(pa.table({"text": docs[:3], "n": [1, 2, 3]}), folder / "a.parquet")
    pq.write_table(pa.table({"text": docs[3:], "n": [4, 5, 6]}), folder / "b.parquet")
    assert load_documents(DataConfig(dataset=str(folder / "a.parquet"), cache_dir=tmp_path)) == docs[:3]
    assert load_documents(DataConfig(dataset=str(folder), cache_dir=tmp_path)) == docs  # sorted files


def test_folder_mixing_types_is_rejected(tmp_path):
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(DataError, match="mixes file types"):
        load_documents(DataConfig(dataset=str(tmp_path), cache_dir=tmp_path))


def test_missing_path_is_a_one_line_data_error(tmp_path):
    missing = tmp_path / "nope" / "corpus.jsonl"
    with pytest.raises(DataError) as info:
        load_documents(DataConfig(dataset=str(missing), cache_dir=tmp_path))
    msg = str(info.value)
    assert str(missing) in msg and "--dataset" in msg and "\n" not in msg


def test_missing_text_field_names_the_columns(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"body": "a", "title": "b"}) + "\n")
    with pytest.raises(DataError) as info:
        load_documents(DataConfig(dataset=str(path), cache_dir=tmp_path))
    msg = str(info.value)
    assert "'text'" in msg and "body, title" in msg and "--text-field" in msg and "\n" not in msg


@pytest.mark.timeout(60)
def test_hub_name_offline_fails_fast_with_data_error(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time, so set the live flags too
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError) as info:
        load_documents(DataConfig(dataset="someone/no-such-dataset", cache_dir=tmp_path))
    msg = str(info.value)
    assert msg.startswith("could not load dataset 'someone/no-such-dataset' from the hub: ")
    assert BUILTIN_STDLIB in msg and "\n" not in msg


def test_builtin_stdlib_finds_sorted_sources():
    files = default_corpus_files()
    assert len(files) > 100
    assert all(p.suffix == ".py" for p in files)
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in files)
    assert {"os.py", "argparse.py"} <= {p.name for p in files}
    rel = [p.as_posix() for p in files]
    assert rel == sorted(rel)
    docs = load_documents(DataConfig(max_chars=50_000))
    assert sum(map(len, docs)) == 50_000 and len(docs) >= 2


def test_config_rejects_bad_values():
    with pytest.raises(ConfigError, match="val_fraction"):
        DataConfig(val_fraction=1.0)
    with pytest.raises(ConfigError, match="max_chars"):
        DataConfig(max_chars=0)


def test_default_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PEER_CACHE_DIR", str(tmp_path / "c"))
    assert DataConfig().cache_dir == tmp_path / "c"


# -------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_identity(stdlib_data, tmp_path):
    tok = stdlib_data.tokenizer
    assert tok.vocab_size == VOCAB and 0 <= tok.eos_id < VOCAB
    text = "def f(x):\n\tif x:  # naïve café 😀 ©\r\n        return [1, 2]\n\n  trailing "
    ids = tok.encode(text)
    assert all(0 <= i < VOCAB for i in ids) and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    loaded = Tokenizer.load(tok.path)
    assert loaded.sha256 == tok.sha256 and loaded.encode(text) == ids
    assert hashlib.sha256(Path(tok.path).read_bytes()).hexdigest() == tok.sha256
    # a given tokenizer file is used as is; its vocabulary must match the config
    cfg = DataConfig(tokenizer=tok.path, vocab_size=VOCAB, cache_dir=tmp_path)
    assert get_tokenizer(cfg, []).sha256 == tok.sha256
    with pytest.raises(DataError, match="--vocab-size 300"):
        get_tokenizer(DataConfig(tokenizer=tok.path, vocab_size=512, cache_dir=tmp_path), [])


def test_unreadable_tokenizer_is_a_data_error(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    for path in (bad, tmp_path / "missing.model"):
        with pytest.raises(DataError) as info:
            get_tokenizer(DataConfig(tokenizer=path, cache_dir=tmp_path), ["some text"])
        msg = str(info.value)
        assert str(path) in msg and "--tokenizer" in msg and "\n" not in msg


def test_too_large_vocab_for_tiny_corpus_suggests_smaller(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("\n\n".join(_docs(4)))
    with pytest.raises(DataError, match="smaller --vocab-size"):
        build_token_data(DataConfig(dataset=str(path), vocab_size=2000, cache_dir=tmp_path))


# ------------------------------------------------------------------------------------ token data


def test_build_is_cached_and_deterministic(tmp_path):
    cfg = DataConfig(vocab_size=VOCAB, max_chars=SMALL, cache_dir=tmp_path / "a")
    first = build_token_data(cfg)
    files = sorted(p for p in cfg.cache_dir.rglob("*") if p.is_file())
    assert [p.parent.name for p in files] == ["tokenizers", "tokens"]
    stamps = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files]
    second = build_token_data(cfg)
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files] == stamps  # read, not rewritten
    assert torch.equal(first.train, second.train) and torch.equal(first.val, second.val)
    assert first.train.dtype == torch.int64 and first.train.dim() == 1
    # a fresh cache reproduces the same tokenizer bytes and tensors
    other = build_token_data(DataConfig(vocab_size=VOCAB, max_chars=SMALL, cache_dir=tmp_path / "b"))
    assert other.tokenizer.sha256 == first.tokenizer.sha256
    assert torch.equal(other.train, first.train) and torch.equal(other.val, first.val)
    # a corrupt token cache is rebuilt, not trusted
    files[1].write_bytes(b"garbage")
    again = build_token_data(cfg)
    assert torch.equal(again.train, first.train)


def test_val_documents_are_held_out_of_train(tmp_path):
    path = tmp_path / "rows.jsonl"
    docs = _docs(40)
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = build_token_data(DataConfig(dataset=str(path), vocab_size=280, val_fraction=0.1, cache_dir=tmp_path))
    train_text, val_text = data.tokenizer.decode(data.train), data.tokenizer.decode(data.val)
    in_val = [f"<doc {i}> " in val_text for i in range(40)]
    in_train = [f"<doc {i}> " in train_text for i in range(40)]
    assert all(a != b for a, b in zip(in_val, in_train, strict=True))  # every document on exactly one side
    assert 1 <= sum(in_val) < 40
    eos = data.tokenizer.eos_id
    assert int((data.train == eos).sum()) + int((data.val == eos).sum()) == 40  # EOS after every document
    assert data.val[-1] == eos and data.train[-1] == eos


def test_split_documents_properties():
    lengths = [100] * 50
    train, val = split_documents(lengths, 0.1, seed=0)
    assert len(val) == 5 and sorted(train + val) == list(range(50)) and not set(train) & set(val)
    assert split_documents(lengths, 0.1, seed=0) == (train, val)
    assert split_documents(lengths, 0.1, seed=1) != (train, val)
    # a huge document is not allowed to swallow the held-out share
    train, val = split_documents([10_000] + [10] * 20, 0.05, seed=0)
    assert 0 not in val and len(val) >= 1 and 0 in train
    assert split_documents([5, 7], 0.01, seed=0)[1] in ([0], [1])
    with pytest.raises(DataError, match="at least 2"):
        split_documents([10], 0.1, seed=0)


# ---------------------------------------------------------------------------------------- batches


def _positional(tok: Tokenizer, n_train: int, n_val: int = 200) -> TokenData:
    """Token i has value i, so a batch shows exactly which positions it read."""
    return TokenData(torch.arange(n_train), torch.arange(n_val), tok)


def test_shards_are_disjoint_and_cover_train(stdlib_data):
    n, n_shards, L, b = 1003, 4, 8, 3
    bounds = [shard_bounds(n, s, n_shards) for s in range(n_shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(n_shards - 1))
    data = _positional(stdlib_data.tokenizer, n)
    seen: list[set[int]] = []
    for s, (lo, hi) in enumerate(bounds):
        n_windows = (hi - lo - 1) // L
        positions: set[int] = set()
        for step in range(-(-n_windows // b)):  # one pass over the shard
            x, y = train_batch(data, s, n_shards, step, b, L)
            assert x.shape == (b, L) and y.shape == (b, L) and x.dtype == torch.int64
            assert torch.equal(y, x + 1)  # targets are the next tokens
            assert int(x.min()) >= lo and int(y.max()) < hi
            positions |= set(x.flatten().tolist())
        assert positions == set(range(lo, lo + n_windows * L))  # every window of the shard visited
        seen.append(positions)
    for i in range(n_shards):
        for j in range(i + 1, n_shards):
            assert not seen[i] & seen[j]


def test_train_batch_is_deterministic_and_wraps(stdlib_data):
    data = stdlib_data
    x1, y1 = train_batch(data, 1, 3, 7, 4, 32)
    x2, y2 = train_batch(data, 1, 3, 7, 4, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(train_batch(data, 1, 3, 8, 4, 32)[0], x1)
    pos = _positional(data.tokenizer, 101)  # one shard: (101 - 1) // 10 = 10 windows
    first = train_batch(pos, 0, 1, 0, 5, 10)[0]
    assert torch.equal(train_batch(pos, 0, 1, 2, 5, 10)[0], first)  # step 2 wraps to step 0
    assert first[:, 0].tolist() == [0, 10, 20, 30, 40]


def test_short_shard_is_a_data_error(stdlib_data):
    data = _positional(stdlib_data.tokenizer, 40)
    with pytest.raises(DataError, match="fewer than seq_len"):
        train_batch(data, 3, 4, 0, 2, 16)
    with pytest.raises(ConfigError):
        train_batch(data, 4, 4, 0, 2, 4)


def test_val_batches_are_deterministic(stdlib_data):
    a = val_batches(stdlib_data, 4, 32, max_batches=3)
    b = val_batches(stdlib_data, 4, 32, max_batches=3)
    assert len(a) == 3 and all(x.shape == (4, 32) for x, _ in a)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b, strict=True))
    pos = _positional(stdlib_data.tokenizer, 10, n_val=23)  # 2 windows of 10 (+1)
    batches = val_batches(pos, 4, 10, max_batches=5)
    assert len(batches) == 1 and batches[0][0][:, 0].tolist() == [0, 10]
    with pytest.raises(DataError, match="validation split"):
        val_batches(pos, 4, 30, max_batches=1)
