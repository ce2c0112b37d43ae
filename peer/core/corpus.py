"""The corpus: where training text comes from, read into a list of documents.

`DataConfig` says where the text comes from, how it is tokenized and how much is used (the whole
data pipeline's settings). `load_documents` reads a corpus: a local .txt/.jsonl/.json/.parquet
file or folder through Hugging Face `datasets`, a hub dataset streamed by name, or
`builtin:stdlib`, the Python standard library's own sources found at run time, capped at
`max_chars`. `corpus_fingerprint` hashes the documents; the tokenizer and token caches under
`cache_dir` are keyed by it.

Invariants:
- Same corpus + same config => the same documents in the same order (files sorted, no RNG).
- Documents are non-blank; together they hold at most `max_chars` characters.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sysconfig
import time
import tokenize
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from peer.core.files import atomic_write_bytes
from peer.errors import ConfigError, DataError, one_line

log = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_STDLIB",
    "CACHE_VERSION",
    "DataConfig",
    "corpus_fingerprint",
    "default_cache_dir",
    "default_corpus_files",
    "load_documents",
    "write_cache_file",
]

BUILTIN_STDLIB = "builtin:stdlib"
CACHE_VERSION = "v1"  # part of every tokenizer / token cache key; bump to invalidate old caches
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


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


def _rows_text(rows: Iterable[Mapping[str, object]], text_field: str, name: str) -> Iterator[str]:
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
            raise DataError(f"could not read dataset '{name}': {one_line(exc)}; check the file format") from exc
        where, what_to_do = "", "check the file format"
    else:
        text_field = cfg.text_field
        try:
            ds = datasets.load_dataset(name, split="train", streaming=True)
        except Exception as exc:
            raise DataError(
                f"could not load dataset '{name}' from the hub: {one_line(exc)}; "
                f"pass a local path with --dataset or use the default {BUILTIN_STDLIB}"
            ) from exc
        where, what_to_do = " from the hub", f"pass a local path with --dataset or use the default {BUILTIN_STDLIB}"
    try:
        return _capped(_rows_text(ds, text_field, name), cfg.max_chars)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"could not read dataset '{name}'{where}: {one_line(exc)}; {what_to_do}") from exc


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


def write_cache_file(path: Path, raw: bytes) -> None:
    """Atomically write one cache file (tokenizer, token tensors); DataError naming PEER_CACHE_DIR on failure."""
    try:
        atomic_write_bytes(path, raw)
    except OSError as exc:
        raise DataError(
            f"cannot write {path}: {exc.strerror or one_line(exc)}; set PEER_CACHE_DIR to a writable folder"
        ) from exc
