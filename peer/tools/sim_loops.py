"""The simulator's two training loops: data-parallel AdamW and SparseLoCo over M replicas of S stages.

`run_adamw` averages M shards' gradients every step into one model; `run_diloco` trains M
`LocalReplica`s for H inner steps and commits every stage's round (`commit_stage`: all-to-all
through `peer.core.commit.commit_round`, or range by range through `peer.tools.sim_ranges`).
Both score the paper's metric after every outer step (`peer.tools.sim_results.Scorer`).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from peer.config import RunConfig
from peer.core.codec.format import Payload
from peer.core.commit import commit_round, perp_decay
from peer.core.feedback import add_to_errors, returned
from peer.core.loader import Corpus, train_batch
from peer.core.sparseloco import compress, decompress, pseudo_gradient
from peer.core.state import stage_state
from peer.core.subspace import make_basis
from peer.core.subspace_state import perp_of, set_perp
from peer.tools.attacks import check_attack, poison
from peer.tools.sim_ablations import configure_replicas, grassmann_round, record_bias
from peer.tools.sim_ranges import RangeMass, RangeShares, check_ranges, commit_ranges
from peer.tools.sim_replica import LocalReplica
from peer.tools.sim_results import (
    ConfigResult,
    Progress,
    Scorer,
    SimOptions,
    boundary_bytes,
    n_uncompressed,
    new_result,
    robust_rule,
)


def run_adamw(
    cfg: RunConfig, data: Corpus, kind: str, opts: SimOptions, progress: Progress | None
) -> tuple[ConfigResult, LocalReplica]:
    """Data-parallel AdamW: gradients of M shards averaged every step (dense fp32 on the wire).

    With a subspace (`adamw-*`), replica m computes its gradient on the compressed path unless it
    is one of the uncompressed ones; the one shared model keeps T_S in Col(U). In the heterogeneous
    config (§2.4) the uncompressed replicas are fully uncompressed: the step's residual outside
    Col(U) moves into T⊥ (`LocalReplica.apply_step(residual_to_perp=True)`) instead of being dropped.
    """
    if opts.adamw_lr is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=opts.adamw_lr))
    train, replicas = cfg.train, opts.replicas
    n_unc = n_uncompressed(kind, replicas, opts.het_fraction)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed) if kind != "adamw" else None
    model = LocalReplica.build(cfg, compressed=False, U=U, weight_projection=opts.weight_projection and U is not None)
    total = train.inner_steps * train.outer_steps
    n_params = sum(p.numel() for s in model.stages for p in s.parameters())
    result = new_result(cfg, kind, opts, n_unc)
    scorer = Scorer.build(data, cfg, opts, n_unc)
    act_bytes = 0
    for step in range(total):
        model.zero_grad()
        loss = 0.0
        for m in range(replicas):
            model.compressed = U is not None and m >= n_unc
            x, y = train_batch(data, m, replicas, step, train.batch_size, train.seq_len)
            stats = model.accumulate(x, y, scale=1.0 / replicas)
            loss += stats.loss / replicas
            act_bytes += boundary_bytes(stats.boundary_values, cfg, stats.tokens, model.compressed)
        model.compressed = False
        het = U is not None and n_unc > 0  # B: §2.4, uncompressed replicas' residual goes into T⊥, not away
        model.apply_step(step, U is not None, decay_perp=U is not None and opts.te_adaptation, residual_to_perp=het)
        result.train_curve.append((step, loss))
        if (step + 1) % train.inner_steps == 0:
            scorer.score(result, model, model, step + 1)
        if progress:
            progress(kind, step + 1, total, loss)
    result.pg_bytes = 4 * n_params * total
    result.act_bytes = act_bytes // replicas
    return result, model


class StageRound(NamedTuple):
    """What one stage's round did (`commit_stage`)."""

    clipped: int  # contributions norm-clipped
    dropped: tuple[int, ...]  # replicas screened out
    embed_update: torch.Tensor | None  # stage 0's committed embedding change
    mass: RangeMass | None = None  # "ranges": what the shards dropped of Δ̄


