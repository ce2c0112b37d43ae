"""Round designs below the dense bound (issue 37): an aligned support, and shards with an agreed residual.

Three ways to commit a stage's round that keep what a range-sharded round (`peer.research.simulate.ranges`)
loses, each committing ONE state that every replica loads (`commit_summed` + `load_committed`, as the
ranges round does).

**aligned** (`--round aligned`, `peer.core.sparseloco.aligned`): every holder derives the same index
set per tile per round — the top-(k′ − x) positions of the last committed aggregate |Δ̄_{t−1}| plus x
positions drawn with a seed from (run seed, t, stage, tile) — and each contribution sends its error
buffer's values at those positions only (no indices); SparseLoCo's error feedback keeps the rest
(e = β·e + Δ, e − v̂ on the support). The mean is exact and k′-sparse: nothing is re-sparsified.
k′ = `swarm.shard_topk` (0: `sparseloco.topk`), x = ⌊k′/4⌋. Why: the shard of a ranges round is the
top-k of a mean whose supports disagree (M senders' top-k, up to M·k per tile), so it drops about
half of ‖Δ̄‖²; with one support there is nothing to drop, and the wire saves the index bytes.
Round mass (`RangeMass`): dense = ‖mean_m e_m‖² (before sending), kept = its part on the support.

**voted** (`--round voted`, `peer.core.sparseloco.ranges.voted`, the swarm's `swarm.shard = "voted"`):
aligned with a vote phase first — each sender publishes the index set of its own top-k per tile of e
(no values), and the support is the k′ positions per tile with the most votes (ties, and unvoted fill,
by a seeded PCG64 draw); then the values phase as aligned. k′ = `swarm.shard_topk`, 0: 2·k (`voted_keep`). Why: last
round's aggregate is a poor guess of where this round's errors are (after a round, e is emptied
exactly on the support it chooses again); the votes are this round's, at the price of the indices.
The owners publish the mean at `swarm.mean_bits` (the codec's quantizer; 0: float32) and nobody gets
the rounding back: it is the round's `quant` mass.
**voted-residual** (`--round voted-residual`): voted, with each owner publishing C = Q(Δ̄ + R) on the
support at quant_bits instead of float32, and R = Δ̄ + R − C kept per stage as agreed, undecayed state
(as residual keeps its shards' drop): the download of a float32 mean cut to 2-bit values.

**residual** (`--round residual`): the senders' top-k payloads (as all-to-all), their exact mean Δ̄
computed per range by its owner, then the shard: C_t = Q(top-(c·k) per tile of A_t), A_t = Δ̄_t + R_{t−1},
and R_t = A_t − C_t. c·k = `swarm.shard_topk` (0: k). R is per stage, part of the agreed state (every
holder computes the same from the same shards) and never decays: what the shard drops (and its
quantization error) enters the next round's aggregate whole, where the ranges round hands it back to
senders' error buffers, which β decays (gTop-k, Shi et al. 2019; Ok-Topk, Li & Hoefler 2022). Round
mass: dense = ‖A‖², kept = ‖A on C's support‖², quant = ‖A on the support − C‖².

Bytes per holder per stage round (`RoundBytes`, all holders alike: every size is a function of shapes
and settings), with R_n = n_ranges_for(M, units) range owners, one range per owner, each range a
1/R_n share of the stage (range headers not counted):
    aligned:   sent V + F/R_n;   downloaded (M − 1)·V/R_n + (R_n − 1)·F/R_n
               V: values only (k′ per tile at quant_bits each + codebook; 1-D tensors as the codec
               sends them); F: the owner's exact mean (float32 at the agreed positions, no indices)
    voted:     as aligned, plus the vote I_k (k indices per tile) in the contribution and the
               owner's published support I_k′ (k′ indices per tile) beside F in the shard
    voted-residual: as voted, F at quant_bits (values only, + codebook) in place of float32
    residual:  sent P + S/R_n;   downloaded (M − 1)·P/R_n + (R_n − 1)·S/R_n
               P: the sender's payload (k per tile, indices + values); S: the c·k-per-tile shard
`pg_bytes` counts a replica's contribution (V, I_k + V or P), as the ranges round counts its parts.

Invariants: every replica holds the same bits after a round; `state` is the only memory a design
keeps across rounds (one entry per stage), and "all" and "ranges" never read it. Outlier screening,
attacks and median clipping are refused (`check_design`), as in the ranges round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from peer.config import RunConfig
from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import aggregate_payloads, compress, decompress, pseudo_gradient
from peer.core.sparseloco.aligned import (
    agreed_support,
    aligned_sum,
    fed_back,
    indices_nbytes,
    requantized,
    send_at,
    sparse_names,
    support_seed,
    values_nbytes,
)
from peer.core.sparseloco.codec.format import DENSE_F32, HEADER_NBYTES, Payload, entry_nbytes
from peer.core.sparseloco.commit import Committed, commit_summed, load_committed
from peer.core.sparseloco.ranges import n_ranges_for, n_units
from peer.core.sparseloco.ranges.owner import shard_config
from peer.core.sparseloco.ranges.voted import tile_topk, voted_keep, voted_support
from peer.core.subspace.state import perp_of
from peer.errors import ConfigError
from peer.research.simulate.ranges import RangeMass
from peer.research.simulate.replica import LocalReplica

__all__ = [
    "DESIGN_RULES",
    "DesignRound",
    "DesignState",
    "RoundBytes",
    "check_design",
    "commit_design",
    "design_mass_line",
]

DESIGN_RULES = ("aligned", "voted", "voted-residual", "residual")

Errors = list[list[dict[str, Tensor] | None]]


@dataclass(frozen=True)
class RoundBytes:
    """What one holder sends and downloads in one stage round (module docstring), in bytes."""

    sent: float
    downloaded: float

    @staticmethod
    def sharded(contribution: int, shard: int, M: int, n_ranges: int) -> RoundBytes:
        """Contributions split over R_n owners, each publishing its range's share of the stage's shard."""
        return RoundBytes(
            contribution + shard / n_ranges, (M - 1) * contribution / n_ranges + (n_ranges - 1) * shard / n_ranges
        )


@dataclass
class DesignState:
    """A design's agreed memory across rounds, and its byte counts (part of a run's checkpoint)."""

    agreed: dict[int, dict[str, Tensor]] = field(default_factory=dict)  # per stage: Δ̄_{t−1} or R_{t−1}
    sent_bytes: float = 0.0  # per holder, summed over stage rounds
    down_bytes: float = 0.0


@dataclass(frozen=True)
class DesignRound:
    """What one stage's design round did."""

    embed_update: Tensor | None
    mass: RangeMass
    bytes: RoundBytes


