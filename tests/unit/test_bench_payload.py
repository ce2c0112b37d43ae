"""`peer bench payload`'s codec figures, its templar-style baseline (sizes and decoded values) and the
`--templar-src` adapter's checks."""

from __future__ import annotations

import os

import pytest
import torch

from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.errors import ConfigError
from peer.research.bench.common import baselines_for, codec_figures
from peer.research.simulate import templar_baseline as tb
from peer.research.simulate import templar_real


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_templar_chunks_are_the_largest_divisor_up_to_64():
    assert [tb.largest_divisor(n, 64) for n in (1024, 2688, 688, 256, 97, 1)] == [64, 64, 43, 64, 1, 1]


def test_templar_baseline_sends_the_top_k_of_each_tile_with_12_bit_indices_and_8_bit_values():
    x = _rand(128, 192, seed=1)
    wire, idx_shape = tb.encode(x)
    assert idx_shape == (2, 3, 32)
    assert len(wire) == 192 * 3 // 2 + 192 + 4 * 256 + 8  # 12-bit indices, uint8 codes, lookup, shift/scale
    y = tb.decode(wire, idx_shape, (128, 192))
    for r in range(2):
        for c in range(3):
            tile, got = x[64 * r : 64 * r + 64, 64 * c : 64 * c + 64], y[64 * r : 64 * r + 64, 64 * c : 64 * c + 64]
            want = set(torch.topk(tile.abs().reshape(-1), 32).indices.tolist())
            assert set(torch.nonzero(got.reshape(-1)).reshape(-1).tolist()) == want
            sel = got != 0
            assert torch.all(torch.sign(got[sel]) == torch.sign(tile[sel]))
            assert torch.allclose(got[sel], tile[sel], rtol=0.1, atol=0.05)  # 8-bit values over ±3σ
    assert torch.equal(tb.unpack12(tb.pack12(torch.tensor([1, 4095, 2048, 7])), 4), torch.tensor([1, 4095, 2048, 7]))
    ragged = tb.encode(_rand(688, 256, seed=2))[1]  # 43×64 tiles, as templar chunks a 688-row matrix
    assert ragged == (16, 4, 32)
    assert tb.decode(*tb.encode(_rand(100, seed=3)), (100,)).count_nonzero() == 2 * 32  # 2 runs of 50


def test_codec_figures_report_sizes_times_memory_and_the_baseline():
    delta = {"a.weight": _rand(128, 192, seed=4), "b.weight": _rand(64, 70, seed=5), "n.weight": _rand(64, seed=6)}
    r = codec_figures(delta, SparseLoCoConfig(), repeats=1, n_aggregate=2)
    assert 8 < r["bits_per_index"] < 12 and r["bits_per_value"] == 2
    assert r["header_bytes"] == 13 + sum(6 + len(n) + 4 * len(t.shape) for n, t in delta.items())
    assert r["bytes_per_param"] == r["payload_bytes"] / sum(t.numel() for t in delta.values())
    assert r["roundtrip_s"] == r["encode_s"] + r["decode_s"] > 0
    assert r["encode_first_round_s"] > 0  # round 1 (fresh buffers); encode_s: rounds 2+, buffers reused
    assert r["templar_roundtrip_s"] == r["templar_encode_s"] + r["templar_decode_s"] > 0
    assert r["speedup_vs_templar"] == r["templar_roundtrip_s"] / r["roundtrip_s"]
    assert r["templar_bytes_per_param"] > r["bytes_per_param"]
    assert r["aggregate_m"] == 2 and r["aggregate_s"] > 0 and r["aggregate_peak_bytes"] >= 0


def test_the_default_baseline_is_still_the_re_implementation(tmp_path):
    assert baselines_for(None) == {"templar": tb.roundtrip}
    x = _rand(128, 192, seed=7)
    wire, idx_shape = tb.encode(x)
    assert len(wire) == 192 * 3 // 2 + 192 + 4 * 256 + 8 and idx_shape == (2, 3, 32)
    r = codec_figures({"a.weight": x}, SparseLoCoConfig(), repeats=1, n_aggregate=2)
    assert "templar_real_roundtrip_s" not in r and r["speedup_vs_templar"] > 0


def test_templar_src_without_tplr_compress_is_a_clear_config_error(tmp_path):
    (tmp_path / "tplr").mkdir()  # a tplr/ package without compress.py
    for bad in (tmp_path, tmp_path / "missing"):
        with pytest.raises(ConfigError, match=r"no tplr/compress\.py"):
            templar_real.load(bad)
        with pytest.raises(ConfigError, match=r"no tplr/compress\.py"):
            baselines_for(str(bad))


def test_templar_src_finds_the_codec_in_a_checkout_or_its_src(tmp_path):
    (tmp_path / "src" / "tplr").mkdir(parents=True)
    (tmp_path / "src" / "tplr" / "compress.py").write_text("")
    assert templar_real.find_root(tmp_path) == tmp_path / "src"
    assert templar_real.find_root(tmp_path / "src") == tmp_path / "src"


@pytest.mark.skipif(not os.environ.get("PEER_TEMPLAR_SRC"), reason="PEER_TEMPLAR_SRC names no templar checkout")
def test_real_templar_round_trip_keeps_the_top_k_of_each_tile():
    real = templar_real.RealTemplar(os.environ["PEER_TEMPLAR_SRC"])
    delta = {"a.weight": _rand(128, 192, seed=8), "n.weight": _rand(100, seed=9)}
    r = real.roundtrip(delta)
    assert r["encode_s"] > 0 and r["decode_s"] > 0
    assert r["bytes_per_param"] == pytest.approx(tb.roundtrip(delta)["bytes_per_param"])  # the same sizes
    figs = codec_figures(delta, SparseLoCoConfig(), repeats=1, n_aggregate=2, baselines=baselines_for(real.src_dir))
    assert figs["speedup_vs_templar_real"] == figs["templar_real_roundtrip_s"] / figs["roundtrip_s"]
