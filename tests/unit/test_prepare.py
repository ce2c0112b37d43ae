"""peer.core.data.prepare: a source streamed into prepared shards -- local jsonl/txt/parquet, builtin:stdlib,
EOS after every document, the split by document, any number of workers giving the same bytes,
resuming after an interruption, and prepared_for's cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peer.core.data import prepare as prepare_mod
from peer.core.data.corpus import DataConfig, default_corpus_files
from peer.core.data.prepare import Source, cache_folder, prepare, prepared_for
from peer.core.data.prepare_pool import is_val
from peer.core.data.prepare_state import STATE_FILE, load_state
from peer.core.data.shards import PreparedDataset, is_prepared
from peer.core.data.tokenizer import Tokenizer
from peer.errors import ConfigError, DataError

VOCAB = 300  # 259 reserved (specials + byte fallback) + 41 pieces


def _paragraphs(n: int) -> list[str]:
    """n real, varied documents: paragraphs of the standard library's first sources."""
    out: list[str] = []
    for path in default_corpus_files():
        out += [p for p in path.read_text(errors="replace").split("\n\n") if p.strip() and len(p) > 40]
        if len(out) >= n:
            return out[:n]
    raise AssertionError("not enough standard library text")


def _jsonl(folder: Path, docs: list[str], files: int = 2, field: str = "text") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    per = -(-len(docs) // files)
    for f in range(files):
        rows = [{"id": i, field: d} for i, d in enumerate(docs[f * per : (f + 1) * per])]
        (folder / f"part-{f}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _files(root: Path) -> dict[str, bytes]:
    """Every file of a prepared folder but the resume record (whose arguments name the folder)."""
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != STATE_FILE}


def _doc_ids(ds: PreparedDataset, split: str) -> list[list[int]]:
    """The documents of a split as id lists (cut at EOS)."""
    flat = np.concatenate([np.asarray(ds.tokens(s)) for s in ds.index.split(split)]).tolist()
    docs, cur = [], []
    for t in flat:
        if t == ds.index.eos_id:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    assert not cur, "a split must end with EOS"
    return docs


@pytest.fixture(scope="module")
def docs() -> list[str]:
    return _paragraphs(300)


@pytest.fixture(scope="module")
def src(tmp_path_factory, docs) -> Path:
    """The documents as a folder of two jsonl files."""
    return _jsonl(tmp_path_factory.mktemp("src"), docs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, src) -> PreparedDataset:
    """The jsonl corpus prepared once, in one process, in shards of 4096 tokens."""
    out = tmp_path_factory.mktemp("ref") / "ref"
    return prepare(Source(str(src)), out, vocab_size=VOCAB, shard_tokens=4096, workers=1, val_fraction=0.1)


# ------------------------------------------------------------------------------------------ output


def test_every_document_once_in_order_with_eos_and_split_by_ordinal(reference, docs):
    ds, index = reference, reference.index
    tok = Tokenizer.load(ds.tokenizer_path)
    assert tok.sha256 == index.tokenizer_sha256 and index.vocab_size == VOCAB and index.dtype == "uint16"
    assert all(s.tokens == 4096 for s in index.train[:-1]) and len(index.train) > 2
    val_ordinals = [i for i in range(len(docs)) if is_val(0, i, 0.1)]
    assert index.documents == {"train": len(docs) - len(val_ordinals), "val": len(val_ordinals)}
    assert 0 in val_ordinals and 1 not in val_ordinals and 10 < len(val_ordinals) < 60
    train = [tok.decode(ids) for ids in _doc_ids(ds, "train")]
    val = [tok.decode(ids) for ids in _doc_ids(ds, "val")]
    assert val == [docs[i] for i in val_ordinals]
    assert train == [d for i, d in enumerate(docs) if i not in set(val_ordinals)]
    ds.verify()


def test_split_is_a_function_of_seed_and_ordinal_alone():
    a = [is_val(0, i, 0.05) for i in range(20_000)]
    assert a == [is_val(0, i, 0.05) for i in range(20_000)]
    assert 0.04 < sum(a) / len(a) < 0.06
    b = [is_val(1, i, 0.05) for i in range(20_000)]
    assert a != b and a[:2] == b[:2] == [True, False]  # document 0 is val, 1 is train, for any seed


def test_one_and_two_workers_write_identical_bytes(reference, src, tmp_path, monkeypatch):
    monkeypatch.setattr(prepare_mod, "_BATCH_CHARS", 2000)  # many batches in flight, out of order on the workers
    two = prepare(Source(str(src)), tmp_path / "two", vocab_size=VOCAB, shard_tokens=4096, workers=2, val_fraction=0.1)
    assert _files(two.root) == _files(reference.root)


def test_same_documents_in_jsonl_txt_and_parquet_give_the_same_fingerprint(reference, docs, tmp_path):
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), tmp_path / "docs.parquet")
    txt = tmp_path / "docs.txt"
    txt.write_text("\n\n".join(d.strip("\n") for d in docs))  # one paragraph per document
    kw = {"vocab_size": VOCAB, "shard_tokens": 4096, "workers": 1, "val_fraction": 0.1}
    from_parquet = prepare(Source(str(tmp_path / "docs.parquet")), tmp_path / "p", **kw)
    assert from_parquet.index.fingerprint == reference.index.fingerprint
    assert from_parquet.index.val_fingerprint == reference.index.val_fingerprint
    from_txt = prepare(Source(str(txt)), tmp_path / "t", **kw)
    assert sum(from_txt.index.documents.values()) == len(docs)


