"""The sentencepiece tokenizer: train one on a sample of the corpus, or load a model file.

`train_tokenizer` trains a byte-fallback BPE sentencepiece model on the documents it is given and
writes it to a file (the caller bounds them: `peer data prepare` passes the first
`TOKENIZER_SAMPLE_CHARS` characters of its stream). `Tokenizer.load` reads a .model file (a
prepared folder's, or one given with --tokenizer). `Tokenizer` carries the model file's path and
sha256 so that peers can check they tokenize alike.

Invariants:
- Same documents + same vocabulary size => bit-identical tokenizer bytes (one training thread, no
  sentence sampling).
- The vocabulary size equals `vocab_size`; decode(encode(s)) == s for any text (identity
  normalisation, no dummy prefix, byte fallback).
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import sentencepiece as spm

from peer.core.files import atomic_write_bytes
from peer.errors import DataError, one_line

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["TOKENIZER_SAMPLE_CHARS", "Tokenizer", "train_tokenizer"]

TOKENIZER_SAMPLE_CHARS = 10_000_000  # characters a tokenizer is trained on (the start of the stream)
_N_RESERVED = 3 + 256  # <unk>, <s>, </s> and the 256 byte-fallback pieces
_MAX_LINE_CHARS = 4096  # longer lines are left out of tokenizer training (sentencepiece skips them)


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
                f"cannot read tokenizer {path}: {exc.strerror or one_line(exc)}; pass a sentencepiece .model "
                "file with --tokenizer, or leave it out to train one"
            ) from exc
        try:
            tok = cls(raw, path)
        except Exception as exc:
            raise DataError(
                f"tokenizer {path} is not a sentencepiece model ({one_line(exc, 120)}); pass a .model file "
                "with --tokenizer, or leave it out to train one"
            ) from exc
        if tok.eos_id < 0:
            raise DataError(f"tokenizer {path} has no end-of-sequence token; use a sentencepiece model with eos_id set")
        return tok

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        ids: list[list[int]] = self._sp.encode(list(texts))
        return ids

    @property
    def model_bytes(self) -> bytes:
        """The serialized sentencepiece model (what the file holds)."""
        raw: bytes = self._sp.serialized_model_proto()
        return raw

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        seq: Any = ids.tolist() if hasattr(ids, "tolist") else ids  # a tensor or an array: plain ints
        text: str = self._sp.decode([int(i) for i in seq])
        return text

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.sha256[:12]})"


def _training_lines(documents: Sequence[str]) -> list[str]:
    return [ln for doc in documents for ln in doc.split("\n") if ln.strip() and len(ln) <= _MAX_LINE_CHARS]


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
            f"could not train a tokenizer with --vocab-size {vocab_size}: {one_line(exc)}; "
            "try another --vocab-size or pass --tokenizer"
        ) from exc
    raw = buf.getvalue()
    tok = Tokenizer(raw, out_path)
    if tok.vocab_size != vocab_size:
        raise DataError(
            f"sentencepiece produced {tok.vocab_size} pieces instead of {vocab_size}; "
            f"pass --vocab-size {tok.vocab_size} or a larger corpus"
        )
    try:
        atomic_write_bytes(out_path, raw)
    except OSError as exc:
        raise DataError(f"cannot write {out_path}: {exc.strerror or one_line(exc)}; make its folder writable") from exc
    log.info("tokenizer trained in %.2fs -> %s", time.perf_counter() - t0, out_path)
    return tok
