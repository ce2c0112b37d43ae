"""A tensor encoded in bands of tile rows (peer.core.sparseloco.codec.bands), one per rank, gives the
whole tensor's bytes: the entry `encode_tensor` makes, and the rows of its new error buffer, at 1–4
ranks, on the fused kernels and on the torch path, quantized and not, with ties and empty bands; and a
whole entry's rows (`entry_rows`) decode to those rows of its Δ̂."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.codec.bands import band_rows, banded, entry_rows, join, select, sent_parts, settle
from peer.core.sparseloco.codec.encode import encode_tensor
from peer.core.sparseloco.codec.format import Payload, PayloadError, SparseLoCoConfig
from tests.unit.test_payload_fused import _path

SHAPES = {
    "tiles": (256, 192),  # four tile rows of 64×64 tiles
    "ragged": (200, 130),  # a last tile row of 8 rows, edge tiles of 2 columns
    "deep": (130, 3, 50),  # viewed as (130, 150): three tile rows
    "one_row": (64, 96),  # one tile row: ranks past it hold empty bands
}


def _tensor(shape: tuple[int, ...], seed: int, ties: bool = False) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return torch.round(x * 2) / 2 if ties else x  # few distinct magnitudes: tied top-k in most tiles


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.int32).numpy().tobytes()


def _banded(name, d, prev, cfg, ranks):
    """(entry bytes, new error buffer) of `d` encoded in `ranks` bands, as the sharded replica does."""
    cuts = band_rows(d.shape, cfg.chunk, ranks)
    bands = [
        select(name, d[a:b].contiguous(), None if prev is None else prev[a:b].clone(), cfg, in_place=True)
        for a, b in cuts
    ]
    wires = [band.wire() for band in bands]
    entry, sent = join(name, d.shape, wires, cfg)
    errors = [settle(band, part, cfg) for band, part in zip(bands, sent_parts(wires, sent), strict=True)]
    return Payload([entry], cfg.chunk, cfg.topk, cfg.quant_bits).to_bytes(), torch.cat(errors).view(d.shape)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("quant_bits", [2, 0])
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_bands_give_the_whole_tensors_bytes(name, quant_bits, fused):
    cfg = dataclasses.replace(SparseLoCoConfig(), quant_bits=quant_bits)
    shape = SHAPES[name]
    for seed, ties, with_prev in [(0, False, True), (1, True, True), (2, False, False)]:
        d = _tensor(shape, seed, ties)
        prev = _tensor(shape, seed + 100, ties) * 0.5 if with_prev else None
        with _path(fused):
            whole, e_whole = encode_tensor(name, d, None if prev is None else prev.clone(), cfg)
            want = Payload([whole], cfg.chunk, cfg.topk, cfg.quant_bits).to_bytes()
            for ranks in (1, 2, 3, 4):
                got, e_got = _banded(name, d, prev, cfg, ranks)
                assert got == want, (name, seed, ranks)
                assert _bits(e_got) == _bits(e_whole), (name, seed, ranks)


def test_band_rows_are_whole_tile_rows_that_cover_dim_0_once():
    for rows in (1, 63, 64, 65, 200, 1000):
        for ranks in (1, 2, 3, 4, 7):
            cuts = band_rows((rows, 8), 64, ranks)
            assert cuts[0][0] == 0 and cuts[-1][1] == rows
            assert all(a == b_prev for (_, b_prev), (a, _) in zip(cuts, cuts[1:], strict=False))
            assert all(a % 64 == 0 and (b % 64 == 0 or b == rows) for a, b in cuts)
            sizes = [-(-b // 64) - a // 64 for a, b in cuts]
            assert max(sizes) - min(sizes) <= 1  # tile rows differ by at most one between ranks
    assert banded((4, 4)) and banded((2, 3, 4)) and not banded((16,)) and not banded(())


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_band_is_refused_where_it_is_selected(fused):
    """The rank whose rows diverged says so (the message `encode_tensor` gives); the others select."""
    cfg = SparseLoCoConfig()
    d = _tensor((128, 64), 0)
    d[70, 3] = float("nan")
    (a0, b0), (a1, b1) = band_rows(d.shape, cfg.chunk, 2)
    with _path(fused):
        assert np.isfinite(select("w", d[a0:b0].contiguous(), None, cfg).values).all()
        with pytest.raises(PayloadError, match="'w' is not finite"):
            select("w", d[a1:b1].contiguous(), None, cfg)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("quant_bits", [2, 0])
def test_an_entrys_rows_decode_to_those_rows_of_the_whole(quant_bits, fused):
    """What a rank takes (or serves) of a payload for its band decodes to exactly the band's rows."""
    cfg = dataclasses.replace(SparseLoCoConfig(), quant_bits=quant_bits)
    for name in sorted(SHAPES):
        d = _tensor(SHAPES[name], 3)
        with _path(fused):
            entry, _ = encode_tensor(name, d, None, cfg)
        payload = Payload([entry], cfg.chunk, cfg.topk, cfg.quant_bits)
        whole = decompress(Payload.from_bytes(payload.to_bytes()))[name]
        for ranks in (1, 2, 3):
            for a, b in band_rows(d.shape, cfg.chunk, ranks):
                cut = entry_rows(entry, a, b, cfg.chunk, cfg.topk)
                back = decompress(Payload.from_bytes(Payload([cut], cfg.chunk, cfg.topk, quant_bits).to_bytes()))
                assert _bits(back[name]) == _bits(whole[a:b]), (name, ranks, a, b)
    with pytest.raises(ValueError, match="not whole tile rows"):
        entry_rows(entry, 1, 64, cfg.chunk, cfg.topk)
