"""The bootstrap's dataset (peer/bootstrap/dataset.py): a prepared folder becomes the run's corpus and
tokenizer only when its tokenizer is the index's and its vocabulary fits the model; otherwise one
line that says what to do."""

from __future__ import annotations

import pytest

from peer.bootstrap.dataset import run_dataset
from peer.config import build_config
from peer.core.data.shards import TOKENIZER_FILE
from peer.errors import DataError
from tests.prepared import VOCAB, corpus, make_prepared


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    return make_prepared(tmp_path_factory.mktemp("prepared") / "run", corpus(0))


def _cfg(dataset, **more):
    return build_config(overrides={"data.dataset": str(dataset), **more}, environ={})


def test_a_prepared_folder_is_the_runs_corpus(prepared):
    got = run_dataset(_cfg(prepared.root))
    assert got.index == prepared.index and got.tokenizer_path == prepared.root / TOKENIZER_FILE


def test_a_vocabulary_larger_than_the_models_is_one_line(prepared):
    with pytest.raises(DataError) as info:
        run_dataset(_cfg(prepared.root, **{"model.vocab_size": VOCAB - 20}))
    message = str(info.value)
    assert "\n" not in message and f"{VOCAB} ids" in message and f"--vocab-size {VOCAB - 20}" in message


def test_a_tokenizer_that_is_not_the_indexs_is_refused(prepared, tmp_path):
    other = make_prepared(tmp_path / "other", corpus(1))
    with pytest.raises(DataError, match="leave --tokenizer out"):
        run_dataset(_cfg(prepared.root, **{"data.tokenizer": str(other.tokenizer_path)}))
    swapped = make_prepared(tmp_path / "swapped", corpus(0))
    (swapped.root / TOKENIZER_FILE).write_bytes(other.tokenizer_path.read_bytes())
    with pytest.raises(DataError, match="not the tokenizer the dataset was made with"):
        run_dataset(_cfg(swapped.root))