def design_mass_line(name: str, seed: int, rule: str, summary: Mapping[str, float]) -> str:
    """One run's line on what its rounds left out, per stage round (`RangeMass` as the design fills it)."""
    mean, peak = summary["dropped_mass_mean"], summary["dropped_mass_max"]
    if rule == "residual":
        what = "the shards left {} of ‖Δ̄ + R‖² in the agreed residual R (max {})"
    else:
        what = "the agreed support left {} of the senders' mean error buffer ‖mean e‖² to error feedback (max {})"
    return f"{name} s{seed} ({rule}): " + what.format(f"{mean:.1%}", f"{peak:.1%}") + " per stage round"


def check_design(round_rule: str, cfg: RunConfig) -> None:
    """Refuse settings a design does not model: median clipping and mean-over-contributors."""
    if round_rule not in DESIGN_RULES:
        return
    slc = cfg.sparseloco
    if slc.clip_median_factor > 0:
        raise ConfigError(f"--round {round_rule} runs without median clipping; set sparseloco.clip_median_factor = 0")
    if slc.aggregation != "mean-over-all":
        raise ConfigError(
            f"--round {round_rule} averages over all replicas; set sparseloco.aggregation = 'mean-over-all'"
        )


def _commit(
    reps: Sequence[LocalReplica],
    s: int,
    start: Mapping[str, Tensor],
    summed: Mapping[str, Tensor],
    cfg: RunConfig,
    perp_factor: float,
    embed_update: Tensor | None,
) -> Committed:
    """commit_summed of the agreed Δ̄, loaded into every replica's view of stage s."""
    U = reps[0].U
    views = [rep.stages[s] for rep in reps]
    perp = perp_of(views[0]) if U is not None else None
    done = commit_summed(start, perp, summed, cfg.sparseloco, U, embed_update, perp_factor)
    for view in views:
        load_committed(view, done)
    return done


