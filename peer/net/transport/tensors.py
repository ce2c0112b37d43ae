"""Tensors and scalar fields on the wire: dtype allow-lists, `WireLimits`, and validated readers.

A tensor travels as (dtype name, shape, raw bytes): little-endian, C-contiguous, bfloat16 as raw
2-byte words, len(data) == prod(shape) * itemsize. `tensor_from_proto` never trusts the peer: the
dtype must be on the caller's allow-list, rank, shape and byte length within `WireLimits`, float
values finite, token ids in [0, vocab_size) when the limits know the vocabulary. The small
`_index`/`_text`/`_norm`… readers check one scalar field each; `peer.net.transport.codec` builds
whole messages from them. Any failure raises `TransportError` naming the field.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import Message as PbMessage

from peer.config import WIRE_DTYPES
from peer.errors import ConfigError
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.errors import TransportError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
BOUNDARY_DTYPES = ("float32", "bfloat16", "float16")
TOKEN_DTYPES = ("int32",)
STATE_DTYPES = tuple(DTYPES)
_MAX_INDEX = 1 << 62  # steps, micro-batch and stage indices
_INT32 = torch.iinfo(torch.int32)


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts. `max_message_bytes` bounds one reassembled message."""

    max_message_bytes: int = 1 << 30
    max_rank: int = 8
    max_string_chars: int = 1024
    max_state_tensors: int = 100_000
    vocab_size: int | None = None  # token ids must lie in [0, vocab_size) when set


