"""A pure-torch re-implementation of templar's top-k codec, the speed and size baseline of `peer bench payload`.

Written for this benchmark after reading templar's v2.1.3 codec (src/tplr/compress.py: the
`ChunkingTransformer` without DCT, `TopKCompressor` with 8-bit quantization and
`pack_12bit_indices`); templar itself is not installable here, and no code is copied. Per tensor:

  encode  each dimension is cut into chunks of its largest divisor <= 64 (so 64×64 tiles for the
          preset shapes, 43×64 for a 688-row matrix; 1-D tensors: runs of that divisor), the tiles
          are laid out as rows (y, x, h·w) (a copy), torch.topk of |x| per row (k = min(topk, row),
          at least 2, even; sorted=False), torch.gather of the values, two 12-bit indices packed in
          three bytes, and 8-bit values: shift = mean, scale = 6σ / 256, code = round(v/scale + 128)
          clamped to 0 … 255, sent with a 256-entry lookup table of each code's mean (scatter_add);
  wire    packed indices | uint8 codes | float32 lookup × 256 | float32 shift, float32 scale;
  decode  lookup[code] + shift, torch.zeros of the tile rows, the 12-bit indices unpacked,
          scatter_reduce_(mean, include_self=False), and the tiles laid back out as the tensor.

It runs on the same tensors in the same process as `peer`'s codec, and is timed the same way.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Mapping

import numpy as np
import torch

N_BINS = 256
RANGE_SIGMAS = 6


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of n that is <= limit (templar's chunk size of a dimension)."""
    best = 1
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            for cand in (d, n // d):
                if cand <= limit:
                    best = max(best, cand)
    return best


def pack12(idx: torch.Tensor) -> torch.Tensor:
    """Indices < 4096, an even number of them, two per three bytes. (n/2·3,) uint8."""
    pairs = idx.reshape(-1, 2).to(torch.int32)
    a, b = pairs[:, 0], pairs[:, 1]
    out = torch.empty(pairs.shape[0], 3, dtype=torch.uint8)
    out[:, 0] = (a & 0xFF).to(torch.uint8)
    out[:, 1] = (((a >> 8) & 0xF) | ((b & 0xF) << 4)).to(torch.uint8)
    out[:, 2] = ((b >> 4) & 0xFF).to(torch.uint8)
    return out.reshape(-1)


def unpack12(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack12: (n,) int64."""
    trip = packed.reshape(-1, 3).to(torch.int64)
    out = torch.empty(trip.shape[0], 2, dtype=torch.int64)
    out[:, 0] = trip[:, 0] | ((trip[:, 1] & 0xF) << 8)
    out[:, 1] = (trip[:, 1] >> 4) | (trip[:, 2] << 4)
    return out.reshape(-1)[:n]


def _dims(shape: tuple[int, ...], chunk: int) -> tuple[int, int, int, int]:
    """(y, x, h, w): tiles of h×w (a 1-D tensor: 1 × x runs of w)."""
    if len(shape) >= 2:
        rows, cols = shape[0], math.prod(shape[1:])
        h, w = largest_divisor(rows, chunk), largest_divisor(cols, chunk)
        return rows // h, cols // w, h, w
    w = largest_divisor(math.prod(shape), chunk)
    return 1, math.prod(shape) // w, 1, w


def _tile_rows(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """The tensor's tiles, one per row: (y, x, h·w) (a copy) or, for 1-D, (x, w)."""
    y, xx, h, w = _dims(tuple(x.shape), chunk)
    if x.dim() >= 2:
        return x.reshape(y, h, xx, w).permute(0, 2, 1, 3).reshape(y, xx, h * w)
    return x.reshape(xx, w)


def _quantize(val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """(codes uint8, lookup (256,) float32, shift, scale): 8-bit codes over ±3σ, bins' means as values."""
    shift = val.mean()
    centred = val - shift
    std = centred.norm() / math.sqrt(max(1, centred.numel() - 1))
    scale = float(RANGE_SIGMAS * std / N_BINS)
    if scale == 0 or not math.isfinite(scale):
        scale = 1.0
    codes = (centred / scale + N_BINS // 2).round().clamp(0, N_BINS - 1).to(torch.uint8)
    flat = codes.reshape(-1).long()
    sums = torch.zeros(N_BINS).scatter_add_(0, flat, centred.reshape(-1))
    counts = torch.zeros(N_BINS).scatter_add_(0, flat, torch.ones(flat.numel()))
    lookup = torch.where(counts > 0, sums / counts, torch.zeros_like(sums))
    return codes, lookup, float(shift), scale


def encode(x: torch.Tensor, topk: int = 32, chunk: int = 64) -> tuple[bytes, tuple[int, ...]]:
    """(wire bytes, tile-row shape) of one tensor."""
    rows = _tile_rows(x, chunk)
    k = max(2, min(topk, rows.shape[-1]))
    k -= k % 2
    idx = torch.topk(rows.abs(), k, dim=-1, largest=True, sorted=False).indices
    if int(idx.max()) >= 4096:
        raise ValueError("an index exceeds 12 bits")
    val = torch.gather(rows, -1, idx)
    codes, lookup, shift, scale = _quantize(val)
    wire = b"".join(
        [
            pack12(idx).numpy().tobytes(),
            codes.numpy().tobytes(),
            lookup.numpy().tobytes(),
            struct.pack("<ff", shift, scale),
        ]
    )
    return wire, tuple(idx.shape)


def decode(wire: bytes, idx_shape: tuple[int, ...], shape: tuple[int, ...], chunk: int = 64) -> torch.Tensor:
    """The dense tensor of `shape` from encode's bytes."""
    n = math.prod(idx_shape)
    packed = torch.from_numpy(np.frombuffer(wire, dtype=np.uint8, count=n // 2 * 3).copy())
    codes = torch.from_numpy(np.frombuffer(wire, dtype=np.uint8, count=n, offset=n // 2 * 3).copy())
    lookup = torch.from_numpy(np.frombuffer(wire, dtype=np.float32, count=N_BINS, offset=n // 2 * 3 + n).copy())
    shift = struct.unpack_from("<f", wire, n // 2 * 3 + n + 4 * N_BINS)[0]
    val = (lookup[codes.long()] + shift).reshape(idx_shape)
    y, xx, h, w = _dims(shape, chunk)
    out = torch.zeros(idx_shape[:-1] + (h * w,))
    out.scatter_reduce_(-1, unpack12(packed, n).reshape(idx_shape), val, reduce="mean", include_self=False)
    if len(shape) >= 2:
        return out.reshape(y, xx, h, w).permute(0, 2, 1, 3).reshape(shape)
    return out.reshape(shape)


def roundtrip(delta: Mapping[str, torch.Tensor], topk: int = 32, chunk: int = 64) -> dict[str, float]:
    """Seconds to encode every tensor, seconds to decode them all, and bytes per parameter."""
    t0 = time.perf_counter()
    encoded = {name: encode(x, topk, chunk) for name, x in delta.items()}
    encode_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for name, (wire, idx_shape) in encoded.items():
        decode(wire, idx_shape, tuple(delta[name].shape), chunk)
    decode_s = time.perf_counter() - t0
    n_bytes = sum(len(wire) for wire, _ in encoded.values())
    total = sum(t.numel() for t in delta.values())
    return {"encode_s": encode_s, "decode_s": decode_s, "bytes_per_param": n_bytes / max(total, 1)}
