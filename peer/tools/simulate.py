"""Single-process M × S simulator of the paper's experiments (arXiv 2601.02360, Tables 2, 4, 5).

Runs, on the same data, seed and number of steps:
- `adamw`                  H = 1 with dense gradient averaging (data-parallel AdamW),
- `sparseloco`             M uncompressed replicas, SparseLoCo every H steps,
- `pp-compress`            every replica's stage boundaries go through the k-dim subspace,
- `het-pp-compress`        a fraction α of the replicas is uncompressed, the rest compressed,
- `adamw-pp-compress`      data-parallel AdamW, every replica compressed (Table 4),
- `adamw-het-pp-compress`  data-parallel AdamW, a fraction α uncompressed (Table 4).

Every replica is S stage views of the decoder (`peer.tools.sim_replica.LocalReplica`), so the chain
forward (`peer.core.chain`), the stage boundaries, the inner step (`peer.core.inner.accumulate`,
`adamw_step`) and the per-stage SparseLoCo rounds (`peer.core.commit.commit_round`) are the ones a
real swarm runs; only the network is missing. Gradients are clipped by the norm over all stages;
median clipping is off unless asked (`sparseloco.clip_median_factor`), and where it clips, the
clipped mass goes back to the sender's error buffer (`peer.core.feedback`, as on every holder).
Outlier screening (`peer.core.robust`) is off unless asked (`SimOptions.robust`); a contribution
it drops goes back whole to its sender's error buffer.
`SimOptions.attack` makes the last replica an attacker (`peer.tools.attacks`): every round it
sends the poisoned contribution instead of its own. T⊥ decays at every commit as AdamW decays the
rest of the embedding. `SimOptions.round_rule` "ranges" commits every stage's round range by range
instead (`peer.tools.sim_ranges`, issue 24): owners' re-sparsified shards, assembled; the share of
‖Δ̄‖² the shards drop is recorded per round (`ConfigResult.dropped_mass`).

The metric is the paper's: after every outer step, the validation loss averaged over the M
replicas, each on its OWN forward path (compressed or not), on `val_tokens` held-out tokens.
After a commit all replicas hold the same weights, so each distinct path is evaluated once and
weighted by its number of replicas. `delta_pct` compares that replica mean with the baseline of
the config's family (`sparseloco`, or `adamw` for the adamw-* configs) of the same seed.
This module does no I/O but the optional checkpoint and plot, and prints nothing: progress goes
through a callback.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from peer.config import WIRE_DTYPES, RunConfig
from peer.core.codec.format import Payload
from peer.core.commit import commit_round, perp_decay
from peer.core.feedback import add_to_errors, returned
from peer.core.loader import Corpus, train_batch, val_batches
from peer.core.robust import OFF, RobustConfig
from peer.core.sparseloco import compress, decompress, pseudo_gradient
from peer.core.state import stage_state
from peer.core.subspace import k_from_ratio, make_basis
from peer.core.subspace_state import perp_of, set_perp
from peer.errors import ConfigError
from peer.node.checkpoints.model import save_model_checkpoint
from peer.tools.attacks import check_attack, poison
from peer.tools.plots import figure
from peer.tools.sim_ranges import RangeMass, RangeShares, check_ranges, commit_ranges
from peer.tools.sim_replica import LocalReplica

log = logging.getLogger(__name__)

CONFIGS = (
    "adamw",
    "sparseloco",
    "pp-compress",
    "het-pp-compress",
    "adamw-pp-compress",
    "adamw-het-pp-compress",
)
BASELINES = ("adamw", "sparseloco")  # no subspace: independent of k/d
# `peer simulate`'s own defaults (its --help says the same): the paper's metric needs no median clip.
SIMULATE_DEFAULTS: dict[str, Any] = {
    "train.inner_steps": 10,
    "train.outer_steps": 20,
    "sparseloco.clip_median_factor": 0.0,
}
VAL_BATCH = 64  # sequences per validation forward pass

Progress = Callable[[str, int, int, float], None]  # (config label, done steps, total steps, last loss)


@dataclass(frozen=True)
class SimOptions:
    """Experiment switches that are not part of a run's config."""

    replicas: int = 4
    het_fraction: float = 0.5
    val_tokens: int = 16384  # held-out tokens of every evaluation
    te_adaptation: bool = True  # Table 5 "no TE adaptation": False keeps T⊥ at its initial value
    weight_projection: bool = False  # Table 5: W_o / W_2 outputs kept in Col(U)
    adamw_lr: float | None = None  # inner learning rate of the adamw* configs (None: train.lr)
    attacks: tuple[str, ...] = ()  # sweeps: also run each config under each attack (peer.tools.experiments)
    robust: RobustConfig = OFF  # outlier screening of each round's contributions (the swarm's: DEFAULT)
    attack: str | None = None  # the last replica sends this attack (peer.tools.attacks) every round
    round_rule: str = "all"  # "all": all-to-all rounds; "ranges": range-sharded rounds (peer.tools.sim_ranges)


