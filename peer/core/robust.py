"""Outlier contributions of a round: score each Δ̂ against the round's robust consensus, drop outliers.

Median clipping (`peer.core.codec.clip`) bounds how FAR a contribution can move the model, not WHERE: an
attacker clipped to 2 × the median norm still pushes in its own direction. This module drops, before
aggregation, the contributions that are far outside the honest range by norm or point against the
round's consensus (DESIGN.md §2, issue 12):

    m_i    = coordinate-wise median of the OTHER voters' Δ̂     (per tensor, in slices)
    s_i    = ⟨Δ̂_i, m_i⟩ / (‖Δ̂_i‖·‖m_i‖)                      cosine to the others' consensus
    drop i ⇔ ‖Δ̂_i‖ > norm_ratio · median‖Δ̂‖                   a norm no honest peer reaches
          or s_i < −max(ratio · median(s), floor), median(s) > 0   clearly against a consensus
    at most ⌊(n − 1)/2⌋ of n voters (norm outliers first, then the lowest scores)

Why this rule: honest SparseLoCo contributions are sparse top-k picks of different replicas, so as
training goes on they become nearly orthogonal (the median cosine falls from ~0.1 to ~0.005 over
50 rounds of the tiny preset) while staying NON-NEGATIVE against the others' median; a rule
relative to the median score ("below 0.25 × median") then drops honest peers in late rounds
(15 of 400 in that run), and with a consensus that weak an honest score can even dip just below
zero (below −0.25 × the median once in 400), hence the absolute `floor` on the cosine. Pointing clearly
against the consensus, or a norm 10× the median, never happened in honest runs and catches a
wrong-sign contribution at any scale (`peer.tools.attacks`).

Voters are the contributions with a finite, non-zero norm; the others (empty, or non-finite and
already zeroed by clipping) are never scored nor dropped. Leaving the scored contribution out of
its own consensus keeps a huge or dense attacker from pulling the median towards itself. The
median of an even count is the mean of its two middle values, so a coordinate's sign needs half of
the voters either way.

Invariants:
- Deterministic on every holder: the median is a selection (exact), each product of two float32
  values is exact in float64 and `math.fsum` rounds each sum once, so the scores are the same bits
  whatever the hardware, thread count or order of the contributions.
- Order independent: the same set in any order drops the same contributions; when the cap binds,
  the lowest scores go first and equal scores are broken by the contribution's key (its replica
  id in the swarm, its position otherwise).
- Memory stays bounded: one slice of one tensor of every contribution at a time, never M dense
  copies of the model.
- Fewer than `min_voters` voters, or nobody past either bar: nothing is dropped and the round's
  math is exactly today's.
Pure torch/numpy: no networking imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.errors import ConfigError

SLICE = 1 << 20  # coordinates of one tensor scored at a time: M × 4 MiB of float32


@dataclass(frozen=True)
class RobustConfig:
    """The outlier rule; the defaults are what every peer of a swarm runs (they must agree)."""

    enabled: bool = True
    ratio: float = 0.25  # drop a contribution whose cosine is below −ratio × the round's median cosine
    floor: float = 0.01  # ... and below −floor: a cosine this far below zero is no noise
    norm_ratio: float = 10.0  # drop a contribution whose norm exceeds this × the median norm (0: never)
    min_voters: int = 3  # with fewer voters no consensus is robust: drop nothing

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio < 1.0:
            raise ConfigError(f"robust.ratio must be in [0, 1), got {self.ratio}")
        if not 0.0 <= self.floor < 1.0:
            raise ConfigError(f"robust.floor must be in [0, 1), got {self.floor}")
        if not (self.norm_ratio == 0 or 1.0 < self.norm_ratio < math.inf):
            raise ConfigError(f"robust.norm_ratio must be 0 (off) or a finite number > 1, got {self.norm_ratio}")
        if self.min_voters < 3:
            raise ConfigError(
                f"robust.min_voters must be >= 3 (a median of two is no consensus), got {self.min_voters}"
            )


DEFAULT = RobustConfig()
OFF = RobustConfig(enabled=False)


@dataclass(frozen=True)
class Screen:
    """What `screen` decided for one round's contributions (indices are positions in the input)."""

    dropped: tuple[int, ...] = ()  # in input order
    scores: tuple[float | None, ...] = ()  # cosine to the consensus; None: not a voter
    consensus: float = 0.0  # median cosine of the voters (0.0 when nothing was scored)


NOTHING = Screen()


def _exact_dot(a: Tensor, b: Tensor) -> float:
    """Σ a·b over a's non-zero entries, exactly rounded (float32 products are exact in float64)."""
    nz = a != 0
    if not bool(nz.any()):
        return 0.0
    prod = a[nz].to(torch.float64) * b[nz].to(torch.float64)
    return math.fsum(prod.tolist())


