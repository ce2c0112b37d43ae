"""The bootstrap's prepared dataset: the one corpus of the run, checked before it is published.

`peer bootstrap --dataset X` names a prepared folder (`peer data prepare`), or a source (a local
file or folder, a hub dataset, builtin:stdlib) that `prepared_for` prepares into the cache once.
`run_dataset` opens it and checks what the manifest will claim:
- the folder's tokenizer.model hashes to the index's `tokenizer_sha256` (it becomes the run's
  tokenizer; the manifest's `tokenizer_sha256` is that hash);
- a `--tokenizer` given with a prepared folder is that same file, and the index's vocabulary fits
  the model (`model.vocab_size`): both checked by `peer.core.data.prepare.prepared_for` (DataError).
"""

from __future__ import annotations

import logging

from peer.config import RunConfig
from peer.core.data.prepare import prepared_for
from peer.core.data.shards import TOKENIZER_FILE, PreparedDataset
from peer.core.files import file_sha256
from peer.errors import DataError, one_line

log = logging.getLogger(__name__)


def run_dataset(cfg: RunConfig) -> PreparedDataset:
    """The run's prepared dataset (`cfg.data.dataset`), its tokenizer and vocabulary checked."""
    dataset = prepared_for(cfg.data)  # checks a given --tokenizer and that the vocabulary fits the model
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
