"""What the simulator runs and returns: its options, a configuration's result, and the paper's metric.

`SimOptions` are the experiment switches that are not part of a run's config; `ConfigResult` is what
one configuration at one seed and k/d measured; `Scorer` is the paper's metric (every replica on its
own path, the paths weighted by their counts). The loops that fill them are `peer.research.simulate.loops`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from peer.config import WIRE_DTYPES, RunConfig
from peer.core.data.loader import Corpus, val_batches
from peer.core.sparseloco.commit import screening_rule
from peer.core.sparseloco.robust import RobustConfig
from peer.errors import ConfigError
from peer.research.simulate.attacks import Collusion
from peer.research.simulate.ranges import RangeShares
from peer.research.simulate.replica import LocalReplica

if TYPE_CHECKING:  # links.py imports SimOptions from here
    from peer.research.simulate.links import LinkSchedule

CONFIGS = (
    "adamw",
    "sparseloco",
    "pp-compress",
    "het-pp-compress",
    "adamw-pp-compress",
    "adamw-het-pp-compress",
    "het-bw-pp-compress",
)
BASELINES = ("adamw", "sparseloco")  # no subspace: independent of k/d
# `peer simulate`'s own defaults (its --help says the same): the paper's metric needs no median clip
# and no outlier screening (both are the swarm's defences against poisoning, README).
SIMULATE_DEFAULTS: dict[str, Any] = {
    "train.inner_steps": 10,
    "train.outer_steps": 20,
    "sparseloco.clip_median_factor": 0.0,
    "sparseloco.screening": False,
}
GRASSMANN_LR = 0.5  # default η_U of --grassmann (docs/configuration.md says how it was chosen)
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
    attacks: tuple[str, ...] = ()  # sweeps: also run each config under each attack (peer.research.simulate.experiments)
    # outlier screening of each round's contributions; None: the run's `sparseloco.screening`, as
    # the swarm (attack sweeps set it per arm)
    robust: RobustConfig | None = None
    attack: str | None = None  # the last replica sends this attack (peer.research.simulate.attacks) every round
    collusion: Collusion | None = None  # the last K replicas collude every round (peer.research.simulate.attacks)
    # "all": all-to-all rounds; "ranges": range-sharded rounds (peer.research.simulate.ranges); the others:
    # peer.research.simulate.round_designs (aligned, voted, voted-residual, residual)
    round_rule: str = "all"
    grassmann: bool = False  # Table 5c: a Riemannian step of U per outer round (peer.research.simulate.ablations)
    grassmann_lr: float = GRASSMANN_LR  # Table 5c: its step size η_U
    modified_adamw: bool = False  # Table 5d: compressed replicas step T_S in subspace coordinates
    overlap: int = 0  # N inner steps of t + 1 before round t lands (peer.research.simulate.overlap); 0: synchronous
    links: LinkSchedule | None = None  # het-bw-pp-compress: every replica's link per outer step (simulate.links)


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
    attack: str | None = None  # the last replica's attack (peer.research.simulate.attacks); None: an honest run
    screening: bool = False  # outlier screening (peer.core.sparseloco.robust) was on
    round_rule: str = "all"  # SimOptions.round_rule
    overlap: int = 0  # SimOptions.overlap: N inner steps of t + 1 before round t lands (0: synchronous)
    dropped_mass: list[RangeShares] = field(default_factory=list)  # "ranges": per stage round
    # a round design's (sent, downloaded) bytes per holder over the run (peer.research.simulate.round_designs)
    holder_bytes: tuple[int, int] | None = None
    train_curve: list[tuple[int, float]] = field(default_factory=list)  # (global step, loss)
    val_curve: list[tuple[int, float]] = field(default_factory=list)  # (global step, replica mean)
    val_sequences: torch.Tensor | None = field(default=None, repr=False)  # (n_seq,) final replica mean
    bias: list[BiasRound] = field(default_factory=list)  # eq. 5, per outer round (peer.research.simulate.ablations)
    # per outer step, each replica's mode: F full replica, U uncompressed pipeline, C compressed (simulate.links)
    modes: list[str] = field(default_factory=list)

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
            "overlap",
            "modes",
        )
        extra: dict[str, Any] = {"dropped": len(self.dropped), "wall_s": round(self.wall_s, 2)}
        extra |= {"val_perplexity": perplexity(self.final_val_loss), "bias": [b._asdict() for b in self.bias]}
        if shares := [m.dropped for m in self.dropped_mass]:  # "ranges": the shards' shares of ‖Δ̄‖²
            quant = sum(m.quant for m in self.dropped_mass) / len(shares)
            extra |= {"dropped_mass_mean": sum(shares) / len(shares), "dropped_mass_max": max(shares)}
            extra |= {"quant_error_mean": quant}
        if self.holder_bytes is not None:  # a round design's (sent, downloaded) per holder over the run
            extra["holder_bytes"] = list(self.holder_bytes)
        return {k: getattr(self, k) for k in keys} | extra


def robust_rule(opts: SimOptions, cfg: RunConfig) -> RobustConfig:
    """The outlier rule a simulation of `cfg` runs: `opts.robust` when an experiment forces one, else
    the run's own (`sparseloco.screening`, as every holder of a swarm applies it)."""
    return opts.robust if opts.robust is not None else screening_rule(cfg.sparseloco)


