"""SparseLoCo math and payload format against plain dense references written with loops."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import (
    aggregate,
    compress,
    decompress,
    ideal_bytes_per_param,
    payload_density,
    pseudo_gradient,
)
from peer.core.sparseloco.codec.format import (
    DENSE_F32,
    DENSE_U8,
    SPARSE,
    Payload,
    PayloadError,
    SparseLoCoConfig,
    TensorEntry,
    pack_bits,
)
from peer.core.sparseloco.commit import outer_delta
from peer.errors import ConfigError, PeerError


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def ref_selected(e: torch.Tensor, chunk: int, k: int) -> set[tuple[int, int]]:
    """(row, col) of the 2-D view (shape[0], rest) chosen by per-tile top-k, with plain loops."""
    e2 = e.reshape(e.shape[0], -1) if e.dim() >= 2 else None
    chosen = set()
    if e2 is None:  # 1-D: flat chunks of chunk² entries
        flat, cc = e.reshape(-1), chunk * chunk
        for start in range(0, flat.numel(), cc):
            part = flat[start : start + cc].abs()
            order = torch.argsort(part, descending=True)[:k]
            chosen |= {(0, start + int(i)) for i in order}
        return chosen
    rows, cols = e2.shape
    for r0 in range(0, rows, chunk):
        for c0 in range(0, cols, chunk):
            tile = e2[r0 : r0 + chunk, c0 : c0 + chunk]
            order = torch.argsort(tile.abs().reshape(-1), descending=True)[:k]
            width = tile.shape[1]
            chosen |= {(r0 + int(i) // width, c0 + int(i) % width) for i in order}
    return chosen


def _nonzero_set(t: torch.Tensor) -> set[tuple[int, int]]:
    t2 = t.reshape(1, -1) if t.dim() <= 1 else t.reshape(t.shape[0], -1)
    return {(int(r), int(c)) for r, c in torch.nonzero(t2).tolist()}


@pytest.mark.parametrize("shape", [(128, 192), (70, 130), (3, 40, 50), (5000,), (10,), (64, 1)])
def test_topk_matches_reference_and_exact_values_without_quantization(shape):
    cfg = SparseLoCoConfig(quant_bits=0, dense_1d=False)
    delta = {"w": _rand(*shape, seed=1)}
    payload, errors = compress(delta, None, cfg)
    sent = decompress(Payload.from_bytes(payload.to_bytes()))["w"]
    assert sent.shape == delta["w"].shape and sent.dtype == torch.float32
    want = ref_selected(delta["w"], cfg.chunk, cfg.topk)
    assert _nonzero_set(sent) == want
    mask = sent != 0
    assert torch.equal(sent[mask], delta["w"][mask])  # quant_bits=0: the selected values exactly
    assert torch.equal(errors["w"] + sent, delta["w"])
    assert torch.all(errors["w"][mask] == 0)


def test_padding_is_never_selected_and_small_edge_chunks_send_everything():
    cfg = SparseLoCoConfig(quant_bits=0)
    e = _rand(70, 130, seed=2)
    payload, _ = compress({"w": e}, None, cfg)
    sent = decompress(payload)["w"]
    # tiles: rows [0,64) [64,70); cols [0,64) [64,128) [128,130) -> real sizes 4096,4096,128,384,384,12
    assert int((sent != 0).sum()) == 32 + 32 + 32 + 32 + 32 + 12
    assert torch.equal(sent[64:, 128:], e[64:, 128:])  # the 6×2 corner tile is sent whole
    entry = payload.entries[0]
    assert entry.kind == SPARSE and len(entry.indices) == 172
    # huge padded entries can't be picked: even a zero tensor selects only real positions
    payload0, _ = compress({"w": torch.zeros(70, 130)}, None, cfg)
    assert len(payload0.entries[0].indices) == 172
    Payload.from_bytes(payload0.to_bytes())  # indices all validated to lie inside the tensor


@pytest.mark.parametrize("bits", [0, 2, 4, 8])
def test_error_feedback_keeps_what_was_not_sent(bits):
    cfg = SparseLoCoConfig(quant_bits=bits)
    shapes = {"a": (96, 200), "b": (64, 64), "n": (50,)}
    errors = None
    ref_e = {k: torch.zeros(s) for k, s in shapes.items()}
    for step in range(3):
        delta = {k: _rand(*s, seed=10 * step + i) * (i + 1) for i, (k, s) in enumerate(shapes.items())}
        payload, errors = compress(delta, errors, cfg)
        sent = decompress(Payload.from_bytes(payload.to_bytes()))
        for k in shapes:
            acc = ref_e[k] * cfg.beta + delta[k]  # e = β·e + Δ, float32 like the module
            assert torch.equal(errors[k], acc - sent[k])  # e_new = e − Δ̂ with Δ̂ as decoded
            unsent = sent[k] == 0
            assert torch.equal(errors[k][unsent], acc[unsent])
            # nothing is lost: e_new + Δ̂ reproduces e (exactly where rounding cannot occur)
            err = (errors[k].double() + sent[k].double() - acc.double()).abs()
            assert torch.all(err <= acc.abs().double() * 2**-23)
            if bits == 0:
                assert torch.equal(errors[k] + sent[k], acc)
            ref_e[k] = errors[k]


def test_quantizer_codebook_holds_bin_means():
    """v3 codes: sign bit (bit 1 at 2 bits) + magnitude bin; the codebook holds each bin's mean |v|."""
    cfg = SparseLoCoConfig(quant_bits=2, topk=64)
    e = _rand(64, 128, seed=3)
    payload, _ = compress({"w": e}, None, cfg)
    entry = payload.entries[0]
    sent = decompress(payload)["w"]
    vals = e[sent != 0]
    codes = torch.from_numpy(entry.codes.astype(np.int64))
    assert sorted(set(codes.tolist())) == [0, 1, 2, 3]
    assert len(entry.codebook) == 2
    for b in range(2):
        members = e[(sent.abs() == float(entry.codebook[b])) & (sent != 0)]
        assert members.numel() == int(((codes & 1) == b).sum()) > 0
        assert math.isclose(float(entry.codebook[b]), float(members.double().abs().mean()), rel_tol=1e-6)
        assert members.abs().max() - members.abs().min() < entry.codebook[1]
    # magnitude bins are ordered: each bin's |v| lie between its neighbours'
    assert np.all(np.diff(entry.codebook) > 0)
    assert torch.equal(torch.sign(sent[sent != 0]), torch.sign(vals))  # no value changes sign
    assert vals.numel() == 2 * 64