def _medians_without_each(stack: Tensor) -> Tensor:
    """(n, k): row i is the coordinate-wise median of the OTHER n − 1 rows of a (n, k) float32 stack.

    One sort per slice: removing the value of rank r from a sorted column shifts every later rank
    down by one, so the other rows' middle ranks are read off the same sorted column. The median
    of an even count is the mean of its two middle values.
    """
    n = stack.shape[0]
    ordered = stack.sort(dim=0, stable=True)
    ranks = torch.empty_like(ordered.indices)
    ranks.scatter_(0, ordered.indices, torch.arange(n).unsqueeze(1).expand_as(ordered.indices).contiguous())
    m = n - 1
    lo = (m - 1) // 2 + ((m - 1) // 2 >= ranks).long()  # (n, k) ranks in the full column
    hi = m // 2 + (m // 2 >= ranks).long()
    low, high = ordered.values.gather(0, lo), ordered.values.gather(0, hi)
    return low if m % 2 else (low + high) * 0.5


def consensus_scores(decoded: Sequence[Mapping[str, Tensor]], voters: Sequence[int]) -> list[float]:
    """Cosine of each voter's Δ̂ to the coordinate-wise median of the OTHER voters' Δ̂ (in `voters` order).

    Absent tensors count as zeros. Works tensor by tensor and slice by slice; the sums are exact
    (`_exact_dot`), so the scores depend only on the set of voters, never on their order.
    """
    names = sorted({name for i in voters for name in decoded[i]})
    dots = [[0.0] for _ in voters]  # partial sums per slice, fsum'd once at the end
    sq_self = [[0.0] for _ in voters]
    sq_med = [[0.0] for _ in voters]
    for name in names:
        shape = next(decoded[i][name].shape for i in voters if name in decoded[i])
        numel = math.prod(shape)
        flat = [
            decoded[i][name].detach().reshape(-1).to("cpu", torch.float32) if name in decoded[i] else None
            for i in voters
        ]
        for start in range(0, numel, SLICE):
            stop = min(numel, start + SLICE)
            rows = [f[start:stop] if f is not None else torch.zeros(stop - start) for f in flat]
            meds = _medians_without_each(torch.stack(rows))  # (n, stop - start)
            for j, row in enumerate(rows):
                dots[j].append(_exact_dot(row, meds[j]))
                sq_self[j].append(_exact_dot(row, row))
                sq_med[j].append(_exact_dot(meds[j], meds[j]))
    out = []
    for dot, sq, sq_m in zip(dots, sq_self, sq_med, strict=True):
        norm, med_norm = math.sqrt(math.fsum(sq)), math.sqrt(math.fsum(sq_m))
        out.append(math.fsum(dot) / (norm * med_norm) if norm > 0 and med_norm > 0 else 0.0)
    return out


def drop_rule(
    scores: Sequence[float], norms: Sequence[float], keys: Sequence[str], cfg: RobustConfig = DEFAULT
) -> list[int]:
    """Positions (into the voters) to drop, in order: see the module docstring.

    Both medians are lower medians (selections: exact). At most ⌊(n − 1)/2⌋ are dropped: norm
    outliers first (largest norm first), then the lowest scores; equal values in key order.
    """
    n = len(scores)
    if n == 0:
        return []
    if len(norms) != n or len(keys) != n:
        raise ValueError(f"{n} scores, {len(norms)} norms and {len(keys)} keys")
    median_score = sorted(scores)[(n - 1) // 2]
    median_norm = sorted(norms)[(n - 1) // 2]
    huge = [i for i in range(n) if cfg.norm_ratio and norms[i] > cfg.norm_ratio * median_norm]
    bar = -max(cfg.ratio * median_score, cfg.floor)
    against = [i for i in range(n) if median_score > 0 and scores[i] < bar and i not in huge]
    order = sorted(huge, key=lambda i: (-norms[i], keys[i])) + sorted(against, key=lambda i: (scores[i], keys[i]))
    return sorted(order[: (n - 1) // 2])


def screen(
    decoded: Sequence[Mapping[str, Tensor]],
    norms: Sequence[float],
    cfg: RobustConfig = DEFAULT,
    keys: Sequence[str] | None = None,
) -> Screen:
    """Which of a round's contributions to drop as outliers (see the module docstring).

    `norms` are their global norms before clipping (`ClipStats.norms`); `keys` break ties among
    equal scores (replica ids; positions when None).
    """
    if len(norms) != len(decoded):
        raise ValueError(f"{len(norms)} norms for {len(decoded)} contributions")
    if keys is not None and len(keys) != len(decoded):
        raise ValueError(f"{len(keys)} keys for {len(decoded)} contributions")
    voters = [i for i, n in enumerate(norms) if math.isfinite(n) and n > 0]
    if not cfg.enabled or len(voters) < cfg.min_voters:
        return NOTHING
    scores = consensus_scores(decoded, voters)
    names = [keys[i] if keys is not None else f"{i:012d}" for i in voters]
    voter_norms = [norms[i] for i in voters]
    dropped = tuple(voters[j] for j in drop_rule(scores, voter_norms, names, cfg))
    by_index: list[float | None] = [None] * len(decoded)
    for i, s in zip(voters, scores, strict=True):
        by_index[i] = s
    return Screen(dropped, tuple(by_index), sorted(scores)[(len(scores) - 1) // 2])
