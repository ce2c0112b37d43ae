"""The simulator's two training loops: data-parallel AdamW and SparseLoCo over M replicas of S stages.

`run_adamw` averages M shards' gradients every step into one model; `run_diloco` trains M
`LocalReplica`s for H inner steps and commits every stage's round (`commit_stage`: all-to-all
through `peer.core.sparseloco.commit.commit_round`, or range by range through `peer.research.simulate.ranges`);
with `SimOptions.overlap` = N > 0 the round lands after the first N inner steps of the next outer step
(`peer.research.simulate.overlap`; N = 0 runs the synchronous schedule, to the bit as before).
Both score the paper's metric after every outer step (`peer.research.simulate.results.Scorer`).
`round_payloads` stops an honest SparseLoCo run at one round and hands back its payloads (`peer bench sybil`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from peer.config import RunConfig
from peer.core.data.loader import Corpus
from peer.core.model.state import stage_state
from peer.core.sparseloco.algorithm import compress, decompress, pseudo_gradient
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.commit import Contribution, commit_round, perp_decay
from peer.core.sparseloco.feedback import add_to_errors, returned
from peer.core.subspace.compression import make_basis
from peer.core.subspace.state import perp_of, set_perp
from peer.errors import ConfigError
from peer.research.simulate.ablations import configure_replicas, grassmann_round, record_bias
from peer.research.simulate.attacks import check_attack, collude, poison
from peer.research.simulate.checkpoint import run_key
from peer.research.simulate.links import BY_LINK, COMPRESSED, FULL, fixed_modes, link_modes
from peer.research.simulate.overlap import Rebase, rebase_replicas, restore, snapshot
from peer.research.simulate.pool import Pending, ReplicaPool, batch, corpus_key
from peer.research.simulate.ranges import RangeMass, RangeShares, check_ranges, commit_ranges
from peer.research.simulate.replica import LocalReplica, StepStats
from peer.research.simulate.results import (
    ConfigResult,
    Progress,
    Scorer,
    SimOptions,
    boundary_bytes,
    n_uncompressed,
    new_result,
    robust_rule,
)
from peer.research.simulate.round_designs import DESIGN_RULES, DesignState, check_design, commit_design
from peer.research.simulate.runtime import current, worker_threads


@dataclass
class AdamwRun:
    """Data-parallel AdamW's loop state after a finished outer step (what a checkpoint holds)."""

    model: LocalReplica
    result: ConfigResult
    step: int = 0  # the next global step
    act_bytes: int = 0
    rng: torch.Tensor = field(default_factory=torch.get_rng_state)


def run_adamw(
    cfg: RunConfig, data: Corpus, kind: str, opts: SimOptions, progress: Progress | None
) -> tuple[ConfigResult, LocalReplica]:
    """Data-parallel AdamW: gradients of M shards averaged every step (dense fp32 on the wire).

    With a subspace (`adamw-*`), replica m computes its gradient on the compressed path unless it
    is one of the uncompressed ones; the one shared model keeps T_S in Col(U). In the heterogeneous
    config (§2.4) the uncompressed replicas are fully uncompressed: the step's residual outside
    Col(U) moves into T⊥ (`LocalReplica.apply_step(residual_to_perp=True)`) instead of being dropped.
    The shards run in this process, on all of its threads, even beside workers: an AdamW step is too
    short to ship the model to workers and back every step (measured slower: docs/results.md).
    """
    rt, key = current(), run_key(cfg, kind, opts)
    if opts.adamw_lr is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=opts.adamw_lr))
    train, replicas = cfg.train, opts.replicas
    n_unc = n_uncompressed(kind, replicas, opts.het_fraction)
    run: AdamwRun | None = rt.restore(key)
    if run is None:
        U = make_basis(cfg.model.d_model, cfg.k, cfg.seed) if kind != "adamw" else None
        wp = opts.weight_projection and U is not None
        model = rt.place(LocalReplica.build(cfg, compressed=False, U=U, weight_projection=wp))
        run = AdamwRun(model, new_result(cfg, kind, opts, n_unc))
    torch.set_rng_state(run.rng)
    model, result, U = run.model, run.result, run.model.U
    total = train.inner_steps * train.outer_steps
    scorer = Scorer.build(data, cfg, opts, n_unc)
    scorer.batches = rt.batches(scorer.batches)
    if progress and run.step:
        progress(kind, run.step, total, result.train_curve[-1][1])
    paths = [U is not None and m >= n_unc for m in range(replicas)]
    with rt.all_threads():
        _adamw_steps(run, cfg, kind, opts, data, paths, scorer, progress, key)
    n_params = sum(p.numel() for s in model.stages for p in s.parameters())
    result.pg_bytes = 4 * n_params * total
    result.act_bytes = run.act_bytes // replicas
    return result, model