@dataclass
class ConfigResult:
    name: str
    k_ratio: str | None
    het_fraction: float | None
    final_loss: float
    final_val_loss: float  # = val_loss_replica_mean
    k: int | None = None  # the subspace width actually run
    seed: int = 0
    delta_pct: float = 0.0
    val_loss_replica_mean: float = math.nan
    val_loss_compressed_path: float | None = None
    val_loss_uncompressed_path: float | None = None
    val_loss_stderr: float = math.nan  # standard error of the replica mean over held-out sequences
    val_tokens: int = 0
    pg_bytes: int = 0  # pseudo-gradient (or dense gradient) bytes sent per replica
    act_bytes: int = 0  # stage-boundary bytes sent per replica (forward + backward)
    wall_s: float = 0.0
    clipped: int = 0  # contributions norm-clipped against their round's median, over the run
    dropped: list[tuple[int, int, int]] = field(default_factory=list)  # (t, stage, replica) screened out
    rounds: int = 0  # stage rounds committed (outer steps × stages)
    config: str = ""  # the configuration run (`name` adds the attack, if any)
    replicas: int = 0  # M
    attack: str | None = None  # the last replica's attack (peer.tools.attacks); None: an honest run
    screening: bool = False  # outlier screening (peer.core.robust) was on
    round_rule: str = "all"  # SimOptions.round_rule
    dropped_mass: list[RangeShares] = field(default_factory=list)  # "ranges": per stage round
    train_curve: list[tuple[int, float]] = field(default_factory=list)  # (global step, loss)
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (global step, replica mean)
    val_sequences: torch.Tensor | None = field(default=None, repr=False)  # (n_seq,) final replica mean

    def summary(self) -> dict[str, Any]:
        keys = (
            "name",
            "k_ratio",
            "k",
            "seed",
            "het_fraction",
            "final_loss",
            "final_val_loss",
            "val_loss_replica_mean",
            "val_loss_compressed_path",
            "val_loss_uncompressed_path",
            "val_loss_stderr",
            "val_tokens",
            "delta_pct",
            "pg_bytes",
            "act_bytes",
            "clipped",
            "attack",
            "screening",
            "rounds",
            "round_rule",
        )
        extra = {"dropped": len(self.dropped), "wall_s": round(self.wall_s, 2)}
        if shares := [m.dropped for m in self.dropped_mass]:  # "ranges": the shards' shares of ‖Δ̄‖²
            quant = sum(m.quant for m in self.dropped_mass) / len(shares)
            extra |= {"dropped_mass_mean": sum(shares) / len(shares), "dropped_mass_max": max(shares)}
            extra |= {"quant_error_mean": quant}
        return {k: getattr(self, k) for k in keys} | extra


