"""Export a whole-model checkpoint as a Hugging Face `LlamaForCausalLM` folder.

The decoder in peer.core.model.decoder is architecturally a Llama model (RMSNorm, rotate_half RoPE,
SwiGLU, untied head, no biases), so export is a rename of tensors plus a config.json:

    embed.weight (full TE)             -> model.embed_tokens.weight
    layers.N.attn.w{q,k,v,o}.weight    -> model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.ffn.w1 / w3 / w2          -> model.layers.N.mlp.gate_proj / up_proj / down_proj
    layers.N.attn_norm / ffn_norm      -> model.layers.N.input_layernorm / post_attention_layernorm
    norm.weight                        -> model.norm.weight
    head.weight                        -> lm_head.weight

Invariants: transformers is never imported here (it is only needed to *load* the result);
the output folder is written atomically; the exported model computes the same logits as
peer.core.model.decoder.Decoder up to float rounding.

A folder of configurations (`peer simulate --save DIR` writes DIR/<config>/) is accepted too:
with exactly one configuration that one is exported, with several the error lists them.
A swarm's model (its peers' stage checkpoints, or the live swarm) is assembled from stage states
by peer.export.model and written by the same `write_hf`: model.safetensors' bytes depend
only on the model, never on where it was read from (where goes to peer_export.json).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from peer import package_version
from peer.core.files import file_sha256
from peer.core.model.decoder import ModelConfig
from peer.errors import CheckpointError
from peer.node.checkpoints.model import (
    META_FILE,
    MODEL_FILE,
    TOKENIZER_FILE,
    atomic_directory,
    load_model_checkpoint,
)

logger = logging.getLogger(__name__)

__all__ = ["export_hf", "hf_config", "hf_name", "list_configurations", "resolve_checkpoint", "write_hf"]

EXPORT_INFO_FILE = "peer_export.json"  # where an export came from: source, outer step, run id, hashes

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_LAYER_MAP = {
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_MAP = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "head.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """The Hugging Face Llama name of a peer.core.model.decoder parameter name; KeyError if unknown."""
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise KeyError(name)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json contents for LlamaForCausalLM (readable by transformers 4.4x and 5.x)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": cfg.n_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len,
        "hidden_act": "silu",
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "use_cache": True,
    }


def _tokenizer_config(tokenizer_path: Path, cfg: ModelConfig) -> dict[str, Any]:
    """tokenizer_config.json for LlamaTokenizer; special tokens read from the .model file."""
    import sentencepiece as spm  # local import: only export needs it here

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    if sp.get_piece_size() != cfg.vocab_size:
        logger.warning("tokenizer has %d pieces but the model's vocab_size is %d", sp.get_piece_size(), cfg.vocab_size)

    _warn_if_not_llama_compatible(tokenizer_path)

    def piece(i: int) -> str | None:
        return sp.id_to_piece(i) if 0 <= i < sp.get_piece_size() else None

    return {
        "tokenizer_class": "LlamaTokenizer",
        "model_max_length": cfg.max_seq_len,
        "bos_token": piece(sp.bos_id()),
        "eos_token": piece(sp.eos_id()),
        "unk_token": piece(sp.unk_id()),
        "pad_token": piece(sp.pad_id()),
        # peer trains on plain sp.encode() ids, without BOS/EOS added per call.
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
    }


def _warn_if_not_llama_compatible(tokenizer_path: Path) -> None:
    """Hugging Face's LlamaTokenizer ignores the .model's normaliser; say when that matters."""
    from google.protobuf.message import DecodeError

    try:
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]  # built at import by protobuf
        proto.ParseFromString(tokenizer_path.read_bytes())
    except (ImportError, OSError, DecodeError) as e:  # only skips this check, and says so
        logger.warning("could not inspect %s (%s); tokenizer compatibility not checked", tokenizer_path, e)
        return
    spec = proto.normalizer_spec
    if spec.name != "identity" or spec.remove_extra_whitespaces:
        logger.warning(
            "tokenizer.model normalises text (%s, remove_extra_whitespaces=%s): the exported "
            "LlamaTokenizer will give different ids for newlines and repeated spaces; train the "
            "tokenizer with normalization_rule_name=identity, remove_extra_whitespaces=False",
            spec.name,
            spec.remove_extra_whitespaces,
        )


def _is_checkpoint(path: Path) -> bool:
    """Whether `path` is meant as one checkpoint (complete or not): it holds meta.json or the weights."""
    return (path / META_FILE).is_file() or (path / MODEL_FILE).is_file()


def list_configurations(folder: Path | str) -> list[str]:
    """Names of the checkpoint folders directly inside `folder` (e.g. `peer simulate --save`'s configs)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and _is_checkpoint(p))


def resolve_checkpoint(path: Path | str) -> Path:
    """The checkpoint folder `path` names: itself, or the only configuration it holds.

    CheckpointError listing the configurations when it holds several, or saying what a
    checkpoint folder looks like when it holds none.
    """
    path = Path(path)
    if not path.is_dir() or _is_checkpoint(path):
        return path  # load_model_checkpoint says what is missing
    configs = list_configurations(path)
    if len(configs) == 1:
        logger.info("%s holds one configuration, %s; exporting it", path, configs[0])
        return path / configs[0]
    if configs:
        raise CheckpointError(
            f"{path} holds {len(configs)} configurations ({', '.join(configs)}); "
            f"export one of them, e.g. `peer export {path / configs[0]} --out …`"
        )
    raise CheckpointError(
        f"{path} is not a checkpoint: it holds no {META_FILE} + {MODEL_FILE}, no folder that does and no "
        f"peer checkpoints; pass a peer's data dir (or one per stage), or a folder written by "
        f"`peer simulate --save` or one of its configurations"
    )


def export_hf(checkpoint_dir: Path | str, out_dir: Path | str) -> Path:
    """Write a LlamaForCausalLM folder for the checkpoint; returns `out_dir`.

    `checkpoint_dir` is a checkpoint or a folder holding exactly one (`resolve_checkpoint`).
    CheckpointError when the checkpoint is missing, corrupt, or not a whole model.
    """
    checkpoint_dir, out_dir = resolve_checkpoint(checkpoint_dir), Path(out_dir)
    state_dict, cfg, meta = load_model_checkpoint(checkpoint_dir)
    tok = meta.get("tokenizer_file")
    info = {"source": "simulate", "checkpoint": str(checkpoint_dir), "outer_step": meta.get("outer_step")}
    write_hf(out_dir, state_dict, cfg, checkpoint_dir / tok if tok is not None else None, info, str(checkpoint_dir))
    return out_dir


def write_hf(
    out_dir: Path,
    state_dict: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    tokenizer: Path | None,
    info: Mapping[str, Any],
    source: str,
) -> str:
    """Write the whole model `state_dict` (global names, the full TE as `embed.weight`) as a
    LlamaForCausalLM folder at `out_dir`, atomically; returns model.safetensors' sha256.

    Every export writes through here: model.safetensors holds only the tensors and {"format": "pt"},
    so one model gives the same bytes whatever it was read from; `info` (where it came from, the
    outer step, ...) goes to EXPORT_INFO_FILE beside it, with the hashes of what was written.
    CheckpointError naming `source` when a tensor is not part of the decoder or one is missing.
    """
    try:
        tensors = {hf_name(k): v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
    except KeyError as e:
        raise CheckpointError(
            f"checkpoint {source} has tensor {e.args[0]!r} that is "
            f"not part of the decoder; export only peer model checkpoints"
        ) from e
    expected = {hf_name(k) for k in _expected_names(cfg)}
    missing = sorted(expected - set(tensors))
    if missing:
        raise CheckpointError(
            f"checkpoint {source} is not a whole model (missing "
            f"{missing[0]} and {len(missing) - 1} more); export a checkpoint "
            f"saved from all stages"
        )
    _check_out(out_dir)
    with atomic_directory(out_dir) as tmp:
        save_file(dict(sorted(tensors.items())), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER_FILE)
            tok_cfg = _tokenizer_config(tmp / TOKENIZER_FILE, cfg)
            (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        sha = file_sha256(tmp / "model.safetensors")
        record = {
            **info,
            "model_sha256": sha,
            "tokenizer_sha256": file_sha256(tmp / TOKENIZER_FILE) if tokenizer is not None else None,
            "peer_version": package_version(),
        }
        (tmp / EXPORT_INFO_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    logger.info(
        "exported %s to %s (%d tensors, tokenizer: %s)", source, out_dir, len(tensors), "yes" if tokenizer else "no"
    )
    return sha


def _check_out(out_dir: Path) -> None:
    """The output folder is replaced as a whole: refuse one that holds anything but an earlier export."""
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / "config.json").is_file():
        raise CheckpointError(
            f"--out {out_dir} is a folder with other files in it and would be replaced; pass a new or empty folder"
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"--out {out_dir} is a file; pass a new or empty folder")


def _expected_names(cfg: ModelConfig) -> list[str]:
    names = ["embed.weight", "norm.weight", "head.weight"]
    for i in range(cfg.n_layers):
        names += [f"layers.{i}.{suffix}" for suffix in _LAYER_MAP]
    return names
