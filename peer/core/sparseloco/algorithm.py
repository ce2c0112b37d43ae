"""SparseLoCo: error feedback, chunked top-k, 2-bit quantization, aggregation and the outer SGD step.

One outer round of SparseLoCo (arXiv 2508.15706, Alg. 1; DESIGN.md §2), per stage and replica:

    Δ  = θ_start − θ_now                  pseudo_gradient
    e  = β·e + Δ                           compress: error feedback
    Δ̂ = Q(TOP-k per chunk(e))              compress: k entries of every 64×64 tile, quantized
    e  = e − Δ̂                             compress: the new error buffer it returns
    Δ̂ ← Δ̂·min(1, c·med/‖Δ̂‖)              clip_to_median (peer.core.sparseloco.codec.clip): robust to poisoning
    Δ̄ = aggregate(Δ̂ over participants)    aggregate ("mean-over-all" or "mean-over-contributors")
    θ  = θ_start − η·Δ̄                     the portable commit (peer.core.sparseloco.commit)

The codec is `peer.core.sparseloco.codec` (this module uses it; it never imports this one): chunking, the
wire format and `SparseLoCoConfig` in `codec.format`, the encoding of one tensor (top-k, the
sign-true quantizer Q) in `codec.encode`, norms and median clipping in `codec.clip`. A chunk with
fewer than k real entries sends all of them, so padding is never selected. With `dense_1d`, 1-D tensors
(norm gains) are sent whole: 8-bit linear (float32 when quant_bits == 0). quant_bits == 0 (the
paper's setting, §3) sends float32 values.
`clip_and_aggregate` is the fused form of clip_to_median + aggregate over decoded payloads: norms
come from the payloads' values, and each payload is scattered straight into one accumulator per
tensor, in the same order, so the result is the same bits; `screen_rows` hands the outlier
screening (`peer.core.sparseloco.robust`) the clipped values at their positions, tensor by tensor, so the
commit (`peer.core.sparseloco.commit`) never decodes a payload densely. `decompress` and `aggregate_payloads`
write into the caller's buffers when given them (`out`: no fresh pages, see
`peer.core.sparseloco.codec.scratch` for who owns a reused buffer). What median clipping removes from a
contribution (`clipped_mass`) goes back into its sender's error buffer (`peer.core.sparseloco.feedback`).

Invariants:
- Δ̂ is exactly what a receiver decodes from the payload (compress decodes its own entries), so
  e_new = fl(e − Δ̂) keeps the quantization error, and `peer.core.sparseloco.feedback.add_to_errors` puts a
  payload that missed the commit back into the buffer.
- Top-k picks what torch.topk(|e| per chunk, sorted=True) picks, ties included (a chunk tied at
  its k-th entry is ranked by torch.topk itself).
Pure torch/numpy: no networking imports.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec.clip import ClipStats, clip_plan, payload_norms
from peer.core.sparseloco.codec.decode import add_entries, entry_values, write_entry
from peer.core.sparseloco.codec.encode import encode_tensor
from peer.core.sparseloco.codec.format import (
    AGGREGATIONS,
    SPARSE,
    Payload,
    PayloadError,
    SparseLoCoConfig,
    TensorEntry,
    index_bits,
    rank_nbytes,
)
from peer.core.sparseloco.codec.fused import run_each
from peer.core.sparseloco.consensus import SparseRows
from peer.errors import ConfigError

__all__ = [
    "aggregate",
    "aggregate_payloads",
    "clip_and_aggregate",
    "compress",
    "decompress",
    "ideal_bytes_per_param",
    "payload_density",
    "pseudo_gradient",
    "screen_rows",
]


def payload_density(cfg: SparseLoCoConfig) -> float:
    """Fraction of a (full) chunk's entries that are sent: topk / chunk²."""
    return cfg.topk / (cfg.chunk * cfg.chunk)


def ideal_bytes_per_param(cfg: SparseLoCoConfig) -> float:
    """Bytes per parameter of the sparse part alone, for full chunks: (index bytes + k values) / chunk².

    Index bytes are ceil(log2 C(chunk², k) / 8) (the entropy of the index set, rounded up to a byte).
    """
    cc = cfg.chunk * cfg.chunk
    k = min(cfg.topk, cc)
    value_bits = cfg.quant_bits if cfg.quant_bits else 32
    idx = rank_nbytes(cc, k) if k <= 64 else (k * index_bits(cfg.chunk) + 7) // 8
    return (idx + k * value_bits / 8) / cc


