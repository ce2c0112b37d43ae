"""Preparing a corpus: stream documents, tokenize them on every core, write token shards.

`prepare(source, out, ...)` turns a `Source` (a hub dataset, local files, builtin:stdlib) into a
prepared folder (`peer.core.data.shards`): it streams the documents (`peer.core.data.corpus`), trains a
tokenizer on the first `TOKENIZER_SAMPLE_CHARS` characters unless one is given, tokenizes on worker
processes in order with EOS after every document (`peer.core.data.prepare_pool`), splits validation off
by document from (seed, document ordinal) alone, writes each split's shards with `ShardWriter` and
the index last. `prepared_for(cfg)` gives a run its corpus: `cfg.dataset` itself when it is a
prepared folder, else the source prepared once into `cfg.cache_dir/datasets/<key>`, where the key
hashes every input, so `peer simulate`, `peer demo`, heads and the bootstrap need no separate step.

Invariants:
- Memory does not grow with the corpus: documents stream, a bounded number of batches is in
  flight, a writer holds at most one shard of tokens.
- The output depends only on the arguments and the source's documents: byte-identical for any
  number of workers and across interruptions (`peer.core.data.prepare_state` resumes it).
- A folder with index.json is complete; a prepare never changes one made with other arguments
  (one-line DataError: a new --out, or --restart).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from peer.core.data.corpus import BUILTIN_STDLIB, DataConfig, Source, iter_documents, source_stamp
from peer.core.data.prepare_pool import Batch, encode_in_order
from peer.core.data.prepare_state import PrepareState, load_pending, load_state, own_files, save_state
from peer.core.data.shards import (
    FORMAT_VERSION,
    SPLITS,
    TOKENIZER_FILE,
    DatasetIndex,
    PreparedDataset,
    ShardWriter,
    is_prepared,
    token_dtype,
    write_index,
)
from peer.core.data.tokenizer import TOKENIZER_SAMPLE_CHARS, Tokenizer, train_tokenizer
from peer.core.files import atomic_write_bytes, file_sha256
from peer.errors import ConfigError, DataError, one_line

log = logging.getLogger(__name__)

__all__ = [
    "PREPARE_VERSION",
    "SHARD_TOKENS",
    "Progress",
    "Source",
    "cache_folder",
    "default_workers",
    "prepare",
    "prepare_arguments",
    "prepared_for",
]

PREPARE_VERSION = 1  # how documents become shards (split rule, EOS, tokenizer sample): bump on any change
SHARD_TOKENS = 1 << 24  # tokens per shard file unless told otherwise (32 MiB of uint16)
Progress = Callable[[int, int], None]  # (documents, tokens) so far
_BATCH_CHARS = 1 << 20  # characters per batch handed to a worker
_BATCH_DOCS = 4096  # documents per batch at most


def prepare_arguments(
    source: Source, *, vocab_size: int, tokenizer_sha256: str | None, val_fraction: float, seed: int, shard_tokens: int
) -> dict[str, Any]:
    """Every input that decides a prepared folder's bytes (the resume check and the cache key)."""
    return {
        "format_version": FORMAT_VERSION,
        "prepare_version": PREPARE_VERSION,
        "source": {
            "config": source.config,
            "split": source.split,
            "text_field": source.text_field,
            "max_chars": source.max_chars,
            **source_stamp(source),
        },
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer_sha256,  # a given tokenizer; None: trained on the sample
        "val_fraction": val_fraction,
        "seed": seed,
        "shard_tokens": shard_tokens,
    }


