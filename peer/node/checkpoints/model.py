"""Whole-model checkpoints: `model.safetensors` + `meta.json` (+ `tokenizer.model`).

A checkpoint holds the WHOLE model under its global parameter names (see peer.core.model.decoder). The
embedding is stored as the full TE: when the state dict carries the T⊥ buffer `embed.perp`,
it is folded into `embed.weight` (TE = T_S + T⊥, arXiv 2601.02360 §3.2) and not stored.

Layout of a checkpoint directory:
    model.safetensors   float tensors, global names
    meta.json           {"format_version", "model": ModelConfig fields, "model_sha256",
                         "tokenizer_file": "tokenizer.model" | null, "tokenizer_sha256", ...meta}
    tokenizer.model     (optional) the sentencepiece model the run trained with

Invariants:
- Writes are atomic: everything goes to a temporary sibling directory first, which is then
  renamed into place; a reader never sees a half-written checkpoint under the final name.
- Loading verifies the sha256 of `model.safetensors` against meta.json; any missing or corrupt
  file raises CheckpointError with a one-line message saying what to do.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from peer.core.files import atomic_directory, file_sha256
from peer.core.model.decoder import ModelConfig
from peer.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "save_model_checkpoint",
    "load_model_checkpoint",
    "atomic_directory",
    "file_sha256",
    "MODEL_FILE",
    "META_FILE",
    "TOKENIZER_FILE",
    "FORMAT_VERSION",
]

MODEL_FILE = "model.safetensors"
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.model"
FORMAT_VERSION = 1
_RESERVED = ("format_version", "model", "model_sha256", "tokenizer_file", "tokenizer_sha256")


def _whole_model_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    perp = tensors.pop("embed.perp", None)
    if perp is not None:
        if "embed.weight" not in tensors:
            raise ValueError("state dict has embed.perp but no embed.weight")
        tensors["embed.weight"] = tensors["embed.weight"] + perp  # TE = T_S + T⊥
    return tensors


def save_model_checkpoint(
    directory: Path | str,
    state_dict: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    tokenizer_file: Path | str | None = None,
    meta: Mapping | None = None,
) -> Path:
    """Write a whole-model checkpoint to `directory` atomically; returns the directory.

    `meta` is any JSON-serialisable extra information (outer step, run id, ...); its keys must
    not collide with the reserved keys written by this function.
    """
    directory = Path(directory)
    meta = dict(meta or {})
    clash = sorted(set(meta) & set(_RESERVED))
    if clash:
        raise ValueError(f"meta keys {clash} are reserved by the checkpoint format")
    tensors = _whole_model_tensors(state_dict)
    if tokenizer_file is not None and not Path(tokenizer_file).is_file():
        raise CheckpointError(
            f"tokenizer file {tokenizer_file} does not exist; pass the path of the run's sentencepiece .model"
        )
    with atomic_directory(directory) as tmp:
        save_file(tensors, str(tmp / MODEL_FILE), metadata={"format": "pt"})
        record = {
            "format_version": FORMAT_VERSION,
            "model": cfg.to_dict(),
            "model_sha256": file_sha256(tmp / MODEL_FILE),
            "tokenizer_file": None,
            "tokenizer_sha256": None,
            **meta,
        }
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / TOKENIZER_FILE)
            record["tokenizer_file"] = TOKENIZER_FILE
            record["tokenizer_sha256"] = file_sha256(tmp / TOKENIZER_FILE)
        (tmp / META_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    logger.info("saved checkpoint %s (%d tensors)", directory, len(tensors))
    return directory


def load_model_checkpoint(directory: Path | str) -> tuple[dict[str, torch.Tensor], ModelConfig, dict]:
    """Read a checkpoint written by save_model_checkpoint -> (state_dict, ModelConfig, meta).

    `meta` is the whole meta.json mapping (reserved keys included). CheckpointError when a
    file is missing, unreadable, or does not match its recorded hash.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint directory {directory} does not exist; pass the folder that holds {META_FILE} and {MODEL_FILE}"
        )
    meta_path, model_path = directory / META_FILE, directory / MODEL_FILE
    for path in (meta_path, model_path):
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint {directory} has no {path.name}; it is incomplete, "
                f"point to a complete checkpoint or save it again"
            )
    try:
        meta = json.loads(meta_path.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        cfg = ModelConfig.from_dict(meta["model"])
    except (ValueError, KeyError, TypeError, ConfigError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {directory} has a corrupt {META_FILE} ({e}); "
            f"restore it from a good copy or save the checkpoint again"
        ) from e
    expected = meta.get("model_sha256")
    if expected is not None and file_sha256(model_path) != expected:
        raise CheckpointError(
            f"checkpoint {directory} is corrupt ({MODEL_FILE} does not match "
            f"its recorded sha256); restore it or save the checkpoint again"
        )
    try:
        state_dict = load_file(str(model_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {directory} has an unreadable {MODEL_FILE} ({e}); restore it or save the checkpoint again"
        ) from e
    tok = meta.get("tokenizer_file")
    if tok is not None and not (directory / tok).is_file():
        raise CheckpointError(
            f"checkpoint {directory} lists tokenizer {tok} but the file is "
            f"missing; copy the run's tokenizer.model into it"
        )
    return state_dict, cfg, meta