def _adamw_steps(
    run: AdamwRun,
    cfg: RunConfig,
    kind: str,
    opts: SimOptions,
    data: Corpus,
    paths: list[bool],
    scorer: Scorer,
    progress: Progress | None,
    key: str,
) -> None:
    """AdamW's steps from `run.step` on: the shards' gradients averaged, one step, scored every H steps."""
    rt, train, replicas = current(), cfg.train, opts.replicas
    model, result, U = run.model, run.result, run.model.U
    n_unc = replicas - sum(paths) if U is not None else replicas
    total = train.inner_steps * train.outer_steps
    for step in range(run.step, total):
        model.zero_grad()
        shards = _shards(model, data, paths, step)
        loss = 0.0
        for stats, compressed in zip(shards, paths, strict=True):
            loss += stats.loss / replicas
            run.act_bytes += boundary_bytes(stats.boundary_values, cfg, stats.tokens, compressed)
        model.compressed = False
        het = U is not None and n_unc > 0  # B: §2.4, uncompressed replicas' residual goes into T⊥, not away
        model.apply_step(step, U is not None, decay_perp=U is not None and opts.te_adaptation, residual_to_perp=het)
        result.train_curve.append((step, loss))
        if (step + 1) % train.inner_steps == 0:
            _score(scorer, result, model, model, step + 1)
            result.modes.append("".join(COMPRESSED if c else FULL for c in paths))
            run.step, run.rng = step + 1, torch.get_rng_state()
            rt.save(key, run)
        if progress:
            progress(kind, step + 1, total, loss)


def _shards(model: LocalReplica, data: Corpus, paths: list[bool], step: int) -> list[StepStats]:
    """Every shard's gradient added into the model's, shard by shard; each shard's stats."""
    replicas, out = len(paths), []
    for m, compressed in enumerate(paths):
        model.compressed = compressed
        out.append(model.accumulate(*batch(data, m, replicas, step, model), scale=1.0 / replicas))
    return out


def _score(
    scorer: Scorer, result: ConfigResult, unc: LocalReplica | None, comp: LocalReplica | None, step: int
) -> None:
    """The paper's metric after an outer step; the held-out losses kept on the CPU."""
    scorer.score(result, unc, comp, step)
    if result.val_sequences is not None:
        result.val_sequences = result.val_sequences.cpu()


def stage_payloads(
    reps: list[LocalReplica],
    s: int,
    start: dict[str, torch.Tensor],
    errors: list[list[dict[str, torch.Tensor] | None]],
    pg_bytes: list[int],
    slc: SparseLoCoConfig,
) -> list[Payload]:
    """Every replica's payload of stage s's round, parsed back from its wire bytes (in replica
    order): Δ = θ_start − θ, compressed with the replica's error buffer (updated in `errors`), its
    bytes counted in `pg_bytes`."""
    parsed = []
    for m, rep in enumerate(reps):
        delta = pseudo_gradient(start, stage_state(rep.stages[s]))
        payload, errors[m][s] = compress(delta, errors[m][s], slc)
        wire = payload.to_bytes()
        pg_bytes[m] += len(wire)
        parsed.append(Payload.from_bytes(wire))
    return parsed


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
    design: DesignState | None = None,
) -> StageRound:
    """One stage's round over all replicas, all-to-all, range by range or by a design of
    `peer.research.simulate.round_designs` (`SimOptions.round_rule`; `design` holds its agreed state).

    Clipped mass returns to its honest sender's error buffer; a dropped contribution returns whole;
    what a range's shard drops returns to each sender (`peer.research.simulate.ranges`).
    """
    slc, opts = cfg.sparseloco, opts or SimOptions()
    if opts.round_rule in DESIGN_RULES:
        state = DesignState() if design is None else design
        made = commit_design(
            opts.round_rule, reps, s, start, errors, pg_bytes, cfg, perp_factor, embed_update, t, state
        )
        return StageRound(0, (), made.embed_update, made.mass)
    if opts.round_rule in ("ranges", "exact"):
        ranged = commit_ranges(reps, s, start, errors, pg_bytes, cfg, perp_factor, embed_update, t, opts.round_rule)
        return StageRound(ranged.clipped, (), ranged.embed_update, ranged.mass)
    parsed = stage_payloads(reps, s, start, errors, pg_bytes, slc)  # the fused commit: no dense Δ̂
    fused = current().fused_commit
    decoded: list[Contribution] = list(parsed) if fused else [decompress(p) for p in parsed]
    attackers = int(opts.attack is not None)
    if opts.attack is not None:
        decoded[-1] = poison(opts.attack, decompress(parsed[-1]), t, s, slc)
    if opts.collusion is not None:  # the last K send one forged payload, made from the others'
        attackers = opts.collusion.colluders
        forged = collude(opts.collusion, parsed[:-attackers], slc, t, s)
        decoded[-attackers:] = [forged if fused else decompress(forged)] * attackers
    U = None if reps[0].U is None else reps[0].U.cpu()  # the commit runs on the CPU
    views = [rep.stages[s] for rep in reps]
    done = commit_round(views, start, decoded, slc, U, embed_update, perp_factor, robust_rule(opts, cfg))
    honest = range(len(reps) - attackers)  # an attacker keeps its own error buffer
    for m in honest:
        back = returned(decoded[m], m, done.clip, done.screen)
        if back is not None:
            errors[m][s] = add_to_errors(errors[m][s], back)
    return StageRound(done.clip.n_clipped, done.dropped, done.embed_update)


