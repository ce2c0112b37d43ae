"""One holder's commit of a stage's round, as data: computed from a state, installed apart.

`compute` runs the portable commit (`peer.core.sparseloco.commit.commit_state`) from a given state — θ_start,
T⊥ and the ban state of round t — and returns an `Outcome`: the new state, its hashes and state id,
the new bans and what the commit took from our own payload. Nothing is changed by computing, so
the same function serves a holder's own commit (`StageWorker.apply_round`) and the check of
another holder's claim (`StageWorker.recompute`: the named set applied to the state we committed
round t from, kept as `Prev` until the next commit).

One path for both kinds of round: `outcome` ends every commit — an all-to-all one (`compute`) and
a ranges one (`peer.node.stage.ranges.commit_ranges`, Δ̄ assembled from range shards) — so the ban
state, the hashes and the state id of a commit are made in one place.

Error feedback across a switch: a commit may return part of our payload to our error buffer
(clipped or screened mass, or all of it when the set lacks it: `own_adjustment`). When a holder
replaces its commit of round t by a checked better one (`StageWorker.switch`), it subtracts what
its own commit added and adds what the new one adds (`peer.core.sparseloco.feedback.add_to_errors`), so
nothing we sent is lost or counted twice (to float32 rounding).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import Tensor

from peer.config import RunConfig
from peer.core.model.state import state_hash
from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import Committed, commit_state, perp_decay
from peer.core.sparseloco.elementwise import Device
from peer.core.sparseloco.feedback import returned
from peer.node.round.bans import Bans, after_commit
from peer.node.round.claims import state_id
from peer.node.round.contribution import Contribution

__all__ = ["Outcome", "Prev", "compute", "named", "outcome", "own_adjustment", "screening_keys"]


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prev:
    """The state round `t` was committed from (kept until the next commit: checks recompute from it)."""

    t: int
    start: Mapping[str, Tensor]  # θ_start of round t, CPU float32
    perp: Tensor | None  # T⊥ before round t, CPU float32
    bans: Bans
    state: str  # its state id
    adjustment: dict[str, Tensor] | None  # what our commit of round t added to our error buffer
    own: Contribution | None = None  # our contribution to round t, if we sent one


@dataclass(frozen=True)
class Outcome:
    """A computed commit of round `t`, not yet installed."""

    t: int
    committed: Committed
    bans: Bans
    replicas: tuple[str, ...]  # the committed replica ids, commit order
    dropped: tuple[str, ...]  # those screening dropped
    param_hash: str
    perp_hash: str

    @property
    def state(self) -> str:
        return state_id(self.param_hash, self.perp_hash, self.bans.to_record())


def compute(
    cfg: RunConfig,
    stage: int,
    U: Tensor | None,
    t: int,
    start: Mapping[str, Tensor],
    perp: Tensor | None,
    bans: Bans,
    payloads: Sequence[Payload],
    replicas: Sequence[str],
    embed_update: Tensor | None,
    device: Device = None,
) -> Outcome:
    """Commit round t of `stage` from (start, perp, bans): the portable commit of `payloads` (in the
    given order, from `replicas`, one id per payload or none; fused, nothing decoded densely; its
    elementwise steps on `device`, None: the CPU, the same bits), then `outcome` (the ban state
    advanced by the set and its outliers)."""
    keys = screening_keys(payloads, replicas)
    factor = perp_decay(cfg.train, t)
    done = commit_state(start, perp, payloads, cfg.sparseloco, U, embed_update, factor, keys=keys, device=device)
    dropped = tuple(keys[i] for i in done.commit.dropped) if keys is not None else ()
    return outcome(cfg, stage, t, bans, done, keys or (), dropped)


def outcome(
    cfg: RunConfig, stage: int, t: int, bans: Bans, done: Committed, replicas: Sequence[str], dropped: Sequence[str]
) -> Outcome:
    """The `Outcome` of `done`, round t's commit of `stage` from the ban state `bans`, however its Δ̄
    was aggregated (all-to-all: `compute`; assembled from range shards:
    `peer.node.stage.ranges.commit_ranges`): the bans advanced by the committed set `replicas`
    (commit order) and the outliers `dropped` from it, the new state's parameter and T⊥ hashes."""
    swarm = cfg.swarm
    new_bans = after_commit(bans, t, replicas, dropped, swarm.ban_after, swarm.ban_rounds, stage)
    perp_hash = done.perp_hash or (state_hash({"perp": done.perp}) if done.perp is not None else state_hash({}))
    param_hash = done.param_hash or state_hash(done.params)  # the commit hashed them as it made them
    return Outcome(t, done, new_bans, tuple(replicas), tuple(dropped), param_hash, perp_hash)


def screening_keys(payloads: Sequence[Payload], replicas: Sequence[str]) -> list[str] | None:
    """The screening's tie-break keys of a commit: the replica ids, one per payload (else none)."""
    return list(replicas) if len(replicas) == len(payloads) else None


def named(contributions: Sequence[Contribution]) -> tuple[list[Payload], list[str]]:
    """A set's payloads and replica ids in commit order, as `compute` takes them (no ids when any
    contribution is anonymous, a bare payload's: the screening then has no tie-break keys)."""
    replicas = [c.replica for c in contributions]
    return [c.payload for c in contributions], replicas if all(replicas) else []


def own_adjustment(
    own: Contribution | None, outcome: Outcome, contributions: Sequence[Contribution]
) -> dict[str, Tensor] | None:
    """What `outcome` takes from our own contribution to its round, for our error buffer: all of it
    when the set lacks it (same replica, same sha256), else what `peer.core.sparseloco.feedback.returned`
    says (dropped: all, clipped: the mass clipping removed, else None)."""
    if own is None:
        return None
    at = [i for i, c in enumerate(contributions) if c.replica == own.replica and c.sha256 == own.sha256]
    if not at:
        return decompress(own.payload)
    commit = outcome.committed.commit
    return returned(own.payload, at[0], commit.clip, commit.screen)


def log_commit(stage: int, out: Outcome, n: int) -> None:
    """Log what a commit screened out or clipped."""
    clip = out.committed.commit.clip
    if out.dropped:
        log.warning(
            "stage %d round %d: screened out %d of %d contributions as outliers: %s",
            stage,
            out.t,
            len(out.dropped),
            n,
            ", ".join(r[:12] for r in out.dropped),
        )
    if clip.n_clipped:
        log.info(
            "stage %d round %d: clipped %d of %d contributions (max norm %.3g x median %.3g)",
            stage,
            out.t,
            clip.n_clipped,
            n,
            clip.max_ratio,
            clip.median,
        )