def test_builtin_stdlib_capped_and_a_given_tokenizer(reference, tmp_path):
    ds = prepare(Source("builtin:stdlib", max_chars=60_000), tmp_path / "s", vocab_size=VOCAB, workers=1)
    assert ds.index.source == "builtin:stdlib, first 60,000 characters"
    assert sum(ds.index.documents.values()) >= 2 and ds.index.tokens("val") > 0
    given = prepare(
        Source("builtin:stdlib", max_chars=60_000),
        tmp_path / "g",
        vocab_size=VOCAB,
        tokenizer=reference.tokenizer_path,
        workers=1,
    )
    assert given.index.tokenizer_sha256 == reference.index.tokenizer_sha256
    assert given.tokenizer_path.read_bytes() == reference.tokenizer_path.read_bytes()


def test_a_vocabulary_beyond_uint16_gives_uint32_shards(reference, tmp_path):
    from sentencepiece import sentencepiece_model_pb2 as pb

    model = pb.ModelProto()
    model.ParseFromString(reference.tokenizer_path.read_bytes())
    for i in range(70_000):  # whole-word pieces: ids up to VOCAB + 69,999, past uint16
        model.pieces.add(piece=f"w{i:05d}x", score=0.0, type=pb.ModelProto.SentencePiece.USER_DEFINED)
    big = tmp_path / "big.model"
    big.write_bytes(model.SerializeToString())
    texts = [f"document {i}: w{69_999 - i:05d}x and w{i:05d}x, then plain words" for i in range(12)]
    src = _jsonl(tmp_path / "src", texts, files=1)
    tok = Tokenizer.load(big)
    ds = prepare(Source(str(src)), tmp_path / "out", vocab_size=tok.vocab_size, tokenizer=big, workers=1)
    assert ds.index.dtype == "uint32" and ds.index.vocab_size == VOCAB + 70_000
    ids = _doc_ids(ds, "train") + _doc_ids(ds, "val")
    assert max(max(d) for d in ids) == tok.encode("w69999x")[0] > 65_535
    assert sorted(tok.decode(d) for d in ids) == sorted(texts)


# ------------------------------------------------------------------------------------------ resume


def _stop_after(shards: int, root: Path):
    def progress(_documents: int, _tokens: int) -> None:
        state = load_state(root)
        if state is not None and sum(len(p.shards) for p in state.splits.values()) >= shards:
            raise KeyboardInterrupt

    return progress