def _n_uncompressed(kind: str, replicas: int, het_fraction: float) -> int:
    if kind in BASELINES:
        return replicas
    if kind.endswith("het-pp-compress"):
        n = round(het_fraction * replicas)
        if not 0 < n < replicas:
            raise ConfigError(
                f"--het-fraction {het_fraction} with {replicas} replicas gives {n} uncompressed replicas; "
                "choose a fraction that leaves at least one of each kind"
            )
        return n
    return 0


def _boundary_bytes(stats_values: int, cfg: RunConfig, tokens: int, compressed: bool) -> int:
    """Bytes for boundary values at the wire dtype plus the int32 token ids a compressed hop carries."""
    per_value = WIRE_DTYPES[cfg.subspace.wire_dtype].itemsize if compressed else 4
    hops = cfg.stages - 1
    return stats_values * per_value + (4 * tokens * hops if compressed else 0)


@dataclass
class _Scorer:
    """The paper's metric: each of M replicas on its own path, the paths weighted by their counts."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    n_uncompressed: int
    replicas: int

    @classmethod
    def build(cls, data: Corpus, cfg: RunConfig, opts: SimOptions, n_unc: int) -> _Scorer:
        seq = cfg.train.seq_len
        max_batches = max(1, -(-opts.val_tokens // (VAL_BATCH * seq)))
        batches = val_batches(data, VAL_BATCH, seq, max_batches)
        n_seq = -(-opts.val_tokens // seq)
        kept, count = [], 0
        for x, y in batches:  # exactly ceil(val_tokens / seq_len) sequences, when the split has them
            take = min(len(x), n_seq - count)
            if take <= 0:
                break
            kept.append((x[:take], y[:take]))
            count += take
        return cls(kept, n_unc, opts.replicas)

    @property
    def tokens(self) -> int:
        return sum(y.numel() for _, y in self.batches)

    def score(self, res: ConfigResult, unc: LocalReplica | None, comp: LocalReplica | None, step: int) -> None:
        """Evaluate both paths (where they exist) and record the replica mean at global `step`."""
        n_comp = self.replicas - self.n_uncompressed
        per_seq = torch.zeros(0, dtype=torch.float64)
        for model, n, compressed in ((unc, self.n_uncompressed, False), (comp, n_comp, True)):
            if model is None or n == 0:
                continue
            losses = model.sequence_losses(self.batches, compressed)
            per_seq = losses * (n / self.replicas) + (per_seq if per_seq.numel() else 0.0)
            if compressed:
                res.val_loss_compressed_path = float(losses.mean())
            else:
                res.val_loss_uncompressed_path = float(losses.mean())
        mean = float(per_seq.mean())
        res.val_curve.append((step, mean))
        res.val_loss_replica_mean = res.final_val_loss = mean
        n_seq = per_seq.numel()
        res.val_loss_stderr = float(per_seq.std() / math.sqrt(n_seq)) if n_seq > 1 else math.nan
        res.val_tokens = self.tokens
        res.val_sequences = per_seq


def _result(cfg: RunConfig, kind: str, opts: SimOptions, n_unc: int) -> ConfigResult:
    uses_subspace = kind not in BASELINES
    screened = opts.robust.enabled
    label = kind if opts.attack is None else f"{kind}+{opts.attack}" + ("" if screened else " (clip only)")
    return ConfigResult(
        label,
        cfg.subspace.k_ratio if uses_subspace else None,
        (n_unc / opts.replicas) if "het" in kind else None,
        0.0,
        0.0,
        k=cfg.k if uses_subspace else None,
        seed=cfg.seed,
        config=kind,
        replicas=opts.replicas,
        attack=opts.attack,
        screening=screened,
        round_rule="all" if kind.startswith("adamw") else opts.round_rule,  # AdamW: dense all-reduce
    )


def run_adamw(
    cfg: RunConfig, data: Corpus, kind: str, opts: SimOptions, progress: Progress | None
) -> tuple[ConfigResult, LocalReplica]:
    """Data-parallel AdamW: gradients of M shards averaged every step (dense fp32 on the wire).

    With a subspace (`adamw-*`), replica m computes its gradient on the compressed path unless it
    is one of the uncompressed ones; the one shared model keeps T_S in Col(U).
    """
    if opts.adamw_lr is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=opts.adamw_lr))
    train, replicas = cfg.train, opts.replicas
    n_unc = _n_uncompressed(kind, replicas, opts.het_fraction)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed) if kind != "adamw" else None
    model = LocalReplica.build(cfg, compressed=False, U=U, weight_projection=opts.weight_projection and U is not None)
    total = train.inner_steps * train.outer_steps
    n_params = sum(p.numel() for s in model.stages for p in s.parameters())
    result = _result(cfg, kind, opts, n_unc)
    scorer = _Scorer.build(data, cfg, opts, n_unc)
    act_bytes = 0
    for step in range(total):
        model.zero_grad()
        loss = 0.0
        for m in range(replicas):
            model.compressed = U is not None and m >= n_unc
            x, y = train_batch(data, m, replicas, step, train.batch_size, train.seq_len)
            stats = model.accumulate(x, y, scale=1.0 / replicas)
            loss += stats.loss / replicas
            act_bytes += _boundary_bytes(stats.boundary_values, cfg, stats.tokens, model.compressed)
        model.compressed = False
        model.apply_step(step, keep_in_subspace=U is not None, decay_perp=U is not None and opts.te_adaptation)
        result.train_curve.append((step, loss))
        if (step + 1) % train.inner_steps == 0:
            scorer.score(result, model, model, step + 1)
        if progress:
            progress(kind, step + 1, total, loss)
    result.pg_bytes = 4 * n_params * total
    result.act_bytes = act_bytes // replicas
    return result, model


class StageRound(NamedTuple):
    """What one stage's round did (`_commit_stage`)."""

    clipped: int  # contributions norm-clipped
    dropped: tuple[int, ...]  # replicas screened out
    embed_update: torch.Tensor | None  # stage 0's committed embedding change
    mass: RangeMass | None = None  # "ranges": what the shards dropped of Δ̄


