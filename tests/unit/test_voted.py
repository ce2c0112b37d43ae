"""Issue 37: the voted support (`peer.core.sparseloco.ranges.voted`) against plain dense references —
a sender's vote, the owner's tally and its stuffing defence, the agreed support, the values and the
exact mean on it."""

from __future__ import annotations

import hashlib

import pytest
import torch

from peer.core.sparseloco.aligned import aligned_sum, send_at
from peer.core.sparseloco.ranges.voted import (
    VoteError,
    check_vote,
    select_support,
    tally,
    tile_of,
    tile_topk,
    voted_keep,
    voted_support,
)

CHUNK, K, KEEP = 8, 4, 6  # 64-entry tiles, votes of 4, 6 agreed per tile
SHAPE = (20, 12)  # 3 × 2 tiles, the last row and column of tiles partial
REAL = torch.tensor([64, 32, 64, 32, 32, 16])  # real entries per tile


def _tiles():
    """{tile: its flat positions} of a SHAPE tensor, by plain loops."""
    out: dict[int, list[int]] = {}
    for r in range(SHAPE[0]):
        for c in range(SHAPE[1]):
            out.setdefault((r // CHUNK) * 2 + c // CHUNK, []).append(r * SHAPE[1] + c)
    return out


def _errors(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(n)]


def test_k_prime_defaults_to_twice_the_top_k():
    assert voted_keep(0, 32) == 64 and voted_keep(48, 32) == 48


def test_a_vote_is_the_top_k_of_every_tile():
    e = _errors(1)[0]
    got = set(tile_topk(e, CHUNK, K).tolist())
    want = set()
    for pos in _tiles().values():
        ranked = sorted(pos, key=lambda p: -abs(float(e.view(-1)[p])))
        want |= set(ranked[:K])
    assert got == want
    assert torch.equal(tile_of(torch.tensor(sorted(got)), SHAPE, CHUNK).bincount(), torch.tensor([K] * 6))


def test_a_malformed_or_stuffed_vote_is_refused_whole():
    good = tile_topk(_errors(1)[0], CHUNK, K)
    assert torch.equal(check_vote(good.flip(0), SHAPE, CHUNK, K), good)  # any order, returned ascending
    tile0 = torch.tensor(_tiles()[0][: K + 1])
    bad = {
        "twice": torch.cat([good, good[:1]]),
        "outside": torch.cat([good, torch.tensor([SHAPE[0] * SHAPE[1]])]),
        "negative": torch.cat([good, torch.tensor([-1])]),
        "k + 1 in a tile": tile0,
        "floats": good.float(),
        "2-D": good.view(1, -1),
    }
    for what, vote in bad.items():
        with pytest.raises(VoteError):
            check_vote(vote, SHAPE, CHUNK, K)
        counts, refused = tally([good, vote, None], SHAPE, CHUNK, K)
        assert refused == [1], what  # the stuffed vote counts nowhere, not even its valid positions
        assert torch.equal(counts, torch.zeros(240, dtype=torch.int64).index_fill(0, good, 1)), what


def test_the_tally_counts_each_valid_vote_once_per_position():
    votes = [tile_topk(e, CHUNK, K) for e in _errors(5)]
    counts, refused = tally(votes, SHAPE, CHUNK, K)
    dense = sum(torch.zeros(240, dtype=torch.int64).index_fill(0, v, 1) for v in votes)
    assert refused == [] and torch.equal(counts, dense)


def _check_support(support, counts, keep):
    """k′ per tile (all real entries of a smaller tile), and no outside position has more votes than
    an inside one of its tile."""
    chosen = set(support.tolist())
    assert torch.all(support[1:] > support[:-1])
    for pos in _tiles().values():
        inside = [int(counts[p]) for p in pos if p in chosen]
        outside = [int(counts[p]) for p in pos if p not in chosen]
        assert len(inside) == min(keep, len(pos))
        assert not outside or max(outside) <= min(inside)


def test_the_support_holds_the_most_voted_positions_of_each_tile():
    votes = [tile_topk(e, CHUNK, K) for e in _errors(3, seed=3)]
    support, refused = voted_support(votes, SHAPE, CHUNK, K, KEEP, seed=11)
    counts, _ = tally(votes, SHAPE, CHUNK, K)
    assert refused == []
    _check_support(support, counts, KEEP)
    assert torch.equal(support, select_support(counts.clone(), SHAPE, CHUNK, KEEP, 11))  # every owner alike
    assert not torch.equal(support, select_support(counts, SHAPE, CHUNK, KEEP, 12))  # the seed breaks ties
    _check_support(select_support(torch.zeros(240, dtype=torch.int64), SHAPE, CHUNK, 40, 5), torch.zeros(240), 40)


def test_a_band_of_whole_tile_rows_selects_what_the_tensor_selects_there():
    counts, _ = tally([tile_topk(e, CHUNK, K) for e in _errors(4, seed=4)], SHAPE, CHUNK, K)
    whole = select_support(counts, SHAPE, CHUNK, KEEP, 99)
    band_rows = (8, 16)  # tile row 1: tiles 2 and 3
    band = counts.view(SHAPE)[band_rows[0] : band_rows[1]]
    got = select_support(band, (8, 12), CHUNK, KEEP, 99, first_tile=2) + band_rows[0] * SHAPE[1]
    lo, hi = band_rows[0] * SHAPE[1], band_rows[1] * SHAPE[1]
    assert torch.equal(got, whole[(whole >= lo) & (whole < hi)])


def test_the_support_is_pinned_bits_of_its_inputs():
    """The draw is PCG64's raw stream: a numpy or torch change that moved it would split the swarm."""
    counts = torch.arange(240, dtype=torch.int64) * 7 % 3  # many ties: the draw decides most slots
    support = select_support(counts, SHAPE, CHUNK, KEEP, 2026)
    assert hashlib.sha256(support.numpy().astype("<i8").tobytes()).hexdigest()[:16] == PINNED


PINNED = "af1141eff092d38f"  # sha256 prefix of the support, little-endian int64


def test_f_stuffers_win_a_slot_only_where_fewer_honest_votes_are():
    honest = torch.tensor(sorted(p for pos in _tiles().values() for p in pos[:KEEP]))  # k′ per tile, 3 votes each
    counts = torch.zeros(240, dtype=torch.int64).index_fill(0, honest, 3)
    lies = torch.tensor(sorted(p for pos in _tiles().values() for p in pos[-K:]))  # a valid vote elsewhere
    for f, displaced in ((2, False), (4, True)):  # f = 3 ties: the draw decides
        stuffed, refused = tally([lies] * f, SHAPE, CHUNK, K)
        assert refused == [] and int(stuffed.max()) == f  # f identities add at most f to a position
        support = select_support(counts + stuffed, SHAPE, CHUNK, KEEP, 1)
        assert torch.equal(support, honest) != displaced


def test_values_and_the_mean_on_the_support_match_a_dense_reference():
    es = _errors(3, seed=9)
    votes = [tile_topk(e, CHUNK, K) for e in es]
    support, _ = voted_support(votes, SHAPE, CHUNK, K, KEEP, seed=3)
    for bits in (0, 2):
        values, news = [], []
        for e in es:
            v, new = send_at(e.clone(), support, bits)
            values.append(v)
            news.append(new)
            off = torch.ones(240, dtype=torch.bool)
            off[support] = False
            assert torch.equal(new.view(-1)[off], e.view(-1)[off])  # error feedback keeps the rest
            assert torch.equal(new.view(-1)[support], e.view(-1)[support] - v)  # e − v̂ on S, bit for bit
        mean = aligned_sum(values, support, SHAPE, 3)
        ref = torch.zeros(240)
        acc = torch.zeros(len(support))
        for v in values:  # float32, in roster order, one division
            acc = acc + v
        ref[support] = acc / 3
        assert torch.equal(mean.view(-1), ref)
        if bits == 0:
            dense = sum(e.view(-1) for e in es) / 3
            torch.testing.assert_close(mean.view(-1)[support], dense[support], rtol=0, atol=1e-6)
