"""Training data: documents, a sentencepiece tokenizer, token tensors and deterministic shards.

Pipeline: `load_documents` reads a corpus (a local .txt/.jsonl/.json/.parquet file or folder
through Hugging Face `datasets`, a hub dataset streamed by name, or `builtin:stdlib`, the Python
standard library's own sources found at run time), capped at `max_chars`. `get_tokenizer` trains
a byte-fallback BPE sentencepiece model on it (cached by corpus fingerprint and vocabulary size)
or loads one. `build_token_data` holds out whole documents for validation, tokenizes with an EOS
after every document and caches the two int64 token streams. `train_batch` cuts the train stream
into `n_shards` disjoint contiguous slices (replica m reads shard m) and walks a shard in
non-overlapping windows of seq_len + 1 tokens, so a batch is a pure function of
(shard, n_shards, step) -- the data offsets of DESIGN §3 ("derive from (t, inner step)").

Invariants:
- Same corpus + same config => bit-identical tokenizer bytes and token tensors (no RNG but the
  seeded document permutation; tokenizer training uses one thread and no sentence sampling).
- Shards are disjoint and together cover train[0 : len(train)]; val documents never appear in train.
- The tokenizer's vocabulary size equals `vocab_size`; decode(encode(s)) == s for any text
  (identity normalisation, no dummy prefix, byte fallback).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import sysconfig
import time
import tokenize
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch

from peer.core.files import atomic_write_bytes
from peer.errors import ConfigError, DataError

log = logging.getLogger(__name__)

BUILTIN_STDLIB = "builtin:stdlib"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_N_RESERVED = 3 + 256  # <unk>, <s>, </s> and the 256 byte-fallback pieces
_MAX_LINE_CHARS = 4096  # longer lines are left out of tokenizer training (sentencepiece skips them)
_TOKENIZER_TRAIN_CHARS = 20_000_000  # lines beyond this are subsampled by a fixed stride
_CACHE_VERSION = "v1"


def default_cache_dir() -> Path:
    """$PEER_CACHE_DIR, else ~/.cache/peer (tokenizers and token tensors live here)."""
    return Path(os.environ.get("PEER_CACHE_DIR") or "~/.cache/peer").expanduser()


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from, how it is tokenized and how much of it is used."""

    dataset: str = BUILTIN_STDLIB  # local file/folder, hub dataset name, or builtin:stdlib
    text_field: str = "text"  # column holding the text in json/parquet/hub datasets
    tokenizer: Path | None = None  # a sentencepiece .model; None = train one on the corpus
    vocab_size: int = 1024
    seq_len: int = 128  # tokens per training sequence
    val_fraction: float = 0.05  # share of the characters held out for validation, as whole documents
    max_chars: int = 4_000_000  # characters of the corpus used (a cap; the corpus may be smaller)
    cache_dir: Path = field(default_factory=default_cache_dir)
    seed: int = 0  # document permutation of the train/val split

    def __post_init__(self) -> None:
        if self.tokenizer is not None and not isinstance(self.tokenizer, Path):
            object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        if not isinstance(self.cache_dir, Path):
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if not self.dataset:
            raise ConfigError("data.dataset is empty; pass a path, a hub dataset name or builtin:stdlib")
        if self.vocab_size < 1:
            raise ConfigError(f"data.vocab_size must be positive, got {self.vocab_size}")
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len must be >= 1, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_chars < 1:
            raise ConfigError(f"data.max_chars must be >= 1, got {self.max_chars}")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------- documents


