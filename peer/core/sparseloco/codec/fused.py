"""Whole-tensor fused kernels of the SparseLoCo payload, split over the CPU cores.

Encode, one pass per tile (`_encode_jit`): e = β·e_prev + Δ (or a copy of Δ) is written to the
error buffer (new, or e_prev itself: in place) while the |e| maxima of the tile's runs (columns of
<= 16 rows) are taken; a histogram of the run maxima gives a threshold that at least k+1 entries
reach, the tile's top-k is chosen among the few entries that reach it (its k-th largest is found
among the smallest of them), and the rank of its sorted positions (see peer.core.sparseloco.codec.kernels) is written
straight into the wire buffer, with the positions and values of the sent entries. Decode
(`_walk_jit`): each tile's rank is unranked (a closed-form first guess, then exact checks) and every
sent entry is written at its flat position: the position itself, out[p] = v, or out[p] += v·scale
(the fused decode-and-aggregate), without any per-entry array in between.

`run_each` shares the tensors of a payload out over the caller and a small thread pool (the
kernels are compiled with nogil), and `run_split` the tiles of one tensor, in ranges taken
dynamically; distinct tiles touch distinct entries, so the result does not depend on the split.
How many threads share the work is torch's intra-op thread count (`n_workers`: the cores this
process may use, unless OMP_NUM_THREADS or torch.set_num_threads says otherwise), so one setting
sizes both torch's elementwise kernels and ours.
Arithmetic is the float32 of the torch/numpy reference (β·e is rounded before + Δ; a scaled value
is rounded before it is added), so the bits equal the numpy path, which tests check. Every index a
kernel writes lies inside its tile's real part, whatever the rank bytes hold.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

MIN_SPLIT_WORK = 1 << 18  # tensors with fewer entries run on the calling thread
PIECES_PER_WORKER = 4  # ranges of bands per worker thread, taken dynamically
GROUP = 16  # rows of a run of the encoder: one column of up to GROUP rows of a tile
N_BINS = 256  # histogram bins of a tile's run maxima
MAX_COUNTED = 96  # candidates ranked by counting (O(n²), branch-free); more: by insertion
MAX_LOW = 24  # at most this many candidates beyond the k-th: keep only the smallest ones (by insertion)

T = TypeVar("T")
R = TypeVar("R")

_pool: dict[str, Any] = {"executor": None, "size": 0, "lock": threading.Lock()}


def _forget_pool() -> None:  # a forked child has none of the parent's pool threads: start afresh
    _pool["executor"], _pool["size"], _pool["lock"] = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def n_workers() -> int:
    """Threads the kernels share work over: torch's intra-op thread count (torch.get_num_threads():
    the cores this process may use, fewer under OMP_NUM_THREADS or torch.set_num_threads)."""
    return max(1, torch.get_num_threads())


def _submit(task: Callable[[], None], count: int) -> list[Future[None]]:
    """`task` submitted `count` times to the pool, which has at least `count` threads (a larger
    thread count starts a larger pool; the old one finishes what it holds and lets its threads go)."""
    with _pool["lock"]:
        if _pool["executor"] is None or _pool["size"] < count:
            if _pool["executor"] is not None:
                _pool["executor"].shutdown(wait=False)
            _pool["executor"] = ThreadPoolExecutor(max_workers=count, thread_name_prefix="peer-codec")
            _pool["size"] = count
        executor: ThreadPoolExecutor = _pool["executor"]
        return [executor.submit(task) for _ in range(count)]


def _share(task: Callable[[], None], parts: int) -> None:
    """Run `task` on the calling thread and on parts − 1 pool threads; wait for the ones that started.

    `task` takes its work from a shared counter until none is left, so a pool thread that is busy (a
    nested call) or that the OS runs less simply takes less of it; nothing ever waits on work that
    is queued but not started, so nesting cannot deadlock."""
    futures = _submit(task, parts - 1)
    task()
    for f in futures:
        if not f.cancel():
            f.result()


def run_split(kernel: Callable[..., Any], n_bands: int, work: int, *args: Any) -> list[Any]:
    """kernel(*args, b0, b1) over contiguous ranges of bands (tile rows) covering [0, n_bands), on the
    thread pool when `work` (entries) is large enough; the results in range order.

    The bands are cut into up to PIECES_PER_WORKER ranges per worker, taken in turn by the caller
    and the pool threads (see `_share`)."""
    parts = min(n_workers(), n_bands) if work >= MIN_SPLIT_WORK else 1
    if parts <= 1:
        return [kernel(*args, 0, n_bands)]
    pieces = min(n_bands, parts * PIECES_PER_WORKER)
    bounds = [n_bands * i // pieces for i in range(pieces + 1)]
    results: list[Any] = [None] * pieces
    taken = itertools.count()  # next() on it is atomic

    def drain() -> None:
        while (i := next(taken)) < pieces:
            results[i] = kernel(*args, bounds[i], bounds[i + 1])

    _share(drain, parts)
    return results


def run_each(fn: Callable[[T], R], items: Sequence[T], work: Sequence[int], in_order: bool = False) -> list[R]:
    """[fn(x) for x in items], the items shared out over the caller and the pool threads, largest
    `work` first (`in_order`: in the given order, for a caller that consumes results as they come),
    when the total work (entries) is large enough. An exception is raised after every item is done:
    the one of the first item that failed, as the plain loop would raise."""
    parts = min(n_workers(), len(items)) if sum(work) >= MIN_SPLIT_WORK else 1
    if parts <= 1:
        return [fn(x) for x in items]
    order = list(range(len(items))) if in_order else sorted(range(len(items)), key=lambda i: -work[i])
    results: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    taken = itertools.count()

    def drain() -> None:
        while (j := next(taken)) < len(items):
            i = order[j]
            try:
                results[i] = fn(items[i])
            except BaseException as exc:  # noqa: BLE001  # re-raised below, in item order
                errors[i] = exc

    _share(drain, parts)
    for exc in errors:
        if exc is not None:
            raise exc
    return results


# ------------------------------------------------------------------------------------------
# numba kernels (plain Python here; compiled by kernels._compile with nogil)
# ------------------------------------------------------------------------------------------


def _encode_jit(
    d: np.ndarray,
    prev: np.ndarray,
    beta: np.float32,
    rows: int,
    cols: int,
    th: int,
    tw: int,
    k: int,
    table: np.ndarray,
    off: np.ndarray,
    e: np.ndarray,
    local: np.ndarray,
    tie: np.ndarray,
    bad: np.ndarray,
    rank_buf: np.ndarray,
    sel: np.ndarray,
    vals: np.ndarray,
    pos: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    # Per band of tiles (tile rows b0 … b1−1), pass 1 streams the band's rows: it writes e (which
    # may be prev itself) and keeps the max |e| (as int32 bits) of every run, a column of <= GROUP
    # rows of a tile, with plain vector loops. Per tile, a histogram of its run maxima gives a
    # threshold that >= k+1 runs reach, so the tile's k+1 largest |e| all reach it; pass 2 (from
    # cache) collects the entries >= it in ascending local order, ranks them by counting, and
    # writes the rank of the top k, and their flat positions and values at pos/vals[sel[t]:]. Returns
    # the number of non-finite tiles.
    use_prev = prev.size > 0
    n_c = (cols + tw - 1) // tw
    k1 = k + 1
    n_limbs = table.shape[2]
    eb = e.view(np.int32)
    mask = np.int32(0x7FFFFFFF)  # |v| orders as its bits
    run_max = np.empty(((th + GROUP - 1) // GROUP) * cols, dtype=np.int32)  # [row group of the band, column]
    hist = np.empty(N_BINS, dtype=np.int32)
    runs = np.empty(tw, dtype=np.int64)
    cand_v = np.empty(th * tw, dtype=np.int32)
    cand_i = np.empty(th * tw, dtype=np.int64)
    place = np.empty(MAX_COUNTED, dtype=np.int64)
    top_v = np.empty(k1, dtype=np.int32)
    low_v = np.empty(MAX_LOW + 1, dtype=np.int32)
    qsel = np.empty(k1, dtype=np.int64)  # compact indices of the selected entries, ascending
    sink = np.zeros(1, dtype=np.int64)  # keeps the touch loop's loads
    acc = np.empty(n_limbs, dtype=np.int64)
    used = np.ones(k1, dtype=np.int64)  # limbs any C(p, j) fills, per j
    for j in range(k1):
        for limb in range(n_limbs):
            if table[j, table.shape[1] - 1, limb] != 0:
                used[j] = limb + 1
    n_bad = 0
    for band in range(b0, b1):
        r0 = band * th
        vr = min(th, rows - r0)
        ng = (vr + GROUP - 1) // GROUP
        for g in range(ng):  # row slices: indices >= 0, so the loops vectorize
            rm = run_max[g * cols : (g + 1) * cols]
            rm[:] = 0
            for ri in range(g * GROUP, min(vr, g * GROUP + GROUP)):
                row = (r0 + ri) * cols
                er, dr, br = e[row : row + cols], d[row : row + cols], eb[row : row + cols]
                if use_prev:
                    pr = prev[row : row + cols]
                    for c in range(cols):
                        er[c] = beta * pr[c] + dr[c]
                else:
                    for c in range(cols):
                        er[c] = dr[c]
                for c in range(cols):
                    rm[c] = max(rm[c], br[c] & mask)
        for tc in range(n_c):
            t = band * n_c + tc
            c0 = tc * tw
            vc = min(tw, cols - c0)
            top, low = 0, 0x7FFFFFFF
            for g in range(ng):
                rm = run_max[g * cols + c0 : g * cols + c0 + vc]
                for c in range(vc):
                    top = max(top, rm[c])
                    low = min(low, rm[c])
            if top >= 0x7F800000:  # inf or nan
                bad[t] = True
                n_bad += 1
                continue
            n = vr * vc
            if n <= k:  # send every real entry
                for i in range(k):
                    local[t, i] = th * tw if i >= n else (i // vc) * tw + i % vc
                for i in range(n):
                    p = (r0 + i // vc) * cols + c0 + i % vc
                    pos[sel[t] + i] = p
                    vals[sel[t] + i] = e[p]
                continue
            thr = 0
            if ng * vc >= k1:  # bins of run maxima from the top; bins 0 … b hold >= k+1 runs
                shift = 0
                while (top - low) >> shift >= N_BINS:
                    shift += 1
                hist[:] = 0
                for g in range(ng):
                    rm = run_max[g * cols + c0 : g * cols + c0 + vc]
                    for c in range(vc):
                        hist[(top - rm[c]) >> shift] += 1
                cum, b = 0, 0
                while cum + hist[b] < k1:
                    cum += hist[b]
                    b += 1
                thr = max(0, top - ((b + 1) << shift) + 1)
            n_cand = 0
            for g in range(ng):  # candidates >= thr in ascending local order, without branches
                n_runs = 0
                for c in range(vc):
                    runs[n_runs] = c
                    n_runs += run_max[g * cols + c0 + c] >= thr
                for ri in range(g * GROUP, min(vr, g * GROUP + GROUP)):
                    base = (r0 + ri) * cols + c0
                    for i in range(n_runs):
                        a = eb[base + runs[i]] & mask
                        cand_v[n_cand] = a
                        cand_i[n_cand] = ri * tw + runs[i]
                        n_cand += a >= thr
            m = n_cand - k + 1  # >= 2: at least k+1 entries reach thr
            if m <= MAX_LOW + 1:  # the usual case: the m smallest candidates, ascending, by insertion;
                filled = 0  # the largest of them is the k-th largest, the one below it the (k+1)-th
                for i in range(n_cand):
                    v = cand_v[i]
                    if filled == m:
                        if v >= low_v[m - 1]:
                            continue
                        at = m - 1
                    else:
                        at = filled
                        filled += 1
                    while at > 0 and low_v[at - 1] > v:
                        low_v[at] = low_v[at - 1]
                        at -= 1
                    low_v[at] = v
                top_v[k - 1], top_v[k] = low_v[m - 1], low_v[m - 2]
            elif n_cand <= MAX_COUNTED:  # each candidate's place in descending order, ties by position
                for i in range(n_cand):
                    v, r = cand_v[i], 0
                    for i2 in range(n_cand):
                        w = cand_v[i2]
                        r += (w > v) | ((w == v) & (i2 < i))
                    place[i] = r
                top_v[k - 1], top_v[k] = 0, 0
                for i in range(n_cand):
                    top_v[k - 1] = cand_v[i] if place[i] == k - 1 else top_v[k - 1]
                    top_v[k] = cand_v[i] if place[i] == k else top_v[k]
            else:  # many equal magnitudes: the k+1 largest by insertion, descending
                filled = 0
                for i in range(n_cand):
                    v = cand_v[i]
                    if filled == k1:
                        if v <= top_v[k]:
                            continue
                        at = k
                    else:
                        at = filled
                        filled += 1
                    while at > 0 and top_v[at - 1] < v:
                        top_v[at] = top_v[at - 1]
                        at -= 1
                    top_v[at] = v
            kth = top_v[k - 1]
            tie[t] = kth == top_v[k]
            for limb in range(n_limbs):
                acc[limb] = 0
            j = 0
            for i in range(n_cand):  # without a tie the top-k are exactly the candidates >= the k-th
                if cand_v[i] >= kth and j < k:
                    li = cand_i[i]
                    local[t, j] = li
                    p = (r0 + li // tw) * cols + c0 + li % tw
                    pos[sel[t] + j] = p
                    vals[sel[t] + j] = e[p]
                    qsel[j] = (li // tw) * vc + li % tw  # compact index among the tile's real entries
                    j += 1
            touch = np.int64(0)  # the selected rows of the binomial table (MBs) at once: their misses overlap
            for jj in range(j):
                touch += np.int64(table[jj + 1, qsel[jj], 0])
            sink[0] += touch
            for jj in range(j):  # rank = Σ C(q_j, j), limb by limb (carries below)
                for limb in range(used[jj + 1]):
                    acc[limb] += np.int64(table[jj + 1, qsel[jj], limb])
            carry = np.int64(0)
            for limb in range(n_limbs):
                v64 = acc[limb] + carry
                acc[limb] = v64 & 0xFFFFFFFF
                carry = v64 >> 32
            o = off[t]
            for b in range(off[t + 1] - o):
                rank_buf[o + b] = np.uint8((acc[b >> 2] >> (8 * (b & 3))) & 0xFF)
    return n_bad


def _tiles_jit(e: np.ndarray, tiles: np.ndarray, rows: int, cols: int, th: int, tw: int, out: np.ndarray) -> int:
    # out[i] = |e| of tile tiles[i], row by row (th·tw entries), −inf where the tile is padding.
    n_c = (cols + tw - 1) // tw
    for i in range(len(tiles)):
        r0, c0 = (tiles[i] // n_c) * th, (tiles[i] % n_c) * tw
        for ri in range(th):
            for ci in range(tw):
                r, c = r0 + ri, c0 + ci
                out[i, ri * tw + ci] = abs(e[r * cols + c]) if r < rows and c < cols else -np.inf
    return 0


def _subtract_jit(e: np.ndarray, pos: np.ndarray, sent: np.ndarray, sel: np.ndarray, n_c: int, b0: int, b1: int) -> int:
    # e[pos[i]] −= sent[i] (float32) for the entries of the tiles of bands b0 … b1−1.
    for i in range(sel[b0 * n_c], sel[b1 * n_c]):
        e[pos[i]] -= sent[i]
    return 0


def _walk_jit(
    buf: np.ndarray,
    off: np.ndarray,
    kc: np.ndarray,
    sel: np.ndarray,
    rows: int,
    cols: int,
    th: int,
    tw: int,
    table: np.ndarray,
    ftab: np.ndarray,
    vals: np.ndarray,
    scale: np.float32,
    mode: int,
    out: np.ndarray,
    cnt: np.ndarray,
    pos: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    # Unrank each tile's positions (largest p with C(p, j) <= r for j = k_c … 1: the closed form
    # p ≈ (j!·r)^(1/j) + (j−1)/2 (off by ~(j²−1)/(24p)), moved to the float64 binomials' answer, then
    # exact limb comparisons, so the result does not depend on the guess) and visit each sent entry
    # i at flat p:
    # mode 0: pos[i] = p; 1: out[p] = vals[i] after zeroing the band; 4: the same, out already zero;
    # 2: out[p] += vals[i];
    # 3: out[p] += vals[i]·scale. With cnt (size > 0) also cnt[p] += 1 where the added value is non-zero.
    n_c = (cols + tw - 1) // tw
    n_limbs = table.shape[2]
    r = np.empty(n_limbs, dtype=np.int64)
    weights = np.empty(n_limbs, dtype=np.float64)
    for limb in range(n_limbs):
        weights[limb] = 2.0 ** (32 * limb)
    use_cnt = cnt.size > 0
    k_max = table.shape[0] - 1
    lfact = np.zeros(k_max + 1)  # log j!, 1/j, (j−1)/2
    inv_j = np.zeros(k_max + 1)
    half_j = np.zeros(k_max + 1)
    for j in range(1, k_max + 1):
        lfact[j] = math.lgamma(j + 1.0)
        inv_j[j] = 1.0 / j
        half_j[j] = (j - 1.0) / 2.0
    for t in range(b0 * n_c, b1 * n_c):
        if mode == 1 and t % n_c == 0:  # zero the band while it is about to be written
            out[(t // n_c) * th * cols : min(rows, (t // n_c + 1) * th) * cols] = 0
        r0, c0 = (t // n_c) * th, (t % n_c) * tw
        vr, vc = min(th, rows - r0), min(tw, cols - c0)
        inv_vc = 1.0 / vc
        for limb in range(n_limbs):
            r[limb] = 0
        o = off[t]
        for b in range(off[t + 1] - o):
            r[b >> 2] |= np.int64(buf[o + b]) << (8 * (b & 3))
        hi = vr * vc
        nl = n_limbs  # limbs of r that may be non-zero
        while nl > 1 and r[nl - 1] == 0:
            nl -= 1
        for j in range(kc[t], 0, -1):
            rf = 0.0
            for limb in range(max(0, nl - 3), nl):  # 96 bits: error < 2^-60 relative
                rf += r[limb] * weights[limb]
            lo, up = j - 1, hi - 1
            if rf < 1.0:
                p = lo
            else:
                m0 = np.exp((np.log(rf) + lfact[j]) * inv_j[j])
                p = int(m0 + half_j[j])
                p = min(max(p, lo), up)
                while p < up and ftab[j, p + 1] <= rf:
                    p += 1
                while p > lo and ftab[j, p] > rf:
                    p -= 1
            # both float errors are < 1e-14 relative: outside that margin the guess is exact
            sure = ftab[j, p] <= rf * (1.0 - 1e-12) and (p == up or ftab[j, p + 1] > rf * (1.0 + 1e-12))
            while not sure and p < up:  # exact: step up while C(p+1, j) <= r
                le = True
                for limb in range(n_limbs - 1, -1, -1):
                    tv = np.int64(table[j, p + 1, limb])
                    if tv != r[limb]:
                        le = tv < r[limb]
                        break
                if not le:
                    break
                p += 1
            while not sure and p > lo:  # exact: step down while C(p, j) > r
                le = True
                for limb in range(n_limbs - 1, -1, -1):
                    tv = np.int64(table[j, p, limb])
                    if tv != r[limb]:
                        le = tv < r[limb]
                        break
                if le:
                    break
                p -= 1
            borrow = np.int64(0)
            for limb in range(nl):  # C(p, j) <= r: no limb of it lies above r's
                v64 = r[limb] - np.int64(table[j, p, limb]) - borrow
                borrow = np.int64(1) if v64 < 0 else np.int64(0)
                r[limb] = v64 + (borrow << 32)
            while nl > 1 and r[nl - 1] == 0:
                nl -= 1
            hi = p
            q = int((p + 0.5) * inv_vc)  # p // vc: (p + ½)/vc lies >= 1/8192 from any integer
            flat = (r0 + q) * cols + c0 + p - q * vc
            i = sel[t] + j - 1
            if mode == 0:
                pos[i] = flat
            elif mode == 1 or mode == 4:
                out[flat] = vals[i]
            else:
                v = vals[i] if mode == 2 else vals[i] * scale
                out[flat] += v
                if use_cnt and v != 0:
                    cnt[flat] += np.float32(1.0)
    return 0
