"""Issue 37: the aligned support (`peer.core.sparseloco.aligned`) — one index set per tile that every
holder derives alike, values-only contributions, and an exact k′-sparse sum."""

from __future__ import annotations

import torch

from peer.core.sparseloco.aligned import (
    EXPLORE_SHARE,
    agreed_support,
    aligned_sum,
    aligned_values,
    support_seed,
    values_nbytes,
)
from peer.core.sparseloco.codec.format import SparseLoCoConfig, payload_nbytes

CHUNK, KEEP = 8, 6  # 64-entry tiles, 6 agreed per tile (1 of them explored)
SHAPE = (20, 12)  # 3 × 2 tiles, the last row and column of tiles partial


def _tile_of(flat: torch.Tensor) -> torch.Tensor:
    """The tile id of each flat position of a SHAPE tensor."""
    r, c = flat // SHAPE[1], flat % SHAPE[1]
    return (r // CHUNK) * -(-SHAPE[1] // CHUNK) + c // CHUNK


def test_the_support_is_a_function_of_its_inputs_with_at_most_k_per_tile_inside_the_tensor():
    prev = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    seed = support_seed(7, 3, 1, "w")
    a = agreed_support(prev, SHAPE, CHUNK, KEEP, seed)
    assert torch.equal(a, agreed_support(prev.clone(), SHAPE, CHUNK, KEEP, seed))  # every holder alike
    assert torch.all(a[1:] > a[:-1]) and int(a.min()) >= 0 and int(a.max()) < 20 * 12  # ascending, inside
    counts = torch.bincount(_tile_of(a), minlength=6)
    real = torch.tensor([64, 32, 64, 32, 32, 16])  # real entries per tile (partial ones at the edges)
    assert torch.equal(counts, torch.minimum(real, torch.tensor(KEEP)))
    assert not torch.equal(a, agreed_support(prev, SHAPE, CHUNK, KEEP, support_seed(7, 4, 1, "w")))  # t moves x


def test_the_support_holds_each_tiles_largest_previous_entries_and_explores_the_rest():
    prev = torch.zeros(SHAPE)
    local = torch.tensor([0, 1, 2, 3, 4, 9, 18, 27, 36])  # positions inside tile 0 (8 × 8)
    flat = (local // CHUNK) * SHAPE[1] + local % CHUNK
    prev.view(-1)[flat] = -torch.arange(1.0, 10.0)  # nine non-zero entries in tile 0, |·| ascending
    n_top = KEEP - int(KEEP * EXPLORE_SHARE)
    a = agreed_support(prev, SHAPE, CHUNK, KEEP, 123)
    top = set(flat[-n_top:].tolist())  # the n_top largest |Δ̄_{t−1}| of tile 0
    assert top <= set(a.tolist())
    in_tile0 = a[_tile_of(a) == 0]
    assert len(in_tile0) == KEEP  # the rest explored, not the next-largest by rule
    explored = agreed_support(None, SHAPE, CHUNK, KEEP, 123)  # round 0: exploration only, still k′ per tile
    assert len(explored) == len(a)


def test_a_contribution_sends_values_at_the_support_and_keeps_the_rest_in_its_error_buffer():
    gen = torch.Generator().manual_seed(1)
    delta, prev_e = torch.randn(SHAPE, generator=gen), torch.randn(SHAPE, generator=gen)
    support = agreed_support(None, SHAPE, CHUNK, KEEP, 5)
    e = prev_e.mul(0.9).add_(delta)  # β·e + Δ, as the codec rounds it
    for bits in (0, 2):
        v, e_new = aligned_values(delta, prev_e, support, 0.9, bits)
        off = torch.ones(e.numel(), dtype=torch.bool)
        off[support] = False
        assert torch.equal(e_new.view(-1)[off], e.view(-1)[off])  # untouched off the support
        assert torch.equal(e_new.view(-1)[support], e.view(-1)[support] - v)  # e − v̂ on it, bit for bit
        if bits == 0:
            assert torch.equal(v, e.view(-1)[support])
        else:
            assert len(torch.unique(v.abs())) <= 2 and torch.equal(torch.sign(v), torch.sign(e.view(-1)[support]))


def test_the_sum_is_the_exact_mean_on_the_support_and_zero_elsewhere():
    support = agreed_support(None, SHAPE, CHUNK, KEEP, 9)
    values = [torch.randn(len(support), generator=torch.Generator().manual_seed(m)) for m in range(3)]
    out = aligned_sum(values, support, SHAPE, 3)
    assert torch.count_nonzero(out) == len(support)  # no more entries than the agreed ones
    torch.testing.assert_close(out.view(-1)[support], (values[0] + values[1] + values[2]) / 3, rtol=0, atol=1e-6)
    off = torch.ones(out.numel(), dtype=torch.bool)
    off[support] = False
    assert not out.view(-1)[off].any()


def test_values_only_cost_the_payload_minus_its_index_bytes():
    cfg = SparseLoCoConfig(topk=32, chunk=64, quant_bits=2)
    shapes = {"w": (256, 128)}
    v = values_nbytes(shapes, 64, 32, 2, ["w"])
    full = payload_nbytes(shapes, cfg)
    assert v < full / 3  # 8 tiles: 32 two-bit values (8 bytes) against ~34 index bytes each
    assert v == values_nbytes(shapes, 64, 32, 2, ["w"])
    assert values_nbytes(shapes, 64, 32, 0, ["w"]) - v == 8 * (32 * 4 - 8) - 4 * 2  # float32, no codebook