def default_corpus_files() -> list[Path]:
    """The Python standard library's .py sources of this interpreter, sorted; no tests, no site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    return [path for _, path in sorted(found)]


def _read_source(path: Path) -> str:
    try:
        with tokenize.open(path) as f:  # honours PEP 263 coding cookies
            return f.read()
    except (SyntaxError, UnicodeDecodeError, LookupError):
        return path.read_bytes().decode("utf-8", errors="replace")


def _capped(texts: Iterable[str], max_chars: int) -> list[str]:
    """Non-blank documents in order until max_chars characters; the last one is cut to fit."""
    out: list[str] = []
    total = 0
    for text in texts:
        if not text.strip():
            continue
        take = text[: max_chars - total]
        out.append(take)
        total += len(take)
        if total >= max_chars:
            break
    return out


def _stdlib_documents() -> Iterator[str]:
    files = default_corpus_files()
    if not files:
        root = sysconfig.get_paths()["stdlib"]
        raise DataError(f"no Python standard library sources found under {root}; pass a corpus with --dataset PATH")
    for path in files:
        yield _read_source(path)


def _local_files(path: Path) -> tuple[str, list[str]]:
    """(datasets builder, data files) for a local file or folder."""
    if path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"dataset file {path} has unsupported type '{path.suffix}'; use .txt, .jsonl/.json or .parquet"
            )
        return builder, [str(path)]
    files = sorted(
        p
        for p in path.rglob("*")
        if p.is_file()
        and p.suffix.lower() in _BUILDERS
        and not any(part.startswith(".") for part in p.relative_to(path).parts)
    )
    builders = sorted({_BUILDERS[p.suffix.lower()] for p in files})
    if not builders:
        raise DataError(f"dataset folder {path} holds no .txt, .jsonl/.json or .parquet files; point --dataset at one")
    if len(builders) > 1:
        raise DataError(
            f"dataset folder {path} mixes file types ({', '.join(builders)}); point --dataset at a folder of one kind"
        )
    return builders[0], [str(p) for p in files]


def _rows_text(rows: Iterable[dict], text_field: str, name: str) -> Iterator[str]:
    for i, row in enumerate(rows):
        if text_field not in row:
            columns = ", ".join(sorted(row)) or "none"
            raise DataError(
                f"dataset '{name}' has no field '{text_field}' (columns: {columns}); pass --text-field with one of them"
            )
        value = row[text_field]
        if value is None:
            continue
        if not isinstance(value, str):
            raise DataError(
                f"field '{text_field}' of dataset '{name}' holds {type(value).__name__} in row {i}, not text; "
                "pass --text-field naming a text column"
            )
        yield value


def _hf_documents(cfg: DataConfig, local: Path | None) -> list[str]:
    import datasets  # heavy import: only when a datasets-backed corpus is used

    name = cfg.dataset
    if local is not None:
        builder, files = _local_files(local)
        kwargs = {"sample_by": "paragraph", "encoding_errors": "replace"} if builder == "text" else {}
        text_field = "text" if builder == "text" else cfg.text_field
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
        except Exception as exc:
            raise DataError(f"could not read dataset '{name}': {_one_line(exc)}; check the file format") from exc
        where, what_to_do = "", "check the file format"
    else:
        text_field = cfg.text_field
        try:
            ds = datasets.load_dataset(name, split="train", streaming=True)
        except Exception as exc:
            raise DataError(
                f"could not load dataset '{name}' from the hub: {_one_line(exc)}; "
                f"pass a local path with --dataset or use the default {BUILTIN_STDLIB}"
            ) from exc
        where, what_to_do = " from the hub", f"pass a local path with --dataset or use the default {BUILTIN_STDLIB}"
    try:
        return _capped(_rows_text(ds, text_field, name), cfg.max_chars)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"could not read dataset '{name}'{where}: {_one_line(exc)}; {what_to_do}") from exc


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\")) or Path(name).suffix.lower() in _BUILDERS


def load_documents(cfg: DataConfig) -> list[str]:
    """The corpus as a list of non-blank documents, at most cfg.max_chars characters in all.

    .txt files yield one document per blank-line-separated paragraph; json/parquet rows yield
    `text_field`; builtin:stdlib yields one document per source file.
    """
    t0 = time.perf_counter()
    if cfg.dataset == BUILTIN_STDLIB:
        docs = _capped(_stdlib_documents(), cfg.max_chars)
    else:
        path = Path(cfg.dataset).expanduser()
        if path.exists():
            docs = _hf_documents(cfg, path)
        elif _looks_like_path(cfg.dataset):
            raise DataError(
                f"dataset path {cfg.dataset} does not exist; pass an existing file or folder with --dataset "
                f"or use the default {BUILTIN_STDLIB}"
            )
        else:
            docs = _hf_documents(cfg, None)
    if not docs:
        raise DataError(f"dataset '{cfg.dataset}' contains no text; pass a non-empty corpus with --dataset")
    log.info(
        "loaded %d documents (%d chars) from %s in %.2fs",
        len(docs),
        sum(map(len, docs)),
        cfg.dataset,
        time.perf_counter() - t0,
    )
    return docs


def corpus_fingerprint(documents: Sequence[str]) -> str:
    """sha256 (hex) of the documents, length-prefixed so document boundaries count."""
    h = hashlib.sha256()
    for doc in documents:
        raw = doc.encode("utf-8", errors="surrogatepass")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """A sentencepiece model: encode/decode text, with the file's path and sha256 for manifests."""

    def __init__(self, model_bytes: bytes, path: Path) -> None:
        self.path = Path(path)
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self._sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        self.vocab_size: int = int(self._sp.vocab_size())
        self.eos_id: int = int(self._sp.eos_id())

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """Read a sentencepiece .model file; DataError if it is missing or not a sentencepiece model."""
        path = Path(path).expanduser()
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise DataError(
                f"cannot read tokenizer {path}: {exc.strerror or _one_line(exc)}; pass a sentencepiece .model "
                "file with --tokenizer, or leave it out to train one"
            ) from exc
        try:
            tok = cls(raw, path)
        except Exception as exc:
            raise DataError(
                f"tokenizer {path} is not a sentencepiece model ({_one_line(exc, 120)}); pass a .model file "
                "with --tokenizer, or leave it out to train one"
            ) from exc
        if tok.eos_id < 0:
            raise DataError(f"tokenizer {path} has no end-of-sequence token; use a sentencepiece model with eos_id set")
        return tok

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