def _sq(x: Tensor) -> float:
    return float(x.double().square().sum())


def _n_ranges(start: Mapping[str, Tensor], cfg: RunConfig, M: int) -> int:
    return n_ranges_for(M, n_units({n: tuple(v.shape) for n, v in start.items()}, cfg.sparseloco.chunk))


def _keep(cfg: RunConfig, vote: bool) -> int:
    """k′: `swarm.shard_topk`, 0 meaning 2·k for the voted rules (`voted_keep`, as the swarm) and k for aligned."""
    return (
        voted_keep(cfg.swarm.shard_topk, cfg.sparseloco.topk) if vote else cfg.swarm.shard_topk or cfg.sparseloco.topk
    )


def _supports(
    es: Sequence[Mapping[str, Tensor]],
    shapes: Mapping[str, tuple[int, ...]],
    cfg: RunConfig,
    t: int,
    s: int,
    prev: Mapping[str, Tensor] | None,
    vote: bool,
) -> dict[str, Tensor]:
    """The round's agreed support of every sparse tensor: from the senders' votes (their top-k index
    sets of e) or from the last committed aggregate, each with the seeded draw of (seed, t, s, tensor)."""
    slc = cfg.sparseloco
    keep = _keep(cfg, vote)
    out = {}
    for n in es[0]:
        seed = support_seed(cfg.seed, t, s, n)
        if vote:
            votes = [tile_topk(e[n], slc.chunk, slc.topk) for e in es]
            out[n], _ = voted_support(votes, shapes[n], slc.chunk, slc.topk, keep, seed)
        else:
            out[n] = agreed_support(None if prev is None else prev[n], shapes[n], slc.chunk, keep, seed)
    return out


