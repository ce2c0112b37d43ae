"""Tensor and message codec: dataclasses of `peer.net.transport.messages` <-> protobuf (peer.proto).

The wire format lives here and nowhere else. A tensor travels as (dtype name, shape, raw bytes):
little-endian, C-contiguous, bfloat16 as raw 2-byte words, len(data) == prod(shape) * itemsize.
Boundary tensors (`hidden`, `grad`) are cast to the sender's wire dtype ("fp32", "bf16", "fp16");
token ids travel as int32; state tensors keep their dtype (bit-exact).

Decoding never trusts the peer. Every tensor is checked against a dtype allow-list, the expected
rank, shape and size limits (`WireLimits`), its byte length, finite values (float tensors) and,
when `WireLimits.vocab_size` is set, token ids in [0, vocab_size). Cross-field shapes are checked
too (hidden (b, L, *) matches tokens (b, L)). Any failure raises `TransportError` naming the field.

`encoded_size(msg)` is the exact serialized protobuf size of a message, computed by the same code
that builds what is sent; `peer.net.transport.framing.framed_size` adds the chunk framing.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as PbMessage

from peer.config import WIRE_DTYPES
from peer.errors import ConfigError
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.checks import _same_bl
from peer.net.transport.checks import check_forward_reply as check_forward_reply  # re-exported
from peer.net.transport.errors import TransportError
from peer.net.transport.messages import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    PayloadRequest,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
)

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
_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")
_INT32 = torch.iinfo(torch.int32)


@dataclass(frozen=True)
class WireLimits:
    """What a receiver accepts. `max_message_bytes` bounds one reassembled message."""

    max_message_bytes: int = 1 << 30
    max_rank: int = 8
    max_string_chars: int = 1024
    max_state_tensors: int = 100_000
    vocab_size: int | None = None  # token ids must lie in [0, vocab_size) when set


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


def _tokens_to_proto(t: torch.Tensor, what: str) -> pb.Tensor:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TransportError(f"cannot send {what}: token ids must be an integer tensor, got {t.dtype}")
    if t.dtype != torch.int32 and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < _INT32.min or hi > _INT32.max:
            raise TransportError(f"cannot send {what}: token ids [{lo}, {hi}] do not fit in int32")
    return tensor_to_proto(t, cast_to=torch.int32)


def _boundary_to_proto(t: torch.Tensor, what: str, dtype: torch.dtype) -> pb.Tensor:
    if not t.is_floating_point():
        raise TransportError(f"cannot send {what}: expected a float tensor, got {t.dtype}")
    return tensor_to_proto(t, cast_to=dtype)


def _opt(msg: PbMessage, name: str) -> pb.Tensor | None:
    return getattr(msg, name) if msg.HasField(name) else None


# ------------------------------------------------------------------------------ validation


def _norm(msg: PbMessage, name: str, what: str) -> float | None:
    """An optional gradient norm (or duration) field: absent → None; present → a finite number >= 0."""
    if not msg.HasField(name):
        return None
    value = float(getattr(msg, name))
    if not (math.isfinite(value) and value >= 0):
        raise TransportError(f"invalid {what}.{name}: {value} is not a finite number >= 0")
    return value


def _index(value: int, what: str) -> int:
    value = int(value)
    if not 0 <= value < _MAX_INDEX:
        raise TransportError(f"invalid {what}: {value} is not a non-negative index")
    return value


def _text(value: str, what: str, limits: WireLimits, allow_empty: bool = True) -> str:
    if len(value) > limits.max_string_chars:
        raise TransportError(f"invalid {what}: {len(value)} characters, more than {limits.max_string_chars}")
    if not allow_empty and not value:
        raise TransportError(f"invalid {what}: must not be empty")
    return value


def _route(route: Any, limits: WireLimits) -> list[str]:
    """Stage-to-stage route: at most 64 non-empty "host:port" addresses."""
    if len(route) > 64:
        raise TransportError(f"invalid ForwardRequest.route: {len(route)} hops, more than 64")
    return [_text(a, "ForwardRequest.route", limits, allow_empty=False) for a in route]


def _sq_norms(values: Any) -> list[float]:
    out = [float(v) for v in values]
    if len(out) > 64 or not all(math.isfinite(v) and v >= 0 for v in out):
        raise TransportError("invalid ForwardReply.sq_norms: at most 64 finite numbers >= 0")
    return out


def _boundary(msg: pb.Tensor, what: str, limits: WireLimits) -> torch.Tensor:
    return tensor_from_proto(msg, what, limits, BOUNDARY_DTYPES, rank=3)


def _tokens(msg: pb.Tensor, what: str, limits: WireLimits) -> torch.Tensor:
    return tensor_from_proto(msg, what, limits, TOKEN_DTYPES, rank=2, token_ids=True)


# -------------------------------------------------------------------------------- messages


def encode(msg: Any, wire_dtype_name: str = "fp32") -> PbMessage:
    """The protobuf message for a dataclass of `peer.net.transport.messages`, or a Blob for bytes."""
    wd = wire_dtype(wire_dtype_name)
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return pb.Blob(data=bytes(msg))
    if isinstance(msg, ForwardRequest):
        out = pb.ForwardRequest(
            pipeline_id=msg.pipeline_id,
            microbatch=msg.microbatch,
            outer_step=msg.outer_step,
            inner_step=msg.inner_step,
            stage=msg.stage,
            tokens=_tokens_to_proto(msg.tokens, "ForwardRequest.tokens"),
            hidden=_boundary_to_proto(msg.hidden, "ForwardRequest.hidden", wd),
            train=msg.train,
            attempt=msg.attempt,
            route=list(msg.route),
            window=msg.window,
            defer_norms=msg.defer_norms,
        )
        if msg.targets is not None:
            out.targets.CopyFrom(_tokens_to_proto(msg.targets, "ForwardRequest.targets"))
        return out
    if isinstance(msg, ForwardReply):
        out = pb.ForwardReply()
        if msg.hidden is not None:
            out.hidden.CopyFrom(_boundary_to_proto(msg.hidden, "ForwardReply.hidden", wd))
        if msg.loss is not None:
            out.loss = float(msg.loss)
        if msg.grad is not None:
            out.grad.CopyFrom(_boundary_to_proto(msg.grad, "ForwardReply.grad", wd))
        if msg.grad_sq_norm is not None:
            out.grad_sq_norm = float(msg.grad_sq_norm)
        out.sq_norms.extend(float(v) for v in msg.sq_norms)
        if msg.served_s is not None:
            out.served_s = float(msg.served_s)
        return out
    if isinstance(msg, BackwardRequest):
        return pb.BackwardRequest(
            pipeline_id=msg.pipeline_id,
            microbatch=msg.microbatch,
            outer_step=msg.outer_step,
            inner_step=msg.inner_step,
            stage=msg.stage,
            grad=_boundary_to_proto(msg.grad, "BackwardRequest.grad", wd),
        )
    if isinstance(msg, BackwardReply):
        out = pb.BackwardReply()
        if msg.grad is not None:
            out.grad.CopyFrom(_boundary_to_proto(msg.grad, "BackwardReply.grad", wd))
        if msg.grad_sq_norm is not None:
            out.grad_sq_norm = float(msg.grad_sq_norm)
        return out
    if isinstance(msg, StepRequest):
        step = pb.StepRequest(
            pipeline_id=msg.pipeline_id,
            outer_step=msg.outer_step,
            inner_step=msg.inner_step,
            n_microbatches=msg.n_microbatches,
            tokens=msg.tokens,
        )
        if msg.grad_norm is not None:
            step.grad_norm = float(msg.grad_norm)
        return step
    if isinstance(msg, StepReply):
        return pb.StepReply(ok=msg.ok, message=msg.message)
    if isinstance(msg, PayloadRequest):
        return pb.PayloadRequest(outer_step=msg.outer_step, stage=msg.stage, sender=msg.sender)
    if isinstance(msg, StateRequest):
        return pb.StateRequest(stage=msg.stage)
    if isinstance(msg, StateReply):
        tensors = [pb.NamedTensor(name=k, tensor=tensor_to_proto(v)) for k, v in msg.tensors.items()]
        meta_json = _dump_json(msg.meta, "StateReply.meta")
        return pb.StateReply(outer_step=msg.outer_step, meta_json=meta_json, tensors=tensors)
    if isinstance(msg, ArtifactRequest):
        return pb.ArtifactRequest(name=msg.name)
    if isinstance(msg, dict):
        return pb.InfoReply(json=_dump_json(msg, "info"))
    raise TypeError(f"no wire encoding for {type(msg).__name__}")


def decode(msg: PbMessage, limits: WireLimits = WireLimits()) -> Any:
    """Validate a protobuf message and return its dataclass (bytes for Blob, dict for InfoReply)."""
    if isinstance(msg, pb.Blob):
        if len(msg.data) > limits.max_message_bytes:
            raise TransportError(
                f"invalid Blob: {len(msg.data)} bytes, more than the {limits.max_message_bytes}-byte limit"
            )
        return msg.data
    if isinstance(msg, pb.ForwardRequest):
        tokens = _tokens(msg.tokens, "ForwardRequest.tokens", limits)
        hidden = _boundary(msg.hidden, "ForwardRequest.hidden", limits)
        _same_bl(hidden, tokens, "ForwardRequest.hidden")
        targets = None
        if msg.HasField("targets"):
            targets = _tokens(msg.targets, "ForwardRequest.targets", limits)
            if targets.shape != tokens.shape:
                raise TransportError(
                    f"invalid ForwardRequest.targets: shape {list(targets.shape)} differs from tokens "
                    f"{list(tokens.shape)}"
                )
        return ForwardRequest(
            pipeline_id=_text(msg.pipeline_id, "ForwardRequest.pipeline_id", limits),
            microbatch=_index(msg.microbatch, "ForwardRequest.microbatch"),
            outer_step=_index(msg.outer_step, "ForwardRequest.outer_step"),
            inner_step=_index(msg.inner_step, "ForwardRequest.inner_step"),
            stage=_index(msg.stage, "ForwardRequest.stage"),
            tokens=tokens,
            hidden=hidden,
            targets=targets,
            train=bool(msg.train),
            attempt=_index(msg.attempt, "ForwardRequest.attempt"),
            route=tuple(_route(msg.route, limits)),
            window=_index(msg.window, "ForwardRequest.window"),
            defer_norms=bool(msg.defer_norms),
        )
    if isinstance(msg, pb.ForwardReply):
        hidden_pb, grad_pb = _opt(msg, "hidden"), _opt(msg, "grad")
        reply = ForwardReply(
            hidden=None if hidden_pb is None else _boundary(hidden_pb, "ForwardReply.hidden", limits),
            loss=msg.loss if msg.HasField("loss") else None,
            grad=None if grad_pb is None else _boundary(grad_pb, "ForwardReply.grad", limits),
            grad_sq_norm=_norm(msg, "grad_sq_norm", "ForwardReply"),
            sq_norms=tuple(_sq_norms(msg.sq_norms)),
            served_s=_norm(msg, "served_s", "ForwardReply"),
        )
        check_forward_reply(reply)
        return reply
    if isinstance(msg, pb.BackwardRequest):
        return BackwardRequest(
            pipeline_id=_text(msg.pipeline_id, "BackwardRequest.pipeline_id", limits),
            microbatch=_index(msg.microbatch, "BackwardRequest.microbatch"),
            outer_step=_index(msg.outer_step, "BackwardRequest.outer_step"),
            inner_step=_index(msg.inner_step, "BackwardRequest.inner_step"),
            stage=_index(msg.stage, "BackwardRequest.stage"),
            grad=_boundary(msg.grad, "BackwardRequest.grad", limits),
        )
    if isinstance(msg, pb.BackwardReply):
        grad_pb = _opt(msg, "grad")
        return BackwardReply(
            grad=None if grad_pb is None else _boundary(grad_pb, "BackwardReply.grad", limits),
            grad_sq_norm=_norm(msg, "grad_sq_norm", "BackwardReply"),
        )
    if isinstance(msg, pb.StepRequest):
        return StepRequest(
            pipeline_id=_text(msg.pipeline_id, "StepRequest.pipeline_id", limits),
            outer_step=_index(msg.outer_step, "StepRequest.outer_step"),
            inner_step=_index(msg.inner_step, "StepRequest.inner_step"),
            n_microbatches=_index(msg.n_microbatches, "StepRequest.n_microbatches"),
            tokens=_index(msg.tokens, "StepRequest.tokens"),
            grad_norm=_norm(msg, "grad_norm", "StepRequest"),
        )
    if isinstance(msg, pb.StepReply):
        return StepReply(ok=bool(msg.ok), message=_text(msg.message, "StepReply.message", limits))
    if isinstance(msg, pb.PayloadRequest):
        return PayloadRequest(
            outer_step=_index(msg.outer_step, "PayloadRequest.outer_step"),
            stage=_index(msg.stage, "PayloadRequest.stage"),
            sender=_text(msg.sender, "PayloadRequest.sender", limits),
        )
    if isinstance(msg, pb.StateRequest):
        return StateRequest(stage=_index(msg.stage, "StateRequest.stage"))
    if isinstance(msg, pb.StateReply):
        return _decode_state(msg, limits)
    if isinstance(msg, pb.ArtifactRequest):
        if not _ARTIFACT_NAME.match(msg.name):
            raise TransportError(
                f"invalid ArtifactRequest.name {msg.name[:64]!r}: use 1-128 characters from [A-Za-z0-9._-], "
                "not starting with '.'"
            )
        return ArtifactRequest(name=msg.name)
    if isinstance(msg, pb.InfoReply):
        return _load_json_object(msg.json, "InfoReply.json", limits)
    raise TypeError(f"no decoder for {type(msg).__name__}")


def _decode_state(msg: pb.StateReply, limits: WireLimits) -> StateReply:
    if len(msg.tensors) > limits.max_state_tensors:
        raise TransportError(f"invalid StateReply: {len(msg.tensors)} tensors, more than {limits.max_state_tensors}")
    tensors: dict[str, torch.Tensor] = {}
    for item in msg.tensors:
        name = _text(item.name, "StateReply tensor name", limits, allow_empty=False)
        if name in tensors:
            raise TransportError(f"invalid StateReply: tensor {name!r} appears twice")
        tensors[name] = tensor_from_proto(item.tensor, f"StateReply tensor {name!r}", limits, STATE_DTYPES)
    meta = _load_json_object(msg.meta_json, "StateReply.meta", limits)
    return StateReply(outer_step=_index(msg.outer_step, "StateReply.outer_step"), meta=meta, tensors=tensors)


def _dump_json(obj: dict[str, Any], what: str) -> str:
    if not isinstance(obj, dict):
        raise TransportError(f"cannot send {what}: expected a dict, got {type(obj).__name__}")
    try:
        return json.dumps(obj, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TransportError(f"cannot send {what}: not JSON-serialisable ({exc})") from None


def _load_json_object(text: str, what: str, limits: WireLimits) -> dict[str, Any]:
    if len(text) > limits.max_message_bytes:
        raise TransportError(f"invalid {what}: {len(text)} characters, more than the message limit")
    try:
        obj = json.loads(text) if text else {}
    except ValueError as exc:
        raise TransportError(f"invalid {what}: not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TransportError(f"invalid {what}: expected a JSON object, got {type(obj).__name__}")
    return obj


# ------------------------------------------------------------------------ bytes and sizes


def to_bytes(msg: Any, wire_dtype_name: str = "fp32") -> bytes:
    """Serialize a message dataclass (or bytes, as a Blob) to protobuf bytes."""
    data: bytes = encode(msg, wire_dtype_name).SerializeToString()
    return data


def parse(pb_type: type[PbMessage], data: bytes, limits: WireLimits = WireLimits()) -> PbMessage:
    """Parse protobuf bytes of `pb_type` (no field validation); TransportError if they are not one."""
    if len(data) > limits.max_message_bytes:
        raise TransportError(
            f"invalid {pb_type.__name__}: {len(data)} bytes, more than the {limits.max_message_bytes}-byte limit"
        )
    msg = pb_type()
    try:
        msg.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise TransportError(f"invalid {pb_type.__name__}: not a parseable protobuf message ({exc})") from None
    return msg


def late_norms_to_bytes(sq_norms: tuple[float, ...]) -> bytes:
    """The second reply of a `defer_norms` forward: a ForwardReply with only sq_norms set."""
    return bytes(pb.ForwardReply(sq_norms=[float(v) for v in sq_norms]).SerializeToString())


def late_norms_from_bytes(data: bytes, limits: WireLimits = WireLimits()) -> tuple[float, ...]:
    """Σ‖g‖² of the second reply of a `defer_norms` forward; TransportError if it is anything else."""
    msg = parse(pb.ForwardReply, data, limits)
    if msg.HasField("hidden") or msg.HasField("grad") or msg.HasField("loss") or not msg.sq_norms:
        raise TransportError("invalid ForwardReply after the answer: it must carry sq_norms and nothing else")
    return tuple(_sq_norms(msg.sq_norms))


def from_bytes(pb_type: type[PbMessage], data: bytes, limits: WireLimits = WireLimits()) -> Any:
    """Parse protobuf bytes of `pb_type` and decode (validate) them into the dataclass."""
    return decode(parse(pb_type, data, limits), limits)


def encoded_size(msg: Any, wire_dtype_name: str = "fp32") -> int:
    """Exact serialized protobuf size in bytes of `msg` (a dataclass, bytes or an info dict).

    Equal to len(to_bytes(msg, wire_dtype_name)); chunk framing comes on top (framing.framed_size).
    """
    size: int = encode(msg, wire_dtype_name).ByteSize()
    return size
