"""The coordinator's side of Table 5c, 5d and eq. 5 of arXiv 2601.02360 in `peer simulate`.

Every function takes the list of `LocalReplica`s of one run (each replica keeps its own state in
its fields), so the loops of `peer.research.simulate.loops` call them in one line each:

- `check_ablations`: the switches against the configs, before anything runs;
- `configure_replicas`: turn the switches on for freshly built replicas;
- `record_bias` (eq. 5, once per outer round, before the commit): per replica, the share of the
  round's embedding change Δ*_m (every inner AdamW step on T_S summed BEFORE any projection) that
  leaves Col(U), ‖Δ*_m − Π(Δ*_m)‖ / ‖Δ*_m‖, averaged over the compressed replicas; and the
  aggregate ‖mean Δ*_m − mean Δ_m‖ / ‖mean Δ*_m‖ over all replicas, Δ_m being what replica m
  keeps and sends (after projection). A fraction α of uncompressed replicas shrinks the aggregate
  towards (1 − α) × the per-replica value (DESIGN §2 "Heterogeneous replicas"); a random direction
  gives √(1 − k/d). Only the token embedding is measured (the only tensor the subspace constrains),
  and only the subspace's bias (not SparseLoCo's top-k and quantization);
- `grassmann_round` (Table 5c, once per outer round, after the commit): average the compressed
  replicas' dL/dU, take one Riemannian step (`peer.core.subspace.grassmann.grassmann_step`), move every
  replica onto U' (`LocalReplica.rebase`), and count each compressed replica's d × k float32
  U-gradient in its pseudo-gradient bytes.

Simulator-only: the swarm keeps a fixed U (its hash is in the manifest).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from peer.core.subspace.compression import project
from peer.core.subspace.grassmann import grassmann_step
from peer.errors import ConfigError
from peer.research.simulate.replica import LocalReplica
from peer.research.simulate.results import BASELINES, BiasRound, ConfigResult, SimOptions


def check_ablations(configs: Sequence[str], opts: SimOptions) -> None:
    """Refuse a bad --grassmann-lr, --grassmann without TE adaptation, and the Table 5c / 5d switches
    where they do not apply (the dense AdamW configs)."""
    if not (math.isfinite(opts.grassmann_lr) and opts.grassmann_lr > 0):
        raise ConfigError(f"--grassmann-lr must be a positive number, got {opts.grassmann_lr}")
    if opts.grassmann and not opts.te_adaptation:
        raise ConfigError("--grassmann re-splits TE = T_S + T⊥ on every new U; it needs --te-adaptation")
    for flag, on in (("--grassmann", opts.grassmann), ("--modified-adamw", opts.modified_adamw)):
        dense = [c for c in configs if on and c.startswith("adamw") and c not in BASELINES]
        if dense:
            raise ConfigError(
                f"{flag} applies to the SparseLoCo configs (pp-compress, het-pp-compress), not to {', '.join(dense)}"
            )


def configure_replicas(reps: Sequence[LocalReplica], opts: SimOptions) -> None:
    """Table 5c / 5d as the options say, and the eq. 5 record, on every replica (before the first step)."""
    for rep in reps:
        rep.enable_ablations(opts.grassmann, opts.modified_adamw, track_bias=True)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    d = float(den.double().norm())
    return float(num.double().norm()) / d if d > 0 else math.nan


@torch.no_grad()
def record_bias(reps: Sequence[LocalReplica], result: ConfigResult, t: int) -> None:
    """Eq. 5 of outer round t into `result.bias`; zero every replica's record for the next round."""
    tracked = [r for r in reps if r.delta_star is not None and r.delta_sent is not None and r.U is not None]
    if not tracked:
        return
    per = [_ratio(r.delta_star - project(r.delta_star, r.U), r.delta_star) for r in tracked if r.compressed]  # type: ignore[arg-type,operator]  # tracked: both set
    star = torch.stack([r.delta_star.double() for r in tracked]).mean(0)  # type: ignore[union-attr]  # tracked
    sent = torch.stack([r.delta_sent.double() for r in tracked]).mean(0)  # type: ignore[union-attr]  # tracked
    replica = statistics.fmean(per) if per else math.nan
    result.bias.append(BiasRound(t, replica, _ratio(star - sent, star)))
    for r in tracked:
        r.delta_star.zero_()  # type: ignore[union-attr]  # tracked
        r.delta_sent.zero_()  # type: ignore[union-attr]  # tracked


def grassmann_round(reps: Sequence[LocalReplica], opts: SimOptions, pg_bytes: list[int]) -> None:
    """Table 5c after a round's commit: U' from the compressed replicas' mean dL/dU; every replica rebased."""
    senders = [m for m, r in enumerate(reps) if r.u_leaf is not None]
    if not opts.grassmann or not senders:
        return
    U = reps[senders[0]].U
    assert U is not None  # a replica with u_leaf has a basis
    grads = [reps[m].u_leaf.grad for m in senders]  # type: ignore[union-attr]  # senders have u_leaf
    mean = torch.stack([g if g is not None else torch.zeros_like(U) for g in grads]).double().mean(0)
    U_new = grassmann_step(U, mean.to(U.dtype), opts.grassmann_lr)
    for m in senders:
        pg_bytes[m] += 4 * U.numel()  # the d × k float32 U-gradient
    for rep in reps:
        rep.rebase(U_new)


# --- the report ---------------------------------------------------------------------------------


def _mean_std(xs: Sequence[float]) -> dict[str, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else math.nan, "n": len(xs)}


def bias_rows(results: Sequence[ConfigResult]) -> list[dict[str, Any]]:
    """One row per k/d: per config, the run-mean eq. 5 ratios as mean ± std over seeds, and √(1 − k/d)."""
    rows = []
    for ratio in dict.fromkeys(r.k_ratio for r in results if r.k_ratio is not None and r.bias):
        at = [r for r in results if r.k_ratio == ratio and r.bias]
        row: dict[str, Any] = {"k_ratio": ratio, "k": at[0].k, "random": math.sqrt(max(0.0, 1 - _k_over_d(ratio)))}
        row["configs"] = {}
        for name in dict.fromkeys(r.name for r in at):
            runs = [r for r in at if r.name == name]
            row["configs"][name] = {
                "replica": _mean_std([_nanmean([b.replica for b in r.bias]) for r in runs]),
                "aggregate": _mean_std([_nanmean([b.aggregate for b in r.bias]) for r in runs]),
            }
        rows.append(row)
    return rows


def _nanmean(xs: Sequence[float]) -> float:
    kept = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(kept) if kept else math.nan


def _k_over_d(ratio: str) -> float:
    num, _, den = ratio.partition("/")
    return float(num) / float(den) if den else float(num)
