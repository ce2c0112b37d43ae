"""Wire codec and framing: round trips, validation of untrusted input, exact byte sizes."""

from __future__ import annotations

import math

import pytest
import torch

from peer.config import WIRE_DTYPES
from peer.errors import ConfigError, PeerError
from peer.net.transport import codec, framing, tensors
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.codec import decode, encode, encoded_size, from_bytes, to_bytes
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
from peer.net.transport.tensors import WireLimits, tensor_to_proto

PB_TYPE = {
    ForwardRequest: pb.ForwardRequest,
    ForwardReply: pb.ForwardReply,
    BackwardRequest: pb.BackwardRequest,
    BackwardReply: pb.BackwardReply,
    StepRequest: pb.StepRequest,
    StepReply: pb.StepReply,
    PayloadRequest: pb.PayloadRequest,
    StateRequest: pb.StateRequest,
    StateReply: pb.StateReply,
    ArtifactRequest: pb.ArtifactRequest,
}


def _fwd(b=2, L=3, k=4, targets=True, vocab=50, seed=0) -> ForwardRequest:
    g = torch.Generator().manual_seed(seed)
    return ForwardRequest(
        pipeline_id="pipe-a",
        microbatch=1,
        outer_step=7,
        inner_step=12,
        stage=2,
        tokens=torch.randint(0, vocab, (b, L), generator=g),  # int64 on purpose: narrowed to int32
        hidden=torch.randn(b, L, k, generator=g),
        targets=torch.randint(0, vocab, (b, L), generator=g) if targets else None,
    )


_DEFAULT_LIMITS = WireLimits()


def _roundtrip(msg, wire="fp32", limits=_DEFAULT_LIMITS):
    return from_bytes(PB_TYPE[type(msg)], to_bytes(msg, wire), limits)


def _all_messages() -> list:
    g = torch.Generator().manual_seed(1)
    return [
        _fwd(),
        _fwd(targets=False),
        ForwardReply(hidden=torch.randn(2, 3, 4, generator=g)),
        ForwardReply(loss=2.5, grad=torch.randn(2, 3, 4, generator=g)),
        ForwardReply(loss=3.25),
        BackwardRequest("p", 0, 1, 2, 3, torch.randn(2, 3, 4, generator=g)),
        BackwardReply(grad=torch.randn(2, 3, 4, generator=g)),
        BackwardReply(),
        StepRequest("p", 4, 5, 8, 4096),
        StepReply(ok=False, message="wrong outer step"),
        PayloadRequest(outer_step=3, stage=1, sender="peer-xyz"),
        StateRequest(stage=2),
        StateReply(
            outer_step=9,
            meta={"basis_hash": "abc", "n": 3},
            tensors={
                "layers.0.attn.wq.weight": torch.randn(4, 4, generator=g),
                "embed.perp": torch.randn(5, 4, generator=g).to(torch.bfloat16),
                "step": torch.tensor([3], dtype=torch.int64),
                "empty": torch.zeros(0, 4),
            },
        ),
        ArtifactRequest(name="tokenizer.model"),
    ]


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_forward_request_round_trip(wire):
    msg = _fwd()
    out = _roundtrip(msg, wire)
    assert out.tokens.dtype == torch.int32 and out.targets.dtype == torch.int32
    assert torch.equal(out.tokens, msg.tokens.to(torch.int32))
    assert torch.equal(out.targets, msg.targets.to(torch.int32))
    assert out.hidden.dtype == WIRE_DTYPES[wire]
    # Bit-exact: what arrives is exactly the sender's tensor cast to the wire dtype.
    assert torch.equal(out.hidden, msg.hidden.to(WIRE_DTYPES[wire]))
    assert (out.pipeline_id, out.microbatch, out.outer_step, out.inner_step, out.stage, out.train) == (
        "pipe-a",
        1,
        7,
        12,
        2,
        True,
    )


def test_every_message_round_trips():
    for msg in _all_messages():
        out = _roundtrip(msg)
        assert type(out) is type(msg)
        for name, value in vars(msg).items():
            got = getattr(out, name)
            if name in ("tokens", "targets") and isinstance(value, torch.Tensor):
                assert got.dtype == torch.int32 and torch.equal(got, value.to(torch.int32)), name
            elif isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), name
            elif isinstance(value, dict) and value and isinstance(next(iter(value.values())), torch.Tensor):
                assert list(got) == list(value)
                for key in value:
                    assert got[key].dtype == value[key].dtype and torch.equal(got[key], value[key]), key
            else:
                assert got == value, name