@dataclass
class DilocoRun:
    """SparseLoCo's loop state after a finished outer step (what a checkpoint holds)."""

    reps: list[LocalReplica]
    errors: list[list[dict[str, torch.Tensor] | None]]
    result: ConfigResult
    initial_perp: list[torch.Tensor]
    pg_bytes: list[int]
    act_bytes: list[int]
    t: int = 0  # the next outer step
    rng: torch.Tensor = field(default_factory=torch.get_rng_state)
    rebase: Rebase | None = None  # overlap: round t − 1, committed, to land after t's first N inner steps
    design: DesignState = field(default_factory=DesignState)  # a round design's agreed state (round_designs)


def run_modes(cfg: RunConfig, kind: str, opts: SimOptions) -> list[str]:
    """Every outer step's mode of each replica (`peer.research.simulate.links`): chosen by the links for
    het-bw-pp-compress, fixed for the others (the first n_uncompressed full replicas, the rest compressed)."""
    if kind != BY_LINK:
        n_unc = n_uncompressed(kind, opts.replicas, opts.het_fraction)
        return fixed_modes(cfg.train.outer_steps, opts.replicas, n_unc)
    if opts.links is None:
        raise ConfigError(f"{BY_LINK} needs --links: every replica's Mbit/s, or 'full' for a full replica")
    return link_modes(cfg, opts.links)


def _new_diloco(cfg: RunConfig, kind: str, opts: SimOptions, modes: list[str]) -> DilocoRun:
    replicas, rt = opts.replicas, current()
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed) if kind != "sparseloco" else None
    wp = opts.weight_projection and U is not None
    first = modes[0]
    if len(first) != replicas:
        raise ConfigError(f"--links names {len(first)} replicas; the run has {replicas}")
    reps = [LocalReplica.build(cfg, compressed=(mode == COMPRESSED), U=U, weight_projection=wp) for mode in first]
    configure_replicas(reps, opts)  # B: Table 5c / 5d switches, the eq. 5 record (peer.research.simulate.ablations)
    reps = [rt.place(rep) for rep in reps]
    errors: list[list[dict[str, torch.Tensor] | None]] = [[None] * cfg.stages for _ in range(replicas)]
    initial_perp = [perp_of(st).clone() for st in reps[0].stages] if U is not None else []
    n_unc = replicas - first.count(COMPRESSED)
    result = new_result(cfg, kind, opts, n_unc, modes if kind == BY_LINK else None)
    return DilocoRun(reps, errors, result, initial_perp, [0] * replicas, [0] * replicas)


