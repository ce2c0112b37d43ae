"""peer.core.data.corpus and peer.core.data.tokenizer: the documents a source yields (txt/jsonl/parquet/stdlib)
and the sentencepiece tokenizer. Refusals met through `prepare` (mixed folders, a missing text field,
an unreachable hub, too large a vocabulary), preparing and reading token shards: test_prepare.py,
test_loader.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from peer.core.data.corpus import BUILTIN_STDLIB, DataConfig, Source, default_corpus_files, iter_documents
from peer.core.data.tokenizer import Tokenizer, train_tokenizer
from peer.errors import ConfigError, DataError

SMALL = 300_000  # characters of builtin:stdlib used by the tests
VOCAB = 300  # 259 reserved (specials + byte fallback) + 41 pieces


def _docs(n: int) -> list[str]:
    return [f"<doc {i}> " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(40 + i)) for i in range(n)]


def _read(dataset: str | Path, **kw) -> list[str]:
    return list(iter_documents(Source(str(dataset), **kw)))


@pytest.fixture(scope="module")
def stdlib_tokenizer(tmp_path_factory) -> Tokenizer:
    docs = _read(BUILTIN_STDLIB, max_chars=SMALL)
    return train_tokenizer(docs, VOCAB, tmp_path_factory.mktemp("tok") / "spm.model")


# ---------------------------------------------------------------------------------------- sources


def test_txt_file_yields_one_document_per_paragraph(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("first para\nline two\n\nsecond para\n\n\nthird para\n")
    assert [d.strip() for d in _read(path)] == ["first para\nline two", "second para", "third para"]


def test_jsonl_uses_text_field_and_max_chars_caps(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": i, "content": d}) + "\n" for i, d in enumerate(_docs(5))))
    assert _read(path, text_field="content") == _docs(5)
    capped = list(iter_documents(Source.of(DataConfig(dataset=str(path), text_field="content", max_chars=300))))
    assert sum(map(len, capped)) == 300
    assert "".join(capped) == "".join(_docs(5))[:300]


def test_parquet_file_and_folder(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    docs = _docs(6)
    pq.write_table(pa.table({"text": docs[:3], "n": [1, 2, 3]}), folder / "a.parquet")
    pq.write_table(pa.table({"text": docs[3:], "n": [4, 5, 6]}), folder / "b.parquet")
    assert _read(folder / "a.parquet") == docs[:3]
    assert _read(folder) == docs  # sorted files


def test_builtin_stdlib_finds_sorted_sources():
    files = default_corpus_files()
    assert len(files) > 100
    assert all(p.suffix == ".py" for p in files)
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in files)
    assert {"os.py", "argparse.py"} <= {p.name for p in files}
    rel = [p.as_posix() for p in files]
    assert rel == sorted(rel)
    docs = list(iter_documents(Source.of(DataConfig(max_chars=50_000))))
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


def test_tokenizer_round_trip_and_identity(stdlib_tokenizer):
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


def test_unreadable_tokenizer_is_a_data_error(tmp_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    for path in (bad, tmp_path / "missing.model"):
        with pytest.raises(DataError) as info:
            Tokenizer.load(path)
        msg = str(info.value)
        assert str(path) in msg and "--tokenizer" in msg and "\n" not in msg