def commit_aligned(
    reps: Sequence[LocalReplica],
    s: int,
    start: dict[str, Tensor],
    errors: Errors,
    pg_bytes: list[int],
    cfg: RunConfig,
    perp_factor: float,
    embed_update: Tensor | None,
    t: int,
    state: DesignState,
    vote: bool = False,
    requantize: bool = False,
) -> DesignRound:
    """One stage's aligned (or, with `vote`, voted) round (module docstring); `errors[m][s]`,
    `pg_bytes[m]` and `state` updated. `requantize`: the owners publish the mean at quant_bits with an
    agreed residual (`peer.core.sparseloco.aligned.requantized`; `state` then holds R, not Δ̄)."""
    slc, M = cfg.sparseloco, len(reps)
    shapes = {n: tuple(v.shape) for n, v in start.items()}
    sparse = sparse_names(shapes, slc.dense_1d)
    dense = [n for n in shapes if n not in sparse]
    keep = _keep(cfg, vote)
    es: list[dict[str, Tensor]] = []  # every sender's e = β·e + Δ of the sparse tensors
    kept: list[dict[str, Tensor]] = []  # every sender's new error buffers of the dense ones
    dense_payloads: list[Payload] = []
    dense_nbytes = 0
    for rep, buf in zip(reps, (errors[m][s] or {} for m in range(M)), strict=True):
        delta = pseudo_gradient(start, stage_state(rep.stages[s]))
        es.append({n: fed_back(delta[n], buf.get(n), slc.beta) for n in sparse})
        if dense:
            payload, rest = compress({n: delta[n] for n in dense}, buf or None, slc)
            wire = payload.to_bytes()
            dense_payloads.append(Payload.from_bytes(wire))
            dense_nbytes = len(wire) - HEADER_NBYTES
        kept.append(rest if dense else {})
    supports = _supports(es, shapes, cfg, t, s, state.agreed.get(s), vote)
    owed = {n: torch.zeros(shapes[n], dtype=torch.float64) for n in sparse}  # mean e before sending
    for e in es:
        for n in sparse:
            owed[n] += e[n].double() / M
    values: dict[str, list[Tensor]] = {n: [] for n in sparse}
    V = values_nbytes(shapes, slc.chunk, keep, slc.quant_bits, sparse) + dense_nbytes
    vote_nbytes = indices_nbytes(shapes, slc.chunk, slc.topk, sparse) if vote else 0
    for m, e in enumerate(es):
        new = dict(kept[m])
        for n in sparse:
            v, new[n] = send_at(e[n], supports[n], slc.quant_bits)
            values[n].append(v)
        errors[m][s] = new
        pg_bytes[m] += vote_nbytes + V
    summed = {n: aligned_sum(values[n], supports[n], shapes[n], M) for n in sparse}
    mean_bits = slc.quant_bits if requantize else cfg.swarm.mean_bits if vote else 0
    if requantize:
        quant_sq: float | None = _requantize(state, s, summed, supports, slc.quant_bits)
    else:
        quant_sq = _rounded(summed, supports, mean_bits) if mean_bits else None
        state.agreed[s] = {n: summed[n].clone() for n in sparse}
    if dense:
        summed |= aggregate_payloads(dense_payloads, M, slc.aggregation)
    done = _commit(reps, s, start, summed, cfg, perp_factor, embed_update)
    mass = _support_mass(owed, supports, summed, quant_sq)
    F = values_nbytes(shapes, slc.chunk, keep, mean_bits, sparse) + sum(
        entry_nbytes(n, DENSE_F32, shapes[n], slc.chunk, keep, 0) for n in dense
    )
    shard = F + (indices_nbytes(shapes, slc.chunk, keep, sparse) if vote else 0)  # the owners' means (and supports)
    nbytes = RoundBytes.sharded(vote_nbytes + V, shard, M, _n_ranges(start, cfg, M))
    return DesignRound(done.commit.embed_update, mass, nbytes)


def _requantize(
    state: DesignState, s: int, summed: dict[str, Tensor], supports: Mapping[str, Tensor], bits: int
) -> float:
    """The owners' C = Q(Δ̄ + R) on the support written over `summed`, R = Δ̄ + R − C into `state`;
    returns Σ ‖(Δ̄ + R − C) on S‖² (the rounding R keeps this round)."""
    prev, quant_sq = state.agreed.get(s) or {}, 0.0
    for n, support in supports.items():
        a_on = (summed[n] if prev.get(n) is None else summed[n] + prev[n]).view(-1)[support]
        summed[n], state.agreed.setdefault(s, {})[n] = requantized(summed[n], prev.get(n), support, bits)
        quant_sq += _sq(a_on - summed[n].view(-1)[support])
    return quant_sq


def _rounded(summed: dict[str, Tensor], supports: Mapping[str, Tensor], bits: int) -> float:
    """The owners publish the mean at `bits` (`swarm.mean_bits`, the codec's quantizer; per tensor here,
    per band in the swarm) with no residual: `summed` becomes Q(Δ̄) on the support; returns Σ ‖Δ̄ − Q(Δ̄)‖²
    there (the rounding nobody gets back)."""
    quant_sq = 0.0
    for n, support in supports.items():
        exact = summed[n].view(-1)[support].clone()
        summed[n], _ = requantized(summed[n], None, support, bits)
        quant_sq += _sq(exact - summed[n].view(-1)[support])
    return quant_sq