def _check(vocab_size: int, val_fraction: float, shard_tokens: int, workers: int | None) -> None:
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if vocab_size < 1:
        raise ConfigError(f"--vocab-size must be positive, got {vocab_size}")
    if shard_tokens < 2:
        raise ConfigError(f"--shard-tokens must be 2 or more, got {shard_tokens}")
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be 1 or more, got {workers}")


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------------------------------ the out folder


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The arguments two prepares differ in, for people ("seed, source files_sha256")."""
    old_src, new_src = dict(old.get("source") or {}), dict(new.get("source") or {})
    diff = [k for k in sorted(old.keys() | new.keys()) if k != "source" and old.get(k) != new.get(k)]
    diff += [f"source {k}" for k in sorted(old_src.keys() | new_src.keys()) if old_src.get(k) != new_src.get(k)]
    return ", ".join(diff) or "nothing"


def _begin(out: Path, arguments: dict[str, Any], restart: bool) -> PrepareState | None:
    """The state to resume in `out`, or None to start afresh there; DataError when `out` holds
    something else (unless `restart`, which removes what a prepare wrote there)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file; pass a folder")
    if restart and out.is_dir():
        for path in own_files(out):
            path.unlink()
        return None
    state = load_state(out) if out.is_dir() else None
    if state is not None:
        if state.arguments != arguments:
            raise DataError(
                f"{out} holds a prepare with other arguments (they differ in: "
                f"{_differences(state.arguments, arguments)}); use a new --out or pass --restart"
            )
        for path in own_files(out):
            if path.name.startswith("."):  # a temporary file of a killed run
                path.unlink()
        return state
    if is_prepared(out):
        raise DataError(f"{out} already holds a prepared dataset made elsewhere; use a new --out or pass --restart")
    if out.is_dir() and any(out.iterdir()):
        raise DataError(f"--out {out} is not empty and holds no prepare; pass a new or empty folder")
    return None


def _take(docs: Iterator[str], max_chars: int) -> list[str]:
    """The first documents of the stream, up to `max_chars` characters (at least one document)."""
    out: list[str] = []
    total = 0
    for doc in docs:
        out.append(doc)
        total += len(doc)
        if total >= max_chars:
            break
    return out


def _tokenizer(out: Path, given: Tokenizer | None, sample: list[str], vocab_size: int) -> Tokenizer:
    """`given` copied to out/tokenizer.model, else one trained on `sample` and written there."""
    path = out / TOKENIZER_FILE
    if given is None:
        return train_tokenizer(sample, vocab_size, path)
    try:
        atomic_write_bytes(path, given.model_bytes)
    except OSError as exc:
        raise DataError(f"cannot write {path}: {exc.strerror or one_line(exc)}; pass a writable --out") from exc
    return Tokenizer.load(path)


# --------------------------------------------------------------------------------------- preparing


def _start(
    out: Path,
    state: PrepareState | None,
    arguments: dict[str, Any],
    given: Tokenizer | None,
    docs: Iterator[str],
    vocab_size: int,
) -> tuple[PrepareState, Tokenizer, Iterator[str]]:
    """Begin (the tokenizer in place, trained on the stream's first documents unless given) or
    resume (its tokenizer checked, the consumed documents skipped): the state, the tokenizer and
    the documents still to tokenize."""
    if state is None or not state.tokenizer_sha256:
        out.mkdir(parents=True, exist_ok=True)
        state = PrepareState(arguments)
        save_state(out, state, {})
        sample = _take(docs, TOKENIZER_SAMPLE_CHARS) if given is None else []
        tok = _tokenizer(out, given, sample, vocab_size)
        state.tokenizer_sha256 = tok.sha256
        save_state(out, state, {})
        return state, tok, itertools.chain(sample, docs)
    tok = Tokenizer.load(out / TOKENIZER_FILE)
    if tok.sha256 != state.tokenizer_sha256:
        raise DataError(f"{out / TOKENIZER_FILE} is not the tokenizer this prepare began with; pass --restart")
    log.info("resuming the prepare in %s after %d documents", out, state.documents)
    return state, tok, itertools.islice(docs, state.documents, None)


def _batches(docs: Iterator[str], first: int) -> Iterator[Batch]:
    buf: list[str] = []
    chars = 0
    for doc in docs:
        buf.append(doc)
        chars += len(doc)
        if chars >= _BATCH_CHARS or len(buf) >= _BATCH_DOCS:
            yield Batch(first, buf)
            first += len(buf)
            buf, chars = [], 0
    if buf:
        yield Batch(first, buf)