def test_quantizer_with_fewer_values_than_bins_is_finite():
    cfg = SparseLoCoConfig(quant_bits=8, topk=2, dense_1d=False)
    payload, errors = compress({"w": torch.tensor([3.0, -1.0, 0.5])}, None, cfg)
    entry = payload.entries[0]
    assert np.all(np.isfinite(entry.codebook))
    sent = decompress(Payload.from_bytes(payload.to_bytes()))["w"]
    assert torch.equal(sent, torch.tensor([3.0, -1.0, 0.0]))  # one value per occupied bin
    assert torch.equal(errors["w"], torch.tensor([0.0, 0.0, 0.5]))


def test_dense_1d_path():
    g = _rand(300, seed=4)
    payload, errors = compress({"g": g}, None, SparseLoCoConfig())
    entry = payload.entries[0]
    assert entry.kind == DENSE_U8
    sent = decompress(Payload.from_bytes(payload.to_bytes()))["g"]
    step = float(entry.codebook[1])
    assert step == pytest.approx((float(g.max()) - float(g.min())) / 255, rel=1e-6)
    assert torch.all((sent - g).abs() <= step * 0.5 + 1e-6)
    assert torch.equal(errors["g"], g - sent)
    payload0, errors0 = compress({"g": g}, None, SparseLoCoConfig(quant_bits=0))
    assert payload0.entries[0].kind == DENSE_F32
    assert torch.equal(decompress(payload0)["g"], g) and torch.all(errors0["g"] == 0)
    const, _ = compress({"g": torch.full((8,), 0.25)}, None, SparseLoCoConfig())
    assert torch.equal(decompress(const)["g"], torch.full((8,), 0.25))


def _sample_payload(bits=2) -> bytes:
    delta = {
        "layers.0.attn.wq.weight": _rand(70, 130, seed=5),
        "layers.0.attn_norm.weight": _rand(20, seed=6),
        "layers.0.ffn.w1.weight": _rand(2, 3, 40, seed=7),
    }
    return compress(delta, None, SparseLoCoConfig(quant_bits=bits))[0].to_bytes()


@pytest.mark.parametrize("bits", [0, 2, 4, 8])
def test_serialization_round_trip_is_byte_exact_and_deterministic(bits):
    b = _sample_payload(bits)
    assert b == _sample_payload(bits)
    p = Payload.from_bytes(b)
    assert p.to_bytes() == b and p.nbytes == len(b)
    assert Payload(p.entries, p.chunk, p.topk, p.quant_bits).to_bytes() == b  # re-encoded
    assert p.names() == ["layers.0.attn.wq.weight", "layers.0.attn_norm.weight", "layers.0.ffn.w1.weight"]
    assert b[:4] == b"SLCO"
    d = decompress(p)
    assert d["layers.0.ffn.w1.weight"].shape == (2, 3, 40)


