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
The outer step is taken a tensor at a time as each Δ̄ is final (`peer.core.sparseloco.step.OuterStep`,
called by the aggregation on the kernel-pool thread that summed the tensor, tensors in name order),
and the state's hashes are made while it is made (`step.Hashing`: tensors in name order, hashed on a
thread of their own as each is final), so the steps and the hashing overlap the screening and sums.

Invariants: the same committed list in the same order gives the same bits on every holder; a
round that drops nothing gives exactly the bits it gave before screening existed; an empty round
leaves θ = θ_start (T⊥ still decays, and moves with stage 0's change).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from peer.core.model.decoder import Decoder
from peer.core.model.optim import TrainConfig, decoupled_decay
from peer.core.sparseloco.algorithm import aggregate, aggregate_payloads, decompress, screen_rows
from peer.core.sparseloco.codec.clip import ClipStats, clip_plan, clip_to_median, global_norm, payload_norms
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.codec.scratch import ACCUMULATORS
from peer.core.sparseloco.consensus import sparse_consensus_scores
from peer.core.sparseloco.elementwise import Device
from peer.core.sparseloco.portable import check_denormals
from peer.core.sparseloco.robust import DEFAULT as ROBUST
from peer.core.sparseloco.robust import NOTHING, OFF, RobustConfig, Screen, screen, screen_scored, sections
from peer.core.sparseloco.step import Hashing, OuterStep, apply_update, decayed, outer_delta
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
    each: Callable[[str, Tensor], None] | None = None,
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
    entry, so u needs nothing else). `each(name, Δ̄[name])`, when given, is called once per tensor as
    soon as that tensor's Δ̄ is final — section by section, in name order within one, from whichever
    kernel-pool thread summed it (the fused path) — so a caller can use it while the rest is summed
    (`commit_state`'s outer step); it must not keep Δ̄, which may be a lent buffer.
    """
    robust = screening_rule(cfg) if robust is None else robust
    if norms is not None and len(norms) != len(decoded):
        raise ValueError(f"{len(norms)} given norms for {len(decoded)} contributions")
    if decoded and all(isinstance(d, Payload) for d in decoded):
        payloads = [d for d in decoded if isinstance(d, Payload)]
        return _fused_aggregate(payloads, cfg, robust, keys, names, out, norms, each)
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
        means = aggregate(kept_parts, len(kept), cfg.aggregation)
        if each is not None:
            for name in sorted(means):
                each(name, means[name])
        summed.update(means)
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


@dataclass(frozen=True)
class CommitPlan:
    """What a fused commit decides from the whole committed payloads before it sums anything: each
    payload's clip scale (`clip_plan`: None keeps it, a float multiplies it), the clip stats, the
    screening's `Screen`, and the payloads each section keeps (by whether it is the embedding's).
    A sum over any rows of the tensors, with these, gives those rows of the whole Δ̄ (`commit_bands`)."""

    clip: ClipStats
    scales: tuple[float | None, ...]
    screen: Screen
    kept: Mapping[bool, tuple[int, ...]]  # is the embedding's section -> positions kept, in commit order

    def section(self, names: Collection[str]) -> list[tuple[list[str], list[int]]]:
        """(the names of a section, the payloads it keeps) for each section that holds one of `names`."""
        out = []
        for embedding in (True, False):
            want = sorted(n for n in names if (n == EMBED) == embedding)
            kept = self.kept.get(embedding, self.kept.get(False, ()))
            if want:
                out.append((want, list(kept)))
        return out


def decide(
    payloads: Sequence[Payload],
    cfg: SparseLoCoConfig,
    robust: RobustConfig,
    keys: Sequence[str] | None,
    names: Collection[str] | None = None,
    norms: Sequence[float] | None = None,
) -> CommitPlan:
    """The fused commit's plan (`CommitPlan`): norms read off the values (`payload_norm`; or given,
    the same floats), the clip plan, and each section's screening from the consensus over the clipped
    values at their positions only (`screen_rows` → `sparse_consensus_scores`: a coordinate nobody
    sends adds nothing)."""
    norms = payload_norms(payloads) if norms is None else norms
    scales, clip = clip_plan(norms, cfg.clip_median_factor)
    held = [{e.name: e for e in p.entries} for p in payloads]
    one = len(sections({n for h in held for n in h})) == 1
    screens: dict[tuple[str, ...], Screen] = {}
    kept: dict[bool, tuple[int, ...]] = {}
    for section in _sections(held, names):
        # a stage without the embedding is one section: its norms are the whole norms, read already
        section_norms = norms if one and EMBED not in section else _voting(payload_norms(payloads, section), norms)

        def scores_of(voters: list[int], section: tuple[str, ...] = section) -> list[float]:
            return sparse_consensus_scores(screen_rows(payloads, voters, scales, section), len(voters))

        screened = screen_scored(scores_of, section_norms, robust, keys)
        kept[section == (EMBED,)] = tuple(i for i in range(len(payloads)) if i not in set(screened.dropped))
        screens[section] = screened
    return CommitPlan(clip, tuple(scales), _screen(screens), kept)


def _fused_aggregate(
    payloads: Sequence[Payload],
    cfg: SparseLoCoConfig,
    robust: RobustConfig,
    keys: Sequence[str] | None,
    names: Collection[str] | None,
    out: Mapping[str, Tensor] | None,
    norms: Sequence[float] | None = None,
    each: Callable[[str, Tensor], None] | None = None,
) -> tuple[dict[str, Tensor], ClipStats, Screen]:
    """`robust_aggregate` of payloads, fused, the same bits: `decide`, then the kept payloads of each
    section scattered straight into one accumulator per tensor (`aggregate_payloads`)."""
    decided = decide(payloads, cfg, robust, keys, names, norms)
    held = [{e.name: e for e in p.entries} for p in payloads]
    summed = summed_by_plan(payloads, decided, cfg, held_names(held, names), out, each)
    return _in_order(summed, held), decided.clip, decided.screen


def held_names(held: Sequence[Mapping[str, Any]], names: Collection[str] | None) -> list[str]:
    """The tensors the payloads hold, `names` only when given."""
    return sorted({n for h in held for n in h if names is None or n in names})


def summed_by_plan(
    payloads: Sequence[Payload],
    plan: CommitPlan,
    cfg: SparseLoCoConfig,
    names: Collection[str],
    out: Mapping[str, Tensor] | None = None,
    each: Callable[[str, Tensor], None] | None = None,
) -> dict[str, Tensor]:
    """Δ̄ of `names` from the payloads (whole, or any rows of them: `codec.bands.entry_rows`) as
    `plan` says: each section's kept payloads, clipped by their scales, summed in commit order."""
    summed: dict[str, Tensor] = {}
    for want, kept in plan.section(names):
        kept_payloads, scales = [payloads[i] for i in kept], [plan.scales[i] for i in kept]
        summed.update(aggregate_payloads(kept_payloads, len(kept), cfg.aggregation, scales, want, out, each))
    return summed


