"""Parts: compress's error feedback band by band (same top-k positions), and the merkle tree over them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.decode import entry_values
from peer.core.sparseloco.codec.format import SPARSE, SparseLoCoConfig
from peer.core.sparseloco.ranges import encode_parts, merkle_check, merkle_proof, merkle_root, plan_ranges

CHUNK = 16
SHAPES = {
    "embed.weight": (200, 24),
    "norm.weight": (24,),
    "attn.weight": (72, 40),
    "big.weight": (320, 272),  # > 65536 entries: the fused (numba) encoder, when it is installed
    "conv": (40, 3, 5),
}


def _delta(seed: int, ties: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, s in SHAPES.items():
        t = torch.randn(s, generator=g)
        out[n] = torch.round(t * 2) / 2 if ties else t  # few distinct magnitudes: ties in every tile
    return out


def _positions(payload, chunk, topk) -> dict[str, np.ndarray]:
    """Flat positions in each whole tensor of the sent entries (band entries shifted by row0 · cols)."""
    out: dict[str, list[np.ndarray]] = {}
    for e in payload.entries:
        name, _, row0 = e.name.partition("@")
        pos, vals = entry_values(e, chunk, topk)
        pos = np.arange(len(vals)) if pos is None else pos
        cols = int(np.prod(e.shape[1:])) if len(e.shape) >= 2 else 0
        out.setdefault(name, []).append(pos + int(row0 or 0) * cols)
    return {n: np.sort(np.concatenate(p)) for n, p in out.items()}


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("R", [1, 3, 8])
def test_parts_pick_the_top_k_positions_compress_picks(R, ties):
    cfg = SparseLoCoConfig(topk=5, chunk=CHUNK, quant_bits=2, beta=0.9)
    plan = plan_ranges(SHAPES, CHUNK, R)
    errors = {n: 0.5 * t for n, t in _delta(7).items()}
    whole, _ = compress(_delta(1, ties), errors, cfg)
    parts, _ = encode_parts(_delta(1, ties), {n: t.clone() for n, t in errors.items()}, cfg, plan)
    assert len(parts) == R
    got = {}
    for p in parts:
        for n, pos in _positions(p, cfg.chunk, cfg.topk).items():
            got[n] = np.sort(np.concatenate([got.get(n, np.zeros(0, np.int64)), pos]))
    want = _positions(whole, cfg.chunk, cfg.topk)
    assert set(got) == set(want)
    for n in want:
        assert np.array_equal(got[n], want[n]), n


def test_with_float32_values_parts_are_compress_bit_for_bit_and_errors_too():
    cfg = SparseLoCoConfig(topk=5, chunk=CHUNK, quant_bits=0, beta=0.9)
    plan = plan_ranges(SHAPES, CHUNK, 4)
    errors = {n: 0.5 * t for n, t in _delta(7).items()}
    whole, e_whole = compress(_delta(2), errors, cfg)
    parts, e_parts = encode_parts(_delta(2), {n: t.clone() for n, t in errors.items()}, cfg, plan)
    dense = decompress(whole)
    for p in parts:
        for entry, band in decompress(p).items():
            name, _, row0 = entry.partition("@")
            ref = dense[name][int(row0) : int(row0) + band.shape[0]] if band.dim() >= 2 else dense[name]
            assert torch.equal(band, ref), entry
    for n in SHAPES:
        assert torch.equal(e_parts[n], e_whole[n]), n


def test_errors_are_updated_in_place_through_band_views_when_they_can_be():
    cfg = SparseLoCoConfig(topk=5, chunk=CHUNK, quant_bits=2, beta=0.9)
    plan = plan_ranges(SHAPES, CHUNK, 4)
    errors = {n: 0.5 * t for n, t in _delta(7).items()}
    ref = {n: t.clone() for n, t in errors.items()}
    parts, new = encode_parts(_delta(3), errors, cfg, plan)
    for n in SHAPES:
        assert new[n].data_ptr() == errors[n].data_ptr()  # written in place
    fresh, again = encode_parts(_delta(3), ref, cfg, plan)
    assert all(torch.equal(new[n], again[n]) for n in SHAPES)
    assert [p.to_bytes() for p in parts] == [p.to_bytes() for p in fresh]
    # a non-contiguous buffer is copied, never written; the result is the same
    strided = {n: (t.t().contiguous().t() if t.dim() == 2 else t.clone()) for n, t in errors.items()}
    before = {n: t.clone() for n, t in strided.items()}
    _, third = encode_parts(_delta(4), strided, cfg, plan)
    assert torch.equal(strided["embed.weight"], before["embed.weight"])
    assert third["embed.weight"].data_ptr() != strided["embed.weight"].data_ptr()


def test_no_errors_starts_from_delta_and_delta_is_never_written():
    cfg = SparseLoCoConfig(topk=5, chunk=CHUNK, quant_bits=0)
    plan = plan_ranges(SHAPES, CHUNK, 3)
    delta = _delta(5)
    keep = {n: t.clone() for n, t in delta.items()}
    _, e_whole = compress(delta, None, cfg)
    _, e_parts = encode_parts(delta, None, cfg, plan)
    assert all(torch.equal(delta[n], keep[n]) and torch.equal(e_parts[n], e_whole[n]) for n in SHAPES)
    with pytest.raises(ValueError, match="replan"):
        encode_parts({n: delta[n] for n in list(SHAPES)[:2]}, None, cfg, plan)


def test_parts_cost_a_few_header_bytes_more_than_the_whole_payload():
    cfg = SparseLoCoConfig(topk=5, chunk=CHUNK, quant_bits=2)
    for R in (1, 4, 16):
        parts, _ = encode_parts(_delta(6), None, cfg, plan_ranges(SHAPES, CHUNK, R))
        whole, _ = compress(_delta(6), None, cfg)
        extra = sum(p.nbytes for p in parts) - whole.nbytes
        # at most: per part a 13-byte header, per band an entry header (name@row0, shape), a codebook
        # (2 levels) and a byte of code padding
        bound = 13 * (R - 1) + sum(4 + len(e.name) + 4 * len(e.shape) + 8 + 1 for p in parts for e in p.entries)
        assert 0 < extra <= bound
        assert all(e.kind == SPARSE for p in parts for e in p.entries if len(e.shape) >= 2)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17])
def test_every_leaf_checks_against_the_root_and_nothing_else_does(n):
    leaves = [bytes([i]) * (i + 1) for i in range(n)]
    root = merkle_root(leaves)
    assert len(root) == 32
    for i in range(n):
        proof = merkle_proof(leaves, i)
        assert merkle_check(root, i, n, leaves[i], proof)
        assert not merkle_check(root, i, n, leaves[i] + b"x", proof)
        assert not merkle_check(root, (i + 1) % n, n, leaves[i], proof) or n == 1
        assert not merkle_check(root, i, n + 1, leaves[i], proof)
        assert not merkle_check(root, i, n, leaves[i], [*proof, "00" * 16])
        if proof:
            assert not merkle_check(root, i, n, leaves[i], proof[:-1])
            assert not merkle_check(root, i, n, leaves[i], ["ff" * 16, *proof[1:]])
            assert not merkle_check(root, i, n, leaves[i], ["zz", *proof[1:]])
    assert merkle_root(leaves + [b""]) != root


def test_a_leaf_can_never_pass_as_an_inner_node():
    leaves = [b"a", b"b", b"c", b"d"]
    proof = merkle_proof(leaves, 0)
    inner = bytes.fromhex(proof[1])  # the hash of (c, d) as a leaf of a 3-leaf tree's shape
    assert not merkle_check(merkle_root(leaves), 2, 3, inner, proof[:1])
    assert merkle_root([b"x"]) != merkle_root([b"x", b"x"])
