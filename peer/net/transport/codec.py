"""Tensor and message codec: dataclasses of `peer.net.transport.messages` <-> protobuf (peer.proto).

The wire format lives here and in `peer.net.transport.tensors` (one tensor or scalar field), nowhere
else. Boundary tensors (`hidden`, `grad`) are cast to the sender's wire dtype ("fp32", "bf16", "fp16");
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
import re
from collections.abc import Callable
from typing import Any

import torch
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as PbMessage

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
    PayloadKind,
    PayloadRequest,
    RangeBlob,
    RangesReply,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
)
from peer.net.transport.tensors import (
    DEFAULT_LIMITS,
    STATE_DTYPES,
    WireLimits,
    boundary_to_proto,
    optional_tensor,
    read_boundary,
    read_index,
    read_norm,
    read_route,
    read_sq_norms,
    read_text,
    read_tokens,
    tensor_from_proto,
    tensor_to_proto,
    tokens_to_proto,
    wire_dtype,
)

_ARTIFACT_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")


def encode(msg: Any, wire_dtype_name: str = "fp32") -> PbMessage:
    """The protobuf message for a dataclass of `peer.net.transport.messages`, or a Blob for bytes."""
    wd = wire_dtype(wire_dtype_name)
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return pb.Blob(data=bytes(msg))
    if isinstance(msg, (ForwardRequest, ForwardReply, BackwardRequest, BackwardReply)):
        return _encode_pipeline(msg, wd)
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
    if isinstance(msg, (PayloadRequest, RangesReply)):
        return _encode_round(msg)
    if isinstance(msg, StateRequest):
        return pb.StateRequest(stage=msg.stage)
    if isinstance(msg, StateReply):
        tensors = [pb.NamedTensor(name=k, tensor=tensor_to_proto(v)) for k, v in msg.tensors.items()]
        meta_json = _dump_json(msg.meta, "StateReply.meta")
        return pb.StateReply(outer_step=msg.outer_step, meta_json=meta_json, tensors=tensors)
    if isinstance(msg, ArtifactRequest):
        return pb.ArtifactRequest(name=msg.name, offset=msg.offset)
    if isinstance(msg, dict):
        return pb.InfoReply(json=_dump_json(msg, "info"))
    raise TypeError(f"no wire encoding for {type(msg).__name__}")


PipelineMessage = ForwardRequest | ForwardReply | BackwardRequest | BackwardReply


def _encode_pipeline(msg: PipelineMessage, wd: torch.dtype) -> PbMessage:
    """A pipeline call or its reply: boundary tensors at the wire dtype `wd`."""
    if isinstance(msg, ForwardRequest):
        out = pb.ForwardRequest(
            pipeline_id=msg.pipeline_id,
            microbatch=msg.microbatch,
            outer_step=msg.outer_step,
            inner_step=msg.inner_step,
            stage=msg.stage,
            tokens=tokens_to_proto(msg.tokens, "ForwardRequest.tokens"),
            hidden=boundary_to_proto(msg.hidden, "ForwardRequest.hidden", wd),
            train=msg.train,
            attempt=msg.attempt,
            route=list(msg.route),
            window=msg.window,
            defer_norms=msg.defer_norms,
            uncompressed=not msg.compressed,
        )
        if msg.targets is not None:
            out.targets.CopyFrom(tokens_to_proto(msg.targets, "ForwardRequest.targets"))
        return out
    if isinstance(msg, ForwardReply):
        out = pb.ForwardReply()
        if msg.hidden is not None:
            out.hidden.CopyFrom(boundary_to_proto(msg.hidden, "ForwardReply.hidden", wd))
        if msg.loss is not None:
            out.loss = float(msg.loss)
        if msg.grad is not None:
            out.grad.CopyFrom(boundary_to_proto(msg.grad, "ForwardReply.grad", wd))
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
            grad=boundary_to_proto(msg.grad, "BackwardRequest.grad", wd),
            uncompressed=not msg.compressed,
        )
    if isinstance(msg, BackwardReply):
        out = pb.BackwardReply()
        if msg.grad is not None:
            out.grad.CopyFrom(boundary_to_proto(msg.grad, "BackwardReply.grad", wd))
        if msg.grad_sq_norm is not None:
            out.grad_sq_norm = float(msg.grad_sq_norm)
        return out
    raise TypeError(f"no wire encoding for {type(msg).__name__}")


def _encode_round(msg: PayloadRequest | RangesReply) -> PbMessage:
    """An outer round's request for a payload, parts or a shard, or the parts/shards it is answered with."""
    if isinstance(msg, PayloadRequest):
        kind = pb.PayloadRequest.Kind.ValueType(int(msg.kind))
        return pb.PayloadRequest(
            outer_step=msg.outer_step, stage=msg.stage, sender=msg.sender, kind=kind, ranges=list(msg.ranges)
        )
    items = [pb.RangeBlob(range=i.range, data=i.data, proof=list(i.proof)) for i in msg.items]
    return pb.RangesReply(items=items)