def _decode_tensor(e: TensorEntry, chunk: int, topk: int, out: Tensor | None = None) -> Tensor:
    """Dense float32 Δ̂ of one entry, into `out` when given (every entry of it is written). Without
    `out` a sparse one starts as np.zeros (calloc: fresh pages come zeroed from the OS, never written
    twice) and only its sent entries are written; a dense one is written whole."""
    if out is not None:
        if out.dtype != torch.float32 or out.device.type != "cpu" or tuple(out.shape) != tuple(e.shape):
            raise ValueError(f"decompress: out[{e.name!r}] must be CPU float32 of shape {tuple(e.shape)}")
        if not out.is_contiguous():
            raise ValueError(f"decompress: out[{e.name!r}] must be contiguous")
        write_entry(e, chunk, topk, out.view(-1).numpy(), add=False)  # a sparse one zeroes band by band
        return out
    if e.kind != SPARSE:
        fresh = torch.empty(e.shape, dtype=torch.float32)
        write_entry(e, chunk, topk, fresh.view(-1).numpy(), add=False)
        return fresh
    flat = np.zeros(math.prod(e.shape), dtype=np.float32)
    write_entry(e, chunk, topk, flat, add=False, zeroed=True)
    return torch.from_numpy(flat).view(e.shape)


# ------------------------------------------------------------------------------------------
# The round
# ------------------------------------------------------------------------------------------