def commit_stage(
    reps: list[LocalReplica],
    s: int,
    start: dict[str, torch.Tensor],
    errors: list[list[dict[str, torch.Tensor] | None]],
    pg_bytes: list[int],
    cfg: RunConfig,
    perp_factor: float,
    embed_update: torch.Tensor | None,
    opts: SimOptions | None = None,
    t: int = 0,
) -> StageRound:
    """One stage's round over all replicas, all-to-all or range by range (`SimOptions.round_rule`).

    Clipped mass returns to its honest sender's error buffer; a dropped contribution returns whole;
    what a range's shard drops returns to each sender (`peer.tools.sim_ranges`).
    """
    slc, opts = cfg.sparseloco, opts or SimOptions()
    if opts.round_rule == "ranges":
        ranged = commit_ranges(reps, s, start, errors, pg_bytes, cfg, perp_factor, embed_update, t)
        return StageRound(ranged.clipped, (), ranged.embed_update, ranged.mass)
    decoded = []
    for m, rep in enumerate(reps):
        delta = pseudo_gradient(start, stage_state(rep.stages[s]))
        payload, errors[m][s] = compress(delta, errors[m][s], slc)
        wire = payload.to_bytes()
        pg_bytes[m] += len(wire)
        decoded.append(decompress(Payload.from_bytes(wire)))
    if opts.attack is not None:
        decoded[-1] = poison(opts.attack, decoded[-1], t, s, slc)
    U = reps[0].U
    views = [rep.stages[s] for rep in reps]
    done = commit_round(views, start, decoded, slc, U, embed_update, perp_factor, robust_rule(opts, cfg))
    honest = range(len(reps) - (opts.attack is not None))  # an attacker keeps its own error buffer
    for m in honest:
        back = returned(decoded[m], m, done.clip, done.dropped)
        if back is not None:
            errors[m][s] = add_to_errors(errors[m][s], back)
    return StageRound(done.clip.n_clipped, done.dropped, done.embed_update)


def run_diloco(
    cfg: RunConfig, data: Corpus, kind: str, opts: SimOptions, progress: Progress | None
) -> tuple[ConfigResult, LocalReplica]:
    """SparseLoCo over M replicas of S stages, some or all with subspace-compressed boundaries."""
    train, replicas = cfg.train, opts.replicas
    check_attack(opts.attack)
    check_ranges(opts.round_rule, robust_rule(opts, cfg), opts.attack)
    n_unc = n_uncompressed(kind, replicas, opts.het_fraction)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed) if kind != "sparseloco" else None
    wp = opts.weight_projection and U is not None
    reps = [LocalReplica.build(cfg, compressed=(m >= n_unc), U=U, weight_projection=wp) for m in range(replicas)]
    configure_replicas(reps, opts)  # B: Table 5c / 5d switches, the eq. 5 record (peer.tools.sim_ablations)
    errors: list[list[dict[str, torch.Tensor] | None]] = [[None] * cfg.stages for _ in range(replicas)]
    result = new_result(cfg, kind, opts, n_unc)
    scorer = Scorer.build(data, cfg, opts, n_unc)
    total = train.inner_steps * train.outer_steps
    pg_bytes = [0] * replicas
    act_bytes = [0] * replicas
    initial_perp = [perp_of(st).clone() for st in reps[0].stages] if U is not None else []
    for t in range(train.outer_steps):
        starts = [stage_state(st) for st in reps[0].stages]
        for h in range(train.inner_steps):
            step = t * train.inner_steps + h
            losses = []
            for m, rep in enumerate(reps):
                x, y = train_batch(data, m, replicas, step, train.batch_size, train.seq_len)
                stats = rep.inner_step(x, y, step)
                losses.append(stats.loss)
                act_bytes[m] += boundary_bytes(stats.boundary_values, cfg, stats.tokens, rep.compressed)
            loss = sum(losses) / replicas
            result.train_curve.append((step, loss))
            if progress:
                progress(kind, step + 1, total, loss)
        record_bias(reps, result, t)  # B: eq. 5 bias of this round's embedding change
        factor = perp_decay(train, t) if opts.te_adaptation else 1.0
        embed_update = None
        for s in range(cfg.stages):
            done = commit_stage(reps, s, starts[s], errors, pg_bytes, cfg, factor, embed_update, opts, t)
            result.clipped += done.clipped
            result.dropped += [(t, s, m) for m in done.dropped]
            result.rounds += 1
            if done.mass is not None:
                result.dropped_mass.append(RangeShares(t, s, done.mass.dropped_fraction, done.mass.quant_fraction))
            if s == 0:
                embed_update = done.embed_update
        if U is not None and not opts.te_adaptation:  # T⊥ stays at its initial value
            for rep in reps:
                for st, perp in zip(rep.stages, initial_perp, strict=True):
                    set_perp(st, perp)
        for rep in reps:
            rep.project_outputs()
        grassmann_round(reps, opts, pg_bytes)  # B: Table 5c, U' for every replica
        unc = reps[0] if n_unc > 0 else None
        comp = reps[n_unc] if n_unc < replicas else None
        scorer.score(result, unc, comp, (t + 1) * train.inner_steps)
    result.pg_bytes = sum(pg_bytes) // replicas
    result.act_bytes = sum(act_bytes) // replicas
    return result, reps[0]
