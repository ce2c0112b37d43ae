"""The fused whole-tensor kernels (peer.core.sparseloco.codec.fused) give the numpy/torch path's bits: encode
(error feedback, top-k with ties, ranks), decode, positions and fused aggregation, split over threads."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import aggregate_payloads, clip_and_aggregate, compress, decompress
from peer.core.sparseloco.codec import fused as pf
from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.decode import entry_values
from peer.core.sparseloco.codec.encode import LLOYD_ROUNDS, quantize
from peer.core.sparseloco.codec.format import Payload, PayloadError, SparseLoCoConfig, index_nbytes
from peer.core.sparseloco.codec.index import layout

pytest.importorskip("numba")

SHAPES = {
    "full": (128, 192),  # 64×64 tiles only
    "ragged": (70, 130),  # edge tiles of 6 rows, 2 columns, and a 6×2 corner sent whole
    "deep": (3, 40, 50),  # viewed as (3, 2000): one band of partial-height tiles
    "flat": (9000,),  # 1-D: chunk²-wide tiles (with dense_1d=False)
    "thin": (200, 1),
}


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@contextmanager
def _threads(n: int) -> Iterator[None]:
    """torch's thread count, which sizes the kernels' pool (the suite runs on 1: conftest.py)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextmanager
def _path(fused: bool) -> Iterator[None]:
    """Run with the fused kernels on every tensor, split over the thread pool of 3 (fused), or without numba."""
    saved = pk.NUMBA_MIN_WORK, pf.MIN_SPLIT_WORK
    pk.NUMBA_MIN_WORK, pf.MIN_SPLIT_WORK = 0, 0
    pk.set_numba(fused)
    try:
        with _threads(3):
            yield
    finally:
        pk.set_numba(True)
        pk.NUMBA_MIN_WORK, pf.MIN_SPLIT_WORK = saved


def _delta(seed: int) -> dict[str, torch.Tensor]:
    out = {name: _rand(*shape, seed=seed + i) * (i + 1) for i, (name, shape) in enumerate(SHAPES.items())}
    out["ties"] = torch.round(_rand(90, 140, seed=seed + 9) * 2) / 2  # many tiles tied at their k-th
    # Adam-like: most magnitudes equal, a few larger (every entry reaches the tiles' threshold)
    g = torch.Generator().manual_seed(seed + 11)
    few = (torch.rand(130, 128, generator=g) < 0.003).float()
    out["levels"] = torch.sign(_rand(130, 128, seed=seed + 10)) * (1 + few * torch.rand(130, 128, generator=g))
    out["zeros"] = torch.zeros(64, 70)
    return out


def _bits(d: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: t.contiguous().numpy().tobytes() for name, t in d.items()}


@pytest.mark.parametrize("bits", [0, 2, 8])
def test_fused_encode_gives_the_same_payload_and_errors_over_rounds(bits):
    cfg = SparseLoCoConfig(quant_bits=bits, dense_1d=False)
    runs = {}
    for fused in (True, False):
        with _path(fused):
            errors, wires = None, []
            for step in range(3):  # with error feedback: e = β·e + Δ in float32, as torch computes it
                payload, errors = compress(_delta(10 * step), errors, cfg)
                wires.append(payload.to_bytes())
            runs[fused] = wires, _bits(errors)
    assert runs[True] == runs[False]


def test_fused_encode_error_buffer_matches_torch_on_a_large_tensor():
    d, prev = _rand(640, 512, seed=1), _rand(640, 512, seed=2)
    cfg = SparseLoCoConfig()
    with _path(True):
        payload, errors = compress({"w": d}, {"w": prev}, cfg)
    sent = decompress(payload)["w"]
    e = prev * cfg.beta + d  # the reference: float32, β·e rounded first
    assert torch.equal(errors["w"], e - sent)
    assert torch.equal(errors["w"][sent == 0], e[sent == 0])


@pytest.mark.parametrize("fused", [True, False])
def test_non_finite_entries_are_refused_on_both_paths(fused):
    for bad in (float("nan"), float("inf")):
        d = _rand(130, 70, seed=3)
        d[129, 69] = bad
        with _path(fused), pytest.raises(PayloadError, match="not finite"):
            compress({"w": d}, None, SparseLoCoConfig())


