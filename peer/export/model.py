"""A swarm's model out: committed stage states → the whole model → a Hugging Face folder.

Every way `peer export` reads a swarm's model — one full replica's checkpoints, one checkpoint
folder per stage, or the live swarm over `GetState` — ends here, so the three give byte-identical
model.safetensors for one outer step:

    1. each stage's committed state (θ_start, T⊥, bans at outer step t, exactly what a state sync
       carries) with its hashes and state id, as holders claim it (peer.node.round.claims): live, it is
       downloaded into a fresh `StageWorker` and checked against the holders' majority claim the
       way a state sync is (peer.node.round.resync.download_claimed), and read back as the worker serves
       it (`read_back`: its `snapshot()`, the very tensors `GetState` serves); from a checkpoint it
       is the θ_start and T⊥ the saving worker held, whose hashes must be the ones it recorded
       (`from_checkpoint`: equal `state_hash`, equal bits, so no worker needs to be built);
    2. `whole_model` joins the stages under their global names and folds the embedding exactly
       as the model computes it: peer.core.model.decoder.Embedding returns weight[x] + perp[x], which is
       (weight + perp)[x] bit for bit, so `embed.weight` = T_S + T⊥ of stage 0, in fp32
       (arXiv 2601.02360 §3.2);
    3. `write_stages` writes it with peer.export.command.write_hf (config.json, the tokenizer,
       peer_export.json: where it came from, its outer step, run id and fingerprint).

Invariants: all stages are at one outer step; a stage is exported from its committed state θ_start,
never from θ of an inner step in progress; the exported tensors are fp32 CPU tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peer.config import RunConfig
from peer.core.model.decoder import stage_shapes
from peer.core.model.state import state_hash
from peer.core.subspace.state import EMBED
from peer.errors import CheckpointError
from peer.export.command import write_hf
from peer.node.manifest import run_id_for
from peer.node.round.bans import Bans
from peer.node.round.claims import state_id
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

__all__ = ["CommittedStage", "ExportResult", "from_checkpoint", "read_back", "whole_model", "write_stages"]


@dataclass(frozen=True, eq=False)
class CommittedStage:
    """One stage's committed state at `outer_step`, as a fresh worker holds it after adopting it."""

    stage: int
    outer_step: int
    params: dict[str, torch.Tensor]  # θ_start by global name, fp32 CPU
    perp: torch.Tensor  # T⊥ (V, d), fp32 CPU
    state_id: str  # what holders of this state claim (peer.node.round.claims.state_id)
    param_hash: str
    perp_hash: str


@dataclass(frozen=True)
class ExportResult:
    """What `peer export` wrote: the folder, the outer step, where the model came from."""

    out: Path
    outer_step: int | None  # None: a `peer simulate --save` checkpoint that does not say
    source: str  # "live", "replica" (one folder: every stage), "stages" (a folder per stage), "simulate"
    model_sha256: str
    tokenizer: bool


def from_checkpoint(stage: int, state: Mapping[str, Any]) -> CommittedStage:
    """A committed state read from a checkpoint ({"outer_step", "start", "perp", "bans"}: peer.node.
    checkpoints.stage.read_committed_states), with the hashes and state id a worker holding it has
    (`peer.core.model.state.state_hash` over names, dtypes, shapes and bytes): equal hashes, equal bits."""
    start = {n: v.detach().to("cpu").contiguous() for n, v in state["start"].items()}
    perp = state["perp"].detach().to("cpu").contiguous()
    param_hash, perp_hash = state_hash(start), state_hash({"perp": perp})
    bans = Bans.from_record(state.get("bans")).to_record()
    sid = state_id(param_hash, perp_hash, bans)
    return CommittedStage(stage, int(state["outer_step"]), start, perp, sid, param_hash, perp_hash)


def read_back(worker: StageWorker) -> CommittedStage:
    """A worker's committed state as `GetState` serves it (`snapshot`), with its state id and hashes."""
    tensors = worker.snapshot()
    perp = tensors.pop("perp")
    return CommittedStage(
        worker.stage, worker.outer_step, tensors, perp, worker.state_id(), worker.param_hash(), worker.perp_hash()
    )


def whole_model(cfg: RunConfig, stages: Mapping[int, CommittedStage]) -> dict[str, torch.Tensor]:
    """The whole model's tensors by global name from every stage's committed state, the embedding
    folded to the full TE = T_S + T⊥ (stage 0's T⊥); CheckpointError naming a missing stage."""
    missing = [s for s in range(cfg.stages) if s not in stages]
    if missing:
        raise CheckpointError(f"stage {missing[0]} of {cfg.stages} is missing: export it from a peer that holds it")
    steps = {st.outer_step for st in stages.values()}
    if len(steps) != 1:
        raise CheckpointError(f"the stages are at different outer steps {sorted(steps)}; export one outer step")
    out: dict[str, torch.Tensor] = {}
    for s in range(cfg.stages):
        shapes = stage_shapes(cfg.model, s, cfg.stages)
        got = {n: tuple(t.shape) for n, t in stages[s].params.items()}
        if got != shapes:
            raise CheckpointError(f"stage {s}'s parameters do not match this run's model (names or shapes)")
        out.update(stages[s].params)
    weight, perp = out[EMBED].to(torch.float32), stages[0].perp.to(torch.float32)
    if perp.shape != weight.shape:
        raise CheckpointError(f"stage 0's T⊥ is {tuple(perp.shape)}, the embedding {tuple(weight.shape)}")
    out[EMBED] = weight + perp  # TE = T_S + T⊥, as Embedding.forward adds weight[x] + perp[x]
    return out


def write_stages(
    out: Path,
    cfg: RunConfig,
    stages: Mapping[int, CommittedStage],
    tokenizer: Path | None,
    source: str,
    sources: Sequence[str],
) -> ExportResult:
    """`whole_model` of `stages`, written as a Hugging Face folder with its peer_export.json."""
    tensors = whole_model(cfg, stages)
    t = stages[0].outer_step
    info = {
        "source": source,
        "sources": list(sources),
        "outer_step": t,
        "run_id": run_id_for(cfg),
        "fingerprint": cfg.fingerprint(),
        "stages": {str(s): stages[s].state_id for s in sorted(stages)},
    }
    sha = write_hf(Path(out), tensors, cfg.model, tokenizer, info, f"{source} export at outer step {t}")
    log.info("exported outer step %d of run %s to %s (model sha256 %s)", t, info["run_id"], out, sha[:16])
    return ExportResult(Path(out), t, source, sha, tokenizer is not None)