def test_twelve_bit_indices_pack_two_per_three_bytes():
    cfg = SparseLoCoConfig(quant_bits=0)
    payload, _ = compress({"w": _rand(64, 64, seed=8)}, None, cfg)
    idx = payload.entries[0].indices
    body = pack_bits(idx, 12)  # the fixed-width index layout (wire format for topk > 64)
    a0, a1 = int(idx[0]), int(idx[1])
    assert body[:3] == bytes([a0 & 0xFF, (a0 >> 8) | ((a1 & 0xF) << 4), a1 >> 4])


def test_bytes_per_param_at_defaults():
    cfg = SparseLoCoConfig()
    delta = {f"layers.{i}.{n}.weight": _rand(256, 4096, seed=i) for i, n in enumerate(["ffn.w1", "attn.wq"])}
    delta["layers.0.attn_norm.weight"] = _rand(256, seed=9)
    payload, _ = compress(delta, None, cfg)
    n_params = sum(t.numel() for t in delta.values())
    bpp = len(payload.to_bytes()) / n_params
    assert bpp <= 0.014 and bpp <= 0.0105  # enumerative indices: 34 bytes per 32 of 4096, not 48
    assert bpp == pytest.approx(ideal_bytes_per_param(cfg), rel=0.02)
    assert payload_density(cfg) == 32 / 4096
    assert ideal_bytes_per_param(cfg) == pytest.approx((34 + 8) / 4096)  # was 0.013671875 with 12-bit indices


def test_aggregation_rules_on_hand_examples():
    a = {"w": torch.tensor([1.0, 0.0, 2.0, 0.0])}
    b = {"w": torch.tensor([3.0, 4.0, 0.0, 0.0])}
    assert torch.equal(aggregate([a, b], 2, "mean-over-all")["w"], torch.tensor([2.0, 2.0, 1.0, 0.0]))
    # a third participant whose payload is missing counts as zero for mean-over-all
    assert torch.equal(aggregate([a, b], 4, "mean-over-all")["w"], torch.tensor([1.0, 1.0, 0.5, 0.0]))
    got = aggregate([a, b], 4, "mean-over-contributors")["w"]
    assert torch.equal(got, torch.tensor([2.0, 4.0, 2.0, 0.0]))
    with pytest.raises(ConfigError):
        aggregate([a], 1, "median")
    with pytest.raises(PayloadError):
        aggregate([a, {"w": torch.zeros(3)}], 2)


def test_outer_step_and_pseudo_gradient():
    start = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0])}
    now = {"w": torch.tensor([0.5, 2.5]), "b": torch.tensor([4.0])}
    delta = pseudo_gradient(start, now)
    assert torch.equal(delta["w"], torch.tensor([0.5, -0.5]))
    assert torch.equal(outer_delta(torch.tensor([0.5, -0.5]), 2.0), torch.tensor([-1.0, 1.0]))


def test_config_validation():
    for bad in [
        dict(quant_bits=3),
        dict(topk=0),
        dict(topk=4097),
        dict(chunk=65),
        dict(aggregation="sum"),
        dict(beta=1.0),
        dict(outer_lr=0.0),
    ]:
        with pytest.raises(ConfigError):
            SparseLoCoConfig(**bad)


def _reencode(p: Payload, **changes) -> bytes:
    e = p.entries[0]
    fields = dict(
        name=e.name, kind=e.kind, shape=e.shape, indices=e.indices, codes=e.codes, values=e.values, codebook=e.codebook
    )
    fields.update(changes)
    return Payload((TensorEntry(**fields),) + p.entries[1:], p.chunk, p.topk, p.quant_bits).to_bytes()


def _sample_payload_wide(bits=2) -> bytes:
    """topk > 64: fixed-width indices, where duplicate or outside indices can be written at all."""
    delta = {"layers.0.attn.wq.weight": _rand(70, 130, seed=5), "layers.0.attn_norm.weight": _rand(20, seed=6)}
    return compress(delta, None, SparseLoCoConfig(quant_bits=bits, topk=100))[0].to_bytes()


