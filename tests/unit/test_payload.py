"""Payload v3: sign-magnitude value codes, enumerative index coding, numba/numpy kernel agreement,
fused aggregation, fixture."""

from __future__ import annotations

import hashlib
import math
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import aggregate, aggregate_payloads, clip_and_aggregate, compress, decompress
from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.clip import clip_to_median, global_norm, payload_norm
from peer.core.sparseloco.codec.format import (
    READ_VERSIONS,
    VERSION,
    Payload,
    PayloadError,
    SparseLoCoConfig,
    index_nbytes,
    rank_nbytes,
)

# compress() at SparseLoCoConfig() of torch.randn with seeds 5, 6, 7, 8 (generator) for
# layers.0.attn.wq.weight (70, 130), layers.0.attn_norm.weight (20,), layers.0.ffn.w1.weight
# (2, 3, 40) and embed.weight (128, 192); regenerated for the v3 value coding.
FIXTURE = Path(__file__).parent.parent / "fixtures" / "sparseloco_payload_v3.bin"
FIXTURE_SHA256 = "851090e19d791e2b77a7e6947f96f8f8a4b42e2706ede81f04447089d3b3f15d"


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _digest(d: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(d):
        h.update(name.encode())
        h.update(d[name].numpy().tobytes())
    return h.hexdigest()


def test_stored_payload_decodes_to_the_pinned_parameters():
    """Committed bytes decode to the same bits on every machine (the committed set is shared)."""
    b = FIXTURE.read_bytes()
    p = Payload.from_bytes(b)
    assert p.to_bytes() == b and b[4] == VERSION
    assert _digest(decompress(p)) == FIXTURE_SHA256


def test_ranks_enumerate_every_subset_in_order_and_round_trip():
    n, k = 9, 3
    table = pk.binomial_table(n, k)
    subsets = np.array(list(combinations(range(n), k)), dtype=np.int64)  # colex order below
    ranks = pk._rank_np(subsets, table)
    values = ranks[:, 0] + (ranks[:, 1] << 32) if ranks.shape[1] > 1 else ranks[:, 0]
    assert sorted(values.tolist()) == list(range(math.comb(n, k)))
    q, bad = pk._unrank_np(ranks, np.full(len(ranks), k), np.full(len(ranks), n), table, k)
    assert bad == -1 and np.array_equal(q, subsets)
    assert rank_nbytes(4096, 32) == 34 and rank_nbytes(12, 12) == 0
    assert index_nbytes((64, 64), 64, 32) == 34


def test_numba_and_numpy_kernels_agree():
    """Both paths give the same ranks, positions and top-k sets (ties included, via torch.topk)."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(0)
    table = pk.binomial_table(4096, 32)
    n = rng.choice([4096, 3072, 100, 33, 20], size=40)
    kc = np.minimum(32, n)
    q = np.zeros((40, 32), np.int64)
    for c in range(40):
        q[c, : kc[c]] = np.sort(rng.choice(n[c], kc[c], replace=False))
    ranks = pk._rank_np(q, table)
    bad_ranks = ranks.copy()
    bad_ranks[7] = table[kc[7], n[7]]  # exactly C(n, k): out of range
    saved = pk.NUMBA_MIN_WORK
    pk.NUMBA_MIN_WORK = 0
    try:
        assert np.array_equal(pk.rank_subsets(q, table), ranks)
        got, bad = pk.unrank_subsets(ranks, kc, n, table, 32)
        assert bad == -1 and np.array_equal(got, q)
        assert pk.unrank_subsets(bad_ranks, kc, n, table, 32)[1] == 7 == pk._unrank_np(bad_ranks, kc, n, table, 32)[1]
        cfg = SparseLoCoConfig(topk=8, chunk=16, dense_1d=False)
        ties = torch.round(_rand(70, 90, seed=3) * 2) / 2  # many equal magnitudes
        delta = {"w": _rand(70, 90, seed=2), "t": ties, "z": torch.zeros(40, 33), "v": _rand(700, seed=4)}
        fast = compress(delta, None, cfg)
        pk.set_numba(False)
        slow = compress(delta, None, cfg)
    finally:
        pk.set_numba(True)
        pk.NUMBA_MIN_WORK = saved
    assert fast[0].to_bytes() == slow[0].to_bytes()
    for name in delta:
        assert fast[1][name].numpy().tobytes() == slow[1][name].numpy().tobytes()


def test_versions_and_out_of_range_ranks_are_payload_errors():
    b = FIXTURE.read_bytes()
    for version in (0, 1, 2, 4, 255):
        with pytest.raises(PayloadError, match=f"unsupported version {version}; this build reads version 3"):
            Payload.from_bytes(b[:4] + bytes([version]) + b[5:])
    assert READ_VERSIONS == (3,)


@pytest.mark.parametrize("rule", ["mean-over-all", "mean-over-contributors"])
@pytest.mark.parametrize("factor", [0.0, 1.2])
def test_fused_clip_and_aggregate_equals_decoding_then_aggregating(rule, factor):
    shapes = {"a": (70, 130), "g": (20,), "c": (3, 5, 7)}
    payloads = [
        compress({n: _rand(*s, seed=10 * i + j) * (1 + 5 * i) for j, (n, s) in enumerate(shapes.items())}, None, cfg)[0]
        for i, cfg in enumerate([SparseLoCoConfig(), SparseLoCoConfig(), SparseLoCoConfig()])
    ]
    decoded = [decompress(p) for p in payloads]
    assert [payload_norm(p) for p in payloads] == [global_norm(d) for d in decoded]
    clipped, stats = clip_to_median(decoded, factor)
    want = aggregate(clipped, len(payloads), rule)
    got, got_stats = clip_and_aggregate(payloads, factor, rule)
    assert got_stats == stats and (factor == 0 or stats.n_clipped == 1)
    assert _digest(got) == _digest(want)
    only_a = aggregate_payloads(payloads, 4, rule, names={"a"})
    assert set(only_a) == {"a"} and _digest(only_a) == _digest({"a": aggregate(decoded, 4, rule)["a"]})
    with pytest.raises(PayloadError, match="disagree"):
        aggregate_payloads([payloads[0], compress({"a": _rand(3, 4)}, None, SparseLoCoConfig())[0]], 2)
