"""TEMPORARY stand-in for helper A's `peer.core.prepare` (branch h23-prep): only `prepared_for`.

*** At merge, take A's peer/core/prepare.py and drop this file. ***

It exists so that the loader's callers (heads, full replicas, `peer simulate`, the bootstrap) run
in this branch before A's streaming, multi-process, resumable preparation lands: one process,
the whole corpus in memory, no resume. `prepared_for(cfg)` opens `cfg.dataset` when it is a
prepared folder; otherwise it loads the documents (`peer.core.corpus`), gets the tokenizer
(`peer.core.tokenizer`), holds out whole documents for validation (seeded), tokenizes them with
an EOS after every document and writes a prepared folder under `cfg.cache_dir/datasets/<key>`
once (`peer.core.shards.write_prepared`), keyed by the corpus, tokenizer, split fraction and seed.

Invariants: same corpus + same config => the same prepared folder (fingerprints included).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from peer.core.corpus import CACHE_VERSION, DataConfig, corpus_fingerprint, load_documents
from peer.core.shards import PreparedDataset, is_prepared, write_prepared
from peer.core.tokenizer import Tokenizer, get_tokenizer
from peer.errors import DataError

log = logging.getLogger(__name__)

__all__ = ["prepared_for"]


def _split(n_docs: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) document indices: each document held out by a seeded draw, at least one each side."""
    if n_docs < 2:
        raise DataError(
            f"the corpus has {n_docs} document(s); a held-out validation split needs at least 2 "
            "(separate documents by blank lines, or pass more files with --dataset)"
        )
    draw = np.random.default_rng(seed).random(n_docs)
    val = [i for i in range(n_docs) if draw[i] < val_fraction] or [int(np.argmin(draw))]
    if len(val) == n_docs:
        val = val[:-1]
    held = set(val)
    return [i for i in range(n_docs) if i not in held], val


def _tokens(tok: Tokenizer, docs: Sequence[str]) -> Iterator[np.ndarray]:
    for i in range(0, len(docs), 512):
        for ids in tok.encode_batch(docs[i : i + 512]):
            yield np.asarray([*ids, tok.eos_id], dtype=np.int64)


def prepared_for(cfg: DataConfig) -> PreparedDataset:
    """`cfg.dataset` as a prepared dataset: opened when it is one, else prepared once into the cache."""
    if is_prepared(cfg.dataset):
        dataset = PreparedDataset.open(cfg.dataset)
        if dataset.index.vocab_size > cfg.vocab_size:
            raise DataError(
                f"prepared dataset {cfg.dataset} has a vocabulary of {dataset.index.vocab_size}, more than the "
                f"model's {cfg.vocab_size}; pass --vocab-size {dataset.index.vocab_size}"
            )
        return dataset
    docs = load_documents(cfg)
    fingerprint = corpus_fingerprint(docs)
    tok = get_tokenizer(cfg, docs, fingerprint)
    key = hashlib.sha256(
        f"prepared-{CACHE_VERSION}|{fingerprint}|{tok.sha256}|{cfg.val_fraction!r}|{cfg.seed}".encode()
    ).hexdigest()[:20]
    root = Path(cfg.cache_dir).expanduser() / "datasets" / key
    if is_prepared(root):
        log.info("using prepared dataset %s", root)
        return PreparedDataset.open(root)
    t0 = time.perf_counter()
    train, val = _split(len(docs), cfg.val_fraction, cfg.seed)
    dataset = write_prepared(
        root,
        {"train": _tokens(tok, [docs[i] for i in train]), "val": _tokens(tok, [docs[i] for i in val])},
        tok.vocab_size,
        tok.eos_id,
        tokenizer=tok.path,
        source=cfg.dataset,
        seed=cfg.seed,
        val_fraction=cfg.val_fraction,
    )
    log.info(
        "prepared %d train / %d val documents (%d / %d tokens) into %s in %.2fs",
        len(train),
        len(val),
        dataset.index.tokens("train"),
        dataset.index.tokens("val"),
        root,
        time.perf_counter() - t0,
    )
    return dataset
