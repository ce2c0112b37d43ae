"""Times templar's own codec, imported from a checkout the user has, beside `peer`'s (issue 24).

`peer.research.simulate.templar_baseline` is our re-implementation of templar's top-k codec; this module is
the other baseline: it imports `tplr.compress` from a directory the user names (a templar
checkout, its `src/`, or any directory holding `tplr/compress.py` or `tplr/compress/`), and times
the real `ChunkingTransformer` + `TopKCompressor` round trip on the same tensors, the way
templar's miner and outer step use them:

  encode  transformer.encode(x, use_dct=False), compressor.compress(tiles, topk) with
          TopKCompressor(use_quantization=True, quantization_bins=256, quantization_range=6)
          (templar's defaults: 12-bit packed indices, 8-bit values with a lookup table);
  decode  compressor.decompress(p, idx, val, xshape, totalk, qparams), transformer.decode(…).

The ChunkingTransformer is built once per set of shapes, outside the timed region (templar builds
it once, at start-up). Sizes are the tensors' own bytes (indices, codes, lookup, shift, scale), not
templar's torch.save framing, as the re-implementation counts them. No templar code is shipped with
`peer`: without a directory, `peer` times the re-implementation only.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from peer.errors import ConfigError

N_BINS = 256
RANGE_SIGMAS = 6


def find_root(src_dir: str | Path) -> Path:
    """The directory to put on sys.path: `src_dir` or its `src/`, whichever holds tplr's codec."""
    base = Path(src_dir).expanduser()
    for root in (base, base / "src"):
        if (root / "tplr" / "compress.py").is_file() or (root / "tplr" / "compress" / "__init__.py").is_file():
            return root
    raise ConfigError(
        f"--templar-src {src_dir}: no tplr/compress.py (nor src/tplr/compress.py, nor a tplr/compress/ package) "
        "there; name a templar checkout (github.com/tplr-ai/templar) or the directory holding its tplr/ package"
    )


def load(src_dir: str | Path) -> ModuleType:
    """templar's `tplr.compress`, imported from `src_dir` (see `find_root`)."""
    root = str(find_root(src_dir))
    if root not in sys.path:
        sys.path.insert(0, root)
    try:
        mod = importlib.import_module("tplr.compress")
    except ImportError as exc:
        raise ConfigError(f"--templar-src {src_dir}: importing tplr.compress failed: {exc}") from exc
    if not hasattr(mod, "TopKCompressor") or not hasattr(mod, "ChunkingTransformer"):
        raise ConfigError(f"--templar-src {src_dir}: tplr.compress has no TopKCompressor/ChunkingTransformer")
    return mod


class _ShapesModel:
    """What ChunkingTransformer reads of a model: named_parameters() with shape, dtype, device, requires_grad."""

    def __init__(self, delta: Mapping[str, torch.Tensor]) -> None:
        self._params = [
            (n, SimpleNamespace(shape=t.shape, dtype=t.dtype, device=t.device, requires_grad=True))
            for n, t in delta.items()
        ]

    def named_parameters(self) -> list[tuple[str, Any]]:
        return self._params


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RealTemplar:
    """templar's codec from a checkout; `roundtrip` has the signature of `templar_baseline.roundtrip`."""

    def __init__(self, src_dir: str | Path) -> None:
        self.src_dir = str(src_dir)
        self.mod = load(src_dir)
        self.compressor = self.mod.TopKCompressor(
            use_quantization=True, quantization_bins=N_BINS, quantization_range=RANGE_SIGMAS
        )
        self._transformers: dict[tuple[Any, ...], Any] = {}

    def transformer(self, delta: Mapping[str, torch.Tensor], chunk: int) -> Any:
        """The ChunkingTransformer of these shapes (built once, as templar does at start-up)."""
        key = (chunk, *sorted({s for t in delta.values() for s in t.shape}))
        if key not in self._transformers:
            self._transformers[key] = self.mod.ChunkingTransformer(_ShapesModel(delta), chunk)
        return self._transformers[key]

    def roundtrip(self, delta: Mapping[str, torch.Tensor], topk: int = 32, chunk: int = 64) -> dict[str, float]:
        """Seconds to encode every tensor, seconds to decode them all, and bytes per parameter."""
        tr, comp = self.transformer(delta, chunk), self.compressor
        t0 = time.perf_counter()
        sent = {name: comp.compress(tr.encode(x, use_dct=False), topk) for name, x in delta.items()}
        encode_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for name, (idx, val, xshape, totalk, qparams) in sent.items():
            tr.decode(comp.decompress(delta[name], idx, val, xshape, totalk, qparams), use_dct=False)
        decode_s = time.perf_counter() - t0
        # indices, 8-bit codes, float32 lookup, float32 shift and scale: the re-implementation's count
        n_bytes = sum(_nbytes(idx) + _nbytes(val) + 4 * q[3].numel() + 8 for idx, val, _, _, q in sent.values())
        total = sum(t.numel() for t in delta.values())
        return {"encode_s": encode_s, "decode_s": decode_s, "bytes_per_param": n_bytes / max(total, 1)}