def test_fused_decode_positions_and_aggregation_equal_the_numpy_path():
    cfg = SparseLoCoConfig(dense_1d=False)
    payloads = [compress(_delta(7 * i), None, cfg)[0] for i in range(3)]
    wires = [p.to_bytes() for p in payloads]
    got = {}
    for fused in (True, False):
        with _path(fused):
            parsed = [Payload.from_bytes(w) for w in wires]
            assert [p.to_bytes() for p in parsed] == wires
            positions = [entry_values(e, p.chunk, p.topk)[0] for p in parsed for e in p.entries]
            got[fused] = (
                [_bits(decompress(p)) for p in parsed],
                [None if x is None else x.tobytes() for x in positions],
                _bits(aggregate_payloads(parsed, 4, "mean-over-all", [None, 0.5, 0.0])),
                _bits(aggregate_payloads(parsed, 3, "mean-over-contributors", [None, 0.25, None])),
                _bits(clip_and_aggregate(parsed, 1.1)[0]),
                [e.indices.tobytes() for p in parsed for e in p.entries],
            )
    assert got[True] == got[False]


def test_a_rank_is_valid_exactly_below_the_binomial():
    """The parse-time check (no unranking) accepts C(n, k) − 1 and refuses C(n, k), per tile class."""
    cfg = SparseLoCoConfig()
    payload, _ = compress({"w": _rand(64, 70, seed=4)}, None, cfg)  # tiles of 4096 and of 64·6 entries
    wire = payload.to_bytes()
    e = payload.entries[0]
    start = 13 + 2 + len(e.name) + 2 + 4 * len(e.shape) + 4 * 2  # header, entry header, codebook
    assert index_nbytes(e.shape, 64, 32) == 34 + 20
    for tile, n, nb in ((0, 4096, 34), (1, 384, 20)):
        at = start + (34 if tile else 0)
        top = math.comb(n, 32)
        ok = wire[:at] + (top - 1).to_bytes(nb, "little") + wire[at + nb :]
        dense = decompress(Payload.from_bytes(ok))["w"]
        cols = slice(0, 64) if tile == 0 else slice(64, 70)
        assert int((dense[:, cols] != 0).sum()) == 32  # the last subset is a valid one
        with pytest.raises(PayloadError, match="out of range"):
            Payload.from_bytes(wire[:at] + top.to_bytes(nb, "little") + wire[at + nb :])


def test_thread_split_does_not_change_the_result():
    cfg = SparseLoCoConfig()
    d = {"w": _rand(640, 256, seed=5)}
    with _path(True):
        split = compress(d, None, cfg)
        pf.MIN_SPLIT_WORK = 1 << 60  # one range on the calling thread
        whole = compress(d, None, cfg)
    assert split[0].to_bytes() == whole[0].to_bytes()
    assert torch.equal(split[1]["w"], whole[1]["w"])
    ranges: list[tuple[int, int]] = []
    pf.MIN_SPLIT_WORK, saved = 0, pf.MIN_SPLIT_WORK
    try:
        with _threads(3):
            assert pf.n_workers() == 3  # the pool follows torch's thread count
            pf.run_split(lambda b0, b1: ranges.append((b0, b1)), 7, 10**9)
        assert pf.n_workers() == torch.get_num_threads()
    finally:
        pf.MIN_SPLIT_WORK = saved
    assert sorted(ranges)[0][0] == 0 and sorted(ranges)[-1][1] == 7
    assert sum(b - a for a, b in ranges) == 7 and len(ranges) > 1


@pytest.mark.parametrize("fused", [True, False])
def test_in_place_encode_gives_the_same_bits_into_the_old_buffers(fused):
    cfg = SparseLoCoConfig(dense_1d=False)
    with _path(fused):
        _, errors = compress(_delta(1), None, cfg)
        kept = {name: e.clone() for name, e in errors.items()}
        payload, fresh = compress(_delta(2), errors, cfg)
        assert _bits(errors) == _bits(kept)  # not in place: the inputs are left alone
        again, reused = compress(_delta(2), errors, cfg, in_place=True)
    assert again.to_bytes() == payload.to_bytes()
    assert _bits(reused) == _bits(fresh)
    assert all(reused[name].data_ptr() == errors[name].data_ptr() for name in errors)  # written into them


