"""The bootstrap's prepared dataset: the one corpus of the run, checked before it is published.

`peer bootstrap --dataset X` names a prepared folder (`peer data prepare`), or a source (a local
file or folder, a hub dataset, builtin:stdlib) that `prepared_for` prepares into the cache once.
`run_dataset` opens it and checks what the manifest will claim:
- the folder's tokenizer.model hashes to the index's `tokenizer_sha256` (it becomes the run's
  tokenizer; the manifest's `tokenizer_sha256` is that hash);
- a `--tokenizer` given with a prepared folder is that same file;
- the index's vocabulary fits the model (`model.vocab_size`), else a one-line ConfigError.

TEMPORARY (issue 23 merge): `prepared_for` below stands in for helper A's
`peer.core.prepare.prepared_for` (branch h23-prep). It opens a prepared folder as A's does; any
other source it prepares the old way (`peer.core.data.build_token_data` tokenizes it in memory) and
writes the result as a prepared folder under `cache_dir/datasets/`. At merge: import A's
`prepared_for` here instead and delete `prepared_for` and `_prepare_in_memory`.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from peer.config import RunConfig
from peer.core.corpus import DataConfig
from peer.core.files import atomic_write_bytes, file_sha256
from peer.core.shards import (
    TOKENIZER_FILE,
    DatasetIndex,
    PreparedDataset,
    ShardWriter,
    is_prepared,
    token_dtype,
    write_index,
)
from peer.errors import ConfigError, DataError, one_line

log = logging.getLogger(__name__)

SHIM_SHARD_TOKENS = 1 << 20  # TEMPORARY shim: tokens per shard file of a source prepared here


def run_dataset(cfg: RunConfig) -> PreparedDataset:
    """The run's prepared dataset (`cfg.data.dataset`), its tokenizer and vocabulary checked."""
    dataset = prepared_for(cfg.data)
    index, tokenizer = dataset.index, dataset.tokenizer_path
    try:
        tok_sha = file_sha256(tokenizer)
    except OSError as exc:
        raise DataError(
            f"prepared dataset {dataset.root} has no readable {TOKENIZER_FILE} ({exc.strerror or one_line(exc)}); "
            "prepare it again"
        ) from None
    if tok_sha != index.tokenizer_sha256:
        raise DataError(
            f"{tokenizer} (sha256 {tok_sha[:12]}) is not the tokenizer the dataset was made with "
            f"({index.tokenizer_sha256[:12]}); prepare the dataset again"
        )
    given = cfg.data.tokenizer
    if given is not None and is_prepared(cfg.data.dataset) and file_sha256(Path(given)) != tok_sha:
        raise ConfigError(
            f"--tokenizer {given} is not the tokenizer of the prepared dataset {dataset.root}; "
            "leave --tokenizer out (the dataset's own is used)"
        )
    if index.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"the prepared dataset {dataset.root} has a vocabulary of {index.vocab_size} ids but the model "
            f"holds {cfg.model.vocab_size} (model.vocab_size); prepare it with --vocab-size {cfg.model.vocab_size} "
            "or choose a model with a larger vocabulary"
        )
    log.info(
        "dataset %s: %d train / %d val tokens in %d shards (fingerprint %s, validation %s)",
        dataset.root,
        index.tokens("train"),
        index.tokens("val"),
        len(index.shards),
        index.fingerprint[:12],
        index.val_fingerprint[:12],
    )
    return dataset


def prepared_for(cfg: DataConfig) -> PreparedDataset:
    """TEMPORARY stand-in for `peer.core.prepare.prepared_for` (see the module docstring)."""
    if is_prepared(cfg.dataset):
        return PreparedDataset.open(cfg.dataset)
    return _prepare_in_memory(cfg)


def _prepare_in_memory(cfg: DataConfig) -> PreparedDataset:
    """TEMPORARY: the old in-memory pipeline's tokens, written once as a prepared folder in the cache."""
    from peer.core.data import build_token_data  # TEMPORARY: helper B replaces peer.core.data

    data = build_token_data(cfg)
    tok = data.tokenizer
    key = hashlib.sha256(f"shim|{data.fingerprint}|{tok.sha256}|{cfg.val_fraction!r}|{cfg.seed}".encode()).hexdigest()
    root = Path(cfg.cache_dir).expanduser() / "datasets" / f"inmemory-{key[:20]}"
    if is_prepared(root):
        return PreparedDataset.open(root)
    dtype = token_dtype(tok.vocab_size)
    shards = []
    for split, tokens in (("train", data.train), ("val", data.val)):
        writer = ShardWriter(root, split, dtype, SHIM_SHARD_TOKENS)
        writer.add(tokens.numpy())
        shards += writer.close()
    atomic_write_bytes(root / TOKENIZER_FILE, Path(tok.path).read_bytes())
    index = DatasetIndex(
        dtype, tok.vocab_size, tok.eos_id, tok.sha256, tuple(shards), cfg.seed, cfg.val_fraction, cfg.dataset
    )
    write_index(root, index)
    return PreparedDataset.open(root)