def _commit_stage(
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
    done = commit_round(views, start, decoded, slc, U, embed_update, perp_factor, opts.robust)
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
    check_ranges(opts.round_rule, opts.robust, opts.attack)
    n_unc = _n_uncompressed(kind, replicas, opts.het_fraction)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed) if kind != "sparseloco" else None
    wp = opts.weight_projection and U is not None
    reps = [LocalReplica.build(cfg, compressed=(m >= n_unc), U=U, weight_projection=wp) for m in range(replicas)]
    errors: list[list[dict[str, torch.Tensor] | None]] = [[None] * cfg.stages for _ in range(replicas)]
    result = _result(cfg, kind, opts, n_unc)
    scorer = _Scorer.build(data, cfg, opts, n_unc)
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
                act_bytes[m] += _boundary_bytes(stats.boundary_values, cfg, stats.tokens, rep.compressed)
            loss = sum(losses) / replicas
            result.train_curve.append((step, loss))
            if progress:
                progress(kind, step + 1, total, loss)
        factor = perp_decay(train, t) if opts.te_adaptation else 1.0
        embed_update = None
        for s in range(cfg.stages):
            done = _commit_stage(reps, s, starts[s], errors, pg_bytes, cfg, factor, embed_update, opts, t)
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
        unc = reps[0] if n_unc > 0 else None
        comp = reps[n_unc] if n_unc < replicas else None
        scorer.score(result, unc, comp, (t + 1) * train.inner_steps)
    result.pg_bytes = sum(pg_bytes) // replicas
    result.act_bytes = sum(act_bytes) // replicas
    return result, reps[0]


def _final(curve: list[tuple[int, float]], last: int) -> float:
    tail = [v for _, v in curve[-last:]]
    return sum(tail) / max(1, len(tail))