def _support_mass(
    owed: Mapping[str, Tensor], supports: Mapping[str, Tensor], summed: Mapping[str, Tensor], quant_sq: float | None
) -> RangeMass:
    """dense = ‖mean e‖², kept = its part on the support, quant = the published mean's rounding there
    (`quant_sq`, or ‖mean e − Δ̄‖² on S when the mean is published exact)."""
    dense_sq = kept_sq = rounding = 0.0
    for n, support in supports.items():
        mean_e = owed[n].view(-1)
        on = mean_e[support]
        dense_sq, kept_sq = dense_sq + _sq(mean_e), kept_sq + _sq(on)
        rounding += _sq(on - summed[n].view(-1)[support].double())
    return RangeMass(dense_sq, kept_sq, rounding if quant_sq is None else quant_sq)


def commit_residual(
    reps: Sequence[LocalReplica],
    s: int,
    start: dict[str, Tensor],
    errors: Errors,
    pg_bytes: list[int],
    cfg: RunConfig,
    perp_factor: float,
    embed_update: Tensor | None,
    t: int,
    state: DesignState,
) -> DesignRound:
    """One stage's residual round (module docstring); `errors[m][s]`, `pg_bytes[m]` and `state` updated."""
    del t  # the residual round's rule does not depend on the round's number
    slc, M = cfg.sparseloco, len(reps)
    payloads: list[Payload] = []
    P = 0
    for m, rep in enumerate(reps):
        delta = pseudo_gradient(start, stage_state(rep.stages[s]))
        payload, errors[m][s] = compress(delta, errors[m][s], slc)
        wire = payload.to_bytes()
        P = len(wire)
        pg_bytes[m] += P
        payloads.append(Payload.from_bytes(wire))
    mean = aggregate_payloads(payloads, M, slc.aggregation)  # the exact Δ̄_t, as all-to-all (no clip)
    prev = state.agreed.get(s)
    A = {n: mean[n] if prev is None else mean[n] + prev[n] for n in mean}
    shard, residual = compress(A, None, shard_config(slc, cfg.swarm.shard_topk or None))
    committed = decompress(shard)
    done = _commit(reps, s, start, committed, cfg, perp_factor, embed_update)
    state.agreed[s] = residual  # R_t = A_t − C_t: never decays
    dense_sq = kept_sq = quant_sq = 0.0
    for n, a in A.items():
        on = committed[n] != 0
        dense_sq, kept_sq = dense_sq + _sq(a), kept_sq + _sq(a[on])
        quant_sq += _sq(a[on] - committed[n][on])
    nbytes = RoundBytes.sharded(P, len(shard.to_bytes()), M, _n_ranges(start, cfg, M))
    return DesignRound(done.commit.embed_update, RangeMass(dense_sq, kept_sq, quant_sq), nbytes)


def commit_design(
    rule: str,
    reps: Sequence[LocalReplica],
    s: int,
    start: dict[str, Tensor],
    errors: Errors,
    pg_bytes: list[int],
    cfg: RunConfig,
    perp_factor: float,
    embed_update: Tensor | None,
    t: int,
    state: DesignState,
) -> DesignRound:
    """One stage's round by design `rule` (`DESIGN_RULES`); its bytes added to `state`'s counts."""
    args = (reps, s, start, errors, pg_bytes, cfg, perp_factor, embed_update, t, state)
    if rule == "residual":
        done = commit_residual(*args)
    else:
        done = commit_aligned(*args, vote=rule != "aligned", requantize=rule == "voted-residual")
    state.sent_bytes += done.bytes.sent
    state.down_bytes += done.bytes.downloaded
    return done
