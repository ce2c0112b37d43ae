"""Who does what in a range-sharded round: the rule, the range owners, the roster's publisher.

Pure functions of agreed inputs (the run's config, the committed state, the round's roster), so every
holder of a stage computes the same answers without talking (docs/protocol.md, RANGES):
- `round_rule`: "all" (every holder fetches every payload: cheapest for a few replicas) or "ranges"
  (each range of the stage is aggregated by its owners; every holder fetches the shards), decided
  from the size of round t − 1's committed set, which every holder committed alike;
- `owners`: rendezvous (highest-random-weight) hashing of a range over the round's candidates, seeded
  by the round, so ownership moves every round and a candidate that vanishes moves only its ranges;
- `coordinator_order`: the order in which holders publish the round's roster (the first one that
  does is taken).
The simulator (`peer bench swarm`) calls these same functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

from peer.config import SwarmConfig

ROSTER_RANGE = -1  # the rendezvous key of the roster's publisher (no range has it)


def round_rule(swarm: SwarmConfig, n_prev: int) -> str:
    """ "all" or "ranges" for a round whose predecessor committed `n_prev` contributions (0 at t = 0)."""
    if swarm.round_rule != "auto":
        return swarm.round_rule
    return "ranges" if n_prev >= swarm.ranges_from else "all"


def _weight(t: int, stage: int, r: int, peer: str) -> bytes:
    return hashlib.sha256(f"{t}|{stage}|{r}|{peer}".encode()).digest()


def owners(t: int, stage: int, r: int, candidates: Collection[str], k: int) -> list[str]:
    """The `k` candidates with the highest rendezvous weight for range `r` of round (t, stage), primary
    first (ties, which sha256 makes vanishingly rare, by peer id)."""
    ranked = sorted(candidates, key=lambda p: (_weight(t, stage, r, p), p), reverse=True)
    return ranked[: max(0, k)]


def coordinator_order(t: int, stage: int, candidates: Collection[str]) -> list[str]:
    """Every candidate, in the order in which they publish round (t, stage)'s roster."""
    return owners(t, stage, ROSTER_RANGE, candidates, len(candidates))
