"""The corpus: where training text comes from, streamed one document at a time.

`DataConfig` holds the whole data pipeline's settings (where the text comes from, the vocabulary,
how much is used, the split's seed). `Source` names one corpus and `iter_documents` streams its
documents:
- `builtin:stdlib`: the Python standard library's own .py sources found at run time, one
  document per file, files sorted by path;
- a local .txt/.jsonl/.json/.parquet file, or a folder of files of one kind (sorted, hidden ones
  skipped), read through Hugging Face `datasets`: a .txt file gives one document per
  blank-line-separated paragraph, a json/parquet row gives its `text_field`;
- a dataset repository: a hub name (`allenai/c4`), or a local folder holding a dataset card
  (README.md with YAML front matter, as `huggingface-cli download` leaves it), opened with
  `datasets.load_dataset(name, config, split=split, streaming=True)`.
`source_stamp` names the files a local source reads (paths, sizes, modification times), so a
prepared corpus is remade when they change. `peer.core.data.prepare` turns the stream into token shards.

Invariants:
- Same source (files unchanged) => the same documents in the same order (no RNG anywhere).
- Documents are non-blank; together they hold at most `max_chars` characters (the last one cut).
- Only the current batch of rows is held: memory does not grow with the corpus.
- Every failure a user can cause is a one-line `DataError` saying what to do.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sysconfig
import tokenize
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.errors import ConfigError, DataError, one_line

__all__ = [
    "BUILTIN_STDLIB",
    "DataConfig",
    "Source",
    "default_cache_dir",
    "default_corpus_files",
    "iter_documents",
    "source_stamp",
]

BUILTIN_STDLIB = "builtin:stdlib"
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_ROWS_PER_BATCH = 1024  # rows read from `datasets` at a time (one pyarrow table)
_HUB_HINT = f"pass a local path or a prepared folder with --dataset, or use {BUILTIN_STDLIB}"


def default_cache_dir() -> Path:
    """$PEER_CACHE_DIR, else ~/.cache/peer (prepared datasets live here)."""
    return Path(os.environ.get("PEER_CACHE_DIR") or "~/.cache/peer").expanduser()


@dataclass(frozen=True)
class DataConfig:
    """Where the text comes from, how it is tokenized and how much of it is used."""

    dataset: str = field(  # prepared folder, local file/folder, hub dataset name, or builtin:stdlib
        default=BUILTIN_STDLIB,
        metadata={
            "help": "The run's one corpus: a prepared folder (`peer data prepare`), or a local file/folder or hub "
            "dataset prepared into the cache (builtin:stdlib: the embedded corpus)."
        },
    )
    config: str | None = None  # hub configuration / subset (C4 "en", FineWeb "sample-10BT")
    split: str = "train"  # hub split
    text_field: str = "text"  # column holding the text in json/parquet/hub datasets
    tokenizer: Path | None = field(  # a sentencepiece .model; None = train one on the corpus
        default=None, metadata={"help": "Use this sentencepiece .model instead of training one."}
    )
    vocab_size: int = 1024
    seq_len: int = 128  # tokens per training sequence
    val_fraction: float = 0.05  # share of the documents held out for validation
    max_chars: int = field(  # characters of the corpus prepared (a cap; the corpus may be smaller)
        default=4_000_000, metadata={"help": "Cap on the corpus size in characters."}
    )
    cache_dir: Path = field(default_factory=default_cache_dir)
    seed: int = 0  # seed of the train/validation document split

    def __post_init__(self) -> None:
        if self.tokenizer is not None and not isinstance(self.tokenizer, Path):
            object.__setattr__(self, "tokenizer", Path(self.tokenizer))
        if not isinstance(self.cache_dir, Path):
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if not self.dataset:
            raise ConfigError("data.dataset is empty; pass a path, a hub dataset name or builtin:stdlib")
        if self.config is not None and not self.config:
            raise ConfigError("data.config is empty; name a hub configuration (e.g. en) or leave it out")
        if not self.split:
            raise ConfigError("data.split is empty; name a split of the dataset (e.g. train)")
        if not self.text_field:
            raise ConfigError("data.text_field is empty; name the column holding the text")
        if self.vocab_size < 1:
            raise ConfigError(f"data.vocab_size must be positive, got {self.vocab_size}")
        if self.seq_len < 1:
            raise ConfigError(f"data.seq_len must be >= 1, got {self.seq_len}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.max_chars < 1:
            raise ConfigError(f"data.max_chars must be >= 1, got {self.max_chars}")


@dataclass(frozen=True)
class Source:
    """One corpus: a hub dataset (name, configuration, split, text field), local files or builtin:stdlib."""

    dataset: str  # hub dataset name, local file/folder, or builtin:stdlib
    config: str | None = None  # hub configuration / subset (C4 "en", FineWeb "sample-10BT")
    split: str = "train"  # hub split
    text_field: str = "text"
    max_chars: int | None = None  # cap on characters read (None: everything)

    def __post_init__(self) -> None:
        if not self.dataset:
            raise ConfigError("the dataset is empty; pass a path, a hub dataset name or builtin:stdlib")
        if self.config is not None and not self.config:
            raise ConfigError("--config is empty; name a hub configuration (e.g. en) or leave it out")
        if not self.split:
            raise ConfigError("--split is empty; name a split of the dataset (e.g. train)")
        if not self.text_field:
            raise ConfigError("--text-field is empty; name the column holding the text")
        if self.max_chars is not None and self.max_chars < 1:
            raise ConfigError(f"--max-chars must be 1 or more, got {self.max_chars}")

    @classmethod
    def of(cls, cfg: DataConfig) -> Source:
        """The source a run's data config names (capped at cfg.max_chars)."""
        return cls(cfg.dataset, cfg.config, cfg.split, cfg.text_field, cfg.max_chars)

    def describe(self) -> str:
        """For people (a prepared index's `source`): the name and whatever is not the default."""
        parts = [self.dataset]
        parts += [f"config {self.config}"] if self.config else []
        parts += [f"split {self.split}"] if self.split != "train" else []
        parts += [f"field {self.text_field}"] if self.text_field != "text" else []
        parts += [f"first {self.max_chars:,} characters"] if self.max_chars else []
        return ", ".join(parts)


