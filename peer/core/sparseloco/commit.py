"""Committing one stage's outer round: the portable commit every holder of the stage applies.

    Δ̂_i    = decode(payload_i)                          integer unranking, codebook lookups
    Δ̂_i   ← Δ̂_i · min(1, c·med/‖Δ̂_i‖)                   clip to the round's median norm (codec.clip)
    keep_σ  = screen(Δ̂[σ])                               drop outliers (peer.core.sparseloco.robust), when
                                                          `sparseloco.screening` (`screening_rule`), per
                                                          section σ: the embedding, the rest
    Δ̄[σ]   = aggregate(Δ̂_i[σ], i ∈ keep_σ)              in commit order ("mean-over-all" or
                                                          "mean-over-contributors")
    θ      = θ_start + fl32(fl32(−η)·Δ̄)                 every parameter but the embedding
    u      = fl32(fl32(−η)·Δ̄[embed])                     the embedding's change
    T⊥     ← fl32(T⊥ · fl32(decay_t))                    T⊥'s share of AdamW's weight decay
    p      = Π(u) in float64                             (peer.core.sparseloco.portable.project64)
    T_S    = fl32(T_S + p);  T⊥ = fl32(T⊥ + (u − p))     TE = T_S + T⊥ moves by u
    stages without the embedding: T⊥ = fl32(T⊥ + (u − Π(u))) with stage 0's committed u

(paper Alg. 1, eqs. 3–4, and §3.2 for the T_S/T⊥ re-projection). `commit_state` is that function
of bytes — the agreed θ_start, T⊥ and decay factor, and the committed payloads in their committed
order — and returns the new state; `commit_round` writes it into a process's views of the stage
(one for a peer, M for the simulator).

Given parsed payloads, the first four lines run fused (`_fused_aggregate`), with no dense Δ̂_i:
‖Δ̂_i‖ is read off the payload's values, the screening ranks only the coordinates some voter
sends (a coordinate nobody sends has a zero median and adds nothing to any score), and each kept
payload's clipped values are scattered straight into one accumulator per tensor, in commit order.
Every sum is the one the dense form computes, so the bits are the same (tests compare both). The
accumulators are lent for the one call by `peer.core.sparseloco.codec.scratch.ACCUMULATORS` (no fresh pages
per round) and never escape it.

Why it gives the same bits on every device, kernel set and thread count (docs/protocol.md):
- It runs on the CPU's cores (as many threads as torch's thread count), and with `device` a CUDA
  device its elementwise float32 steps there (`peer.core.sparseloco.elementwise` argues why that
  is the same bits); results are CPU tensors, copied exactly.
- Decoding is integer arithmetic and table lookups; norms and screening scores are exactly
  rounded sums (of products that are exact in float64: integer accumulators rounded once, or
  `math.fsum`, the same value: `peer.core.sparseloco.codec.exact`), so how the work is split over
  threads and in which order is irrelevant; the lower median is a selection.
- Every other step is elementwise: one IEEE-754 operation per value (+, −, ×, ÷, each correctly
  rounded) in a fixed order — contributions are added in commit order, one coordinate at a time —
  so SIMD width, threads and the device cannot change a bit. No step uses `a + α·b` with α ≠ ±1
  (torch runs it as one fused multiply-add with AVX2 and as two roundings without); a clip factor
  is a float32 value, so its product is the same whether a kernel widens to float64 first or not
  (double rounding of a float32 product, quotient or sum through float64 is innocuous).
- The only sums over many terms with rounding, Π's, run in a fixed order in float64 in our own
  kernel, compiled without fastmath (no FMA contraction); a test inspects its machine code.
- The decay factor is a product of Python floats from `portable_cos` (no libm).
- `check_denormals` refuses a process that flushes subnormals to zero.
Training (forward, backward, AdamW) stays device-native; only what every holder agrees on is here.
The state's hashes are made while it is made (`peer.core.model.state.StateHasher`: tensors in name
order, hashed on a thread of their own as each is final), so hashing overlaps the commit's work.

Invariants: the same committed list in the same order gives the same bits on every holder; a
round that drops nothing gives exactly the bits it gave before screening existed; an empty round
leaves θ = θ_start (T⊥ still decays, and moves with stage 0's change).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from peer.core.model.decoder import Decoder
from peer.core.model.optim import TrainConfig, decoupled_decay
from peer.core.model.state import StateHasher
from peer.core.sparseloco.algorithm import aggregate, aggregate_payloads, decompress, screen_rows
from peer.core.sparseloco.codec.clip import ClipStats, clip_plan, clip_to_median, global_norm, payload_norms
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.codec.fused import n_workers
from peer.core.sparseloco.codec.scratch import ACCUMULATORS
from peer.core.sparseloco.consensus import sparse_consensus_scores
from peer.core.sparseloco.elementwise import Device, copied, scaled, stepped
from peer.core.sparseloco.portable import check_denormals
from peer.core.sparseloco.robust import DEFAULT as ROBUST
from peer.core.sparseloco.robust import NOTHING, OFF, RobustConfig, Screen, screen, screen_scored, sections
from peer.core.subspace.compression import embedding_outer_update, perp_outer_update
from peer.core.subspace.state import EMBED, perp_of, set_perp

__all__ = [
    "NO_CLIP",
    "Committed",
    "Contribution",
    "apply_update",
    "commit_summed",
    "RoundCommit",
    "commit_round",
    "commit_state",
    "embedding_update",
    "outer_delta",
    "perp_decay",
    "robust_aggregate",
    "screening_rule",
]


@dataclass(frozen=True)
class RoundCommit:
    """What committing one stage's round did: the clip stats, the outliers dropped (positions in
    the committed list, from any section: `dropped`; by section: `screen`) and, when the stage holds
    the embedding, its committed change u = −η·Δ̄[embed.weight] (the T⊥ update of every other stage)."""

    clip: ClipStats
    embed_update: Tensor | None = None
    screen: Screen = Screen()

    @property
    def dropped(self) -> tuple[int, ...]:
        return self.screen.outliers


NO_CLIP = ClipStats(0, (), 0.0, 0.0)

Contribution = Payload | Mapping[str, Tensor]  # a parsed payload (the fused commit) or its decoded Δ̂


@dataclass(frozen=True)
class Committed:
    """The state after a commit (CPU float32 tensors), what the commit did, and the state's hashes
    (`state_hash` of θ and of {"perp": T⊥}, made while the commit ran; "" where not made)."""

    params: dict[str, Tensor]  # θ for every name of θ_start
    perp: Tensor | None  # T⊥ (None when the run uses no subspace)
    commit: RoundCommit
    param_hash: str = ""
    perp_hash: str = ""


def perp_decay(train: TrainConfig, outer_step: int) -> float:
    """The weight-decay factor of T⊥ for outer step t: Π_h (1 − lr(t·H + h)·wd), applied at commit.

    T⊥ is part of the embedding but no optimizer's parameter, so it decays here, once per round,
    by what AdamW's decoupled decay did to T_S (and to a full model's embedding) in that round.
    Every holder computes the same float from (train, t) alone (Python floats, `portable_cos`).
    """
    H = train.inner_steps
    return decoupled_decay(range(outer_step * H, (outer_step + 1) * H), train)


def screening_rule(cfg: SparseLoCoConfig) -> RobustConfig:
    """The outlier rule a run's config sets (`sparseloco.screening`): the one every holder applies,
    and the one the commit functions below use when no other `robust` is passed (the simulator's
    attack sweeps pass their own per arm)."""
    return ROBUST if cfg.screening else OFF


def robust_aggregate(
    decoded: Sequence[Contribution],
    cfg: SparseLoCoConfig,
    robust: RobustConfig | None = None,
    keys: Sequence[str] | None = None,
    names: Collection[str] | None = None,
    out: Mapping[str, Tensor] | None = None,
    norms: Sequence[float] | None = None,
) -> tuple[dict[str, Tensor], ClipStats, Screen]:
    """Δ̄ of a committed list: median clip → drop outliers → aggregate the kept ones (in order).

    Clipping reads each contribution's whole norm; the screening runs by sections
    (`peer.core.sparseloco.robust.sections`: the embedding apart from the rest, each with its own
    norms and consensus) and each section's Δ̄ sums the contributions that section kept. With
    nothing dropped this is aggregate(clip_to_median(decoded), len(decoded)), bit for bit.
    Contributions that are all payloads take the fused path (`_fused_aggregate`: the same bits, no
    dense Δ̂); `names` restricts Δ̄ (and the sections screened, never the clip) to those tensors, and
    `out` lends the fused path its accumulators (`peer.core.sparseloco.codec.scratch`: Δ̄ may then be
    those buffers). `robust` None: the config's rule (`screening_rule`). `norms` (payloads only):
    each payload's whole norm, given where the payloads hold only the `names` entries (embedding
    views, `peer.core.sparseloco.codec.sections`: the embedding's section is screened from its own
    entry, so u needs nothing else).
    """
    robust = screening_rule(cfg) if robust is None else robust
    if norms is not None and len(norms) != len(decoded):
        raise ValueError(f"{len(norms)} given norms for {len(decoded)} contributions")
    if decoded and all(isinstance(d, Payload) for d in decoded):
        payloads = [d for d in decoded if isinstance(d, Payload)]
        return _fused_aggregate(payloads, cfg, robust, keys, names, out, norms)
    if norms is not None:
        raise ValueError("given norms need parsed payloads")
    dense = [decompress(d) if isinstance(d, Payload) else d for d in decoded]
    clipped, clip = clip_to_median(dense, cfg.clip_median_factor)
    summed: dict[str, Tensor] = {}
    screens: dict[tuple[str, ...], Screen] = {}
    for section in _sections(dense, names):
        part = [{n: t for n, t in d.items() if n in section} for d in dense]
        section_norms = _voting(_norms(part), clip.norms)
        screened = screen([{n: t for n, t in d.items() if n in section} for d in clipped], section_norms, robust, keys)
        kept = [i for i in range(len(clipped)) if i not in set(screened.dropped)]
        want = section if names is None else [n for n in section if n in names]
        kept_parts = [{n: t for n, t in clipped[i].items() if n in want} for i in kept]
        summed.update(aggregate(kept_parts, len(kept), cfg.aggregation))
        screens[section] = screened
    return _in_order(summed, dense), clip, _screen(screens)


def _sections(contributions: Sequence[Mapping[str, Any]], names: Collection[str] | None) -> list[tuple[str, ...]]:
    """The screening sections of these contributions' tensors that hold one of `names` (None: all)."""
    held = {n for d in contributions for n in d}
    return [sec for sec in sections(held) if names is None or any(n in names for n in sec)]


