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
  covered by its backups, not by a new deal);
- `range_step`: what a holder does next about one range, from the shard hashes its owners published
  (take the agreed shard, check a disagreement, compute an orphaned range, or wait);
- `quiet_close`: whether a roster may close before every expected contributor announced.
The simulator (`peer bench swarm`) calls these same functions.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Collection, Mapping

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
    """The `k` owners of range `r` of round (t, stage), primary first: k owner slots per range dealt
    round-robin over the round's rendezvous order (`coordinator_order`), range r taking positions
    r·k, r·k + 1, ..., r·k + k − 1 (mod the number of candidates, so they are distinct while k ≤ M).
    Dealt, not hashed per range: every candidate owns k·R/M ranges, rounded up or down, so no holder
    fetches more parts than another (a per-range rendezvous hash gives some holder twice the mean
    at M = 8)."""
    order = coordinator_order(t, stage, candidates)
    if not order:
        return []
    k = min(max(0, k), len(order))
    return [order[(r * k + j) % len(order)] for j in range(k)]


class RangeStep(enum.Enum):
    """What a holder does next about one range of a ranges round (`range_step`)."""

    WAIT = "wait"  # an owner has not published yet, and the shard deadline has not passed
    TAKE = "take"  # fetch the shard whose hash the owners that published agree on
    CHECK = "check"  # owners disagree: fetch the parts, recompute each claimed shard, refuse a liar
    COMPUTE = "compute"  # no owner published by the shard deadline: compute the range here


def range_step(claims: Mapping[str, str], n_owners: int, past_deadline: bool) -> RangeStep:
    """The next step for a range whose `n_owners` owners published `claims` ({owner: shard sha256}, a
    refused owner left out), `past_deadline` = the shard deadline has passed: agreement of every owner
    (or, past the deadline, of those that published) is taken at once; any disagreement is checked."""
    distinct = set(claims.values())
    if len(distinct) > 1:
        return RangeStep.CHECK
    if distinct and (len(claims) >= n_owners or past_deadline):
        return RangeStep.TAKE
    return RangeStep.COMPUTE if past_deadline and not distinct else RangeStep.WAIT


def quiet_close(announced: int, expected: int, quiet_s: float, roster_quiet_s: float, quorum: float) -> bool:
    """Whether the announcements may close without the rest of the `expected` contributors: at least
    `quorum` of them announced (`announced` of `expected`, ours included) and none was announced for
    `roster_quiet_s` (`quiet_s` since the last). A departed contributor stays expected until its
    records expire (`swarm.record_ttl_s`), so without this every roster of a large swarm under churn
    waits for that; a live contributor left out sends its error a round later (error feedback keeps
    it). `roster_quiet_s` 0 turns it off."""
    if roster_quiet_s <= 0 or expected <= 0:
        return False
    return announced >= quorum * expected and quiet_s >= roster_quiet_s