def _decode_blob(msg: pb.Blob, limits: WireLimits) -> bytes:
    if len(msg.data) > limits.max_message_bytes:
        limit = limits.max_message_bytes
        raise TransportError(f"invalid Blob: {len(msg.data)} bytes, more than the {limit}-byte limit")
    return msg.data


def _decode_forward_request(msg: pb.ForwardRequest, limits: WireLimits) -> ForwardRequest:
    tokens = read_tokens(msg.tokens, "ForwardRequest.tokens", limits)
    hidden = read_boundary(msg.hidden, "ForwardRequest.hidden", limits)
    _same_bl(hidden, tokens, "ForwardRequest.hidden")
    targets = None
    if msg.HasField("targets"):
        targets = read_tokens(msg.targets, "ForwardRequest.targets", limits)
        if targets.shape != tokens.shape:
            raise TransportError(
                f"invalid ForwardRequest.targets: shape {list(targets.shape)} differs from tokens {list(tokens.shape)}"
            )
    return ForwardRequest(
        pipeline_id=read_text(msg.pipeline_id, "ForwardRequest.pipeline_id", limits),
        microbatch=read_index(msg.microbatch, "ForwardRequest.microbatch"),
        outer_step=read_index(msg.outer_step, "ForwardRequest.outer_step"),
        inner_step=read_index(msg.inner_step, "ForwardRequest.inner_step"),
        stage=read_index(msg.stage, "ForwardRequest.stage"),
        tokens=tokens,
        hidden=hidden,
        targets=targets,
        train=bool(msg.train),
        attempt=read_index(msg.attempt, "ForwardRequest.attempt"),
        route=tuple(read_route(msg.route, limits)),
        window=read_index(msg.window, "ForwardRequest.window"),
        defer_norms=bool(msg.defer_norms),
        compressed=not msg.uncompressed,
    )


def _decode_forward_reply(msg: pb.ForwardReply, limits: WireLimits) -> ForwardReply:
    hidden_pb, grad_pb = optional_tensor(msg, "hidden"), optional_tensor(msg, "grad")
    reply = ForwardReply(
        hidden=None if hidden_pb is None else read_boundary(hidden_pb, "ForwardReply.hidden", limits),
        loss=msg.loss if msg.HasField("loss") else None,
        grad=None if grad_pb is None else read_boundary(grad_pb, "ForwardReply.grad", limits),
        grad_sq_norm=read_norm(msg, "grad_sq_norm", "ForwardReply", overflow=True),
        sq_norms=tuple(read_sq_norms(msg.sq_norms)),
        served_s=read_norm(msg, "served_s", "ForwardReply"),
    )
    check_forward_reply(reply)
    return reply


def _decode_backward_request(msg: pb.BackwardRequest, limits: WireLimits) -> BackwardRequest:
    return BackwardRequest(
        pipeline_id=read_text(msg.pipeline_id, "BackwardRequest.pipeline_id", limits),
        microbatch=read_index(msg.microbatch, "BackwardRequest.microbatch"),
        outer_step=read_index(msg.outer_step, "BackwardRequest.outer_step"),
        inner_step=read_index(msg.inner_step, "BackwardRequest.inner_step"),
        stage=read_index(msg.stage, "BackwardRequest.stage"),
        grad=read_boundary(msg.grad, "BackwardRequest.grad", limits),
        compressed=not msg.uncompressed,
    )


def _decode_backward_reply(msg: pb.BackwardReply, limits: WireLimits) -> BackwardReply:
    grad_pb = optional_tensor(msg, "grad")
    return BackwardReply(
        grad=None if grad_pb is None else read_boundary(grad_pb, "BackwardReply.grad", limits),
        grad_sq_norm=read_norm(msg, "grad_sq_norm", "BackwardReply", overflow=True),
    )


def _decode_step_request(msg: pb.StepRequest, limits: WireLimits) -> StepRequest:
    return StepRequest(
        pipeline_id=read_text(msg.pipeline_id, "StepRequest.pipeline_id", limits),
        outer_step=read_index(msg.outer_step, "StepRequest.outer_step"),
        inner_step=read_index(msg.inner_step, "StepRequest.inner_step"),
        n_microbatches=read_index(msg.n_microbatches, "StepRequest.n_microbatches"),
        tokens=read_index(msg.tokens, "StepRequest.tokens"),
        grad_norm=read_norm(msg, "grad_norm", "StepRequest", overflow=True),
    )


def _decode_step_reply(msg: pb.StepReply, limits: WireLimits) -> StepReply:
    return StepReply(ok=bool(msg.ok), message=read_text(msg.message, "StepReply.message", limits))


MAX_RANGES = 4096  # ranges one PART or SHARD request or reply may name (a plan has at most this many)
MAX_PROOF = 32  # merkle path length (2^32 ranges)


def _decode_payload_request(msg: pb.PayloadRequest, limits: WireLimits) -> PayloadRequest:
    if int(msg.kind) not in {int(k) for k in PayloadKind} or len(msg.ranges) > MAX_RANGES:
        raise TransportError(f"invalid PayloadRequest: kind {msg.kind} or {len(msg.ranges)} ranges")
    return PayloadRequest(
        outer_step=read_index(msg.outer_step, "PayloadRequest.outer_step"),
        stage=read_index(msg.stage, "PayloadRequest.stage"),
        sender=read_text(msg.sender, "PayloadRequest.sender", limits),
        kind=PayloadKind(msg.kind),
        ranges=tuple(read_index(r, "PayloadRequest.ranges") for r in msg.ranges),
    )