def _in_order(summed: dict[str, Tensor], contributions: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
    """Δ̄'s tensors in the order the contributions first name them (as one unsectioned aggregate)."""
    order = dict.fromkeys(n for d in contributions for n in d)
    return {n: summed[n] for n in order if n in summed}


def _norms(parts: Sequence[Mapping[str, Tensor]]) -> list[float]:
    return [global_norm(d) for d in parts]


def _voting(section_norms: Sequence[float], whole_norms: Sequence[float]) -> list[float]:
    """A section's norms for its screening, nan where the whole norm is not finite: clipping zeroed
    that contribution, so it votes in no section (as it votes nowhere unsectioned)."""
    return [n if math.isfinite(w) else math.nan for n, w in zip(section_norms, whole_norms, strict=True)]


def _screen(screens: Mapping[tuple[str, ...], Screen]) -> Screen:
    """One `Screen` of a round screened by sections: the rest's decision with the embedding's own (the
    embedding's alone, as both, where the contributions hold nothing else: views)."""
    embedding = screens.get((EMBED,))
    rest = next((sc for sec, sc in screens.items() if sec != (EMBED,)), embedding or NOTHING)
    return rest if embedding is None else dataclasses.replace(rest, embedding=embedding)


def _fused_aggregate(
    payloads: Sequence[Payload],
    cfg: SparseLoCoConfig,
    robust: RobustConfig,
    keys: Sequence[str] | None,
    names: Collection[str] | None,
    out: Mapping[str, Tensor] | None,
    norms: Sequence[float] | None = None,
) -> tuple[dict[str, Tensor], ClipStats, Screen]:
    """`robust_aggregate` of payloads, fused, the same bits: norms read off the values
    (`payload_norm`; or given, the same floats), each section's screening consensus over the clipped
    values at their positions only (`screen_rows` → `sparse_consensus_scores`: a coordinate nobody
    sends adds nothing), then the kept payloads scattered straight into one accumulator per tensor
    (`aggregate_payloads`)."""
    norms = payload_norms(payloads) if norms is None else norms
    plan, clip = clip_plan(norms, cfg.clip_median_factor)
    summed: dict[str, Tensor] = {}
    screens: dict[tuple[str, ...], Screen] = {}
    held = [{e.name: e for e in p.entries} for p in payloads]
    one = len(sections({n for h in held for n in h})) == 1
    for section in _sections(held, names):
        # a stage without the embedding is one section: its norms are the whole norms, read already
        section_norms = norms if one and EMBED not in section else _voting(payload_norms(payloads, section), norms)

        def scores_of(voters: list[int], section: tuple[str, ...] = section) -> list[float]:
            return sparse_consensus_scores(screen_rows(payloads, voters, plan, section), len(voters))

        screened = screen_scored(scores_of, section_norms, robust, keys)
        kept = [i for i in range(len(payloads)) if i not in set(screened.dropped)]
        want = section if names is None else [n for n in section if n in names]
        kept_payloads, scales = [payloads[i] for i in kept], [plan[i] for i in kept]
        summed.update(aggregate_payloads(kept_payloads, len(kept), cfg.aggregation, scales, want, out))
        screens[section] = screened
    return _in_order(summed, held), clip, _screen(screens)


def _shapes(contributions: Sequence[Contribution]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the committed payloads (the accumulators a fused commit borrows)."""
    return {e.name: tuple(e.shape) for p in contributions if isinstance(p, Payload) for e in p.entries}


def outer_delta(agg: Tensor, lr: float, device: Device = None) -> Tensor:
    """fl32(fl32(−η)·Δ̄): the committed change of one tensor (CPU float32; computed on `device`)."""
    return scaled(agg, -lr, device)


def commit_state(
    start: Mapping[str, Tensor],
    perp: Tensor | None,
    decoded: Sequence[Contribution],
    cfg: SparseLoCoConfig,
    U: Tensor | None,
    embed_update: Tensor | None = None,
    perp_factor: float = 1.0,
    robust: RobustConfig | None = None,
    keys: Sequence[str] | None = None,
    device: Device = None,
) -> Committed:
    """The portable commit (module docstring): the state after one round, as CPU tensors.

    `start` = θ_start, `perp` = T⊥ before the round (None without a subspace), `decoded` = the
    committed contributions in commit order, as parsed payloads (the fused path: nothing is
    decoded densely, Δ̄ is summed in accumulators lent by `ACCUMULATORS` for this call only) or as
    decoded Δ̂ (the same bits), `embed_update` = stage 0's committed change (for a stage without
    the embedding), `perp_factor` = `perp_decay` of the round, `robust` the outlier rule (None:
    the config's, `screening_rule`), `keys` the contributions' replica ids (its tie-break) and
    `device` where the elementwise steps run (`peer.core.sparseloco.elementwise`; None: the CPU,
    the same bits either way). Nothing passed in is modified, and nothing returned aliases a lent
    buffer (`apply_update` writes every result afresh).
    """
    check_denormals()
    with Hashing(start, perp is not None) as hashing:
        perp = _decayed(perp, U, perp_factor, device)
        if not decoded:
            params = {name: copied(start[name]) for name in start}
            for name in sorted(params):
                hashing.param(name, params[name])
            if perp is not None and U is not None and embed_update is not None and EMBED not in start:
                perp = perp_outer_update(perp, embed_update, U)  # stage 0 moved: so does T⊥
            hashing.perp(perp)
            return hashing.committed(params, perp, RoundCommit(NO_CLIP))
        with ACCUMULATORS.lend(_shapes(decoded)) as sums:
            summed, clip, screened = robust_aggregate(decoded, cfg, robust, keys, out=sums)
            params, perp, own_update = apply_update(start, perp, summed, cfg, U, embed_update, device, hashing)
        return hashing.committed(params, perp, RoundCommit(clip, own_update, screened))


class Hashing:
    """θ's and T⊥'s hashes (`state_hash` of θ and of {"perp": T⊥}), each made by a `StateHasher` while
    the commit makes the state: on a thread of its own when the commit runs on several, every tensor
    handed in as soon as it is final (`param`, `perp`). A context manager (its threads end with it)."""

    def __init__(self, names: Iterable[str], has_perp: bool) -> None:
        background = n_workers() > 1
        self._params = StateHasher(names, background)
        self._perp = StateHasher(["perp"] if has_perp else [], background)

    def __enter__(self) -> Hashing:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._params, self._perp:
            pass

    def param(self, name: str, t: Tensor) -> None:
        self._params.add(name, t)

    def perp(self, t: Tensor | None) -> None:
        if t is not None:
            self._perp.add("perp", t)

    def committed(self, params: dict[str, Tensor], perp: Tensor | None, commit: RoundCommit) -> Committed:
        return Committed(params, perp, commit, self._params.digest(), self._perp.digest())


def _decayed(perp: Tensor | None, U: Tensor | None, perp_factor: float, device: Device) -> Tensor | None:
    """A fresh CPU float32 T⊥ after the round's weight decay (`perp_decay`)."""
    if perp is not None and U is not None and perp_factor != 1.0:
        return scaled(perp, perp_factor, device)
    return None if perp is None else copied(perp)


def commit_summed(
    start: Mapping[str, Tensor],
    perp: Tensor | None,
    summed: Mapping[str, Tensor],
    cfg: SparseLoCoConfig,
    U: Tensor | None,
    embed_update: Tensor | None = None,
    perp_factor: float = 1.0,
    device: Device = None,
) -> Committed:
    """`commit_state` for a round whose Δ̄ is already agreed (e.g. assembled from range shards,
    `peer.core.sparseloco.ranges`): decay T⊥, then `apply_update`. No clip or screening happens here (the
    round that produced Δ̄ did its own), so the stats are empty. Nothing passed in is modified."""
    check_denormals()
    with Hashing(start, perp is not None) as hashing:
        perp = _decayed(perp, U, perp_factor, device)
        params, perp, own_update = apply_update(start, perp, summed, cfg, U, embed_update, device, hashing)
        return hashing.committed(params, perp, RoundCommit(NO_CLIP, own_update))


def apply_update(
    start: Mapping[str, Tensor],
    perp: Tensor | None,
    summed: Mapping[str, Tensor],
    cfg: SparseLoCoConfig,
    U: Tensor | None,
    embed_update: Tensor | None = None,
    device: Device = None,
    hashing: Hashing | None = None,
) -> tuple[dict[str, Tensor], Tensor | None, Tensor | None]:
    """θ = θ_start + fl32(−η·Δ̄) for every name of `summed` (the others stay θ_start), with the
    embedding's T_S/T⊥ split and a stage without the embedding's T⊥ moved by stage 0's committed
    change. `perp` is T⊥ after this round's decay (a fresh tensor this function may write). Returns
    (θ, T⊥, the embedding's committed change u when this stage holds it). Every step is elementwise
    float32 (`peer.core.sparseloco.elementwise`, on `device`) or `peer.core.sparseloco.portable`'s
    float64 split (on the CPU's cores): any holder gets the same bits from the same Δ̄, however Δ̄ was
    aggregated (all-to-all here, or assembled from range shards). Tensors are made in name order,
    each handed to `hashing` as soon as it is final (hashed while the rest are made)."""
    params = {}
    own_update: Tensor | None = None
    perp_final = False
    for name in sorted(start):
        value = start[name]
        if name not in summed:
            params[name] = copied(value)
        elif name == EMBED:
            own_update = outer_delta(summed[name], cfg.outer_lr, device)
            if U is not None and perp is not None:
                params[name], perp = embedding_outer_update(value, perp, own_update, U)
                if hashing is not None:
                    hashing.perp(perp)  # final now: hashed while the other tensors are made
                perp_final = True
            else:
                params[name] = stepped(value, summed[name], cfg.outer_lr, device)
        else:
            params[name] = stepped(value, summed[name], cfg.outer_lr, device)
        if hashing is not None:
            hashing.param(name, params[name])
    if EMBED not in start and perp is not None and U is not None and embed_update is not None:
        perp = perp_outer_update(perp, embed_update, U)
    if hashing is not None and not perp_final:
        hashing.perp(perp)
    return {name: params[name] for name in start}, perp, own_update


def commit_round(
    views: Sequence[Decoder],
    start: Mapping[str, Tensor],
    decoded: Sequence[Contribution],
    cfg: SparseLoCoConfig,
    U: Tensor | None,
    embed_update: Tensor | None = None,
    perp_factor: float = 1.0,
    robust: RobustConfig | None = None,
    keys: Sequence[str] | None = None,
) -> RoundCommit:
    """Apply one committed round to every view of a stage: `commit_state`, written into each view
    (its parameters, and its T⊥ when the run uses a subspace; every view holds the same T⊥)."""
    perp = perp_of(views[0]) if U is not None and views else None
    done = commit_state(start, perp, decoded, cfg, U, embed_update, perp_factor, robust, keys)
    for view in views:
        load_committed(view, done)
    return done.commit


@torch.no_grad()
def load_committed(view: Decoder, done: Committed) -> None:
    """Copy a committed state into one view (its parameters and T⊥, on the view's own device)."""
    params = dict(view.named_parameters())
    for name, value in done.params.items():
        params[name].copy_(value)
    if done.perp is not None:
        set_perp(view, done.perp)


def embedding_update(
    decoded: Sequence[Contribution],
    cfg: SparseLoCoConfig,
    robust: RobustConfig | None = None,
    keys: Sequence[str] | None = None,
    norms: Sequence[float] | None = None,
) -> Tensor:
    """Stage 0's committed change of embed.weight (fl32(−η·Δ̄)) for a holder that only observes
    stage 0 (its payloads, fused, or decoded Δ̂). Clipped (by whole norms) and screened (the
    embedding's section) exactly as `commit_state` treats stage 0, so T⊥ moves by the same bits on
    every stage. `norms`: the payloads' whole norms, when the payloads are views holding only the
    embedding's entry (`peer.core.sparseloco.codec.sections`)."""
    summed = robust_aggregate(decoded, cfg, robust, keys, names=(EMBED,), norms=norms)[0]
    return outer_delta(summed[EMBED], cfg.outer_lr)
