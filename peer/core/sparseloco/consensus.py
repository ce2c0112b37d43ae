"""The screening's consensus scores: each voter's cosine to the median of the others, exactly, on every core.

    m_i = coordinate-wise median of the OTHER voters' Δ̂;   s_i = ⟨Δ̂_i, m_i⟩ / (‖Δ̂_i‖·‖m_i‖)

(the rule that uses them: `peer.core.sparseloco.robust`). Each of the three sums behind a score is
grouped as the protocol fixes it: one exactly rounded partial sum per tensor and SLICE of its
coordinates, then one `math.fsum` of a voter's partials. Only the union of the voters' positions
is visited: a coordinate that no voter sends has a zero median for every voter and adds nothing.

Two ways to the same bits:
- compiled (numba, nogil; `_count_jit`, `_place_jit`, `_partials_jit`): a tensor's entries are
  bucketed by UNIT of coordinates (a slice is cut into units; a counting sort whose two passes are
  shared out over the cores, `_bucket`), and the units are shared out over the cores
  (`codec.fused.run_split`). Per unit, a slot map groups each coordinate's values (no sort of the
  positions), a small insertion sort gives the medians, and each product of two float32 values
  (exact in float64) goes into an integer accumulator (`codec.exact`): a unit's accumulators are
  added into its slice's, and the slice's sum is rounded once — what `math.fsum` of the same
  products gives, however the units were split over threads.
- numpy (`_slice_np`, the reference and the fallback): every voter's positions sorted, the union of
  a slice ranked PASS entries at a time, the products' `math.fsum`. It runs when numba is not in
  use, for small tensors, and for a slice where a product is not finite (say a float32 overflow in
  a median of two huge values): there the kernel adds nothing and the fallback gives inf, nan or
  raises exactly as before.

Medians are selections (or (low + high)·0.5 in float32 for an even count), so which of two equal
values a sort puts first never matters, and a coordinate's zero median's sign adds nothing (zero
products are skipped). Memory: one tensor's entries of every voter at a time, a unit's slot map and
values per thread, and one accumulator per unit and voter (3 × LIMBS int64). Pure numpy/numba.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.exact import LIMBS, OFFSET, to_float
from peer.core.sparseloco.codec.fused import run_each, run_split

__all__ = ["SLICE", "SparseRows", "sparse_consensus_scores"]

SLICE = 1 << 20  # coordinates of one tensor whose products are summed together (it fixes the bits)
PASS = 1 << 22  # entries (voters × coordinates) the numpy path ranks at once: 16 MiB of float32
UNIT = 1 << 16  # coordinates of a slice one kernel call groups at a time (splits, never fixes, the bits)
MIN_WORK = 1 << 14  # entries × voters below which the numpy path runs (tiny tests never JIT)
BUCKET_PIECES = 16  # pieces of a tensor's entries the bucketing's two passes are cut into, at most
MIN_PIECE = 1 << 16  # entries of a piece, at least (fewer entries: fewer pieces)

SparseRows = Sequence["tuple[np.ndarray, np.ndarray] | None"]  # per voter: (flat positions, float32 values)


def sparse_consensus_scores(tensors: Sequence[tuple[int, Callable[[], SparseRows]]], n_voters: int) -> list[float]:
    """Each voter's consensus cosine, from voters given tensor by tensor as (numel, a loader of per
    voter (positions, values) or None): the partial sums per tensor and SLICE (`_tensor_partials`;
    tensors shared out over the cores, each loaded where it is scored), then each voter's exactly
    rounded totals. Sums are exact, so the scores depend only on the set of voters, never on their
    order nor on how the work was split."""

    def partials(item: tuple[int, Callable[[], SparseRows]]) -> np.ndarray:
        numel, load = item
        rows = load()
        if len(rows) != n_voters:
            raise ValueError(f"{len(rows)} rows for {n_voters} voters")
        return _tensor_partials(numel, rows)

    dots: list[list[float]] = [[0.0] for _ in range(n_voters)]  # partial sums per slice, fsum'd at the end
    sq_self: list[list[float]] = [[0.0] for _ in range(n_voters)]
    sq_med: list[list[float]] = [[0.0] for _ in range(n_voters)]
    for done in run_each(partials, list(tensors), [numel * n_voters for numel, _ in tensors]):
        for part in done:  # (n, 3) per slice
            for j, (dot, sq, sq_m) in enumerate(part.tolist()):
                dots[j].append(dot)
                sq_self[j].append(sq)
                sq_med[j].append(sq_m)
    return _cosines(dots, sq_self, sq_med)


def _cosines(dots: list[list[float]], sq_self: list[list[float]], sq_med: list[list[float]]) -> list[float]:
    """Each voter's cosine from its exactly rounded partial sums (one fsum of each list)."""
    out = []
    for dot, sq, sq_m in zip(dots, sq_self, sq_med, strict=True):
        norm, med_norm = math.sqrt(math.fsum(sq)), math.sqrt(math.fsum(sq_m))
        out.append(math.fsum(dot) / (norm * med_norm) if norm > 0 and med_norm > 0 else 0.0)
    return out