DEFAULT_LIMITS = WireLimits()


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype setting ("fp32", "bf16", "fp16")."""
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown wire dtype {name!r}; use one of {', '.join(WIRE_DTYPES)}") from None


# ----------------------------------------------------------------------------------- tensors


def tensor_to_proto(t: torch.Tensor, cast_to: torch.dtype | None = None) -> pb.Tensor:
    """Encode a tensor (any device) as pb.Tensor, optionally cast to `cast_to` first."""
    t = t.detach()
    if cast_to is not None and t.dtype != cast_to:
        t = t.to(cast_to)
    if t.dtype not in _DTYPE_NAMES:
        raise TransportError(f"cannot send a {t.dtype} tensor; supported dtypes: {', '.join(DTYPES)}")
    flat = t.to("cpu").contiguous().reshape(-1)  # (numel,)
    raw = flat.view(torch.uint8).numpy()  # (numel * itemsize,)
    if sys.byteorder != "little" and flat.element_size() > 1:
        raw = raw.reshape(-1, flat.element_size())[:, ::-1]
    return pb.Tensor(dtype=_DTYPE_NAMES[t.dtype], shape=list(t.shape), data=raw.tobytes())


def tensor_from_proto(
    msg: pb.Tensor,
    what: str,
    limits: WireLimits,
    dtypes: tuple[str, ...],
    rank: int | None = None,
    token_ids: bool = False,
) -> torch.Tensor:
    """Decode and validate a pb.Tensor; `what` names the field in error messages."""
    if not msg.dtype:
        raise TransportError(f"invalid {what}: missing (no dtype); the sender is incompatible with this peer")
    if msg.dtype not in dtypes:
        raise TransportError(f"invalid {what}: dtype {msg.dtype!r} not allowed here (allowed: {', '.join(dtypes)})")
    dtype = DTYPES[msg.dtype]
    shape = [int(s) for s in msg.shape]
    if len(shape) > limits.max_rank or (rank is not None and len(shape) != rank):
        expected = f"rank {rank}" if rank is not None else f"rank <= {limits.max_rank}"
        raise TransportError(f"invalid {what}: shape {_fmt_shape(shape)} has rank {len(shape)}, expected {expected}")
    if any(s < 0 for s in shape):
        raise TransportError(f"invalid {what}: negative dimension in shape {_fmt_shape(shape)}")
    itemsize = dtype.itemsize
    nbytes = math.prod(shape) * itemsize
    if nbytes > limits.max_message_bytes:
        raise TransportError(
            f"invalid {what}: shape {_fmt_shape(shape)} {msg.dtype} needs {nbytes} bytes, more than the "
            f"{limits.max_message_bytes}-byte message limit; raise max_message_bytes if this is expected"
        )
    if len(msg.data) != nbytes:
        raise TransportError(
            f"invalid {what}: {len(msg.data)} data bytes for shape {_fmt_shape(shape)} {msg.dtype} "
            f"(expected {nbytes}); the sender is incompatible or the stream was corrupted"
        )
    if nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        buf = bytearray(msg.data)
        if sys.byteorder != "little" and itemsize > 1:
            arr = np.frombuffer(buf, dtype=np.uint8).reshape(-1, itemsize)[:, ::-1]
            buf = bytearray(arr.tobytes())
        t = torch.frombuffer(buf, dtype=dtype).reshape(shape)
    if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
        raise TransportError(
            f"invalid {what}: contains NaN or Inf; the sending peer diverged (lower the learning rate "
            "or check its inputs)"
        )
    if token_ids and limits.vocab_size is not None and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= limits.vocab_size:
            raise TransportError(
                f"invalid {what}: token ids span [{lo}, {hi}], outside [0, {limits.vocab_size}); "
                "the sender uses a different tokenizer or vocabulary than this run's manifest"
            )
    return t


def _fmt_shape(shape: list[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def tokens_to_proto(t: torch.Tensor, what: str) -> pb.Tensor:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TransportError(f"cannot send {what}: token ids must be an integer tensor, got {t.dtype}")
    if t.dtype != torch.int32 and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < _INT32.min or hi > _INT32.max:
            raise TransportError(f"cannot send {what}: token ids [{lo}, {hi}] do not fit in int32")
    return tensor_to_proto(t, cast_to=torch.int32)


def boundary_to_proto(t: torch.Tensor, what: str, dtype: torch.dtype) -> pb.Tensor:
    if not t.is_floating_point():
        raise TransportError(f"cannot send {what}: expected a float tensor, got {t.dtype}")
    return tensor_to_proto(t, cast_to=dtype)


def optional_tensor(msg: PbMessage, name: str) -> pb.Tensor | None:
    return getattr(msg, name) if msg.HasField(name) else None


# ------------------------------------------------------------------------------ validation


def read_norm(msg: PbMessage, name: str, what: str, overflow: bool = False) -> float | None:
    """An optional gradient norm (or duration) field: absent → None; present → a finite number >= 0,
    or +inf where `overflow` allows it (a gradient norm: +inf says a stage's gradients overflowed,
    and every stage skips that inner step's optimizer step)."""
    if not msg.HasField(name):
        return None
    value = float(getattr(msg, name))
    if not (_norm_ok(value, overflow)):
        raise TransportError(f"invalid {what}.{name}: {value} is not a finite number >= 0")
    return value


def _norm_ok(value: float, overflow: bool) -> bool:
    return (math.isfinite(value) or (overflow and value == math.inf)) and value >= 0


def read_index(value: int, what: str) -> int:
    value = int(value)
    if not 0 <= value < _MAX_INDEX:
        raise TransportError(f"invalid {what}: {value} is not a non-negative index")
    return value


def read_text(value: str, what: str, limits: WireLimits, allow_empty: bool = True) -> str:
    if len(value) > limits.max_string_chars:
        raise TransportError(f"invalid {what}: {len(value)} characters, more than {limits.max_string_chars}")
    if not allow_empty and not value:
        raise TransportError(f"invalid {what}: must not be empty")
    return value


def read_route(route: Any, limits: WireLimits) -> list[str]:
    """Stage-to-stage route: at most 64 non-empty "host:port" addresses."""
    if len(route) > 64:
        raise TransportError(f"invalid ForwardRequest.route: {len(route)} hops, more than 64")
    return [read_text(a, "ForwardRequest.route", limits, allow_empty=False) for a in route]


def read_sq_norms(values: Any) -> list[float]:
    """Σ‖g‖² of up to 64 stages, each finite and >= 0 or +inf (that stage overflowed)."""
    out = [float(v) for v in values]
    if len(out) > 64 or not all(_norm_ok(v, overflow=True) for v in out):
        raise TransportError("invalid ForwardReply.sq_norms: at most 64 numbers >= 0, finite or +inf")
    return out


def read_boundary(msg: pb.Tensor, what: str, limits: WireLimits) -> torch.Tensor:
    return tensor_from_proto(msg, what, limits, BOUNDARY_DTYPES, rank=3)


def read_tokens(msg: pb.Tensor, what: str, limits: WireLimits) -> torch.Tensor:
    return tensor_from_proto(msg, what, limits, TOKEN_DTYPES, rank=2, token_ids=True)


# -------------------------------------------------------------------------------- messages
