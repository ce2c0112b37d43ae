"""Outlier contributions of a round: score each Δ̂ against the round's robust consensus, drop outliers.

Median clipping (`peer.core.sparseloco.codec.clip`) bounds how FAR a contribution can move the model, not WHERE: an
attacker clipped to 2 × the median norm still pushes in its own direction. This module drops, before
aggregation, the contributions that are far outside the honest range by norm or point against the
round's consensus (DESIGN.md §2, issue 12):

    m_i    = coordinate-wise median of the OTHER voters' Δ̂     (per tensor, in slices)
    s_i    = ⟨Δ̂_i, m_i⟩ / (‖Δ̂_i‖·‖m_i‖)                      cosine to the others' consensus
    drop i ⇔ ‖Δ̂_i‖ > norm_ratio · median‖Δ̂‖                   a norm no honest peer reaches
          or s_i < −max(ratio · median(s), floor), median(s) > floor   clearly against a consensus
    at most ⌊(n − 1)/2⌋ of n voters (norm outliers first, then the lowest scores)

Why this rule: honest SparseLoCo contributions are sparse top-k picks of different replicas, so as
training goes on they become nearly orthogonal (the median cosine falls from ~0.1 to ~0.005 over
50 rounds of the tiny preset) while staying NON-NEGATIVE against the others' median; a rule
relative to the median score ("below 0.25 × median") then drops honest peers in late rounds
(15 of 400 in that run), and with a consensus that weak an honest score can even dip just below
zero (below −0.25 × the median once in 400), hence the absolute `floor` on the cosine. A consensus
exists only where the median cosine is above that floor: the embedding's section alone (stage 0,
screened by sections) has rounds whose median cosine is 0.002–0.008, where honest scores dip to
−0.015 (two false drops in 50 rounds of the tiny run below, none with the bar at the floor). Pointing clearly
against the consensus, or a norm 10× the median, never happened in honest runs and catches a
wrong-sign contribution at any scale (`peer.research.simulate.attacks`).

Screened by sections: where the contributions hold the embedding (stage 0's), the embedding and the
rest of the tensors are screened apart, each with its own norms and consensus, and each section's
aggregate takes the contributions that section kept (`sections`). So stage 0's committed embedding
change is a function of each payload's embedding entry (and whole norm, for clipping) alone, and a
holder of another stage reproduces it from embedding views without stage 0's whole payloads; an
outlier in the embedding is caught there, one in the blocks there, and a contribution is an outlier
of the round (`Screen.outliers`, what bans count) when any section dropped it.

Voters are the contributions with a finite, non-zero norm; the others (empty, or non-finite and
already zeroed by clipping) are never scored nor dropped. Leaving the scored contribution out of
its own consensus keeps a huge or dense attacker from pulling the median towards itself. The
median of an even count is the mean of its two middle values, so a coordinate's sign needs half of
the voters either way.

Invariants:
- Deterministic on every holder: the median is a selection (exact), each product of two float32
  values is exact in float64 and each sum is rounded once (`math.fsum`, or the integer
  accumulators of `peer.core.sparseloco.codec.exact`: the same value), so the scores are the same
  bits whatever the hardware, thread count or order of the contributions.
- Order independent: the same set in any order drops the same contributions; when the cap binds,
  the lowest scores go first and equal scores are broken by the contribution's key (its replica
  id in the swarm, its position otherwise).
- Sparse: a coordinate that no voter sends has a zero median for every voter and adds nothing to
  any sum, so only the union of the voters' positions is ranked (`peer.core.sparseloco.consensus`,
  which reads them straight off the payloads in the fused commit, compiled and split over the
  cores); the partial sums are grouped per tensor and slice as the dense form groups them, so the
  scores are the same bits (a test keeps the dense form as its reference).
- Memory stays bounded: the sent entries of one tensor of every voter at a time, however many
  voters there are; never M dense copies of the model.
- Fewer than `min_voters` voters, or nobody past either bar: nothing is dropped and the round's
  math is exactly today's.
Pure torch/numpy: no networking imports.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.consensus import SparseRows, sparse_consensus_scores
from peer.core.subspace.state import EMBED
from peer.errors import ConfigError


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
    """What `screen` decided for one round's contributions (indices are positions in the input):
    for every tensor, or (`embedding` set) for every tensor but the embedding, whose own decision
    `embedding` is (module docstring, screened by sections)."""

    dropped: tuple[int, ...] = ()  # in input order
    scores: tuple[float | None, ...] = ()  # cosine to the consensus; None: not a voter
    consensus: float = 0.0  # median cosine of the voters (0.0 when nothing was scored)
    embedding: Screen | None = None  # the embedding section's decision (contributions that hold it)

    @property
    def outliers(self) -> tuple[int, ...]:
        """The contributions some section dropped, in input order (what bans count)."""
        more = self.embedding.dropped if self.embedding is not None else ()
        return tuple(sorted({*self.dropped, *more}))

    def dropped_names(self, index: int, names: Collection[str]) -> set[str]:
        """Which of a contribution's tensors `names` the screening left out of the aggregate."""
        out = {n for n in names if n != EMBED} if index in self.dropped else set()
        dropped_embedding = self.embedding.dropped if self.embedding is not None else self.dropped
        return out | ({EMBED} & set(names) if index in dropped_embedding else set())