# ---------------------------------------------------------------------------------------- resolving


@dataclass(frozen=True)
class _Plan:
    """How a source is read: kind "stdlib", "files" (a datasets builder over files) or "repo"."""

    kind: str
    name: str  # the hub name or the absolute local path
    builder: str = ""
    files: tuple[str, ...] = ()


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~", ".\\")) or Path(name).suffix.lower() in _BUILDERS


def _is_dataset_repo(path: Path) -> bool:
    """A folder with a dataset card (README.md opening with YAML front matter): read like the hub."""
    card = path / "README.md"
    if not (path.is_dir() and card.is_file()):
        return False
    try:
        with open(card, "rb") as f:
            return f.read(3) == b"---"
    except OSError:
        return False


def _data_files(path: Path) -> tuple[str, list[str]]:
    """(datasets builder, data files) of a local file or a folder of files of one kind."""
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


def _plan(source: Source) -> _Plan:
    """Decide how `source` is read; DataError for a missing path or flags that do not apply."""
    plain = source.config is None and source.split == "train"
    if source.dataset == BUILTIN_STDLIB:
        if not plain:
            raise DataError(f"{BUILTIN_STDLIB} has no --config or --split; leave them out")
        return _Plan("stdlib", BUILTIN_STDLIB)
    path = Path(source.dataset).expanduser()
    if path.exists():
        path = path.resolve()
        if _is_dataset_repo(path):
            return _Plan("repo", str(path))
        if not plain:
            raise DataError(
                f"--config and --split name a part of a dataset repository; {path} is plain data files "
                "(no README.md dataset card): leave them out"
            )
        builder, files = _data_files(path)
        return _Plan("files", str(path), builder, tuple(files))
    if _looks_like_path(source.dataset):
        raise DataError(
            f"dataset path {source.dataset} does not exist; pass an existing file or folder with --dataset "
            f"(`peer data prepare`: as SOURCE), a hub dataset name or {BUILTIN_STDLIB}"
        )
    return _Plan("repo", source.dataset)


def source_stamp(source: Source) -> dict[str, Any]:
    """What identifies the text a source reads: its canonical name (a local path made absolute) and,
    for local files, a hash of their paths, sizes and modification times (builtin:stdlib: with the
    Python version); a hub dataset is known by its name alone."""
    plan = _plan(source)
    if plan.kind == "stdlib":
        paths = default_corpus_files()
        root = Path(sysconfig.get_paths()["stdlib"])
    elif Path(plan.name).exists():
        root = Path(plan.name)
        paths = [Path(f) for f in plan.files] if plan.files else sorted(p for p in root.rglob("*") if p.is_file())
    else:
        return {"name": plan.name}
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        rel = p.relative_to(root).as_posix() if p != root else p.name
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode(errors="surrogateescape"))
    stamp: dict[str, Any] = {"name": plan.name, "files": len(paths), "files_sha256": h.hexdigest()}
    if plan.kind == "stdlib":
        stamp["python"] = platform.python_version()
    return stamp


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


