"""`peer export FOLDER…`: a swarm's model from its peers' stage checkpoints (no network).

(One folder that holds no peer checkpoint is read as a `peer simulate --save` checkpoint:
peer.export.command.export_hf.)

Each folder is a peer's data dir, its `checkpoints/` root, or one `step-NNNNNN` checkpoint
(peer.node.checkpoints.stage). A full replica's folder holds every stage; a stage peer's holds
one, so `peer export s0/ s1/` needs a folder per stage. The outer step is the newest one every
folder has a complete checkpoint of (or `--outer-step T`); each stage's committed state at that
step (θ_start, T⊥, bans) is read, checked against the hashes its checkpoint recorded, and handed
to peer.export.model, which the live export (peer.export.live) ends in too.

Refused in one line (CheckpointError): no step common to all folders, or `--outer-step` missing
in one (the message lists each folder's steps); folders of different runs (their config
fingerprints differ); a stage no folder holds; a stage given twice with different bytes;
checkpoints written before checkpoints recorded the run's config.

The tokenizer is the `tokenizer.model` a peer keeps in its data dir (`peer join` downloads it,
sha256-checked against the manifest); a checkpoint records its sha256 and a copy that does not
match it is not exported.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.config import RunConfig, config_from_dict
from peer.core.files import file_sha256
from peer.errors import CheckpointError, PeerError
from peer.export.command import EXPORT_INFO_FILE, export_hf, resolve_checkpoint
from peer.export.model import CommittedStage, ExportResult, from_checkpoint, write_stages
from peer.node.checkpoints.model import TOKENIZER_FILE
from peer.node.checkpoints.stage import (
    META_FILE,
    checkpoint_fingerprint,
    complete_stage_checkpoints,
    read_committed_states,
    read_stage_meta,
)

log = logging.getLogger(__name__)

__all__ = ["PeerFolder", "export_folders", "peer_folder", "pick_outer_step"]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class PeerFolder:
    """One folder given to `peer export`: the complete checkpoints it offers and where its tokenizer may be."""

    arg: Path  # as given
    steps: dict[int, Path]  # outer step -> step-NNNNNN directory
    data_dir: Path | None  # the peer's data dir (holds tokenizer.model), when the layout shows it


def peer_folder(path: Path) -> PeerFolder | None:
    """The stage checkpoints `path` offers (a data dir, a checkpoints root, one step dir); None when
    it holds no peer stage checkpoint (it may be a `peer simulate --save` checkpoint)."""
    path = Path(path)
    if (path / META_FILE).is_file() and path.name.startswith("step-"):
        meta = read_stage_meta(path)  # a single step: that one, even while a newer one is written
        data_dir = path.parent.parent if path.parent.name == "checkpoints" else None
        return PeerFolder(path, {meta["outer_step"]: path}, data_dir)
    for root, data_dir in ((path / "checkpoints", path), (path, path.parent if path.name == "checkpoints" else None)):
        steps = complete_stage_checkpoints(root)
        if steps:
            return PeerFolder(path, steps, data_dir)
    return None


def pick_outer_step(folders: Sequence[PeerFolder], outer_step: int | None) -> int:
    """The newest outer step every folder has a complete checkpoint of, or `outer_step` when all have it;
    CheckpointError listing each folder's steps otherwise."""

    def listing() -> str:
        return "; ".join(f"{f.arg} has {_steps(f.steps)}" for f in folders)

    if outer_step is not None:
        lacking = [f for f in folders if outer_step not in f.steps]
        if lacking:
            raise CheckpointError(f"no checkpoint at outer step {outer_step} in {lacking[0].arg}: {listing()}")
        return outer_step
    common = set.intersection(*(set(f.steps) for f in folders))
    if not common:
        raise CheckpointError(f"the folders have no outer step in common: {listing()}")
    return max(common)


def _steps(steps: Mapping[int, Path]) -> str:
    return "outer steps " + ", ".join(str(t) for t in sorted(steps)) if steps else "no checkpoint"


def _run_config(path: Path, meta: Mapping[str, Any]) -> RunConfig:
    """The run's config a checkpoint records, checked against its fingerprint."""
    record = meta.get("config")
    if not isinstance(record, Mapping):
        raise CheckpointError(
            f"{path} does not record the run's config (written by an older peer); export the live swarm "
            "with `peer export --initial-peers …`, or let a peer of this version save a checkpoint"
        )
    try:
        cfg = config_from_dict(record)
    except PeerError as exc:
        raise CheckpointError(f"{path}: its recorded config is unreadable ({exc})") from None
    if checkpoint_fingerprint(cfg) != meta.get("fingerprint"):
        raise CheckpointError(f"{path}: its recorded config does not give its fingerprint; the checkpoint is corrupt")
    return cfg