def _write_shards(
    out: Path,
    state: PrepareState,
    docs: Iterator[str],
    tok: Tokenizer,
    workers: int,
    progress: Progress | None,
    source_name: str,
) -> DatasetIndex:
    """Tokenize `docs` (the stream past state.documents) into shards, saving the state after every
    finished shard; returns the index of the whole folder."""
    args = state.arguments
    dtype = token_dtype(tok.vocab_size)
    shard_tokens = int(args["shard_tokens"])
    writers = {}
    for split in SPLITS:
        writers[split] = ShardWriter(out, split, dtype, shard_tokens, first=len(state.splits[split].shards))
        writers[split].add(load_pending(out, state, split, dtype))
    restored = {split: list(state.splits[split].shards) for split in SPLITS}
    finished = 0
    model = tok.model_bytes
    batches = _batches(docs, state.documents)
    with contextlib.closing(
        encode_in_order(batches, model, dtype, args["seed"], args["val_fraction"], workers)
    ) as results:
        for enc in results:
            writers["train"].add(enc.train)
            writers["val"].add(enc.val)
            state.documents += enc.documents
            for split, n_docs, tokens in (("train", enc.train_docs, enc.train), ("val", enc.val_docs, enc.val)):
                state.splits[split].documents += n_docs
                state.splits[split].tokens += int(tokens.size)
            now = sum(len(w.shards) for w in writers.values())
            if now > finished:
                finished = now
                for split in SPLITS:
                    state.splits[split].shards = restored[split] + writers[split].shards
                save_state(out, state, {split: writers[split].pending for split in SPLITS})
            if progress is not None:
                progress(state.documents, state.tokens)
    for split in SPLITS:
        state.splits[split].shards = restored[split] + writers[split].close()
    return DatasetIndex(
        dtype=dtype,
        vocab_size=tok.vocab_size,
        eos_id=tok.eos_id,
        tokenizer_sha256=tok.sha256,
        shards=tuple(state.splits["train"].shards + state.splits["val"].shards),
        seed=int(args["seed"]),
        val_fraction=float(args["val_fraction"]),
        source=source_name,
        documents={split: state.splits[split].documents for split in SPLITS},
    )


def prepare(
    source: Source,
    out: Path,
    *,
    vocab_size: int,
    tokenizer: Path | None = None,
    val_fraction: float = 0.05,
    seed: int = 0,
    shard_tokens: int = SHARD_TOKENS,
    workers: int | None = None,
    progress: Progress | None = None,
    restart: bool = False,
) -> PreparedDataset:
    """Prepare `source` into the folder `out` and open it; see the module docstring.

    Resumes a prepare of the same arguments that was interrupted in `out`, and returns a finished
    one as it is. `restart` first removes whatever a prepare wrote in `out`.
    """
    _check(vocab_size, val_fraction, shard_tokens, workers)
    out = Path(out).expanduser()
    given = Tokenizer.load(tokenizer) if tokenizer is not None else None
    if given is not None and given.vocab_size != vocab_size:
        raise DataError(
            f"tokenizer {tokenizer} has {given.vocab_size} pieces but --vocab-size is {vocab_size}; "
            f"pass --vocab-size {given.vocab_size}"
        )
    arguments = prepare_arguments(
        source,
        vocab_size=vocab_size,
        tokenizer_sha256=given.sha256 if given else None,
        val_fraction=val_fraction,
        seed=seed,
        shard_tokens=shard_tokens,
    )
    state = _begin(out, arguments, restart)
    if state is not None and is_prepared(out):
        log.info("%s is already prepared with these arguments; left as is", out)
        if not state.finished:  # stopped between the index and the last state: only the record is behind
            state.finished = True
            save_state(out, state, {})
        return PreparedDataset.open(out)
    t0 = time.perf_counter()
    docs = iter_documents(source)
    head = list(itertools.islice(docs, 2))  # a corpus too small to split fails before anything is written
    if len(head) < 2:
        what = "contains no text" if not head else "has one document; a validation split needs at least 2"
        raise DataError(f"dataset '{source.dataset}' {what}; pass a larger corpus (or a larger --max-chars)")
    docs = itertools.chain(head, docs)
    state, tok, docs = _start(out, state, arguments, given, docs, vocab_size)
    if progress is not None:
        progress(state.documents, state.tokens)
    index = _write_shards(out, state, docs, tok, workers or default_workers(), progress, source.describe())
    write_index(out, index)
    state.finished = True
    save_state(out, state, {})
    log.info(
        "prepared %s into %s: %d documents, %d tokens in %.1fs",
        index.source,
        out,
        state.documents,
        state.tokens,
        time.perf_counter() - t0,
    )
    return PreparedDataset.open(out)


