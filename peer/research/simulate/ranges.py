"""The simulator's range-sharded round (issue 24): one stage's round over M local replicas, as a
swarm of M holders commits it when the round rule gives "ranges" (docs/protocol.md).

    R        = n_ranges_for(M, units of the stage)          the plan every holder computes alike
    parts_m  = encode_parts(Δ_m, e_m)                       replica m: one part per range, error feedback
    shard_r  = aggregate_range(part_r of every replica)     once per range, in replica (roster) order,
                                                            clipped, averaged, re-sparsified to
                                                            swarm.shard_topk per tile, as its owner
    Δ̄       = assemble(shard deltas)                        the same bits on every holder
    θ, T⊥    = commit_summed(θ_start, T⊥, Δ̄, …)             written into every replica's view
    e_m     += returned_to(part_m,r, m, shard_r)  for all r  error feedback keeps what the shard dropped

With rule "exact" (`--round exact`) each shard is the range's exact aggregate
(`peer.core.sparseloco.ranges.exact`): nothing is dropped, only clipped mass returns, and with
quant_bits 0 and no clip the run commits exactly what `--round all` commits (tested); with
quant_bits > 0 the shards' requantization of Δ̄ is `quant_fraction` (returned to nobody).

Only the network is missing: owners are not chosen (each range is aggregated once, here, which is
what every honest owner publishes) and parts are not fetched (each owner parses the part's bytes
as it would after fetching them, `RangePlan.validator`). A replica's `pg_bytes` are its parts' bytes.

The re-sparsification drops Σ_r ‖Δ̄_r‖² − ‖Δ̄_r ⊙ mask_r‖² of the aggregate's squared mass; `RangeMass`
records it per round and `dropped_fraction` divides by Σ_r ‖Δ̄_r‖². `returned_to` gives each
contributor its own coordinates the shard dropped, so the mean over contributors of what goes back
is exactly the dropped part of Δ̄ (the next round sends it again). The shard's quantization error
on the kept values (quant_bits > 0) goes back to nobody: `quant_fraction` measures it. Error
feedback delays the dropped mass but a round still commits at most `swarm.shard_topk` entries per
tile where all-to-all commits the union of M senders' top-k: docs/results.md measures what that
costs ("Range-sharded rounds"). Outlier screening and attacks are not part of this round
(`check_ranges` refuses them); median clipping is, per range.

Invariants: every replica holds the same bits after the round (one `Committed`, loaded into each
view); the "all" round (`peer.research.simulate.loops.commit_stage`) is untouched by this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from peer.config import RunConfig
from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import pseudo_gradient
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import commit_summed, load_committed
from peer.core.sparseloco.ranges import assemble, band_views, encode_parts, n_ranges_for, n_units, plan_ranges
from peer.core.sparseloco.ranges.owner import Shard, aggregate_range, returned_to, roster_digest, shard_delta
from peer.core.sparseloco.ranges.plan import RangePlan
from peer.core.sparseloco.robust import RobustConfig
from peer.core.subspace.state import perp_of
from peer.errors import ConfigError
from peer.research.simulate.replica import LocalReplica

__all__ = ["ROUND_RULES", "RangeMass", "RangeShares", "RangesRound", "check_ranges", "commit_ranges", "plan_for"]

ROUND_RULES = (
    "all",
    "ranges",  # topk shards (swarm.shard_topk)
    "exact",  # exact shards
    "aligned",
    "voted",
    "voted-residual",
    "residual",
)  # the last four: peer.research.simulate.round_designs


def check_ranges(round_rule: str, robust: RobustConfig, attack: str | None) -> None:
    """Refuse an unknown rule, and screening or an attack with any rule but "all" (the others have neither)."""
    if round_rule not in ROUND_RULES:
        raise ConfigError(f"--round must be one of {', '.join(ROUND_RULES)}, got {round_rule!r}")
    if round_rule != "all" and (robust.enabled or attack is not None):
        raise ConfigError(
            f"--round {round_rule} runs without outlier screening and attacks; drop --attacks, set "
            "sparseloco.screening = false, or use --round all"
        )


@dataclass(frozen=True)
class RangeMass:
    """The squared mass of one round's aggregate Δ̄ before and after re-sparsification (Σ over ranges)."""

    dense_sq: float  # Σ_r ‖Δ̄_r‖²
    kept_sq: float  # Σ_r ‖Δ̄_r ⊙ mask_r‖²
    quant_sq: float = 0.0  # Σ_r ‖Δ̄_r ⊙ mask_r − shard_r‖²: the shards' quantization error

    @property
    def dropped_fraction(self) -> float:
        """(dense − kept) / dense: the share of ‖Δ̄‖² the shards do not carry (0 for an empty round)."""
        return (self.dense_sq - self.kept_sq) / self.dense_sq if self.dense_sq > 0 else 0.0

    @property
    def quant_fraction(self) -> float:
        """quant / dense: the share of ‖Δ̄‖² the shards' quantization changed (returned to nobody)."""
        return self.quant_sq / self.dense_sq if self.dense_sq > 0 else 0.0


