"""peer.core.corpus and peer.core.tokenizer: corpus loading (txt/jsonl/parquet/stdlib/hub) and the
sentencepiece tokenizer. Preparing and reading token shards: test_prepare.py, test_loader.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from peer.core.corpus import BUILTIN_STDLIB, DataConfig, default_corpus_files, load_documents
from peer.core.tokenizer import Tokenizer, get_tokenizer
from peer.errors import ConfigError, DataError

SMALL = 300_000  # characters of builtin:stdlib used by the tests
VOCAB = 300  # 259 reserved (specials + byte fallback) + 41 pieces


def _docs(n: int) -> list[str]:
    return [f"<doc {i}> " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(40 + i)) for i in range(n)]


@pytest.fixture(scope="module")
def stdlib_tokenizer(tmp_path_factory) -> Tokenizer:
    cfg = DataConfig(vocab_size=VOCAB, max_chars=SMALL, cache_dir=tmp_path_factory.mktemp("cache"))
    return get_tokenizer(cfg, load_documents(cfg))


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


def test_tokenizer_round_trip_and_identity(stdlib_tokenizer, tmp_path):
    tok = stdlib_tokenizer
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
    cfg = DataConfig(dataset=str(path), vocab_size=2000, cache_dir=tmp_path)
    with pytest.raises(DataError, match="smaller --vocab-size"):
        get_tokenizer(cfg, load_documents(cfg))