def _tensor_partials(numel: int, rows: SparseRows) -> np.ndarray:
    """(n_slices, n, 3): per SLICE of one tensor and voter, (Σ row·med, Σ row², Σ med²), each
    exactly rounded; compiled where it can be, numpy for the rest (module docstring)."""
    n = len(rows)
    empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
    flat = [empty if row is None else (np.asarray(row[0], np.int64), np.asarray(row[1], np.float32)) for row in rows]
    for pos, _ in flat:
        if len(pos) and (int(pos.min()) < 0 or int(pos.max()) >= numel):
            raise ValueError(f"a position lies outside a tensor of {numel} entries")
    out = np.zeros((-(-numel // SLICE), n, 3), dtype=np.float64)
    redo = _compiled_partials(flat, out) if n >= 2 and sum(p.size for p, _ in flat) * n >= MIN_WORK else None
    todo = range(out.shape[0]) if redo is None else redo
    if len(todo):
        ordered = []
        for pos, vals in flat:
            order = np.argsort(pos, kind="stable")
            ordered.append((pos[order], vals[order]))
        for s in todo:
            out[s] = _slice_np(ordered, s * SLICE, min(numel, (s + 1) * SLICE))
    return out


# ------------------------------------------------------------------------------------------
# numpy: the reference
# ------------------------------------------------------------------------------------------


def _slice_np(ordered: Sequence[tuple[np.ndarray, np.ndarray]], start: int, stop: int) -> np.ndarray:
    """(n, 3) partial sums of the coordinates [start, stop) from each voter's sorted (positions, values)."""
    n = len(ordered)
    cuts = [np.searchsorted(pos, [start, stop]) for pos, _ in ordered]
    parts = [(pos[a:b], vals[a:b]) for (pos, vals), (a, b) in zip(ordered, cuts, strict=True)]
    union = np.unique(np.concatenate([pos for pos, _ in parts]))  # (u,) ascending
    terms: list[list[list[np.ndarray]]] = [[[], [], []] for _ in range(n)]  # the slice's non-zero products
    step = max(1, PASS // n)  # coordinates ranked at once: n × step float32 at most
    for c0 in range(0, len(union), step):
        _products(union[c0 : c0 + step], parts, terms)
    return np.array([[_exact_sum(t) for t in terms[j]] for j in range(n)], dtype=np.float64)


def _exact_sum(terms: Sequence[np.ndarray]) -> float:
    """Σ of float64 terms (each exact), exactly rounded: one `math.fsum`, whatever the grouping."""
    flat = np.concatenate(terms) if terms else np.zeros(0)
    return math.fsum(flat.tolist()) if len(flat) else 0.0


def _medians_without_each(cols: np.ndarray) -> np.ndarray:
    """(k, n): entry [c, i] is the median of column c's values in the OTHER n − 1 rows of a (k, n)
    float32 array (a coordinate per row, a voter per column: each sort is one contiguous row).

    One sort per coordinate: removing the value of rank r from the sorted values shifts every later
    rank down by one, so the others' middle ranks are read off the same sorted values. The median
    of an even count is the mean of its two middle values (float32: (low + high)·0.5).
    """
    n = cols.shape[1]
    order = np.argsort(cols, axis=1, kind="stable")  # (k, n)
    values = np.take_along_axis(cols, order, axis=1)
    ranks = np.empty_like(order)
    np.put_along_axis(ranks, order, np.broadcast_to(np.arange(n), order.shape), axis=1)
    m = n - 1
    low = np.take_along_axis(values, (m - 1) // 2 + ((m - 1) // 2 >= ranks), axis=1)  # ranks in the full row
    if m % 2:
        return low
    high = np.take_along_axis(values, m // 2 + (m // 2 >= ranks), axis=1)
    out: np.ndarray = (low + high) * np.float32(0.5)
    return out


def _products(
    coords: np.ndarray, parts: Sequence[tuple[np.ndarray, np.ndarray]], terms: list[list[list[np.ndarray]]]
) -> None:
    """Append each voter's row·med, row² and med² (float64, exact) at `coords` (ascending, each
    sent by some voter) to terms[voter]: the voters' values there, their medians without each."""
    n = len(parts)
    cols = np.zeros((len(coords), n), dtype=np.float32)  # (u, n)
    lo, hi = coords[0], coords[-1] + 1
    for j, (pos, vals) in enumerate(parts):
        a, b = np.searchsorted(pos, [lo, hi])
        cols[np.searchsorted(coords, pos[a:b]), j] = vals[a:b]
    meds = _medians_without_each(cols).T.astype(np.float64)  # (n, u); float32 products are exact
    sent = cols.T.astype(np.float64)
    for j in range(n):
        row, med = sent[j], meds[j]
        for k, prod in enumerate((row * med, row * row, med * med)):
            terms[j][k].append(prod[prod != 0])  # zero terms change no sum


# ------------------------------------------------------------------------------------------
# compiled: units over the cores, integer accumulators
# ------------------------------------------------------------------------------------------


def _compiled_partials(flat: Sequence[tuple[np.ndarray, np.ndarray]], out: np.ndarray) -> list[int] | None:
    """Fill out (n_slices, n, 3) with the compiled kernels; the slices left to the numpy path (a
    non-finite product), or None when numba is not in use."""
    count, place = pk.compiled_function(_count_jit), pk.compiled_function(_place_jit)
    partials = pk.compiled_function(_partials_jit, _medians_jit, _add_products_jit)
    if count is None or place is None or partials is None:
        return None
    n, n_slices = len(flat), out.shape[0]
    unit = min(UNIT, SLICE)
    per_slice = -(-SLICE // unit)  # units of a slice (its last may be short)
    pos = np.concatenate([p for p, _ in flat])
    vals = np.concatenate([v for _, v in flat])
    who = np.repeat(np.arange(n, dtype=np.int64), [p.size for p, _ in flat])  # (E,) each entry's voter
    starts, order = _bucket(count, place, pos, unit, per_slice, n_slices * per_slice)
    acc = np.zeros((n_slices * per_slice, n, 3, LIMBS), dtype=np.int64)
    bad = np.zeros(n_slices * per_slice, dtype=np.uint8)
    args = (pos, vals, who, order, starts, n, SLICE, unit, per_slice, acc, bad)
    run_split(partials, n_slices * per_slice, pos.size * n, *args)
    out[:] = to_float(acc.reshape(n_slices, per_slice, n, 3, LIMBS).sum(axis=1))  # < 2^53 per digit: exact
    return sorted({int(u) // per_slice for u in np.flatnonzero(bad)})


def _bucket(
    count: Callable[..., int], place: Callable[..., int], pos: np.ndarray, unit: int, per_slice: int, n_units: int
) -> tuple[np.ndarray, np.ndarray]:
    """(starts, order): the entries' indices grouped by unit (slice · per_slice + offset in the slice
    // unit), each unit's in their given order; starts[u] … starts[u + 1] − 1 index `order` for unit
    u. A counting sort in two passes over the entries, each cut into pieces the cores take
    (`_count_jit`, `_place_jit`): piece i's entries of a unit follow those of pieces before it, so
    the grouping is the one a single pass gives, however the pieces were shared out."""
    size = pos.size
    pieces = max(1, min(BUCKET_PIECES, size // MIN_PIECE))
    bounds = np.array([size * i // pieces for i in range(pieces + 1)], dtype=np.int64)
    counts = np.zeros((pieces, n_units), dtype=np.int64)
    run_split(count, pieces, size, pos, bounds, SLICE, unit, per_slice, counts)
    starts = np.zeros(n_units + 1, dtype=np.int64)
    np.cumsum(counts.sum(axis=0), out=starts[1:])
    fill = starts[:-1] + (np.cumsum(counts, axis=0) - counts)  # (pieces, n_units): each piece's first slot
    order = np.empty(size, dtype=np.int64)
    run_split(place, pieces, size, pos, bounds, SLICE, unit, per_slice, fill, order)
    return starts, order


def _count_jit(
    pos: np.ndarray, bounds: np.ndarray, slice_: int, unit: int, per_slice: int, counts: np.ndarray, b0: int, b1: int
) -> int:
    # counts[i, u] = entries of piece i (bounds[i] … bounds[i + 1] − 1) in unit u, for pieces b0 … b1 − 1.
    for i in range(b0, b1):
        for e in range(bounds[i], bounds[i + 1]):
            p = pos[e]
            counts[i, (p // slice_) * per_slice + (p % slice_) // unit] += 1
    return 0


def _place_jit(
    pos: np.ndarray,
    bounds: np.ndarray,
    slice_: int,
    unit: int,
    per_slice: int,
    fill: np.ndarray,
    order: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    # Each entry of pieces b0 … b1 − 1 into its unit's next slot of its piece (fill[i, u], advanced).
    for i in range(b0, b1):
        for e in range(bounds[i], bounds[i + 1]):
            p = pos[e]
            u = (p // slice_) * per_slice + (p % slice_) // unit
            order[fill[i, u]] = e
            fill[i, u] += 1
    return 0


def _partials_jit(
    pos: np.ndarray,
    vals: np.ndarray,
    who: np.ndarray,
    order: np.ndarray,
    starts: np.ndarray,
    n: int,
    slice_: int,
    unit: int,
    per_slice: int,
    acc: np.ndarray,
    bad: np.ndarray,
    u0: int,
    u1: int,
) -> int:
    # For units u0 … u1−1: group each coordinate's values (a slot map; a voter that sends nothing
    # there holds 0), take each voter's median of the others (`_medians_jit`) and add its row·med,
    # row² and med² into acc[u, voter, 0 … 2] (`_add_products_jit`). A non-finite value or median
    # marks the unit bad (the numpy path redoes its slice).
    most = 1
    for u in range(u0, u1):
        most = max(most, starts[u + 1] - starts[u])
    slot = np.full(unit, -1, dtype=np.int64)
    cols = np.empty((most, n), dtype=np.float32)
    col_bits = cols.view(np.int32)
    coords = np.empty(most, dtype=np.int64)
    srt = np.empty(n, dtype=np.float32)  # the sort's scratch: the values, their voters and ranks
    ranks = np.empty((2, n), dtype=np.int64)
    meds = np.zeros(n, dtype=np.float32)
    med_bits = meds.view(np.int32)
    for u in range(u0, u1):
        base = (u // per_slice) * slice_ + (u % per_slice) * unit
        used = 0
        for t in range(starts[u], starts[u + 1]):
            e = order[t]
            c = pos[e] - base
            k = slot[c]
            if k < 0:
                k = used
                slot[c], coords[k] = k, c
                cols[k, :] = 0
                used += 1
            cols[k, who[e]] = vals[e]
        for k in range(used):
            slot[coords[k]] = -1
            senders = 0
            for j in range(n):
                senders += cols[k, j] != 0
            if senders == 0:
                continue
            if senders == 1 and n >= 4:  # the others' middle values are all zeros: every median is 0
                meds[:] = 0
            else:
                _medians_jit(cols[k], srt, ranks, meds)
            for j in range(n):
                if _add_products_jit(np.int64(col_bits[k, j]), np.int64(med_bits[j]), acc[u, j]):
                    bad[u] = 1
    return 0


def _medians_jit(row: np.ndarray, srt: np.ndarray, ranks: np.ndarray, meds: np.ndarray) -> None:
    # meds[j] = the median of row's values but row[j] (float32: (low + high)·0.5 for an even count).
    # One insertion sort of the values (srt) with their voters (ranks[0]); removing the value at
    # voter j's rank (ranks[1, j]) leaves the others (equal values may swap ranks: removing either
    # leaves the same values).
    n = row.size
    for j in range(n):
        v = row[j]
        at = j
        while at > 0 and srt[at - 1] > v:
            srt[at], ranks[0, at] = srt[at - 1], ranks[0, at - 1]
            at -= 1
        srt[at], ranks[0, at] = v, j
    for r in range(n):
        ranks[1, ranks[0, r]] = r
    m = n - 1  # the others of each voter
    low_at, high_at, half = (m - 1) // 2, m // 2, np.float32(0.5)
    for j in range(n):
        r = ranks[1, j]
        med = srt[low_at if low_at < r else low_at + 1]
        if m % 2 == 0:
            med = (med + srt[high_at if high_at < r else high_at + 1]) * half  # float32
        meds[j] = med


def _add_products_jit(wa: np.int64, wb: np.int64, acc: np.ndarray) -> bool:
    # Add a·b, a² and b² of the float32 values with bits wa, wb into acc[0 … 2] exactly; True (and
    # nothing added) when either is inf or nan. A float32 is ±m·2^e (m < 2^24 an integer, e >= −149),
    # so each product is m·m' < 2^48 at 2^(e + e'): exact in int64, added digit by digit (the same
    # lines as codec.exact._squares_jit, with a sign).
    if (wa | wb) & 0x7FFFFFFF == 0:  # both ±0: nothing to add
        return False
    ea, eb = (wa >> 23) & 0xFF, (wb >> 23) & 0xFF
    if ea == 0xFF or eb == 0xFF:
        return True
    ma, mb = (wa & 0x7FFFFF) | (0x800000 if ea else 0), (wb & 0x7FFFFF) | (0x800000 if eb else 0)
    xa, xb = ea + (ea == 0) - 150, eb + (eb == 0) - 150  # a subnormal's exponent is −149
    for q in range(3):  # a·b, a², b²
        if q == 0:
            big, bit, sign = ma * mb, xa + xb + OFFSET, 1 - 2 * (((wa ^ wb) >> 31) & 1)
        elif q == 1:
            big, bit, sign = ma * ma, 2 * xa + OFFSET, np.int64(1)
        else:
            big, bit, sign = mb * mb, 2 * xb + OFFSET, np.int64(1)
        if big == 0:
            continue
        li, sh = bit >> 5, bit & 31
        lo = (big & 0xFFFFFFFF) << sh  # < 2^63
        up = (big >> 32) << sh  # < 2^47
        acc[q, li] += sign * (lo & 0xFFFFFFFF)  # < 2^33 per term: a unit's digits never overflow
        acc[q, li + 1] += sign * ((lo >> 32) + (up & 0xFFFFFFFF))
        acc[q, li + 2] += sign * (up >> 32)
    return False