class RangeShares(NamedTuple):
    """One stage round's shares of ‖Δ̄‖² (`RangeMass`), as a run records them."""

    t: int
    stage: int
    dropped: float  # re-sparsification: returned to the senders by error feedback
    quant: float  # the shards' quantization: returned to nobody


@dataclass(frozen=True)
class RangesRound:
    """What one stage's ranges round did."""

    clipped: int  # contributions clipped in at least one range
    embed_update: Tensor | None  # stage 0's committed change of the embedding (None elsewhere)
    mass: RangeMass
    n_ranges: int


def plan_for(start: Mapping[str, Tensor], cfg: RunConfig, n_contributors: int) -> RangePlan:
    """The round's plan: R = n_ranges_for(contributors, units of the stage) over θ_start's tensors."""
    shapes = {name: tuple(v.shape) for name, v in start.items()}
    chunk = cfg.sparseloco.chunk
    return plan_ranges(shapes, chunk, n_ranges_for(n_contributors, n_units(shapes, chunk)))


def _contribute(
    rep: LocalReplica,
    s: int,
    start: Mapping[str, Tensor],
    errors: dict[str, Tensor] | None,
    cfg: RunConfig,
    plan: RangePlan,
) -> tuple[list[Payload], dict[str, Tensor], list[bytes]]:
    """One replica's parts (as Payloads), its new error buffers, and the parts' bytes."""
    delta = pseudo_gradient(start, stage_state(rep.stages[s]))
    parts, new_errors = encode_parts(delta, errors, cfg.sparseloco, plan)
    return parts, new_errors, [p.to_bytes() for p in parts]


def _take_back(errors: dict[str, Tensor], plan: RangePlan, r: int, back: Mapping[str, Tensor]) -> None:
    """e += returned, band by band, into the error tensors of range r (elementwise float32: e + r)."""
    views = band_views(errors, plan, r)
    for entry, value in back.items():
        view = views[entry]
        view.add_(value.reshape(view.shape))


def commit_ranges(
    reps: Sequence[LocalReplica],
    s: int,
    start: dict[str, Tensor],
    errors: list[list[dict[str, Tensor] | None]],
    pg_bytes: list[int],
    cfg: RunConfig,
    perp_factor: float,
    embed_update: Tensor | None,
    t: int = 0,
    rule: str = "ranges",
) -> RangesRound:
    """One stage's ranges round over every replica (module docstring); `errors[m][s]` and
    `pg_bytes[m]` are updated for every replica m. `rule` "ranges": topk shards at
    `swarm.shard_topk`; "exact": exact shards (`peer.core.sparseloco.ranges.exact`)."""
    if rule not in ("ranges", "exact"):
        raise ValueError(f"commit_ranges: rule must be 'ranges' or 'exact', got {rule!r}")
    exact = rule == "exact"
    slc, plan = cfg.sparseloco, plan_for(start, cfg, len(reps))
    own: list[list[Payload]] = []
    bufs: list[dict[str, Tensor]] = []  # every replica's error buffers of this stage after encoding
    received: list[list[Payload]] = [[] for _ in range(plan.n)]  # per range, the parts as an owner parses them
    roster = []
    for m, rep in enumerate(reps):
        parts, buf, wires = _contribute(rep, s, start, errors[m][s], cfg, plan)
        errors[m][s] = buf
        own.append(parts)
        bufs.append(buf)
        pg_bytes[m] += sum(len(w) for w in wires)
        roster.append((f"replica-{m}", hashlib.sha256(b"".join(wires)).hexdigest()))
        for r, wire in enumerate(wires):
            received[r].append(plan.validator(r, slc)(wire))
    digest = roster_digest(roster)
    shards: list[Shard] = []
    dense = kept = quant = 0.0
    clipped: set[int] = set()
    for r in range(plan.n):
        topk = None if exact else cfg.swarm.shard_topk or None
        shard, stats = aggregate_range(t, s, r, plan, received[r], digest, slc, topk, exact=exact)
        shards.append(shard)
        dense, kept, quant = dense + stats.dense_sq, kept + stats.kept_sq, quant + stats.quant_sq
        clipped |= {m for m in range(len(reps)) if shard.scale_of(m) is not None}
    summed = assemble(plan, {r: shard_delta(sh) for r, sh in enumerate(shards)}, {n: v.shape for n, v in start.items()})
    U = reps[0].U
    views = [rep.stages[s] for rep in reps]
    perp = perp_of(views[0]) if U is not None else None
    done = commit_summed(start, perp, summed, slc, U, embed_update, perp_factor)
    for view in views:
        load_committed(view, done)
    for m, buf in enumerate(bufs):
        for r, shard in enumerate(shards):
            _take_back(buf, plan, r, returned_to(own[m][r], m, shard))
    return RangesRound(len(clipped), done.commit.embed_update, RangeMass(dense, kept, quant), plan.n)