def _training_lines(documents: Sequence[str]) -> list[str]:
    lines = [ln for doc in documents for ln in doc.split("\n") if ln.strip() and len(ln) <= _MAX_LINE_CHARS]
    total = sum(map(len, lines))
    if total > _TOKENIZER_TRAIN_CHARS:  # deterministic subsample: every stride-th line
        stride = -(-total // _TOKENIZER_TRAIN_CHARS)
        lines = lines[::stride]
    return lines


def _pieceable_lines(lines: Sequence[str], vocab_size: int, coverage: float = 0.9995) -> list[str]:
    """Training lines cut at characters that get no piece of their own.

    A character gets a piece if it is among the most frequent ones covering `coverage` of the
    text, and only as many as the vocabulary has room for (vocab_size - 259). The others are
    encoded through byte fallback, so merges across them are never learned: the lines are split
    there. sentencepiece then trains with character_coverage=1.0 on exactly the kept characters,
    which also lets small vocabularies train on corpora with many distinct characters.
    """
    codes = np.frombuffer("".join(lines).encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    chars, counts = np.unique(codes, return_counts=True)  # (C,), (C,) sorted by code point
    order = np.lexsort((chars, -counts))  # most frequent first, ties by code point
    ranked = [chr(c) for c in chars[order].tolist()]
    cum = np.cumsum(counts[order].astype(np.float64)) / max(int(codes.size), 1)
    needed = int(np.searchsorted(cum, coverage, side="left")) + 1
    keep = min(needed, len(ranked), vocab_size - _N_RESERVED)
    rare = ranked[keep:]
    if not rare:
        return list(lines)
    splitter = re.compile("[" + "".join(re.escape(c) for c in rare) + "]+")
    return [seg for ln in lines for seg in splitter.split(ln) if seg.strip()]


def train_tokenizer(documents: Sequence[str], vocab_size: int, out_path: Path) -> Tokenizer:
    """Train a byte-fallback BPE sentencepiece model on the documents and write it to out_path."""
    if vocab_size <= _N_RESERVED:
        raise DataError(
            f"--vocab-size {vocab_size} is too small: byte fallback and special tokens take {_N_RESERVED}; "
            f"pass --vocab-size {_N_RESERVED + 32} or more"
        )
    lines = _training_lines(documents)
    if not lines:
        raise DataError("the corpus has no text to train a tokenizer on; pass a non-empty corpus with --dataset")
    lines = _pieceable_lines(lines, vocab_size)
    log.info("training sentencepiece BPE tokenizer (vocab %d) on %d lines...", vocab_size, len(lines))
    t0 = time.perf_counter()
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=buf,
            model_type="bpe",
            vocab_size=vocab_size,
            byte_fallback=True,
            character_coverage=1.0,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=4 * _MAX_LINE_CHARS,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=1,
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as exc:
        msg = str(exc)
        high = re.search(r"Vocabulary size too high \((\d+)\).*?<= (\d+)", msg)
        if high:
            raise DataError(
                f"the corpus is too small for --vocab-size {vocab_size} (at most {high.group(2)}); "
                f"pass a smaller --vocab-size or a larger corpus (--dataset, --max-chars)"
            ) from exc
        raise DataError(
            f"could not train a tokenizer with --vocab-size {vocab_size}: {_one_line(exc)}; "
            "try another --vocab-size or pass --tokenizer"
        ) from exc
    raw = buf.getvalue()
    tok = Tokenizer(raw, out_path)
    if tok.vocab_size != vocab_size:
        raise DataError(
            f"sentencepiece produced {tok.vocab_size} pieces instead of {vocab_size}; "
            f"pass --vocab-size {tok.vocab_size} or a larger corpus"
        )
    _atomic_write(out_path, raw)
    log.info("tokenizer trained in %.2fs -> %s", time.perf_counter() - t0, out_path)
    return tok


def _atomic_write(path: Path, raw: bytes) -> None:
    try:
        atomic_write_bytes(path, raw)
    except OSError as exc:
        raise DataError(
            f"cannot write {path}: {exc.strerror or _one_line(exc)}; set PEER_CACHE_DIR to a writable folder"
        ) from exc


def get_tokenizer(cfg: DataConfig, documents: Sequence[str], fingerprint: str | None = None) -> Tokenizer:
    """cfg.tokenizer if given, else the cached (or freshly trained) tokenizer of this corpus and vocab size."""
    if cfg.tokenizer is not None:
        tok = Tokenizer.load(cfg.tokenizer)
    else:
        fingerprint = fingerprint or corpus_fingerprint(documents)
        key = hashlib.sha256(f"spm-{_CACHE_VERSION}|{fingerprint}|{cfg.vocab_size}".encode()).hexdigest()[:20]
        path = Path(cfg.cache_dir).expanduser() / "tokenizers" / f"spm-{key}.model"
        if path.is_file():
            try:
                tok = Tokenizer.load(path)
                log.info("using cached tokenizer %s", path)
            except DataError as exc:
                log.warning("cached tokenizer unusable (%s); training it again", exc)
                tok = train_tokenizer(documents, cfg.vocab_size, path)
        else:
            tok = train_tokenizer(documents, cfg.vocab_size, path)
    if tok.vocab_size != cfg.vocab_size:
        raise DataError(
            f"tokenizer {tok.path} has {tok.vocab_size} pieces but --vocab-size is {cfg.vocab_size}; "
            f"pass --vocab-size {tok.vocab_size}"
        )
    return tok


# ------------------------------------------------------------------------------------- token data


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
        f"tokens-{_CACHE_VERSION}|{fingerprint}|{tok.sha256}|{cfg.val_fraction!r}|{cfg.seed}".encode()
    ).hexdigest()[:20]
    path = Path(cfg.cache_dir).expanduser() / "tokens" / f"tokens-{key}.pt"
    if path.is_file():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            log.info("using cached tokens %s (%d train, %d val)", path, blob["train"].numel(), blob["val"].numel())
            return TokenData(blob["train"], blob["val"], tok, fingerprint)
        except Exception as exc:  # a truncated or foreign file: rebuild it
            log.warning("token cache %s unreadable (%s); rebuilding it", path, _one_line(exc))
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
    _atomic_write(path, buf.getvalue())
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
