"""Benchmark of the SparseLoCo payload on a real model's pseudo-gradient (DESIGN.md §5).

Builds the model preset (or a preset with its layer count changed) whose parameter count is
closest to the request, runs a few real AdamW steps on random tokens, takes Δ = θ_start − θ_now,
and measures the serialized payload: bytes per parameter (budget ≤ 0.0105 at defaults), bits per
index and per value, header bytes, the ratio to dense fp32, the time to compress + serialize, to
parse + decompress, to parse and clip-and-aggregate M payloads, and the peak memory of that
aggregation against one dense float32 copy of the parameters.

The default baseline is `peer.research.simulate.templar_baseline`, a pure-torch re-implementation of templar's
`TopKCompressor` (v2.1.3: chunked top-k, 12-bit packed indices, 8-bit values with a lookup
table). Each repetition times `peer`'s encode, its decode and the baseline's round trip one after
the other on the same tensors in the same process, so a busy machine slows all three alike;
the reported times are the medians.

`encode_s` is the steady state of a run: round 2 and later, each encoding Δ into the error buffers
of the round before, which `compress(..., in_place=True)` overwrites with the new ones (as a peer
that drops its old buffers does), so no buffer of the model's size is allocated. The first round
(fresh buffers, no error feedback yet) is reported apart as `encode_first_round_s`. `decode_s` is
the steady state of a receiver too: it parses the wire bytes and decodes them into the dense
tensors of the round before (`decompress(..., out=...)`), which a receiver that dropped the old
round's Δ̂ reuses, so no fresh page is touched; the first decode, into new tensors, is reported
apart as `decode_first_round_s`. (The swarm's commit decodes no payload densely any more: it
parses and scatters each one straight into the commit's reused accumulators, see
`peer.core.sparseloco.commit`; `aggregate_s` times that fused path for M payloads.)

`codec_runs` (`peer bench codec [--params N] [--runs RUNS] [--templar-src DIR]`) runs `codec_figures` RUNS
times (default 5) in one process on one real Δ (178M by default) and gives each run's speed-up over the
baseline and their median: the round trip's figure of issue 24. With `--templar-src DIR` (a templar
checkout), templar's real `ChunkingTransformer` + `TopKCompressor` round trip is timed as well, in the
same repetitions (`peer.research.simulate.templar_real`; no templar code ships with `peer`).

Invariant: bytes are counted from `Payload.to_bytes()`, i.e. exactly what goes on the wire.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import psutil
import torch
import torch.nn.functional as F

from peer.core.model.decoder import PRESETS, ModelConfig, build_model, get_preset
from peer.core.model.optim import TrainConfig, build_adamw, clip_grads
from peer.core.sparseloco.algorithm import (
    clip_and_aggregate,
    compress,
    decompress,
    ideal_bytes_per_param,
    payload_density,
    pseudo_gradient,
)
from peer.core.sparseloco.codec import kernels as codec_kernels
from peer.core.sparseloco.codec.format import SPARSE, Payload, SparseLoCoConfig, index_nbytes, n_selected
from peer.errors import ConfigError
from peer.research.simulate import templar_baseline

log = logging.getLogger(__name__)


def closest_model(n_params: int) -> tuple[str, ModelConfig]:
    """The preset, possibly with another n_layers (1 … 2× its own), closest to n_params."""
    if n_params < 1:
        raise ConfigError(f"--params must be a positive parameter count, got {n_params}")
    best: tuple[int, str, ModelConfig] | None = None
    for name, preset in PRESETS.items():
        for n_layers in range(1, 2 * preset.n_layers + 1):
            cfg = get_preset(name, n_layers=n_layers)
            gap = abs(cfg.n_params - n_params)
            if best is None or gap < best[0]:
                label = name if n_layers == preset.n_layers else f"{name}@{n_layers}layers"
                best = (gap, label, cfg)
    assert best is not None  # PRESETS is not empty
    return best[1], best[2]


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(median seconds of `repeats` calls, the last result)."""
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _aggregate_child(wire: bytes, total: int, cfg: SparseLoCoConfig, m: int) -> int:
    """In a fresh process: peak resident bytes added while parsing and clip-and-aggregating m payloads
    (sampled every millisecond; the kernels are loaded and torch's thread pool warmed up on a tiny
    payload first)."""
    proc = psutil.Process()
    codec_kernels.compiled(codec_kernels.NUMBA_MIN_WORK)  # numba and its compiled kernels load now
    tiny = compress({"w": torch.ones(64, 64)}, None, cfg)[0]
    clip_and_aggregate([tiny, tiny], cfg.clip_median_factor, cfg.aggregation)
    base = peak = proc.memory_info().rss
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    payloads = [Payload.from_bytes(wire, max_bytes=len(wire), max_elements=total, cfg=cfg) for _ in range(m)]
    agg = clip_and_aggregate(payloads, cfg.clip_median_factor, cfg.aggregation)[0]
    done.set()
    thread.join()
    peak = max(peak, proc.memory_info().rss)
    del agg
    return int(peak - base)