def _plan(folders: Sequence[PeerFolder], t: int) -> tuple[RunConfig, list[tuple[Path, dict[str, Any]]]]:
    """The run's config and each folder's checkpoint at outer step t with its meta, checked before any
    tensor is read: one run, every stage held by some folder."""
    cfg: RunConfig | None = None
    fingerprint, first = None, None
    read = []
    for folder in folders:
        path = folder.steps[t]
        meta = read_stage_meta(path)
        if cfg is None:
            cfg, fingerprint, first = _run_config(path, meta), meta.get("fingerprint"), folder.arg
        elif meta.get("fingerprint") != fingerprint:
            raise CheckpointError(
                f"{first} and {folder.arg} are checkpoints of different runs "
                f"(config fingerprints {fingerprint} and {meta.get('fingerprint')})"
            )
        held = sorted(int(s) for s in meta["stages"])
        if any(not 0 <= s < cfg.stages for s in held):
            raise CheckpointError(f"{path} holds stages {held}, the run has {cfg.stages}")
        read.append((path, meta))
    assert cfg is not None
    missing = sorted(set(range(cfg.stages)) - {int(s) for _, meta in read for s in meta["stages"]})
    if missing:
        raise CheckpointError(
            f"stage {missing[0]} of {cfg.stages} is missing: add the folder of a peer that holds it "
            f"(a stage peer of stage {missing[0]} or a full replica)"
        )
    return cfg, read


def _read_stages(
    cfg: RunConfig, read: Sequence[tuple[Path, Mapping[str, Any]]], progress: Progress
) -> dict[int, CommittedStage]:
    """Every stage's committed state from the checkpoints `read` (`_plan`), each checked against the
    hashes its checkpoint recorded and a stage given twice against itself."""
    stages: dict[int, CommittedStage] = {}
    given: dict[int, Path] = {}
    for path, meta in read:
        held = sorted(int(s) for s in meta["stages"])
        for s, state in read_committed_states(path, meta, held).items():
            got = from_checkpoint(s, state)
            info = meta["stages"][str(s)]
            if (got.param_hash, got.perp_hash) != (info.get("param_hash"), info.get("perp_hash")):
                raise CheckpointError(f"{path}: stage {s}'s state does not match the hashes its checkpoint recorded")
            if s in stages and (stages[s].param_hash, stages[s].perp_hash) != (got.param_hash, got.perp_hash):
                raise CheckpointError(
                    f"stage {s} differs between {given[s]} and {path} at outer step {got.outer_step} "
                    f"(states {stages[s].state_id} and {got.state_id}); give one of them"
                )
            stages.setdefault(s, got)
            given.setdefault(s, path)
            progress(f"stage {s}: state {got.state_id} at outer step {got.outer_step} from {path}")
    return stages


def _tokenizer(folders: Sequence[PeerFolder], want: str | None) -> Path | None:
    """A folder's tokenizer.model (the first whose sha256 is the one the checkpoint recorded)."""
    for folder in folders:
        path = folder.data_dir / TOKENIZER_FILE if folder.data_dir is not None else None
        if path is None or not path.is_file():
            continue
        if want is None or file_sha256(path) == want:
            return path
        log.warning("%s is not the run's tokenizer (sha256 differs from the checkpoint's); not exported", path)
    log.warning("no tokenizer.model of this run next to the checkpoints; exporting the model without it")
    return None


def _export_simulate(path: Path, out: Path, say: Progress) -> ExportResult:
    """`export_hf` of a `peer simulate --save` checkpoint, described like the other exports."""
    source = resolve_checkpoint(path)
    if source != path:
        say(f"{path} holds one configuration: exporting {source}")
    out = export_hf(source, out)
    info = json.loads((out / EXPORT_INFO_FILE).read_text())
    return ExportResult(out, info.get("outer_step"), "simulate", info["model_sha256"], (out / TOKENIZER_FILE).exists())


def export_folders(
    paths: Sequence[Path], out: Path, outer_step: int | None = None, progress: Progress | None = None
) -> ExportResult:
    """Export a swarm's model from peers' stage checkpoint folders (module docstring) to `out`."""
    say = progress or log.info
    for path in paths:
        if not Path(path).exists():
            raise CheckpointError(
                f"{path} does not exist; pass a peer's data dir (its checkpoints/ or a step-NNNNNN folder in it), "
                "one per stage, or a folder written by `peer simulate --save`"
            )
    found = [(Path(path), peer_folder(Path(path))) for path in paths]
    if len(found) == 1 and found[0][1] is None:  # not a peer's folder: a `peer simulate --save` checkpoint
        if outer_step is not None:
            raise CheckpointError(f"{found[0][0]} holds no peer stage checkpoint; --outer-step applies to those only")
        return _export_simulate(found[0][0], out, say)
    folders = []
    for path, folder in found:
        if folder is None:
            raise CheckpointError(
                f"{path} holds no peer checkpoint: pass a peer's data dir, its checkpoints/ folder or a "
                "step-NNNNNN folder in it (a `peer simulate --save` checkpoint is exported alone)"
            )
        folders.append(folder)
    cfg, read = _plan(folders, pick_outer_step(folders, outer_step))
    stages = _read_stages(cfg, read, say)
    want = read[0][1].get("tokenizer_sha256")
    tokenizer = _tokenizer(folders, want if isinstance(want, str) else None)
    source = "replica" if len(folders) == 1 else "stages"
    return write_stages(out, cfg, stages, tokenizer, source, [str(path) for path, _ in read])