def pseudo_gradient(start: Mapping[str, Tensor], now: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Δ = θ_start − θ_now per name of `start`, in float32 on CPU."""
    missing = [n for n in start if n not in now]
    if missing:
        raise ValueError(f"pseudo_gradient: current parameters lack {missing[:3]}")
    return {n: start[n].detach().float().cpu() - now[n].detach().float().cpu() for n in start}


def compress(
    delta: Mapping[str, Tensor],
    errors: Mapping[str, Tensor] | None,
    cfg: SparseLoCoConfig,
    *,
    in_place: bool = False,
) -> tuple[Payload, dict[str, Tensor]]:
    """e = β·e + Δ; Δ̂ = Q(TOP-k per chunk(e)); returns (payload of Δ̂, new errors e − Δ̂).

    Inputs are not modified, unless `in_place`: then the new errors are written into the tensors of
    `errors` (float32, CPU, contiguous ones are used as they are) and returned, for a caller that
    drops the old ones anyway; a steady-state round then allocates no buffer of the model's size.
    The bits are the same either way. Δ̂ is decoded from the entries exactly as a receiver decodes it.
    """
    items = []
    for name, d in delta.items():
        d = d.detach().to("cpu", torch.float32).contiguous()
        prev = None if errors is None else errors.get(name)
        if prev is not None:
            if tuple(prev.shape) != tuple(d.shape):
                raise ValueError(f"error buffer of {name!r} has shape {tuple(prev.shape)}, delta has {tuple(d.shape)}")
            prev = prev.detach().to("cpu", torch.float32).contiguous()
        items.append((name, d, prev))
    done = run_each(lambda x: encode_tensor(*x, cfg, in_place), items, [x[1].numel() for x in items])
    entries = [entry for entry, _ in done]
    return Payload(entries, cfg.chunk, cfg.topk, cfg.quant_bits), {
        x[0]: e for x, (_, e) in zip(items, done, strict=True)
    }


def decompress(payload: Payload, out: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Dense float32 Δ̂ per name; shapes come from the payload.

    With `out` (the caller's buffers, e.g. the last round's: CPU float32, contiguous, one per
    entry's name and shape) every tensor is written into its buffer and the result holds those
    very tensors: no fresh pages. The caller owns them, so what it kept from the last decode into
    them is overwritten; without `out` the tensors are new and the caller's alone.
    """
    entries = payload.entries
    if out is not None:
        missing = [e.name for e in entries if e.name not in out]
        if missing:
            raise ValueError(f"decompress: out lacks buffers for {missing[:3]}")
    work = [math.prod(e.shape) for e in entries]
    decoded = run_each(
        lambda e: _decode_tensor(e, payload.chunk, payload.topk, None if out is None else out[e.name]), entries, work
    )
    return {e.name: t for e, t in zip(entries, decoded, strict=True)}


def screen_rows(
    payloads: Sequence[Payload],
    voters: Sequence[int],
    scales: Sequence[float | None],
    names: Collection[str] | None = None,
) -> list[tuple[int, Callable[[], SparseRows]]]:
    """The voters' clipped Δ̂ tensor by tensor, as `peer.core.sparseloco.consensus.sparse_consensus_scores`
    reads them: per tensor, in name order, (numel, a loader of per voter (flat positions, values ×
    scale) or None where it lacks the tensor). Exactly the non-zero-bit entries of
    clip_to_median(decompress(p)) and no more: a loader decodes one tensor's positions of every voter
    when it is called (on whichever thread scores that tensor), never a dense copy. `names`: those
    tensors only (a screening section, `peer.core.sparseloco.robust.sections`)."""
    by_name = [{e.name: e for e in payloads[i].entries if names is None or e.name in names} for i in voters]
    out: list[tuple[int, Callable[[], SparseRows]]] = []
    for name in sorted({n for entries in by_name for n in entries}):
        shapes = {tuple(entries[name].shape) for entries in by_name if name in entries}
        if len(shapes) > 1:
            raise _shape_mismatch(name, *sorted(shapes)[:2])
        out.append((math.prod(shapes.pop()), functools.partial(_voter_rows, payloads, voters, scales, by_name, name)))
    return out


def _voter_rows(
    payloads: Sequence[Payload],
    voters: Sequence[int],
    scales: Sequence[float | None],
    by_name: Sequence[Mapping[str, TensorEntry]],
    name: str,
) -> SparseRows:
    """One tensor's (flat positions, values × scale) of every voter, None where a voter lacks it; the
    voters decoded on the kernel pool when the tensor is large (one tensor alone is a whole section:
    the embedding's)."""

    def row(voter: tuple[int, TensorEntry | None]) -> tuple[np.ndarray, np.ndarray] | None:
        i, e = voter
        if e is None:
            return None
        pos, vals = entry_values(e, payloads[i].chunk, payloads[i].topk)
        if pos is None:
            pos = np.arange(vals.size, dtype=np.int64)
        if scales[i] is not None:
            vals = vals * np.float32(scales[i])  # a float32 product: what clip_to_median computes
        return pos, vals

    items = [(i, entries.get(name)) for i, entries in zip(voters, by_name, strict=True)]
    return run_each(row, items, [0 if e is None else math.prod(e.shape) for _, e in items], in_order=True)


def _check_rule(rule: str, n_participants: int, n_payloads: int) -> None:
    if rule not in AGGREGATIONS:
        raise ConfigError(f"sparseloco.aggregation must be 'mean-over-all' or 'mean-over-contributors', got {rule!r}")
    if n_participants < max(1, n_payloads):
        raise ValueError(f"n_participants={n_participants} < {max(1, n_payloads)} payloads")


def _shape_mismatch(name: str, have: tuple[int, ...], got: tuple[int, ...]) -> PayloadError:
    return PayloadError(f"payloads disagree on the shape of {name!r}: {have} vs {got}; drop the odd one")


def _finish(sums: dict[str, Tensor], counts: dict[str, Tensor], n_participants: int, rule: str) -> dict[str, Tensor]:
    """Σ Δ̂ → Δ̄ by the aggregation rule (shared by `aggregate` and `aggregate_payloads`)."""
    if rule == "mean-over-all":
        return {name: _divided(s, n_participants) for name, s in sums.items()}  # in place: no second dense copy
    return {
        name: torch.where(counts[name] > 0, s / counts[name].clamp_min(1), torch.zeros_like(s))
        for name, s in sums.items()
    }


def _divided(s: Tensor, n: int) -> Tensor:
    """s ÷ n in place, each element one correctly rounded float32 division (torch's `div_` and numpy's
    give the same bits; numpy's on a contiguous CPU float32 tensor, so that a kernel-pool thread
    never starts a team of torch's own threads)."""
    if s.device.type == "cpu" and s.dtype == torch.float32 and s.is_contiguous():
        flat = s.view(-1).numpy()
        np.divide(flat, np.float32(n), out=flat)
        return s
    return s.div_(n)


def aggregate(
    decoded: Sequence[Mapping[str, Tensor]], n_participants: int, rule: str = "mean-over-all"
) -> dict[str, Tensor]:
    """Δ̄ from the committed Δ̂s, summed in the given order (so every peer gets the same bits).

    "mean-over-all": Σ Δ̂ / n_participants (absent names count as zero).
    "mean-over-contributors": per coordinate Σ Δ̂ / #{Δ̂ ≠ 0 there}; 0 where nobody sent anything.
    """
    _check_rule(rule, n_participants, len(decoded))
    sums: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    for d in decoded:
        for name, t in d.items():
            t = t.to(torch.float32)
            if name not in sums:
                sums[name] = torch.zeros_like(t)
                if rule == "mean-over-contributors":
                    counts[name] = torch.zeros_like(t)
            if sums[name].shape != t.shape:
                raise _shape_mismatch(name, tuple(sums[name].shape), tuple(t.shape))
            sums[name] += t
            if rule == "mean-over-contributors":
                counts[name] += (t != 0).to(torch.float32)
    return _finish(sums, counts, n_participants, rule)


def aggregate_payloads(
    payloads: Sequence[Payload],
    n_participants: int,
    rule: str = "mean-over-all",
    scales: Sequence[float | None] | None = None,
    names: Collection[str] | None = None,
    out: Mapping[str, Tensor] | None = None,
    each: Callable[[str, Tensor], None] | None = None,
) -> dict[str, Tensor]:
    """aggregate([decompress(p) (× scales[i]) for p in payloads]), the same bits, without M dense copies.

    Each payload's values are scattered straight into one float32 accumulator per tensor, in the
    given order; an absent coordinate adds +0.0 in `aggregate`, which never changes a sum that
    starts at +0.0. `scales` (from `clip_plan`): None keeps a payload, a float multiplies its
    values (0.0 zeroes it). `names` restricts the result to those tensors. With `out` (buffers by
    name, e.g. lent by `peer.core.sparseloco.codec.scratch.ACCUMULATORS`: CPU float32, contiguous) the sums are
    zeroed and accumulated there, so no fresh pages are touched; with "mean-over-all" each sum is
    divided by n_participants there too (a block at a time, while it is in cache: `add_entries`)
    and the result then holds those very buffers (the caller's ownership rule applies to it). `each(name, Δ̄[name])`,
    when given, is called as soon as that tensor's Δ̄ is final, on the thread that summed it; tensors
    are then taken in name order (not largest first), the order a state's hash reads them in.
    """
    _check_rule(rule, n_participants, len(payloads))
    scales = [None] * len(payloads) if scales is None else list(scales)
    shapes: dict[str, tuple[int, ...]] = {}
    adds: dict[str, list[tuple[TensorEntry, Payload, float | None]]] = {}  # per tensor, in payload order
    for p, scale in zip(payloads, scales, strict=True):
        for e in p.entries:
            if names is not None and e.name not in names:
                continue
            shape = shapes.setdefault(e.name, tuple(e.shape))
            if shape != tuple(e.shape):
                raise _shape_mismatch(e.name, shape, tuple(e.shape))
            adds.setdefault(e.name, []).append((e, p, scale))
    contributors = rule == "mean-over-contributors"

    def accumulate(name: str) -> Tensor:  # tensors are independent: shared out
        total = _accumulator(name, shapes[name], out)
        count = _accumulator(name, shapes[name], None) if contributors else None
        items = [(e, p.chunk, p.topk, scale) for e, p, scale in adds[name]]  # in payload order
        divisor = None if contributors else n_participants  # Σ ÷ M while each block is in cache
        add_entries(items, total.view(-1).numpy(), None if count is None else count.view(-1).numpy(), True, divisor)
        mean = total if count is None else _finish({name: total}, {name: count}, n_participants, rule)[name]
        if each is not None:
            each(name, mean)  # while the other tensors are summed
        return mean

    order = sorted(adds) if each is not None else list(adds)
    done = run_each(accumulate, order, [math.prod(shapes[n]) * len(adds[n]) for n in order], each is not None)
    means = dict(zip(order, done, strict=True))
    return {name: means[name] for name in adds}


def _accumulator(name: str, shape: tuple[int, ...], out: Mapping[str, Tensor] | None) -> Tensor:
    """A float32 buffer for one tensor's sum, its contents undefined (`add_entries` zeroes it a block
    at a time): out[name], or fresh pages. numpy's, not torch's: this runs on the kernel pool's
    threads, where a torch op would start a team of torch's own threads per pool thread."""
    if out is None or name not in out:
        return torch.from_numpy(np.empty(shape, dtype=np.float32))
    buf = out[name]
    if buf.dtype != torch.float32 or buf.device.type != "cpu" or tuple(buf.shape) != shape or not buf.is_contiguous():
        raise ValueError(f"aggregate_payloads: out[{name!r}] must be contiguous CPU float32 of shape {shape}")
    return buf


def clip_and_aggregate(
    payloads: Sequence[Payload],
    factor: float,
    rule: str = "mean-over-all",
    names: Collection[str] | None = None,
    out: Mapping[str, Tensor] | None = None,
) -> tuple[dict[str, Tensor], ClipStats]:
    """aggregate(clip_to_median([decompress(p) for p in payloads], factor), len(payloads), rule), fused.

    The same bits, with norms read off the payloads and one accumulator per tensor (see
    `aggregate_payloads`, and its `out`); `names` restricts the aggregate (not the norms) to those tensors.
    """
    plan, stats = clip_plan(payload_norms(payloads), factor)
    return aggregate_payloads(payloads, len(payloads), rule, plan, names, out), stats