def check_configs(configs: Sequence[str]) -> None:
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ConfigError(f"unknown simulator config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")


def run_config(
    cfg: RunConfig,
    data: Corpus,
    name: str,
    opts: SimOptions,
    progress: Progress | None = None,
    save_dir: Path | None = None,
) -> ConfigResult:
    """One configuration at cfg's seed and k/d (checkpointed under save_dir/name if given)."""
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    if name.startswith("adamw"):
        res, model = run_adamw(cfg, data, name, opts, progress)
    else:
        res, model = run_diloco(cfg, data, name, opts, progress)
    res.wall_s = time.perf_counter() - started
    res.final_loss = _final(res.train_curve, cfg.train.inner_steps)
    log.info("%s: train %.4f val %.4f in %.1fs", name, res.final_loss, res.final_val_loss, res.wall_s)
    if save_dir is not None:
        meta = {"simulate": res.summary(), "run": cfg.to_dict()}
        tok = data.tokenizer.path if data.tokenizer is not None else None
        save_model_checkpoint(Path(save_dir) / name, model.full_state(), cfg.model, tok, meta)
    return res


def assign_deltas(results: Sequence[ConfigResult]) -> None:
    """Δ % of each result against its family's baseline of the same seed (else the seed's first)."""
    for r in results:
        same_seed = [b for b in results if b.seed == r.seed]
        family = "adamw" if r.name.startswith("adamw") else "sparseloco"
        base = next((b for b in same_seed if b.name == family), same_seed[0])
        if r.attack is not None:  # an attacked run against the same config's honest run
            honest = (b for b in same_seed if b.attack is None and b.config == r.config and b.k == r.k)
            base = next(honest, base)
        r.delta_pct = 100.0 * (r.final_val_loss - base.final_val_loss) / base.final_val_loss


def simulate(
    cfg: RunConfig,
    data: Corpus,
    replicas: int,
    configs: Sequence[str] = CONFIGS[:4],
    het_fraction: float = 0.5,
    progress: Progress | None = None,
    save_dir: Path | None = None,
    options: SimOptions | None = None,
) -> list[ConfigResult]:
    """Run each configuration on the same data and steps (one seed, one k/d); Δ% as `assign_deltas`."""
    check_configs(configs)
    if replicas < 1:
        raise ConfigError(f"--replicas must be >= 1, got {replicas}")
    k_from_ratio(cfg.model.d_model, cfg.subspace.k_ratio)
    opts = dataclasses.replace(options or SimOptions(), replicas=replicas, het_fraction=het_fraction)
    results = [run_config(cfg, data, name, opts, progress, save_dir) for name in configs]
    assign_deltas(results)
    return results


def with_overrides(cfg: RunConfig, **train_overrides: Any) -> RunConfig:
    """Convenience for tests and the CLI: a copy of cfg with some TrainConfig fields replaced."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train_overrides))


def plot_curves(results: Sequence[ConfigResult], path: Path, title: str = "peer simulate") -> Path:
    """Train (thin) and validation (markers) loss against the global inner step, one colour per config."""
    with figure(path, title) as ax:
        for i, r in enumerate(results):
            color = f"C{i % 10}"
            label = r.name if r.k_ratio is None else f"{r.name} {r.k_ratio}"
            label += f" s{r.seed}"
            steps, losses = zip(*r.train_curve, strict=True)
            window = max(1, len(losses) // 50)
            smooth = [
                sum(losses[max(0, j - window + 1) : j + 1]) / len(losses[max(0, j - window + 1) : j + 1])
                for j in range(len(losses))
            ]
            ax.plot(steps, smooth, color=color, alpha=0.6, linewidth=1, label=f"{label} train")
            if r.val_curve:
                vs, vl = zip(*r.val_curve, strict=True)
                ax.plot(vs, vl, "o-", color=color, markersize=3, label=f"{label} val")
    return Path(path)
