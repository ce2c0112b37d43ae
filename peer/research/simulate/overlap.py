"""Overlapped outer steps in the simulator (`SimOptions.overlap` = N, `peer simulate --overlap`, issue 36).

The round of outer step t runs while the first N inner steps of t + 1 do (0 < N ≤ H); when it
commits, every replica moves onto the committed state keeping what it trained meanwhile
(`peer.core.sparseloco.overlap.rebase`). The loop (`peer.research.simulate.loops.run_diloco`) does,
at the boundary of every outer step t but the last:
1. keeps every replica's state θ_b (parameters, and T⊥ with a subspace: `snapshot`);
2. commits the round as the synchronous run does, from the payloads of θ_start(t) − θ_b: the
   replicas then hold θ_c = θ_start(t + 1), which is scored (the paper's metric is taken on the
   committed model, a function of the round's bytes) and kept (`snapshot`);
3. puts the replicas back at θ_b (`restore`) and runs the first N inner steps of t + 1 on them;
4. rebases (`rebase_replicas`: θ ← θ_c + (θ_now − θ_b)) and runs the other H − N.
The round of t + 1 starts from θ_c (`Rebase.starts`), so its pseudo-gradient θ_c − θ holds the N
overlapped steps once. The last round commits as in the synchronous run; N = 0 is the synchronous
schedule itself, by the same code (its losses are the same bits). Each replica's AdamW state runs
on through the rebase, as a node's inner optimizer does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.core.sparseloco.overlap import rebase
from peer.core.subspace.state import perp_of, set_perp
from peer.errors import ConfigError
from peer.research.simulate.replica import LocalReplica

PERP = "T⊥"  # T⊥'s key in a stage's snapshot (no parameter has this name)
StageState = dict[str, Tensor]  # one stage of one replica: its parameters by global name, and T⊥


@dataclass
class Rebase:
    """A committed round not yet applied to the replicas that train on: θ_c and θ_b, [replica][stage]."""

    committed: list[list[StageState]]
    boundary: list[list[StageState]]

    def starts(self) -> list[dict[str, Tensor]]:
        """θ_start of the next round per stage (the committed parameters, on the CPU, as the commit takes them)."""
        return [{n: v.cpu().clone() for n, v in st.items() if n != PERP} for st in self.committed[0]]


def check_overlap(overlap: int, inner_steps: int, configs: Sequence[str], grassmann: bool) -> None:
    """ConfigError naming the flag: N outside 0 … H, or N > 0 where no round runs or U moves every round."""
    if not 0 <= overlap <= inner_steps:
        raise ConfigError(f"--overlap must be between 0 and --inner-steps (H = {inner_steps}), got {overlap}")
    if overlap == 0:
        return
    dense = [c for c in configs if c.startswith("adamw")]
    if dense:
        raise ConfigError(f"--overlap: {', '.join(dense)} average every step and have no outer round to overlap")
    if grassmann:
        raise ConfigError("--overlap with --grassmann: a round's new U would land on replicas that trained on the old")


@torch.no_grad()
def snapshot(reps: Sequence[LocalReplica]) -> list[list[StageState]]:
    """Every replica's stages as they are now (copies)."""
    out = []
    for rep in reps:
        stages = []
        for st in rep.stages:
            state = {n: p.detach().clone() for n, p in st.named_parameters()}
            if rep.U is not None:
                state[PERP] = perp_of(st).clone()
            stages.append(state)
        out.append(stages)
    return out


@torch.no_grad()
def restore(reps: Sequence[LocalReplica], states: Sequence[Sequence[StageState]]) -> None:
    """Copy `states` ([replica][stage], as `snapshot` made them) into the replicas."""
    for rep, stages in zip(reps, states, strict=True):
        for st, state in zip(rep.stages, stages, strict=True):
            params = dict(st.named_parameters())
            for name, value in state.items():
                if name == PERP:
                    set_perp(st, value)
                else:
                    params[name].copy_(value)


def rebase_replicas(reps: Sequence[LocalReplica], pending: Rebase) -> None:
    """θ ← θ_c + (θ_now − θ_b) on every replica and stage; W_o / W_2 re-projected (weight projection)."""
    now = snapshot(reps)
    moved = [
        [rebase(c, n, b) for c, n, b in zip(cs, ns, bs, strict=True)]
        for cs, ns, bs in zip(pending.committed, now, pending.boundary, strict=True)
    ]
    restore(reps, moved)
    for rep in reps:
        rep.project_outputs()