@pytest.mark.parametrize("workers", [1, 2])
def test_an_interrupted_prepare_resumes_to_identical_bytes(reference, src, tmp_path, monkeypatch, workers):
    monkeypatch.setattr(prepare_mod, "_BATCH_CHARS", 3000)
    out = tmp_path / "out"
    kw = {"vocab_size": VOCAB, "shard_tokens": 4096, "workers": workers, "val_fraction": 0.1}
    for stop in (1, 3):  # stop twice, at different shards
        with pytest.raises(KeyboardInterrupt):
            prepare(Source(str(src)), out, progress=_stop_after(stop, out), **kw)
        assert not is_prepared(out) and (out / STATE_FILE).is_file()
    seen: list[tuple[int, int]] = []
    ds = prepare(Source(str(src)), out, progress=lambda d, t: seen.append((d, t)), **kw)
    assert seen[0][0] > 0  # it continued, not started over
    assert _files(ds.root) == _files(reference.root)
    assert not any(p.name.startswith(("prepare.pending", ".")) for p in out.iterdir())


def test_a_finished_folder_is_left_as_is_and_other_arguments_are_refused(reference, src, tmp_path):
    stamp = {p.name: p.stat().st_mtime_ns for p in reference.root.iterdir()}
    src = str(src)
    again = prepare(Source(src), reference.root, vocab_size=VOCAB, shard_tokens=4096, workers=1, val_fraction=0.1)
    assert again.index.fingerprint == reference.index.fingerprint
    assert {p.name: p.stat().st_mtime_ns for p in reference.root.iterdir()} == stamp
    with pytest.raises(DataError) as info:
        prepare(Source(src), reference.root, vocab_size=VOCAB, shard_tokens=4096, workers=1, val_fraction=0.1, seed=3)
    msg = str(info.value)
    assert "differ in: seed" in msg and "--restart" in msg and "\n" not in msg
    out = tmp_path / "copy"
    out.mkdir()
    for p in reference.root.iterdir():
        (out / p.name).write_bytes(p.read_bytes())
    kw = {"vocab_size": VOCAB, "shard_tokens": 4096, "workers": 1, "val_fraction": 0.1}
    restarted = prepare(Source(src), out, seed=3, restart=True, **kw)
    assert restarted.index.seed == 3 and restarted.index.fingerprint != reference.index.fingerprint


# -------------------------------------------------------------------------------------- bad inputs


def _one_line_error(fn, *words: str, kind: type[Exception] = DataError) -> None:
    with pytest.raises(kind) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_bad_inputs_are_one_line_errors(reference, docs, tmp_path):
    def run(src: str, out: str = "out", text_field: str = "text", **kw):
        args = {"vocab_size": VOCAB, "workers": 1, **kw}
        return lambda: prepare(Source(src, text_field=text_field), tmp_path / out, **args)

    missing = str(tmp_path / "missing.jsonl")
    _one_line_error(run(missing), "does not exist", missing, "--dataset")
    (tmp_path / "data.csv").write_text("a,b\n")
    _one_line_error(run(str(tmp_path / "data.csv")), "unsupported type", ".parquet")
    mixed = _jsonl(tmp_path / "mixed", docs[:10])
    (mixed / "x.txt").write_text("text\n")
    _one_line_error(run(str(mixed)), "mixes file types")
    plain = _jsonl(tmp_path / "plain", docs[:10], field="body")
    _one_line_error(run(str(plain)), "no field 'text'", "body, id", "--text-field")
    _one_line_error(run(str(plain), text_field="id"), "holds int", "--text-field")
    _one_line_error(lambda: prepare(Source(str(plain), config="en"), tmp_path / "o", vocab_size=VOCAB), "--config")
    _one_line_error(lambda: Source("builtin:stdlib", max_chars=0), "--max-chars", kind=ConfigError)
    one = _jsonl(tmp_path / "one", docs[:1], files=1)
    _one_line_error(run(str(one)), "one document", "larger corpus")
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    _one_line_error(run(str(tmp_path / "empty.txt")), "contains no text")
    _one_line_error(run(str(plain), text_field="body", vocab_size=5000), "smaller --vocab-size")
    _one_line_error(run(str(plain), tokenizer=reference.tokenizer_path, vocab_size=512), "--vocab-size 300")
    _one_line_error(run(str(plain), val_fraction=1.0), "--val-fraction", kind=ConfigError)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.md").write_text("mine")
    _one_line_error(run(str(plain), "busy", text_field="body"), "not empty")
    assert (tmp_path / "busy" / "notes.md").read_text() == "mine"