def _aggregate_peak(wire: bytes, total: int, cfg: SparseLoCoConfig, m: int) -> int:
    """Peak memory of aggregating m payloads, measured in a spawned process (a clean allocator)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return int(pool.apply(_aggregate_child, (wire, total, cfg, m)))


Baseline = Callable[[Mapping[str, torch.Tensor], int, int], dict[str, float]]
"""A codec to compare with: (Δ, topk, chunk) -> {"encode_s", "decode_s", "bytes_per_param"}."""


def baselines_for(templar_src: str | None) -> dict[str, Baseline]:
    """The re-implementation as `templar`, and, given a templar checkout, its real codec as `templar_real`."""
    out: dict[str, Baseline] = {"templar": templar_baseline.roundtrip}
    if templar_src is not None:
        from peer.research.simulate.templar_real import RealTemplar

        out["templar_real"] = RealTemplar(templar_src).roundtrip
    return out


def _size_figures(payload: Payload, cfg: SparseLoCoConfig) -> dict[str, float]:
    """Bits per sent index and per value of a payload's sparse entries, and its header bytes."""
    sparse = [e for e in payload.entries if e.kind == SPARSE]
    n_idx = sum(n_selected(e.shape, cfg.chunk, cfg.topk) for e in sparse)
    idx_bytes = sum(index_nbytes(e.shape, cfg.chunk, cfg.topk) for e in sparse)
    value_bytes = sum(((cfg.quant_bits or 32) * n_selected(e.shape, cfg.chunk, cfg.topk) + 7) // 8 for e in sparse)
    return {
        "bits_per_index": 8 * idx_bytes / max(n_idx, 1),
        "bits_per_value": 8 * value_bytes / max(n_idx, 1),
        "header_bytes": 13 + sum(6 + len(e.name.encode()) + 4 * len(e.shape) for e in payload.entries),
    }


def codec_figures(
    delta: Mapping[str, torch.Tensor],
    cfg: SparseLoCoConfig,
    repeats: int = 3,
    n_aggregate: int = 16,
    baselines: Mapping[str, Baseline] | None = None,
) -> dict[str, Any]:
    """Sizes, median times (encode, decode, each baseline's round trip, aggregate-M) and aggregation memory.

    Encode times are of the steady state (round >= 2, error buffers reused in place; see the module
    docstring); the first round's is `encode_first_round_s`. `baselines` (default: the templar
    re-implementation as `templar`) each report NAME_encode_s, NAME_decode_s, NAME_roundtrip_s,
    NAME_bytes_per_param and speedup_vs_NAME.
    """
    baselines = baselines or {"templar": templar_baseline.roundtrip}
    total = sum(t.numel() for t in delta.values())
    errors: dict[str, torch.Tensor] | None = None

    def encode() -> tuple[Payload, bytes]:
        nonlocal errors
        payload, errors = compress(delta, errors, cfg, in_place=True)  # the next round's buffers
        return payload, payload.to_bytes()

    def parse(b: bytes) -> Payload:
        return Payload.from_bytes(b, max_bytes=max(len(b), 1), max_elements=total, cfg=cfg)

    received: dict[str, torch.Tensor] = {}  # the receiver's dense Δ̂ of the round before, reused

    def decode(b: bytes) -> float:
        def once() -> None:
            nonlocal received
            received = decompress(parse(b), out=received or None)

        return _median_time(once, 1)[0]

    first_s, (_, first_wire) = _median_time(encode, 1)  # round 1: fresh error buffers
    first_decode_s = decode(first_wire)  # round 1 of a receiver: new tensors
    enc_times, dec_times = [], []
    base_runs: dict[str, list[dict[str, float]]] = {name: [] for name in baselines}
    for _ in range(repeats):  # rounds 2, 3, …, interleaved: a busy machine slows each codec alike
        t, (payload, wire) = _median_time(encode, 1)
        enc_times.append(t)
        dec_times.append(decode(wire))
        for name, roundtrip in baselines.items():
            base_runs[name].append(roundtrip(delta, cfg.topk, cfg.chunk))
    encode_s, decode_s = statistics.median(enc_times), statistics.median(dec_times)
    dense_copy = 4 * total

    def aggregate_m() -> dict[str, torch.Tensor]:
        payloads = [parse(wire) for _ in range(n_aggregate)]
        return clip_and_aggregate(payloads, cfg.clip_median_factor, cfg.aggregation)[0]

    aggregate_s = _median_time(aggregate_m, 1)[0]
    peak = _aggregate_peak(wire, total, cfg, n_aggregate)
    out: dict[str, Any] = {
        "payload_bytes": len(wire),
        "bytes_per_param": len(wire) / total,
        **_size_figures(payload, cfg),
        "encode_first_round_s": first_s,
        "encode_s": encode_s,
        "decode_first_round_s": first_decode_s,
        "decode_s": decode_s,
        "roundtrip_s": encode_s + decode_s,
        "aggregate_m": n_aggregate,
        "aggregate_s": aggregate_s,
        "aggregate_peak_bytes": peak,
        "aggregate_peak_vs_dense": peak / dense_copy,
    }
    for name, runs in base_runs.items():
        t_enc = statistics.median(t["encode_s"] for t in runs)
        t_dec = statistics.median(t["decode_s"] for t in runs)
        out[f"{name}_bytes_per_param"] = runs[0]["bytes_per_param"]
        out[f"{name}_encode_s"] = t_enc
        out[f"{name}_decode_s"] = t_dec
        out[f"{name}_roundtrip_s"] = t_enc + t_dec
        out[f"speedup_vs_{name}"] = (t_enc + t_dec) / (encode_s + decode_s)
    return out


def real_delta(
    model_cfg: ModelConfig, seed: int = 0, steps: int = 3, seq_len: int = 16
) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """(Δ = θ_start − θ_now after `steps` real AdamW steps on random tokens, the model)."""
    torch.manual_seed(seed)
    model = build_model(model_cfg, seed=seed)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train = TrainConfig()
    opt = build_adamw(model.named_parameters(), train)
    gen = torch.Generator().manual_seed(seed)
    seq_len = min(seq_len, model_cfg.max_seq_len)
    for _ in range(steps):
        tokens = torch.randint(0, model_cfg.vocab_size, (1, seq_len + 1), generator=gen)  # (1, L+1)
        logits = model(tokens[:, :-1])  # (1, L, V)
        loss = F.cross_entropy(logits.reshape(-1, model_cfg.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_grads(model.parameters(), train.grad_clip)
        opt.step()
    return pseudo_gradient(start, dict(model.named_parameters())), model


def bench_payload(
    n_params: int,
    seed: int = 0,
    steps: int = 3,
    cfg: SparseLoCoConfig | None = None,
    seq_len: int = 16,
    repeats: int = 3,
    n_aggregate: int = 16,
    templar_src: str | None = None,
) -> dict[str, Any]:
    """Measure the payload of one round for a model of about `n_params` parameters.

    Times are medians of `repeats` runs; aggregation parses and clip-and-aggregates `n_aggregate`
    copies of the payload (the work and memory of as many distinct ones). `templar_src`, a templar
    checkout, adds its real codec as the `templar_real` baseline (`peer.research.simulate.templar_real`).
    """
    cfg = cfg or SparseLoCoConfig()
    baselines = baselines_for(templar_src)  # a bad checkout fails before the model is built
    preset, model_cfg = closest_model(n_params)
    t0 = time.perf_counter()
    delta, model = real_delta(model_cfg, seed, steps, seq_len)
    train_s = time.perf_counter() - t0
    total = sum(t.numel() for t in delta.values())

    t0 = time.perf_counter()
    payload, errors = compress(delta, None, cfg)
    wire = payload.to_bytes()
    compress_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    decoded = decompress(Payload.from_bytes(wire, max_bytes=max(len(wire), 1), max_elements=total, cfg=cfg))
    decompress_s = time.perf_counter() - t0

    sent_norm = sum(float(d.double().square().sum()) for d in decoded.values()) ** 0.5
    delta_norm = sum(float(d.double().square().sum()) for d in delta.values()) ** 0.5
    result = {
        "n_params": total,
        "target_params": n_params,
        "preset": preset,
        "model": model_cfg.to_dict(),
        "sparseloco": dataclasses.asdict(cfg),
        "steps": steps,
        "seed": seed,
        "payload_bytes": len(wire),
        "bytes_per_param": len(wire) / total,
        "ideal_bytes_per_param": ideal_bytes_per_param(cfg),
        "ratio_vs_fp32": 4 * total / len(wire),
        "density": payload_density(cfg),
        "n_tensors": len(payload.entries),
        "compress_s": compress_s,
        "decompress_s": decompress_s,
        "train_s": train_s,
        "sent_norm_fraction": sent_norm / delta_norm if delta_norm else 0.0,
        "roundtrip_exact": Payload.from_bytes(wire, max_bytes=len(wire), max_elements=total).to_bytes() == wire,
    }
    del decoded, errors, payload, model
    result.update(codec_figures(delta, cfg, repeats, n_aggregate, baselines))
    log.info(
        "payload benchmark: %s params (%s), %d bytes, %.5f B/param, %.0fx vs fp32",
        total,
        preset,
        len(wire),
        result["bytes_per_param"],
        result["ratio_vs_fp32"],
    )
    return result


def codec_runs(n_params: int = 178_000_000, runs: int = 5, templar_src: str | None = None) -> Iterator[dict[str, Any]]:
    """`codec_figures` `runs` times in this one process on one real Δ of about `n_params` parameters, after
    one untimed round trip of each baseline, each run's median of 3 repetitions. Yields, as each is known,
    one dict per run ({"run", "preset", its times and speed-ups over each baseline}), then one per baseline
    ({"baseline", "speedups", "median"}). With `templar_src`, templar's real codec from that checkout is
    timed too (`templar_real`), beside the re-implementation (`templar`)."""
    if runs < 1:
        raise ConfigError("--runs must be 1 or more")
    baselines = baselines_for(templar_src)
    preset, model_cfg = closest_model(n_params)
    delta, model = real_delta(model_cfg)
    del model
    cfg = SparseLoCoConfig()
    for roundtrip in baselines.values():  # warm-up, untimed: torch's first top-k and scatter at these shapes
        roundtrip(delta, cfg.topk, cfg.chunk)
    speedups: dict[str, list[float]] = {name: [] for name in baselines}
    for run in range(runs):
        log.info("codec run %d of %d (%s)", run + 1, runs, preset)
        r = codec_figures(delta, cfg, repeats=3, n_aggregate=2, baselines=baselines)
        for name in baselines:
            speedups[name].append(r[f"speedup_vs_{name}"])
        times = {k: round(v, 4) for k, v in r.items() if k.endswith("_s") or k.startswith("speedup_vs_")}
        yield {"run": run + 1, "preset": preset, **times}
    for name, got in speedups.items():
        yield {"baseline": name, "speedups": [round(x, 3) for x in got], "median": round(statistics.median(got), 3)}
