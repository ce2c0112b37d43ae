"""`peer plan --recommend`: for each link, the pipeline mode and k/d that keep the GPUs busy, and what
that compression is expected to cost in loss.

The paper compresses by bandwidth, not by role (arXiv 2601.02360 §2.3: well-connected groups run
"standard parallelism without subspace projection", poorly connected ones the subspace compression).
Per bandwidth this asks the planner (`peer.research.plan.command.plan_rows`) for the uncompressed
pipeline and every candidate k/d, and recommends, in this order:
1. **uncompressed** when it reaches the target utilisation: no loss from compression;
2. else the **least compression** (largest k/d among `CANDIDATES` that give an integer k) that reaches
   it;
3. else **none reaches the target**: the least compression within `NEAR_BEST` (1 point) of the highest
   utilisation any k/d gives — more compression would cost loss and buy next to nothing once the round
   bounds the outer step —, said so; or uncompressed, when no compression beats it.

The loss a k/d is expected to cost is the paper's Table 2 (512M, SparseLoCo, final loss against the
uncompressed baseline, "Δ (%)"), for a swarm where every pipeline compresses (PP-Compress) and where
half the replicas run uncompressed (Het-PP-Compress 1/2). Table 2 measures d/k = 8, 24, 96, 192,
384 and 768; between them the cost is interpolated linearly in log(d/k) (the table's trend), past 768
it is not known and none is given. It is the paper's figure for its 512M model, not a measurement of
this model; `peer simulate --configs pp-compress,het-pp-compress --k-ratio …` measures one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from peer.errors import ConfigError
from peer.research.plan.command import PlanInputs, parse_k_ratios, plan_rows, resolve_model

# arXiv 2601.02360, Table 2: d/k → (PP-Compress Δ %, Het-PP-Compress (1/2) Δ %), 512M, SparseLoCo.
PAPER_TABLE2: dict[int, tuple[float, float]] = {
    8: (4.0, 3.3),
    24: (5.9, 5.5),
    96: (8.4, 7.7),
    192: (11.0, 8.8),
    384: (11.4, 9.5),
    768: (12.5, 9.9),
}
CANDIDATES = ("1/8", "1/16", "1/24", "1/32", "1/64", "1/96", "1/128", "1/192", "1/256", "1/384", "1/512", "1/768")
DEFAULT_TARGET = 0.95
NEAR_BEST = 0.01  # when no k/d reaches the target: the least compression within 1 point of the best


@dataclass(frozen=True)
class Recommendation:
    """What `recommend` says for one bandwidth."""

    bandwidth_mbps: float
    mode: str  # "uncompressed", "compressed" or "none" (no candidate reaches the target)
    k_ratio: str | None  # the recommended (or, for "none", the best) k/d; None when uncompressed
    util: float  # the recommended pipeline's utilisation
    util_uncompressed: float
    loss_pp: float | None  # expected Δ loss (%) when every pipeline compresses (Table 2 trend)
    loss_het: float | None  # ... when half the replicas run uncompressed
    reason: str


def expected_loss(ratio: str) -> tuple[float, float] | None:
    """The paper's Table 2 Δ loss (%) at k/d = `ratio` (PP-Compress, Het-PP-Compress 1/2),
    interpolated in log(d/k) between its rows; None past its range (d/k < 8 gives 8's, at most)."""
    dk = float(1 / Fraction(ratio))
    points = sorted(PAPER_TABLE2)
    if dk > points[-1]:
        return None
    if dk <= points[0]:
        return PAPER_TABLE2[points[0]] if dk == points[0] else None
    for lo, hi in zip(points, points[1:], strict=False):
        if lo <= dk <= hi:
            w = (math.log(dk) - math.log(lo)) / (math.log(hi) - math.log(lo))
            a, b = PAPER_TABLE2[lo], PAPER_TABLE2[hi]
            return (round(a[0] + w * (b[0] - a[0]), 2), round(a[1] + w * (b[1] - a[1]), 2))
    return None  # unreachable: dk lies in [points[0], points[-1]]


def usable_ratios(d_model: int, candidates: Sequence[str] = CANDIDATES) -> list[str]:
    """The candidates whose k = d·k/d is a whole number of channels for this model, least compressed first."""
    out = [r for r in candidates if (d_model * Fraction(r)).denominator == 1]
    if not out:
        raise ConfigError(f"no k/d of {', '.join(candidates)} divides d_model = {d_model}")
    return sorted(out, key=Fraction, reverse=True)


def recommend(
    args: Mapping[str, Any], bandwidths_mbps: Sequence[float], target: float = DEFAULT_TARGET
) -> tuple[PlanInputs, list[Recommendation]]:
    """The planner's inputs from the CLI's flags (`args`, as `plan`; `k_ratio` is ignored: every usable
    candidate is tried) and one recommendation per bandwidth (module docstring)."""
    if not 0 < target <= 1:
        raise ConfigError(f"--target-util must be in (0, 1], got {target:g}")
    fields = {f.name: args[f.name] for f in dataclasses.fields(PlanInputs) if f.name in args and f.name != "tokens"}
    inputs = PlanInputs(**{**fields, "k_ratio": "1/8"})
    _, cfg = resolve_model(inputs)
    ratios = usable_ratios(cfg.d_model)
    parse_k_ratios(",".join(ratios), cfg.d_model)  # the planner's own checks of each ratio
    rows = plan_rows(dataclasses.replace(inputs, k_ratio=",".join(ratios)), list(bandwidths_mbps))
    out = []
    for bw in bandwidths_mbps:
        at = {r["k_ratio"]: r for r in rows if r["bandwidth_mbps"] == bw}
        uncompressed = next(iter(at.values()))["util_uncompressed"]
        out.append(_choose(bw, ratios, at, uncompressed, target))
    return inputs, out


def _choose(
    bw: float, ratios: Sequence[str], at: Mapping[str, Mapping[str, Any]], uncompressed: float, target: float
) -> Recommendation:
    if uncompressed >= target:
        why = f"uncompressed keeps {100 * uncompressed:.1f} % ≥ {100 * target:.0f} %: no compression needed"
        return Recommendation(bw, "uncompressed", None, uncompressed, uncompressed, 0.0, 0.0, why)
    for ratio in ratios:  # least compression first
        util = at[ratio]["util_compressed"]
        if util >= target:
            pp, het = expected_loss(ratio) or (None, None)
            why = f"uncompressed {100 * uncompressed:.1f} %; the least compression reaching {100 * target:.0f} %"
            return Recommendation(bw, "compressed", ratio, util, uncompressed, pp, het, why)
    top = max(at[r]["util_compressed"] for r in ratios)
    best = next(r for r in ratios if at[r]["util_compressed"] >= top - NEAR_BEST)  # least compression near the top
    util = at[best]["util_compressed"]
    if util <= uncompressed:  # compression does not help: the round, not the boundary, bounds the step
        why = f"no k/d reaches {100 * target:.0f} % nor beats uncompressed: the round bounds the outer step"
        return Recommendation(bw, "none", None, uncompressed, uncompressed, 0.0, 0.0, why)
    pp, het = expected_loss(best) or (None, None)
    why = f"no k/d reaches {100 * target:.0f} %; {best} is within 1 point of the most: the round or link bounds it"
    return Recommendation(bw, "none", best, util, uncompressed, pp, het, why)