NOTHING = Screen()


def sections(names: Collection[str]) -> list[tuple[str, ...]]:
    """The tensors screened together (module docstring): the embedding alone and the rest where the
    contributions hold the embedding, else all of them; each section in name order, empty ones left out."""
    rest = tuple(sorted(n for n in names if n != EMBED))
    if EMBED not in names:
        return [rest] if rest else []
    return [(EMBED,), *([rest] if rest else [])]


def sparse_rows(t: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(ascending flat positions, float32 values) of a dense tensor's entries whose bits are not +0.0
    (a −0.0 is kept: the sparse form holds exactly the values the dense one does)."""
    flat = t.detach().reshape(-1).to("cpu", torch.float32).contiguous().numpy()
    pos = np.flatnonzero(flat.view(np.int32))
    return pos, flat[pos]


def consensus_scores(decoded: Sequence[Mapping[str, Tensor]], voters: Sequence[int]) -> list[float]:
    """Cosine of each voter's Δ̂ to the coordinate-wise median of the OTHER voters' Δ̂ (in `voters` order).

    Absent tensors count as zeros. The dense form of `sparse_consensus_scores` (the same bits).
    """
    names = sorted({name for i in voters for name in decoded[i]})

    def rows(name: str) -> SparseRows:
        return [sparse_rows(decoded[i][name]) if name in decoded[i] else None for i in voters]

    tensors = [
        (next(decoded[i][name].numel() for i in voters if name in decoded[i]), functools.partial(rows, name))
        for name in names
    ]
    return sparse_consensus_scores(tensors, len(voters))


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
    against = [i for i in range(n) if median_score > cfg.floor and scores[i] < bar and i not in huge]
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
    return screen_scored(lambda voters: consensus_scores(decoded, voters), norms, cfg, keys)


def screen_scored(
    scores_of: Callable[[list[int]], list[float]],
    norms: Sequence[float],
    cfg: RobustConfig = DEFAULT,
    keys: Sequence[str] | None = None,
) -> Screen:
    """`screen` with the scoring given as a function of the voters' positions (`consensus_scores`
    of the contributions in whatever form they are held, e.g. `sparse_consensus_scores` of payloads);
    it is called only when a consensus is scored at all."""
    if keys is not None and len(keys) != len(norms):
        raise ValueError(f"{len(keys)} keys for {len(norms)} contributions")
    voters = [i for i, n in enumerate(norms) if math.isfinite(n) and n > 0]
    if not cfg.enabled or len(voters) < cfg.min_voters:
        return NOTHING
    scores = scores_of(voters)
    names = [keys[i] if keys is not None else f"{i:012d}" for i in voters]
    voter_norms = [norms[i] for i in voters]
    dropped = tuple(voters[j] for j in drop_rule(scores, voter_norms, names, cfg))
    by_index: list[float | None] = [None] * len(norms)
    for i, s in zip(voters, scores, strict=True):
        by_index[i] = s
    return Screen(dropped, tuple(by_index), sorted(scores)[(len(scores) - 1) // 2])