def test_from_bytes_rejects_each_kind_of_bad_input():
    b = _sample_payload()
    p = Payload.from_bytes(b)
    wide = Payload.from_bytes(_sample_payload_wide())
    idx = wide.entries[0].indices.copy()
    dup = idx.copy()
    dup[1] = dup[0]
    into_padding = idx.copy()
    into_padding[-1] = 4095  # the last chunk is the 6×2 corner tile: local 4095 is padding
    bad_cb = p.entries[0].codebook.copy()
    bad_cb[1] = np.nan
    negative_cb = p.entries[0].codebook.copy()
    negative_cb[0] = -negative_cb[0]
    cases = {
        "magic": b"XXXX" + b[4:],
        "version": b[:4] + bytes([9]) + b[5:],
        "truncated": b[:-1],
        "trailing": b + b"\0",
        "duplicate": _reencode(wide, indices=dup),
        "outside": _reencode(wide, indices=into_padding),
        "rank out of range": _with_rank_bytes(b, 0xFF),
        "non-finite": _reencode(p, codebook=bad_cb),
        "negative magnitude": _reencode(p, codebook=negative_cb),
        "bad name": _reencode(p, name="a\nb"),
        "not bytes": "SLCO",
    }
    for data in cases.values():
        with pytest.raises(PayloadError):
            Payload.from_bytes(data)
    with pytest.raises(PayloadError, match="exceeds"):
        Payload.from_bytes(b, max_bytes=len(b) - 1)
    with pytest.raises(PayloadError, match="elements"):
        Payload.from_bytes(b, max_elements=1000)
    with pytest.raises(PayloadError, match="differ"):
        Payload.from_bytes(b, cfg=SparseLoCoConfig(topk=16))
    with pytest.raises(PayloadError, match="reads version 3"):
        Payload.from_bytes(b[:4] + bytes([1]) + b[5:])  # an older version names the readable ones
    absurd = (
        struct.pack("<4sBBBHI", b"SLCO", 3, 2, 64, 32, 1)
        + struct.pack("<H", 1)
        + b"w"
        + struct.pack("<BB2I", SPARSE, 2, 2**32 - 1, 2**32 - 1)
    )
    with pytest.raises(PayloadError):
        Payload.from_bytes(absurd)
    assert issubclass(PayloadError, PeerError)


def _with_rank_bytes(b: bytes, fill: int) -> bytes:
    """`_sample_payload()` with the first chunk's 34 rank bytes (after the codebook) set to `fill`."""
    p = Payload.from_bytes(b)
    e = p.entries[0]
    start = 13 + 2 + len(e.name) + 2 + 4 * len(e.shape) + 4 * 2  # header, entry header, codebook
    return b[:start] + bytes([fill]) * 34 + b[start + 34 :]


def test_fuzz_random_and_mutated_bytes_raise_only_payload_error():
    rng = random.Random(0)
    seeds = [_sample_payload(bits) for bits in (0, 2, 8)] + [_sample_payload_wide()]
    accepted = 0
    for i in range(2000):
        base = bytearray(seeds[i % len(seeds)])
        mode = i % 4
        if mode == 0:
            data = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 64)))
            if i % 8 == 0:
                data = base[:13] + data
        elif mode == 1:
            data = bytes(base[: rng.randrange(0, len(base))])
        elif mode == 2:
            for _ in range(rng.randrange(1, 4)):
                base[rng.randrange(len(base))] = rng.getrandbits(8)
            data = bytes(base)
        else:
            pos = rng.randrange(len(base))
            data = bytes(
                base[:pos]
                + bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 9)))
                + base[pos + rng.randrange(0, 9) :]
            )
        try:
            p = Payload.from_bytes(data)
        except PayloadError:
            continue
        accepted += 1
        assert p.to_bytes() == data  # whatever is accepted is canonical
        decompress(p)
    assert accepted < 2000


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("shape", [(128, 64), (70, 130), (5,)])
def test_non_finite_pseudo_gradient_is_refused(bad, shape):
    d = _rand(*shape, seed=13) * 1e3
    d.view(-1)[d.numel() // 2 + 1] = bad  # a non-finite entry anywhere must be caught
    for dense_1d in (True, False):
        with pytest.raises(PayloadError, match="not finite"):
            compress({"w": d}, None, SparseLoCoConfig(dense_1d=dense_1d))


@pytest.mark.parametrize("bits", [0, 2, 4, 8])
@pytest.mark.parametrize("dense_1d", [True, False])
def test_payload_nbytes_equals_serialized_size(bits, dense_1d):
    """`peer plan` counts payload bytes with payload_nbytes; it must equal the real wire size."""
    from peer.core.sparseloco.codec.format import payload_nbytes

    cfg = SparseLoCoConfig(quant_bits=bits, dense_1d=dense_1d)
    g = torch.Generator().manual_seed(bits)
    shapes = {"a.weight": (70, 130), "b.weight": (128, 64), "norm.weight": (100,), "c": (3, 5, 7)}
    delta = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    payload, _ = compress(delta, None, cfg)
    assert payload_nbytes(shapes, cfg) == len(payload.to_bytes())