class BiasRound(NamedTuple):
    """Eq. 5 for one outer round's embedding change Δ* (before projection) and Δ (as sent)."""

    t: int  # outer step
    replica: float  # ‖Δ*_m − Π(Δ*_m)‖ / ‖Δ*_m‖, mean over compressed replicas (nan: none)
    aggregate: float  # ‖mean Δ*_m − mean Δ_m‖ / ‖mean Δ*_m‖ over all replicas


def perplexity(loss: float) -> float:
    """exp(loss), inf past float range."""
    return math.exp(loss) if loss < 700 else math.inf


def n_uncompressed(kind: str, replicas: int, het_fraction: float) -> int:
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


def boundary_bytes(stats_values: int, cfg: RunConfig, tokens: int, compressed: bool) -> int:
    """Bytes for boundary values at the wire dtype plus the int32 token ids a compressed hop carries."""
    per_value = WIRE_DTYPES[cfg.subspace.wire_dtype].itemsize if compressed else 4
    hops = cfg.stages - 1
    return stats_values * per_value + (4 * tokens * hops if compressed else 0)


@dataclass
class Scorer:
    """The paper's metric: each of M replicas on its own path, the paths weighted by their counts."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    n_uncompressed: int
    replicas: int

    @classmethod
    def build(cls, data: Corpus, cfg: RunConfig, opts: SimOptions, n_unc: int) -> Scorer:
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


def uncompressed_share(modes: list[str]) -> float:
    """The share of replica-steps that ran uncompressed (F or U) over `modes` (one string per outer step)."""
    return sum(len(m) - m.count("C") for m in modes) / sum(len(m) for m in modes)


def new_result(cfg: RunConfig, kind: str, opts: SimOptions, n_unc: int, modes: list[str] | None = None) -> ConfigResult:
    """An empty result of `kind`; its α is n_unc / M, or with `modes` (het-bw) the uncompressed share."""
    uses_subspace = kind not in BASELINES
    screened = robust_rule(opts, cfg).enabled
    label = kind if opts.attack is None else f"{kind}+{opts.attack}" + ("" if screened else " (clip only)")
    return ConfigResult(
        label,
        cfg.subspace.k_ratio if uses_subspace else None,
        (n_unc / opts.replicas if modes is None else uncompressed_share(modes)) if "het" in kind else None,
        0.0,
        0.0,
        k=cfg.k if uses_subspace else None,
        seed=cfg.seed,
        config=kind,
        replicas=opts.replicas,
        attack=opts.attack,
        screening=screened,
        round_rule="all" if kind.startswith("adamw") else opts.round_rule,  # AdamW: dense all-reduce
        overlap=0 if kind.startswith("adamw") else opts.overlap,
    )
