"""`peer bench sybil`: what K colluding contributors of a round's M do to the committed update.

One operator can run many identities in an open swarm (docs/poisoning.md, "Sybils"). Here K of
M contributors of one stage's round send the same forged payload (`peer.research.simulate.attacks.Collusion`:
`aligned`, `reversed`, `orthogonal`, `threshold`), built from the round's honest payloads and sent
at the median clip's bound. The honest payloads are real: M replicas of an honest SparseLoCo run
(`peer.research.simulate.loops.round_payloads`), trained and committed for `t` rounds first so the round
measured is not the first one. Both lists go through the portable commit every holder runs
(`peer.core.sparseloco.commit.commit_state`: clip, screening, aggregation, the outer step), with screening on
(`peer.core.sparseloco.robust.DEFAULT`) and off, and the committed update u = θ − θ_start is compared with the
update u_h of the M − K honest contributions alone under the same rule:

    deviation = ‖u − u_h‖ / ‖u_h‖,   cosine = ⟨u, u_h⟩ / (‖u‖·‖u_h‖),   norm = ‖u‖ / ‖u_h‖

(every tensor of the stage, in float64), and which of the colluders screening dropped.

`losses` (`--loss-outer-steps`) runs the simulator with the same colluders in every round of every
stage (`SimOptions.collusion`) and reports the held-out loss against the honest run. The rows are
`peer.research.bench.sybil_figures.SybilRow`s; its `RECORDED` table is this bench's output at `COMMAND`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from peer.config import RunConfig, build_config
from peer.core.data.loader import Corpus
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import commit_state
from peer.core.sparseloco.robust import DEFAULT, OFF
from peer.errors import ConfigError
from peer.research.bench.sybil_figures import LossRow, SybilRow
from peer.research.simulate.attacks import COLLUSIONS, Collusion, collude
from peer.research.simulate.loops import round_payloads, run_diloco
from peer.research.simulate.results import SimOptions

FRACTIONS = (0.10, 0.33, 0.50)  # of a round's M contributors


@dataclass(frozen=True)
class SybilResult:
    preset: str
    stages: int
    stage: int
    replicas: int
    t: int  # the outer step of the round measured
    rows: tuple[SybilRow, ...]
    losses: tuple[LossRow, ...] = ()


def colluder_counts(replicas: int, fractions: Sequence[float] = FRACTIONS) -> list[int]:
    """K = round(f·M), at least 1, for each fraction (a median needs K ≤ M/2 to hold: refused above)."""
    counts = [max(1, round(f * replicas)) for f in fractions]
    if any(k > replicas // 2 for k in counts):
        raise ConfigError(f"colluders {counts} of M = {replicas}: at most M/2 (above, they own the median)")
    return counts


def _update(start: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """θ − θ_start over every tensor, flattened, float64."""
    return torch.cat([(params[n].double() - start[n].double()).reshape(-1) for n in sorted(start)])


def measure_round(
    start: Mapping[str, torch.Tensor],
    payloads: Sequence[Payload],
    cfg: RunConfig,
    colluders: int,
    strategy: str,
    t: int = 0,
    stage: int = 0,
) -> list[SybilRow]:
    """The rows of one (K, strategy) with screening on and off: the last K of `payloads` are
    replaced by the colluders' one payload (`collude`, from the first M − K)."""
    m = len(payloads)
    honest = list(payloads[: m - colluders])
    forged = collude(Collusion(colluders, strategy, seed=cfg.seed), honest, cfg.sparseloco, t, stage)
    keys = [f"replica-{i:03d}" for i in range(m)]
    rows = []
    for robust in (DEFAULT, OFF):
        ref = commit_state(start, None, honest, cfg.sparseloco, None, robust=robust, keys=keys[: len(honest)])
        done = commit_state(
            start, None, [*honest, *[forged] * colluders], cfg.sparseloco, None, robust=robust, keys=keys
        )
        u_h, u = _update(start, ref.params), _update(start, done.params)
        dropped = done.commit.dropped
        rows.append(
            SybilRow(
                colluders,
                m,
                strategy,
                robust.enabled,
                float((u - u_h).norm() / u_h.norm()),
                float(u @ u_h / (u.norm() * u_h.norm())) if u.norm() > 0 else math.nan,
                float(u.norm() / u_h.norm()),
                sum(i >= len(honest) for i in dropped),
                sum(i < len(honest) for i in dropped),
                done.commit.clip.n_clipped,
            )
        )
    return rows


def bench_config(preset: str, stages: int, inner_steps: int, batch_size: int, seq_len: int, seed: int) -> RunConfig:
    """The run measured (SparseLoCo's defaults otherwise: clip factor 2, screening as configured per row)."""
    overrides = {
        "preset": preset,
        "stages": stages,
        "train.inner_steps": inner_steps,
        "train.batch_size": batch_size,
        "train.seq_len": seq_len,
        "seed": seed,
    }
    return build_config(overrides=overrides, environ={})


def bench_sybil(
    cfg: RunConfig,
    data: Corpus,
    replicas: int = 10,
    t: int = 3,
    stage: int = 0,
    strategies: Sequence[str] = COLLUSIONS,
    fractions: Sequence[float] = FRACTIONS,
) -> SybilResult:
    """Every (K, strategy, screening) row of stage `stage`'s round at outer step t (module docstring)."""
    counts = colluder_counts(replicas, fractions)
    start, payloads = round_payloads(cfg, data, replicas, t, stage)
    rows = [row for k in counts for s in strategies for row in measure_round(start, payloads, cfg, k, s, t, stage)]
    return SybilResult(cfg.preset, cfg.stages, stage, replicas, t, tuple(rows))


def losses(
    cfg: RunConfig, data: Corpus, replicas: int, strategy: str, counts: Sequence[int], val_tokens: int = 4096
) -> tuple[LossRow, ...]:
    """Simulated SparseLoCo runs of `cfg` (M replicas, the run's screening) with K of `counts` colluders
    in every round of every stage (K = 0: the honest run), each from the same seed."""
    out = []
    for k in counts:
        opts = SimOptions(replicas=replicas, val_tokens=val_tokens)
        if k:
            opts = replace(opts, collusion=Collusion(k, strategy, seed=cfg.seed))
        torch.manual_seed(cfg.seed)
        res, _ = run_diloco(cfg, data, "sparseloco", opts, None)
        caught = sum(1 for _, _, m in res.dropped if m >= replicas - k)
        out.append(LossRow(k, strategy if k else "-", res.final_val_loss, caught, res.rounds))
    return tuple(out)