def run_diloco(
    cfg: RunConfig, data: Corpus, kind: str, opts: SimOptions, progress: Progress | None
) -> tuple[ConfigResult, LocalReplica]:
    """SparseLoCo over M replicas of S stages, some or all with subspace-compressed boundaries.

    The inner steps run on the session's workers when it has them (`peer.research.simulate.pool`); the
    state after every outer step goes to the session's checkpoint, and a stored one is resumed."""
    train, replicas, rt, key = cfg.train, opts.replicas, current(), run_key(cfg, kind, opts)
    check_attack(opts.attack)
    if opts.attack is not None and opts.collusion is not None:
        raise ConfigError("a run has one attack: an attacker (--attacks) or colluders, not both")
    colluding = None if opts.collusion is None else opts.collusion.strategy
    check_ranges(opts.round_rule, robust_rule(opts, cfg), opts.attack or colluding)
    check_design(opts.round_rule, cfg)
    modes = run_modes(cfg, kind, opts)
    run: DilocoRun = rt.restore(key) or _new_diloco(cfg, kind, opts, modes)
    torch.set_rng_state(run.rng)
    result, reps, U = run.result, run.reps, run.reps[0].U
    scorer = Scorer.build(data, cfg, opts, 0)  # its count of uncompressed replicas: per outer step (`_score_modes`)
    scorer.batches = rt.batches(scorer.batches)
    total = train.inner_steps * train.outer_steps
    if progress and run.t:
        progress(kind, run.t * train.inner_steps, total, result.train_curve[-1][1])
    pool, N = rt.pool(replicas), opts.overlap
    _begin(run, modes, run.t)
    pending = _send_inner(pool, run, data, cfg, run.t, 0, N if run.rebase is not None else None)
    for t in range(run.t, train.outer_steps):
        if run.rebase is None:
            starts = [{n: v.cpu() for n, v in stage_state(st).items()} for st in reps[0].stages]
        else:  # round t − 1 lands after t's first N inner steps: θ_start(t) is what it committed
            starts = run.rebase.starts()
        _train(run, data, cfg, t, kind, progress, pool, pending, N)
        record_bias(reps, result, t)  # B: eq. 5 bias of this round's embedding change
        overlapped = N > 0 and t + 1 < train.outer_steps  # the round runs beside t + 1's first N steps
        boundary = snapshot(reps) if overlapped else None
        with rt.all_threads():  # the workers wait for the round: its encode and commit take every core
            _commit_all(run, cfg, opts, starts, t)
        if U is not None and not opts.te_adaptation:  # T⊥ stays at its initial value
            for rep in reps:
                for st, perp in zip(rep.stages, run.initial_perp, strict=True):
                    set_perp(st, perp)
        for rep in reps:
            rep.project_outputs()
        grassmann_round(reps, opts, run.pg_bytes)  # B: Table 5c, U' for every replica
        _begin(run, modes, t + 1)  # t + 1's modes, before its inner steps are sent
        if boundary is None:
            pending = _send_inner(pool, run, data, cfg, t + 1)  # the workers train on while this scores
        _score_modes(scorer, result, reps, modes[t], (t + 1) * train.inner_steps)  # the committed model
        if boundary is not None:  # back to θ_b: t + 1's first N steps run before round t lands
            run.rebase = Rebase(snapshot(reps), boundary)
            restore(reps, boundary)
            pending = _send_inner(pool, run, data, cfg, t + 1, 0, N)
        run.t, run.rng = t + 1, torch.get_rng_state()
        rt.save(key, run)
    result.pg_bytes = sum(run.pg_bytes) // replicas
    result.act_bytes = sum(run.act_bytes) // replicas
    if opts.round_rule in DESIGN_RULES:
        result.holder_bytes = (round(run.design.sent_bytes), round(run.design.down_bytes))
    return result, reps[0]


def _begin(run: DilocoRun, modes: list[str], t: int) -> None:
    """Outer step t's modes on the replicas (before its inner steps run or are sent), recorded once."""
    if t >= len(modes):
        return
    for rep, mode in zip(run.reps, modes[t], strict=True):
        rep.compressed = mode == COMPRESSED
    if len(run.result.modes) == t:
        run.result.modes.append(modes[t])


def _score_modes(scorer: Scorer, result: ConfigResult, reps: list[LocalReplica], ran: str, step: int) -> None:
    """The paper's metric after an outer step whose replicas ran the modes `ran`: after the commit every
    replica holds the same weights, so each path is evaluated on its first replica, weighted by its count."""
    unc = next((rep for rep, mode in zip(reps, ran, strict=True) if mode != COMPRESSED), None)
    comp = next((rep for rep, mode in zip(reps, ran, strict=True) if mode == COMPRESSED), None)
    scorer.n_uncompressed = len(ran) - ran.count(COMPRESSED)
    _score(scorer, result, unc, comp, step)


def _commit_all(
    run: DilocoRun, cfg: RunConfig, opts: SimOptions, starts: list[dict[str, torch.Tensor]], t: int
) -> None:
    """Outer step t's rounds, stage by stage (stage 0's embedding change moves the others' T⊥), into `run.result`."""
    result = run.result
    factor = perp_decay(cfg.train, t) if opts.te_adaptation else 1.0
    embed_update = None
    for s in range(cfg.stages):
        done = commit_stage(
            run.reps, s, starts[s], run.errors, run.pg_bytes, cfg, factor, embed_update, opts, t, run.design
        )
        result.clipped += done.clipped
        result.dropped += [(t, s, m) for m in done.dropped]
        result.rounds += 1
        if done.mass is not None:
            result.dropped_mass.append(RangeShares(t, s, done.mass.dropped_fraction, done.mass.quant_fraction))
        if s == 0:
            embed_update = done.embed_update


