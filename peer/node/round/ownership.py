"""Who does what in a range-sharded round: the rule, the range owners, the roster's publisher.

Pure functions of agreed inputs (the run's config, the committed state, the round's roster), so every
holder of a stage computes the same answers without talking (docs/protocol.md, RANGES):
- `round_rule`: "all" (every holder fetches every payload: cheapest for a few replicas) or "ranges"
  (each range of the stage is aggregated by its owners; every holder fetches the shards), decided
  from the size of round t − 1's committed set, which every holder committed alike;
- `coordinator_order`: the round's rendezvous (highest-random-weight) order of its candidates, seeded
  by the round so it moves every round: the order in which holders publish the round's roster;
- `owners`: the ranges dealt round-robin over that order, so each candidate owns as many as any
  other (the candidates are the roster's senders, fixed once the roster is; a vanished owner is
  covered by its backups, not by a new deal).
The simulator (`peer bench swarm`) calls these same functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

from peer.config import SwarmConfig


def round_rule(swarm: SwarmConfig, n_prev: int) -> str:
    """ "all" or "ranges" for a round whose predecessor committed `n_prev` contributions (0 at t = 0)."""
    if swarm.round_rule != "auto":
        return swarm.round_rule
    return "ranges" if n_prev >= swarm.ranges_from else "all"


def _weight(t: int, stage: int, peer: str) -> bytes:
    return hashlib.sha256(f"{t}|{stage}|{peer}".encode()).digest()


def coordinator_order(t: int, stage: int, candidates: Collection[str]) -> list[str]:
    """Every candidate in round (t, stage)'s rendezvous order: highest sha256(f"{t}|{stage}|{peer}")
    first (ties, which sha256 makes vanishingly rare, by peer id). Any two peers keep their relative
    order whatever the rest of the set, so holders that saw different candidates rank alike. It is
    the order in which holders publish the round's roster (the first one that does is taken)."""
    return sorted(candidates, key=lambda p: (_weight(t, stage, p), p), reverse=True)


def owners(t: int, stage: int, r: int, candidates: Collection[str], k: int) -> list[str]:
    """The `k` owners of range `r` of round (t, stage), primary first: ranges are dealt round-robin
    over the round's rendezvous order (`coordinator_order`), range r to positions r, r + 1, ...,
    r + k − 1 (mod the number of candidates). Dealt, not hashed per range: every candidate owns
    k·R/M ranges (± 1), so no holder fetches more parts than another (a per-range rendezvous hash
    gives some holder twice the mean at M = 8)."""
    order = coordinator_order(t, stage, candidates)
    if not order:
        return []
    return [order[(r + j) % len(order)] for j in range(min(max(0, k), len(order)))]