def _decode_ranges_reply(msg: pb.RangesReply, limits: WireLimits) -> RangesReply:
    if len(msg.items) > MAX_RANGES:
        raise TransportError(f"invalid RangesReply: {len(msg.items)} items, more than {MAX_RANGES}")
    items = []
    for item in msg.items:
        if len(item.proof) > MAX_PROOF or any(len(h) != 16 for h in item.proof):
            raise TransportError("invalid RangesReply: a merkle proof is not a list of 16-byte hashes")
        items.append(RangeBlob(read_index(item.range, "RangeBlob.range"), bytes(item.data), tuple(item.proof)))
    return RangesReply(tuple(items))


def _decode_state_request(msg: pb.StateRequest, limits: WireLimits) -> StateRequest:
    return StateRequest(stage=read_index(msg.stage, "StateRequest.stage"))


def _decode_artifact_request(msg: pb.ArtifactRequest, limits: WireLimits) -> ArtifactRequest:
    if not _ARTIFACT_NAME.match(msg.name):
        raise TransportError(
            f"invalid ArtifactRequest.name {msg.name[:64]!r}: use 1-128 characters from [A-Za-z0-9._-], "
            "not starting with '.'"
        )
    if msg.offset < 0:
        raise TransportError(f"invalid ArtifactRequest.offset {msg.offset}: must be >= 0")
    return ArtifactRequest(name=msg.name, offset=msg.offset)


def _decode_info_reply(msg: pb.InfoReply, limits: WireLimits) -> dict[str, Any]:
    return _load_json_object(msg.json, "InfoReply.json", limits)


def decode(msg: PbMessage, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """Validate a protobuf message and return its dataclass (bytes for Blob, dict for InfoReply)."""
    decoder = _DECODERS.get(type(msg))
    if decoder is None:
        raise TypeError(f"no decoder for {type(msg).__name__}")
    return decoder(msg, limits)


def _decode_state(msg: pb.StateReply, limits: WireLimits) -> StateReply:
    if len(msg.tensors) > limits.max_state_tensors:
        raise TransportError(f"invalid StateReply: {len(msg.tensors)} tensors, more than {limits.max_state_tensors}")
    tensors: dict[str, torch.Tensor] = {}
    for item in msg.tensors:
        name = read_text(item.name, "StateReply tensor name", limits, allow_empty=False)
        if name in tensors:
            raise TransportError(f"invalid StateReply: tensor {name!r} appears twice")
        tensors[name] = tensor_from_proto(item.tensor, f"StateReply tensor {name!r}", limits, STATE_DTYPES)
    meta = _load_json_object(msg.meta_json, "StateReply.meta", limits)
    return StateReply(outer_step=read_index(msg.outer_step, "StateReply.outer_step"), meta=meta, tensors=tensors)


# One validating decoder per wire message type (decode's dispatch).
_DECODERS: dict[type, Callable[[Any, WireLimits], Any]] = {
    pb.Blob: _decode_blob,
    pb.ForwardRequest: _decode_forward_request,
    pb.ForwardReply: _decode_forward_reply,
    pb.BackwardRequest: _decode_backward_request,
    pb.BackwardReply: _decode_backward_reply,
    pb.StepRequest: _decode_step_request,
    pb.StepReply: _decode_step_reply,
    pb.PayloadRequest: _decode_payload_request,
    pb.RangesReply: _decode_ranges_reply,
    pb.StateRequest: _decode_state_request,
    pb.StateReply: _decode_state,
    pb.ArtifactRequest: _decode_artifact_request,
    pb.InfoReply: _decode_info_reply,
}


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


def parse(pb_type: type[PbMessage], data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> PbMessage:
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


def late_norms_from_bytes(data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> tuple[float, ...]:
    """Σ‖g‖² of the second reply of a `defer_norms` forward; TransportError if it is anything else."""
    msg = parse(pb.ForwardReply, data, limits)
    if msg.HasField("hidden") or msg.HasField("grad") or msg.HasField("loss") or not msg.sq_norms:
        raise TransportError("invalid ForwardReply after the answer: it must carry sq_norms and nothing else")
    return tuple(read_sq_norms(msg.sq_norms))


def from_bytes(pb_type: type[PbMessage], data: bytes, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """Parse protobuf bytes of `pb_type` and decode (validate) them into the dataclass."""
    return decode(parse(pb_type, data, limits), limits)


def encoded_size(msg: Any, wire_dtype_name: str = "fp32") -> int:
    """Exact serialized protobuf size in bytes of `msg` (a dataclass, bytes or an info dict).

    Equal to len(to_bytes(msg, wire_dtype_name)); chunk framing comes on top (framing.framed_size).
    """
    size: int = encode(msg, wire_dtype_name).ByteSize()
    return size