def test_bf16_carried_as_raw_words():
    t = torch.tensor([1.0, -2.5, 3.140625], dtype=torch.bfloat16)
    proto = tensors.tensor_to_proto(t)
    assert proto.dtype == "bfloat16" and list(proto.shape) == [3]
    assert proto.data == t.view(torch.int16).numpy().astype("<i2").tobytes()
    back = tensors.tensor_from_proto(proto, "x", WireLimits(), tensors.BOUNDARY_DTYPES)
    assert torch.equal(back, t)


def test_non_contiguous_tensor_is_sent_in_logical_order():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # (4, 3), not contiguous
    back = tensors.tensor_from_proto(tensors.tensor_to_proto(t), "x", WireLimits(), tensors.STATE_DTYPES)
    assert torch.equal(back, t)


def _tensor(dtype="float32", shape=(2, 3), data=None) -> pb.Tensor:
    if data is None:
        data = bytes(4 * math.prod(shape))
    return pb.Tensor(dtype=dtype, shape=list(shape), data=data)


def _bad(proto: pb.Tensor, match: str, **kw):
    with pytest.raises(TransportError, match=match):
        limits, dtypes = kw.pop("limits", WireLimits()), kw.pop("dtypes", tensors.BOUNDARY_DTYPES)
        tensors.tensor_from_proto(proto, "T.hidden", limits, dtypes, **kw)


def test_rejects_wrong_byte_length():
    _bad(_tensor(data=bytes(23)), r"23 data bytes .* \(expected 24\)")