def _shapes(contributions: Sequence[Contribution]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in the committed payloads (the accumulators a fused commit borrows)."""
    return {e.name: tuple(e.shape) for p in contributions if isinstance(p, Payload) for e in p.entries}


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
    buffer (`OuterStep` writes every result afresh).

    Each tensor's outer step is taken as soon as its Δ̄ is final (`OuterStep.take`, called by the
    aggregation on the thread that summed it), and hashed as soon as it is made, so the steps and
    the state's hash overlap the screening and the sums of the tensors after it.
    """
    check_denormals()
    with Hashing(start, perp is not None) as hashing:
        step = OuterStep(start, decayed(perp, U, perp_factor, device), cfg, U, embed_update, device, hashing)
        if not decoded:
            params, perp, _ = step.finish()  # θ_start; T⊥ decays, and moves with stage 0's change
            return _committed(params, perp, RoundCommit(NO_CLIP), hashing)
        with ACCUMULATORS.lend(_shapes(decoded)) as sums:
            _, clip, screened = robust_aggregate(decoded, cfg, robust, keys, out=sums, each=step.take)
        params, perp, own_update = step.finish()
        return _committed(params, perp, RoundCommit(clip, own_update, screened), hashing)


def _committed(params: dict[str, Tensor], perp: Tensor | None, commit: RoundCommit, hashing: Hashing) -> Committed:
    return Committed(params, perp, commit, *hashing.digests())


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
        perp = decayed(perp, U, perp_factor, device)
        params, perp, own_update = apply_update(start, perp, summed, cfg, U, embed_update, device, hashing)
        return _committed(params, perp, RoundCommit(NO_CLIP, own_update), hashing)


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