def _stdlib_documents() -> Iterator[str]:
    files = default_corpus_files()
    if not files:
        root = sysconfig.get_paths()["stdlib"]
        raise DataError(f"no Python standard library sources found under {root}; pass a corpus with --dataset PATH")
    for path in files:
        yield _read_source(path)


def _capped(texts: Iterable[str], max_chars: int | None) -> Iterator[str]:
    """Non-blank documents in order until max_chars characters; the last one is cut to fit."""
    total = 0
    for text in texts:
        if not text or text.isspace():
            continue
        if max_chars is not None:
            text = text[: max_chars - total]
        total += len(text)
        yield text
        if max_chars is not None and total >= max_chars:
            return


def _column_texts(tables: Iterable[Any], text_field: str, name: str) -> Iterator[str]:
    """The `text_field` values of a stream of pyarrow tables (nulls skipped); DataError for a missing
    or non-text column. (Arrow batches: 2-3x faster than `datasets`' per-row dicts.)"""
    for table in tables:
        if text_field not in table.column_names:
            columns = ", ".join(sorted(table.column_names)) or "none"
            raise DataError(
                f"dataset '{name}' has no field '{text_field}' (columns: {columns}); pass --text-field with one of them"
            )
        column = table.column(text_field)
        kind = str(column.type)  # pyarrow's type name (pyarrow comes with `datasets`; no import here)
        if kind not in ("string", "large_string", "string_view"):
            if kind == "null":  # every row null
                continue
            raise DataError(
                f"field '{text_field}' of dataset '{name}' holds {column.type} values, not text; "
                "pass --text-field naming a text column"
            )
        for value in column.to_pylist():
            if value is not None:
                yield value


def _open_dataset(plan: _Plan, source: Source) -> Any:
    """The streaming `datasets.IterableDataset` of a files or repo plan; DataError on failure."""
    import datasets  # heavy import: only when a datasets-backed corpus is used

    if plan.kind == "files":
        kwargs = {"sample_by": "paragraph", "encoding_errors": "replace"} if plan.builder == "text" else {}
        try:
            return datasets.load_dataset(
                plan.builder, data_files=list(plan.files), split="train", streaming=True, **kwargs
            )
        except Exception as exc:
            raise DataError(
                f"could not read dataset '{source.dataset}': {one_line(exc)}; check the file format"
            ) from exc
    try:
        return datasets.load_dataset(plan.name, source.config, split=source.split, streaming=True)
    except ConnectionError as exc:
        raise DataError(
            f"could not load dataset '{plan.name}' from the hub: the hub is unreachable ({one_line(exc, 160)}); "
            f"check the network (HF_ENDPOINT, HF_HUB_OFFLINE) or {_HUB_HINT}"
        ) from exc
    except Exception as exc:
        raise DataError(
            f"could not load dataset '{plan.name}' from the hub: {one_line(exc)}; check the name, --config and "
            f"--split, or {_HUB_HINT}"
        ) from exc


def _dataset_documents(plan: _Plan, source: Source) -> Iterator[str]:
    ds = _open_dataset(plan, source)
    text_field = "text" if plan.builder == "text" else source.text_field
    what = "check the file format" if plan.kind == "files" else "run the same command again to resume"
    try:
        tables = ds.with_format("arrow").iter(batch_size=_ROWS_PER_BATCH)
        yield from _column_texts(tables, text_field, source.dataset)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"could not read dataset '{source.dataset}': {one_line(exc)}; {what}") from exc


def iter_documents(source: Source) -> Iterator[str]:
    """Stream the source's non-blank documents in order, at most source.max_chars characters in all.

    Checks the source first (a missing path, flags that do not apply, an unreachable hub: one-line
    DataError here rather than at the first document)."""
    plan = _plan(source)
    if plan.kind == "stdlib":
        return _capped(_stdlib_documents(), source.max_chars)
    docs = _dataset_documents(plan, source)
    first = next(docs, None)  # opens the dataset now, so its errors surface here
    if first is None:
        return iter(())
    return _capped(_prepend(first, docs), source.max_chars)


def _prepend(first: str, rest: Iterator[str]) -> Iterator[str]:
    yield first
    yield from rest