# ---------------------------------------------------------------------------------- a run's corpus


def _check_fits(dataset: PreparedDataset, cfg: DataConfig) -> PreparedDataset:
    index = dataset.index
    if index.vocab_size > cfg.vocab_size:
        raise DataError(
            f"prepared dataset {dataset.root} has a vocabulary of {index.vocab_size} ids but the model has "
            f"{cfg.vocab_size}; use a model preset with vocab_size {index.vocab_size}, or prepare it again "
            f"with --vocab-size {cfg.vocab_size}"
        )
    if cfg.tokenizer is not None and file_sha256(Path(cfg.tokenizer).expanduser()) != index.tokenizer_sha256:
        raise DataError(
            f"tokenizer {cfg.tokenizer} is not the one prepared dataset {dataset.root} was made with; "
            f"leave --tokenizer out (the folder has its own tokenizer.model)"
        )
    return dataset


def cache_folder(cfg: DataConfig) -> Path:
    """Where `prepared_for` prepares cfg's source: cache_dir/datasets/<name>-<key of every input>."""
    tok_sha = None
    if cfg.tokenizer is not None:
        tok_sha = Tokenizer.load(cfg.tokenizer).sha256
    arguments = prepare_arguments(
        Source.of(cfg),
        vocab_size=cfg.vocab_size,
        tokenizer_sha256=tok_sha,
        val_fraction=cfg.val_fraction,
        seed=cfg.seed,
        shard_tokens=SHARD_TOKENS,
    )
    key = hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest()[:16]
    name = "stdlib" if cfg.dataset == BUILTIN_STDLIB else Path(cfg.dataset.rstrip("/")).name or "dataset"
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
    return Path(cfg.cache_dir).expanduser() / "datasets" / f"{safe}-{key}"


def prepared_for(cfg: DataConfig, progress: Progress | None = None) -> PreparedDataset:
    """The prepared corpus of a run: cfg.dataset when it is a prepared folder (checked against
    cfg.vocab_size), else cfg's source prepared once into `cache_folder(cfg)` (cfg.max_chars caps
    it) and opened. Processes racing for the same folder take turns (a file lock); the first
    prepares, the others open what it made."""
    if cfg.dataset != BUILTIN_STDLIB and is_prepared(cfg.dataset):
        return _check_fits(PreparedDataset.open(cfg.dataset), cfg)
    folder = cache_folder(cfg)
    if is_prepared(folder):
        return _check_fits(PreparedDataset.open(folder), cfg)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # fcntl.flock: the kernel releases the lock when its holder dies, so a killed preparer never blocks
    with open(folder.parent / f".{folder.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_prepared(folder):
                log.info("preparing %s into %s (once: later runs reuse it)", cfg.dataset, folder)
            dataset = prepare(
                Source.of(cfg),
                folder,
                vocab_size=cfg.vocab_size,
                tokenizer=cfg.tokenizer,
                val_fraction=cfg.val_fraction,
                seed=cfg.seed,
                progress=progress,
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return _check_fits(dataset, cfg)