def test_encode_kernel_ranks_candidates_by_counting_or_by_insertion_alike(monkeypatch):
    """A tile's k-th and (k+1)-th largest candidates come from its few smallest candidates (up to
    MAX_LOW beyond the k-th), else from ranks by counting (up to MAX_COUNTED candidates), else by
    insertion; all three give the same selection, ties, ranks, values and error buffer."""
    numba = pytest.importorskip("numba")
    with _path(True):
        smallest = pk.compiled(1).encode
    monkeypatch.setattr(pf, "MAX_LOW", -1)  # read when the copies below compile
    counting = numba.njit(nogil=True)(pf._encode_jit)
    monkeypatch.setattr(pf, "MAX_COUNTED", 0)
    insertion = numba.njit(nogil=True)(pf._encode_jit)
    table = pk.binomial_table(4096, 32)
    for name, x in _delta(3).items():
        if x.dim() < 2:
            continue
        lay = layout(tuple(x.shape), 64, 32)
        runs = []
        for kernel in (smallest, counting, insertion):
            e = torch.empty_like(x).reshape(-1).numpy()
            arrays = (
                np.zeros((lay.n_chunks, lay.k), np.int64),
                np.zeros(lay.n_chunks, np.bool_),
                np.zeros(lay.n_chunks, np.bool_),
                np.zeros(int(lay.off[-1]), np.uint8),
                lay.sel,
                np.zeros(int(lay.sel[-1]), np.float32),
                np.zeros(int(lay.sel[-1]), np.int64),
            )
            prev = (x * 0.5).reshape(-1).numpy()
            geometry = (lay.rows, lay.cols, lay.th, lay.tw, lay.k)
            kernel(x.reshape(-1).numpy(), prev, np.float32(0.95), *geometry, table, lay.off, e, *arrays, 0, lay.n_bands)
            runs.append([e.tobytes()] + [a.tobytes() for a in arrays])
        assert runs[0] == runs[1] == runs[2], name


def test_run_each_keeps_the_order_shares_nested_splits_and_raises_the_first_failure():
    saved = pf.MIN_SPLIT_WORK
    pf.MIN_SPLIT_WORK = 0
    try:
        with _threads(3):
            # each item splits again on the same pool: nesting must neither deadlock nor mix results
            out = pf.run_each(lambda n: sum(pf.run_split(lambda b0, b1: b1 - b0, n, 1)), list(range(1, 40)), [1] * 39)
            assert out == list(range(1, 40))
            done: list[int] = []

            def fail_odd(i: int) -> int:
                done.append(i)
                if i % 2:
                    raise PayloadError(f"item {i}")
                return i

            with pytest.raises(PayloadError, match="item 1$"):
                pf.run_each(fail_odd, list(range(8)), list(range(8)))  # largest work first: 7 fails first
            assert sorted(done) == list(range(8))  # every item ran before the error was raised
    finally:
        pf.MIN_SPLIT_WORK = saved


@pytest.mark.parametrize("fused", [False, True], ids=["numpy", "numba"])
def test_quantizer_fast_paths_give_the_full_lloyd_reference(fused):
    """The float32 sort, the single-edge compare and the stop at a fixed point are exact shortcuts,
    and the numba kernel (`_quantize_jit`) gives the numpy path's bits."""
    g = np.random.default_rng(5)
    cases = [g.standard_normal(n).astype(np.float32) for n in (1, 7, 1000, 40_000)]
    cases += [np.full(50, -0.25, np.float32), np.zeros(9, np.float32), g.standard_normal(999)]  # ties, float64
    cases += [(np.round(g.standard_normal(5000) * 4) / 4).astype(np.float32)]
    cases += [np.zeros(3000, np.float32), np.full(700, 3.0, np.float32)]  # one value: bins merged away
    cases += [np.concatenate([np.zeros(30_000), g.standard_normal(100)]).astype(np.float32)]  # empty bins
    with _path(fused):
        for v in cases:
            for bits in (2, 3, 4, 8):
                codes, codebook = quantize(v, bits)
                ref_codes, ref_codebook = _reference_quantize(v, bits)
                assert np.array_equal(codes, ref_codes) and codebook.tobytes() == ref_codebook.tobytes()


def _reference_quantize(v: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The quantizer as issue 10 wrote it: float64 sort, every Lloyd round, searchsorted bins."""
    n_bins = 2 ** (bits - 1)
    a = np.abs(v.astype(np.float64))
    s = np.sort(a)
    csum = np.concatenate([[0.0], np.cumsum(s)])

    def means_of(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        while True:
            bounds = np.concatenate([[0], np.searchsorted(s, edges, side="left"), [s.size]])
            counts = np.diff(bounds)
            with np.errstate(invalid="ignore", divide="ignore"):
                means = np.where(counts > 0, (csum[bounds[1:]] - csum[bounds[:-1]]) / np.maximum(counts, 1), np.nan)
            if not np.isnan(means).any():
                return edges, means
            edges = np.delete(edges, min(int(np.argmax(np.isnan(means))), len(edges) - 1))

    edges, means = means_of(np.unique(s[(np.arange(1, n_bins) * a.size) // n_bins]))
    for _ in range(LLOYD_ROUNDS):
        edges, means = means_of((means[:-1] + means[1:]) / 2)
    mag = np.searchsorted(edges, a, side="right").astype(np.uint8)
    codebook = np.full(n_bins, means[-1], dtype=np.float32)
    codebook[: len(means)] = means
    return ((v < 0).astype(np.uint8) << (bits - 1)) | mag, codebook