def test_rejects_nan_and_inf():
    for bad in (float("nan"), float("inf")):
        data = torch.tensor([[0.0, bad, 1.0], [2.0, 3.0, 4.0]]).numpy().tobytes()
        _bad(_tensor(data=data), "NaN or Inf")
    half = torch.tensor([1.0, float("nan")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    _bad(_tensor(dtype="bfloat16", shape=(2,), data=half), "NaN or Inf")


def test_rejects_bad_dtype():
    _bad(_tensor(dtype="complex64"), "dtype 'complex64' not allowed")
    _bad(_tensor(dtype="int32"), "dtype 'int32' not allowed")  # not a boundary dtype
    _bad(_tensor(dtype=""), "missing")


def test_rejects_huge_shape_before_allocating():
    _bad(_tensor(shape=(1 << 40, 1 << 40), data=b""), "more than the .*-byte message limit")
    _bad(_tensor(shape=(1,) * 9, data=bytes(4)), "rank 9")
    _bad(_tensor(shape=(2, -3), data=b""), "negative dimension")
    _bad(_tensor(shape=(2, 3)), "expected rank 3", rank=3)


def test_rejects_token_ids_out_of_range():
    limits = WireLimits(vocab_size=50)
    for bad in (50, -1):
        ids = torch.tensor([[1, 2], [3, bad]], dtype=torch.int32).numpy().tobytes()
        proto = _tensor(dtype="int32", shape=(2, 2), data=ids)
        _bad(proto, r"outside \[0, 50\)", dtypes=tensors.TOKEN_DTYPES, token_ids=True, limits=limits)
    msg = _fwd(vocab=50)
    assert torch.equal(_roundtrip(msg, limits=limits).tokens, msg.tokens.to(torch.int32))
    with pytest.raises(TransportError, match="ForwardRequest.tokens"):
        _roundtrip(msg, limits=WireLimits(vocab_size=10))


def _mutated_forward(mutate) -> pb.ForwardRequest:
    msg = encode(_fwd())
    mutate(msg)
    return msg


def test_rejects_inconsistent_messages():
    t2 = tensors.tensor_to_proto(torch.zeros(2))
    t111 = tensors.tensor_to_proto(torch.zeros(1, 1, 1))
    cases = [
        (_mutated_forward(lambda m: m.ClearField("hidden")), "ForwardRequest.hidden: missing"),
        (_mutated_forward(lambda m: m.hidden.CopyFrom(tensor_to_proto(torch.zeros(2, 4, 4)))), "does not match"),
        (
            _mutated_forward(lambda m: m.targets.CopyFrom(tensor_to_proto(torch.zeros(2, 2, dtype=torch.int32)))),
            "differs from tokens",
        ),
        (_mutated_forward(lambda m: setattr(m, "stage", -1)), "non-negative"),
        (pb.ForwardReply(loss=1.0, hidden=t111), "exactly one"),
        (pb.ForwardReply(grad=t111), "exactly one"),
        (pb.ForwardReply(loss=float("nan")), "not finite"),
        (pb.StateReply(tensors=[pb.NamedTensor(name="a", tensor=t2), pb.NamedTensor(name="a", tensor=t2)]), "twice"),
        (pb.StateReply(meta_json="[1, 2]"), "JSON object"),
        (pb.StateReply(meta_json="{not json"), "not valid JSON"),
        (pb.ArtifactRequest(name="../etc/passwd"), "ArtifactRequest.name"),
        (pb.ArtifactRequest(name=""), "ArtifactRequest.name"),
        (pb.PayloadRequest(sender="x" * 5000), "characters"),
    ]
    for msg, match in cases:
        with pytest.raises(TransportError, match=match):
            decode(msg)


def test_rejects_unparseable_and_oversized_bytes():
    with pytest.raises(TransportError, match="not a parseable protobuf"):
        from_bytes(pb.ForwardRequest, b"\xff\xff\xff\xff garbage")
    data = to_bytes(_fwd())
    with pytest.raises(TransportError, match="byte limit"):
        from_bytes(pb.ForwardRequest, data, WireLimits(max_message_bytes=len(data) - 1))
    assert isinstance(TransportError("x"), PeerError)


def test_encode_rejects_misuse():
    with pytest.raises(TransportError, match="integer tensor"):
        encode(ForwardRequest("p", 0, 0, 0, 1, tokens=torch.zeros(1, 2), hidden=torch.zeros(1, 2, 3)))
    with pytest.raises(TransportError, match="float tensor"):
        encode(BackwardRequest("p", 0, 0, 0, 1, grad=torch.zeros(1, 2, 3, dtype=torch.int32)))
    with pytest.raises(TransportError, match="int32"):
        encode(ForwardRequest("p", 0, 0, 0, 1, tokens=torch.tensor([[1 << 40]]), hidden=torch.zeros(1, 1, 3)))
    with pytest.raises(TransportError, match="JSON"):
        encode(StateReply(outer_step=0, meta={"x": object()}))
    with pytest.raises(ConfigError, match="fp8"):
        tensors.wire_dtype("fp8")


@pytest.mark.parametrize("wire", ["fp32", "bf16", "fp16"])
def test_encoded_size_is_serialized_length(wire):
    for msg in _all_messages() + [b"", b"\x01" * 300, {"stage": 1, "state": "ready"}]:
        assert encoded_size(msg, wire) == len(to_bytes(msg, wire))
    small, big = encoded_size(_fwd(b=4, L=16, k=32), "bf16"), encoded_size(_fwd(b=4, L=16, k=32), "fp32")
    # the halved hidden bytes, give or take a byte of varint length prefixes
    assert abs((big - small) - 4 * 16 * 32 * 2) <= 2


@pytest.mark.parametrize("n", [0, 1, 999, 1000, 1001, 3000, 3 * framing.CHUNK_BYTES + 5])
def test_framing_round_trip_and_size(n):
    chunk = 1000 if n < framing.CHUNK_BYTES else framing.CHUNK_BYTES
    data = bytes(range(256)) * (n // 256) + bytes(n % 256)
    chunks = list(framing.split(data, chunk))
    assert all(len(c.data) <= chunk for c in chunks) and [c.last for c in chunks].count(True) == 1 and chunks[-1].last
    assert framing.join(iter(chunks), max_bytes=n, what="x") == data
    assert framing.framed_size(n, chunk) == sum(c.ByteSize() for c in chunks)
    if n:
        with pytest.raises(TransportError, match="message limit"):
            framing.join(iter(chunks), max_bytes=n - 1, what="x")
        if len(chunks) > 1:
            with pytest.raises(TransportError, match="ended before its last chunk"):
                framing.join(iter(chunks[:-1]), max_bytes=n, what="x")


def test_forward_reply_must_fit_its_request():
    inter, last = _fwd(targets=False), _fwd(targets=True)
    h, g = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    codec.check_forward_reply(ForwardReply(hidden=h), inter)
    codec.check_forward_reply(ForwardReply(loss=1.0, grad=g), last)
    for reply, request, match in [
        (ForwardReply(loss=1.0, grad=g), inter, "must be answered with hidden"),
        (ForwardReply(hidden=h), last, "must be answered with the loss"),
        (ForwardReply(loss=1.0), last, "must be answered with grad"),
        (ForwardReply(hidden=torch.zeros(2, 4, 4)), inter, "does not match"),
        (ForwardReply(loss=1.0, grad=torch.zeros(2, 3, 5)), last, "differs from the sent hidden"),
    ]:
        with pytest.raises(TransportError, match=match):
            codec.check_forward_reply(reply, request)