# ------------------------------------------------------------------------------ dataset repositories


def test_a_dataset_repository_is_read_by_configuration_and_split(tmp_path):
    """The hub's code path (datasets.load_dataset(name, config, split=...)) on a local repository."""
    repo = tmp_path / "repo"
    texts = {
        (c, s): [f"{c} {s} document {i}: " + "lorem ipsum dolor sit amet " * 3 for i in range(6)]
        for c in ("en", "de")
        for s in ("train", "validation")
    }
    for (c, s), rows in texts.items():
        (repo / c).mkdir(parents=True, exist_ok=True)
        (repo / c / f"{s}.jsonl").write_text("".join(json.dumps({"text": r}) + "\n" for r in rows))
    configs = "".join(
        f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
        f"  - split: validation\n    path: {c}/validation.jsonl\n"
        for c in ("en", "de")
    )
    (repo / "README.md").write_text(f"---\nconfigs:\n{configs}---\n# a dataset card\n")
    from peer.core.data.corpus import iter_documents

    assert list(iter_documents(Source(str(repo), "de", "validation"))) == texts[("de", "validation")]
    assert list(iter_documents(Source(str(repo), "en"))) == texts[("en", "train")]
    _one_line_error(lambda: iter_documents(Source(str(repo), "fr")), "could not load dataset", "'fr' not found")
    _one_line_error(lambda: iter_documents(Source(str(repo), "en", "test")), "could not load dataset", "--split")


@pytest.mark.timeout(60)
def test_hub_unreachable_is_one_line(tmp_path, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # read at import time, so set the live flags too
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    _one_line_error(
        lambda: prepare(Source("someone/no-such-dataset", "en"), tmp_path / "o", vocab_size=VOCAB),
        "could not load dataset 'someone/no-such-dataset' from the hub",
        "builtin:stdlib",
    )
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------- a run's corpus


def test_prepared_for_prepares_once_and_opens_prepared_folders(tmp_path, reference):
    cfg = DataConfig(vocab_size=VOCAB, max_chars=50_000, cache_dir=tmp_path / "cache")
    ds = prepared_for(cfg)
    assert ds.root == cache_folder(cfg) and ds.root.parent == tmp_path / "cache" / "datasets"
    stamp = (ds.root / "index.json").stat().st_mtime_ns
    assert prepared_for(cfg).index.fingerprint == ds.index.fingerprint
    assert (ds.root / "index.json").stat().st_mtime_ns == stamp  # opened, not prepared again
    for other in (
        DataConfig(vocab_size=VOCAB, max_chars=50_000, cache_dir=tmp_path / "cache", seed=1),
        DataConfig(vocab_size=VOCAB, max_chars=40_000, cache_dir=tmp_path / "cache"),
        DataConfig(vocab_size=VOCAB, max_chars=50_000, cache_dir=tmp_path / "cache", val_fraction=0.1),
    ):
        assert cache_folder(other) != cache_folder(cfg)
    assert prepared_for(DataConfig(dataset=str(reference.root), vocab_size=VOCAB)).root == reference.root
    _one_line_error(lambda: prepared_for(DataConfig(dataset=str(reference.root), vocab_size=256)), "vocab_size 300")
