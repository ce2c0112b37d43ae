"""Whole-tensor fused kernels of the SparseLoCo payload, split over the CPU cores.

Encode, one pass per tile (`encode_tiles`): e = β·e_prev + Δ (or a copy of Δ) is written to the
new error buffer while the tile's |e| maxima per run of <= 64 entries are taken; the tile's top-k
is chosen from the entries that reach the (k+1)-th largest run maximum, and the rank of its sorted
positions (see payload_kernels) is written straight into the wire buffer. Decode (`walk_tiles`):
each tile's rank is unranked and every sent entry is written at its flat position: the position
itself, out[p] = v, or out[p] += v·scale (the fused decode-and-aggregate), without any per-entry
array in between.

Each call splits the tiles of one tensor into contiguous ranges run on a small thread pool (the
kernels are compiled with nogil); distinct tiles touch distinct entries, so the result does not
depend on the split. Arithmetic is the float32 of the torch/numpy reference (β·e is rounded before
+ Δ; a scaled value is rounded before it is added), so the bits equal the numpy path, which tests
check. Every index a kernel writes lies inside its tile's real part, whatever the rank bytes hold.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

MIN_SPLIT_WORK = 1 << 18  # tensors with fewer entries run on the calling thread

_pool: dict[str, Any] = {"executor": None, "lock": threading.Lock()}


def _forget_pool() -> None:  # a forked child has none of the parent's pool threads: start afresh
    _pool["executor"], _pool["lock"] = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def n_workers() -> int:
    """CPU cores this process may use (the size of the kernel thread pool)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def run_split(kernel: Callable[..., Any], n_bands: int, work: int, *args: Any) -> list[Any]:
    """kernel(*args, b0, b1) over contiguous ranges of bands (tile rows) covering [0, n_bands), on the
    thread pool when `work` (entries) is large enough; the results in range order."""
    parts = min(n_workers(), n_bands) if work >= MIN_SPLIT_WORK else 1
    bounds = [n_bands * i // parts for i in range(parts + 1)]
    if parts <= 1:
        return [kernel(*args, 0, n_bands)]
    with _pool["lock"]:
        if _pool["executor"] is None:
            _pool["executor"] = ThreadPoolExecutor(max_workers=parts, thread_name_prefix="peer-codec")
        executor: ThreadPoolExecutor = _pool["executor"]
    futures = [executor.submit(kernel, *args, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    first = kernel(*args, bounds[0], bounds[1])  # the caller takes the first range itself
    return [first] + [f.result() for f in futures]


# ------------------------------------------------------------------------------------------
# numba kernels (plain Python here; compiled by payload_kernels._compile with nogil)
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
    b0: int,
    b1: int,
) -> int:
    # Per band of tiles (tile rows b0 … b1−1), pass 1 streams the band's rows: it writes e and
    # takes the max |e| (as int32 bits) of every run of <= 64 entries of a tile row. Per tile, the
    # (k+1)-th largest run maximum is <= the tile's (k+1)-th largest |e|, so pass 2 (from cache)
    # only ranks entries >= it, collected in ascending local order. Returns the non-finite tiles.
    use_prev = prev.size > 0
    n_c = (cols + tw - 1) // tw
    segs = (tw + 63) // 64
    k1 = k + 1
    n_limbs = table.shape[2]
    seg_max = np.empty(n_c * th * segs, dtype=np.int32)  # [tile of the band, row, run]
    finite = np.empty(n_c, dtype=np.bool_)
    cand_v = np.empty(th * tw, dtype=np.int32)
    cand_i = np.empty(th * tw, dtype=np.int64)
    vals = np.empty(k1, dtype=np.int32)
    acc = np.empty(n_limbs, dtype=np.int64)
    n_bad = 0
    for band in range(b0, b1):
        r0 = band * th
        vr = min(th, rows - r0)
        finite[:] = True
        for ri in range(vr):
            for tc in range(n_c):
                base = (r0 + ri) * cols + tc * tw
                vc = min(tw, cols - tc * tw)
                for s0 in range(0, vc, 64):
                    m = 0
                    if use_prev:
                        for ci in range(base + s0, base + min(vc, s0 + 64)):
                            v = beta * prev[ci] + d[ci]
                            e[ci] = v
                            m = max(m, int(np.float32(v).view(np.int32) & 0x7FFFFFFF))  # |v| orders as its bits
                    else:
                        for ci in range(base + s0, base + min(vc, s0 + 64)):
                            v = d[ci]
                            e[ci] = v
                            m = max(m, int(np.float32(v).view(np.int32) & 0x7FFFFFFF))
                    if m >= 0x7F800000:  # inf or nan
                        finite[tc] = False
                    seg_max[(tc * th + ri) * segs + (s0 >> 6)] = m
        for tc in range(n_c):
            t = band * n_c + tc
            c0 = tc * tw
            vc = min(tw, cols - c0)
            if not finite[tc]:
                bad[t] = True
                n_bad += 1
                continue
            n = vr * vc
            if n <= k:  # send every real entry
                for i in range(k):
                    local[t, i] = th * tw if i >= n else (i // vc) * tw + i % vc
                continue
            thr = 0
            if vr * ((vc + 63) >> 6) >= k1:
                filled = 0
                for ri in range(vr):
                    for s in range((vc + 63) >> 6):
                        v = seg_max[(tc * th + ri) * segs + s]
                        if filled == k1:
                            if v <= vals[k]:
                                continue
                            pos = k
                        else:
                            pos = filled
                            filled += 1
                        while pos > 0 and vals[pos - 1] < v:
                            vals[pos] = vals[pos - 1]
                            pos -= 1
                        vals[pos] = v
                thr = vals[k]
            n_cand = 0
            for ri in range(vr):
                base = (r0 + ri) * cols + c0
                for s0 in range(0, vc, 64):
                    if seg_max[(tc * th + ri) * segs + (s0 >> 6)] >= thr:  # runs that reach the threshold
                        for ci in range(s0, min(vc, s0 + 64)):
                            a = np.float32(e[base + ci]).view(np.int32) & 0x7FFFFFFF
                            if a >= thr:
                                cand_v[n_cand] = a
                                cand_i[n_cand] = ri * tw + ci
                                n_cand += 1
            filled = 0
            for i in range(n_cand):  # the k+1 largest candidate magnitudes, descending
                v = cand_v[i]
                if filled == k1:
                    if v <= vals[k]:
                        continue
                    pos = k
                else:
                    pos = filled
                    filled += 1
                while pos > 0 and vals[pos - 1] < v:
                    vals[pos] = vals[pos - 1]
                    pos -= 1
                vals[pos] = v
            kth = vals[k - 1]
            tie[t] = kth == vals[k]
            for limb in range(n_limbs):
                acc[limb] = 0
            j = 0
            for i in range(n_cand):  # without a tie the top-k are exactly the candidates >= the k-th
                if cand_v[i] >= kth and j < k:
                    li = cand_i[i]
                    local[t, j] = li
                    qc = (li // tw) * vc + li % tw  # compact index among the tile's real entries
                    for limb in range(n_limbs):
                        acc[limb] += np.int64(table[j + 1, qc, limb])
                    j += 1
            carry = np.int64(0)
            for limb in range(n_limbs):
                v64 = acc[limb] + carry
                acc[limb] = v64 & 0xFFFFFFFF
                carry = v64 >> 32
            o = off[t]
            for b in range(off[t + 1] - o):
                rank_buf[o + b] = np.uint8((acc[b >> 2] >> (8 * (b & 3))) & 0xFF)
    return n_bad


def _gather_jit(
    e: np.ndarray,
    local: np.ndarray,
    kc: np.ndarray,
    sel: np.ndarray,
    cols: int,
    th: int,
    tw: int,
    vals: np.ndarray,
    pos: np.ndarray,
    b0: int,
    b1: int,
) -> int:
    # Flat positions and values of the sent entries, tile by tile, ascending inside a tile.
    n_c = (cols + tw - 1) // tw
    for t in range(b0 * n_c, b1 * n_c):
        r0, c0 = (t // n_c) * th, (t % n_c) * tw
        for i in range(kc[t]):
            li = local[t, i]
            p = (r0 + li // tw) * cols + c0 + li % tw
            pos[sel[t] + i] = p
            vals[sel[t] + i] = e[p]
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
    # Unrank each tile's positions (largest p with C(p, j) <= r for j = k_c … 1: a binary search on
    # float64 binomials, then exact limb comparisons) and visit each sent entry i at flat p:
    # mode 0: pos[i] = p; 1: out[p] = vals[i] after zeroing the band; 2: out[p] += vals[i];
    # 3: out[p] += vals[i]·scale. With cnt (size > 0) also cnt[p] += 1 where the added value is non-zero.
    n_c = (cols + tw - 1) // tw
    n_limbs = table.shape[2]
    r = np.empty(n_limbs, dtype=np.int64)
    weights = np.empty(n_limbs, dtype=np.float64)
    for limb in range(n_limbs):
        weights[limb] = 2.0 ** (32 * limb)
    use_cnt = cnt.size > 0
    for t in range(b0 * n_c, b1 * n_c):
        if mode == 1 and t % n_c == 0:  # zero the band while it is about to be written
            out[(t // n_c) * th * cols : min(rows, (t // n_c + 1) * th) * cols] = 0
        r0, c0 = (t // n_c) * th, (t % n_c) * tw
        vr, vc = min(th, rows - r0), min(tw, cols - c0)
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
            for limb in range(nl):
                rf += r[limb] * weights[limb]
            lo, up = j - 1, hi - 1
            p, size = lo, up - lo + 1  # largest p in [lo, up] with float C(p, j) <= float r: a guess
            while size > 1:  # branch-free halving (C(lo, j) = 0 <= r)
                half = size >> 1
                p = p + half if ftab[j, p + half] <= rf else p
                size -= half
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
            flat = (r0 + p // vc) * cols + c0 + p % vc
            i = sel[t] + j - 1
            if mode == 0:
                pos[i] = flat
            elif mode == 1:
                out[flat] = vals[i]
            else:
                v = vals[i] if mode == 2 else vals[i] * scale
                out[flat] += v
                if use_cnt and v != 0:
                    cnt[flat] += np.float32(1.0)
    return 0