def _train(
    run: DilocoRun,
    data: Corpus,
    cfg: RunConfig,
    t: int,
    kind: str,
    progress: Progress | None,
    pool: ReplicaPool | None,
    pending: Pending | None,
    overlap: int,
) -> None:
    """Outer step t's H inner steps; with a round pending (`run.rebase`), the first `overlap` of them on
    the un-rebased replicas, then the rebase (`peer.research.simulate.overlap`), then the rest."""
    H = cfg.train.inner_steps
    if run.rebase is None:
        _inner_steps(run, data, cfg, t, kind, progress, pool, pending)
        return
    _inner_steps(run, data, cfg, t, kind, progress, pool, pending, 0, overlap)
    rebase_replicas(run.reps, run.rebase)
    run.rebase = None
    if overlap < H:
        rest = _send_inner(pool, run, data, cfg, t, overlap, H - overlap)
        _inner_steps(run, data, cfg, t, kind, progress, pool, rest, overlap, H - overlap)


def _send_inner(
    pool: ReplicaPool | None,
    run: DilocoRun,
    data: Corpus,
    cfg: RunConfig,
    t: int,
    first: int = 0,
    count: int | None = None,
) -> Pending | None:
    """Send outer step t's inner steps `first` … `first + count − 1` (default: all H) to the workers (the
    replicas as they are now), if any."""
    if pool is None or t >= cfg.train.outer_steps:
        return None
    H, replicas = cfg.train.inner_steps, len(run.reps)
    n = H - first if count is None else count
    jobs = [(rep, m, replicas, t * H + first, n) for m, rep in enumerate(run.reps)]
    return pool.submit("inner", corpus_key(data), jobs)


def _inner_steps(
    run: DilocoRun,
    data: Corpus,
    cfg: RunConfig,
    t: int,
    kind: str,
    progress: Progress | None,
    pool: ReplicaPool | None = None,
    pending: Pending | None = None,
    first: int = 0,
    count: int | None = None,
) -> None:
    """Outer step t's inner steps `first` … `first + count − 1` (default: all H) of every replica (in
    process, or sent to the workers: `pending`); each step's replica-mean loss into the train curve
    (summed in replica order) and the progress."""
    H, replicas = cfg.train.inner_steps, len(run.reps)
    total = H * cfg.train.outer_steps
    n = H - first if count is None else count
    if pool is not None and pending is not None:
        done = pool.collect(pending)
        run.reps[:] = [rep for rep, _ in done]
        per_step = [[stats[h] for _, stats in done] for h in range(n)]
    for h in range(n):
        step = t * H + first + h
        if pool is None or pending is None:
            with worker_threads():  # the bits of any --workers
                stats_h = [rep.inner_step(*batch(data, m, replicas, step, rep), step) for m, rep in enumerate(run.reps)]
        else:
            stats_h = per_step[h]
        for m, (rep, stats) in enumerate(zip(run.reps, stats_h, strict=True)):
            run.act_bytes[m] += boundary_bytes(stats.boundary_values, cfg, stats.tokens, rep.compressed)
        loss = sum(s.loss for s in stats_h) / replicas
        run.result.train_curve.append((step, loss))
        if progress:
            progress(kind, step + 1, total, loss)


def round_payloads(
    cfg: RunConfig, data: Corpus, replicas: int, t: int, stage: int
) -> tuple[dict[str, torch.Tensor], list[Payload]]:
    """(θ_start, every replica's payload) of `stage`'s round at outer step t of an honest SparseLoCo run
    of M = `replicas` (rounds 0 … t−1 trained and committed as `run_diloco` does, in this process)."""
    opts = SimOptions(replicas=replicas)
    run = _new_diloco(cfg, "sparseloco", opts, run_modes(cfg, "sparseloco", opts))

    def starts() -> list[dict[str, torch.Tensor]]:
        return [{n: v.cpu() for n, v in stage_state(st).items()} for st in run.reps[0].stages]

    for u in range(t):
        begun = starts()
        _inner_steps(run, data, cfg, u, "sparseloco", None)
        embed_update = None
        for s in range(cfg.stages):
            done = commit_stage(run.reps, s, begun[s], run.errors, run.pg_bytes, cfg, 1.0, embed_update, opts, u)
            embed_update = done.embed_update
    start = starts()[stage]
    _inner_steps(run, data, cfg, t, "sparseloco", None)
    return start, stage_payloads(run.reps, stage, start, run.errors, run.pg_bytes, cfg.sparseloco)
