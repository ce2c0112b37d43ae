"""Resumable checkpoints of a training peer's stage state (`peer join --resume`).

A peer's state between two outer rounds is everything its next round depends on (paper Alg. 1,
SparseLoCo): per stage s it holds θ (the stage's parameters, = θ_start right after a commit), T⊥
(the embedding's complement, arXiv 2601.02360 §3.2), the error-feedback buffer e, the inner
AdamW moments and step count, plus the outer step t. Data batches and the learning rate are
functions of (t, inner step) and the claimed shard, so t *is* the data position; it is stored,
with the shard, in `extra`.

Layout under a root (one per peer, `<data-dir>/checkpoints`):
    step-000004/state.safetensors   s{stage}/param/<global name>   θ
                                    s{stage}/start/<global name>   θ_start, only where it differs from θ
                                    s{stage}/perp                  T⊥ (V, d)
                                    s{stage}/err/<global name>     e (absent: empty buffer)
                                    s{stage}/opt/<global name>/<exp_avg|exp_avg_sq|step>
    step-000004/meta.json           outer step, fingerprint, sha256 + size of the tensor file,
                                    per stage: AdamW param groups (hyperparameters, parameter
                                    names), step count, param/perp hashes; `extra` (shard, ...);
                                    the run's config without local paths (`config`: what `peer
                                    export` builds the model from) and the tokenizer's sha256
The directory is named by the outer step the peer resumes at (rounds committed so far).
`read_stage_meta`, `complete_stage_checkpoints` and `read_committed_states` read a checkpoint for
`peer export` (peer.export.checkpoints): the committed state of each stage, as a state sync
carries it.

Invariants:
- A save is atomic (temporary sibling directory, fsync, rename: peer.core.files.atomic_directory).
  A failed write (disk full, any OSError) leaves no half-written directory and never touches the
  previous checkpoints; it raises CheckpointError.
- The newest `keep` complete checkpoints are kept; older ones, stale ones newer than the one just
  written (another history of this data dir) and leftovers of crashed writes are removed.
- Loading verifies sha256, config fingerprint, stages, tensor names and shapes BEFORE touching
  the workers, so a corrupt checkpoint never half-loads; the newest one that verifies wins.
- save → load into fresh workers → continue is bit-identical to never having stopped.
- Workers are read and restored only through `StageWorker.state_dict()` / `load_state_dict()`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import re
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file

from peer.config import RunConfig
from peer.core.files import atomic_directory, file_sha256
from peer.errors import CheckpointError
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

__all__ = [
    "save_stage_checkpoint",
    "load_latest_stage_checkpoint",
    "list_stage_checkpoints",
    "complete_stage_checkpoints",
    "read_stage_meta",
    "read_committed_states",
    "checkpoint_fingerprint",
    "config_record",
    "STATE_FILE",
    "META_FILE",
]

STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
FORMAT = "peer-stage-checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{6,})$")
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def checkpoint_fingerprint(cfg: RunConfig) -> str:
    """Hash of the config parts that shape the state (model, split, subspace, SparseLoCo, data, train).

    Swarm deadlines and checkpoint cadence are left out: a restarted bootstrap with other timeouts
    still accepts the state.
    """
    d = cfg.to_dict()
    d.pop("swarm", None)
    d["data"].pop("cache_dir", None)
    d["data"].pop("tokenizer", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def config_record(cfg: RunConfig) -> dict[str, Any]:
    """The run's config as a checkpoint records it: the manifest's form, without local paths
    (`config_from_dict` of it gives back the run's fingerprint and `checkpoint_fingerprint`)."""
    d = cfg.to_dict()
    d["data"].pop("cache_dir", None)
    d["data"]["tokenizer"] = None
    return d


def _tokenizer_sha256(cfg: RunConfig) -> str | None:
    """sha256 of the run's tokenizer file, when this peer has one (`peer export` checks a copy by it)."""
    path = cfg.data.tokenizer
    return file_sha256(Path(path)) if path is not None and Path(path).is_file() else None


def list_stage_checkpoints(root: Path) -> list[Path]:
    """step-* directories under root, newest (highest outer step) first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


# ---------------------------------------------------------------------- save
def _collect(workers: Mapping[int, StageWorker]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """All tensors by checkpoint name (CPU, not cloned: call between rounds) and per-stage meta."""
    tensors: dict[str, torch.Tensor] = {}
    stages: dict[str, Any] = {}
    for s, w in sorted(workers.items()):
        state = w.state_dict()
        for name, p in state["params"].items():
            tensors[f"s{s}/param/{name}"] = p
            if not torch.equal(state["start"][name], p):
                tensors[f"s{s}/start/{name}"] = state["start"][name]
        tensors[f"s{s}/perp"] = state["perp"]
        for name, e in (state["errors"] or {}).items():
            tensors[f"s{s}/err/{name}"] = e.detach()
        opt_tensors = state["optimizer"]["state"]
        for key, value in opt_tensors.items():
            tensors[f"s{s}/opt/{key}"] = value
        steps = [int(v.item()) for k, v in opt_tensors.items() if k.endswith("/step")]
        stages[str(s)] = {
            "compressed": w.compressed,
            "outer_step": state["outer_step"],
            "errors": state["errors"] is not None,
            "adamw_step": max(steps, default=0),
            "adamw_param_groups": state["optimizer"]["param_groups"],
            "param_hash": w.param_hash(),
            "perp_hash": w.perp_hash(),
            "bans": state["bans"],  # part of the committed state (its state id)
            "link": state["link"],  # how it was reached: the claim a resumed holder publishes again
        }
    return {k: v.to("cpu").contiguous() for k, v in tensors.items()}, stages


def save_stage_checkpoint(
    root: Path, workers: Mapping[int, StageWorker], extra: Mapping[str, Any] | None = None, keep: int = 2
) -> Path:
    """Write root/step-{t:06d}/ atomically and keep the newest `keep` checkpoints; returns the directory.

    Call between rounds, while nothing trains the workers (the tensors are written, not copied).
    `extra` is JSON-serialisable (data position: shard, ...). CheckpointError when the write fails.
    """
    if not workers:
        raise ValueError("no stage workers to checkpoint")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(root)
    steps = {w.outer_step for w in workers.values()}
    if len(steps) != 1:
        raise ValueError(f"stage workers are at different outer steps {sorted(steps)}; checkpoint after a round")
    t = steps.pop()
    cfg = next(iter(workers.values())).cfg
    final = root / f"step-{t:06d}"
    previous = next((p for p in list_stage_checkpoints(root) if p != final and _complete(p)), None)
    started = time.perf_counter()
    tensors, stages = _collect(workers)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "outer_step": t,
        "fingerprint": checkpoint_fingerprint(cfg),
        "run_name": cfg.run_name,
        "config": config_record(cfg),
        "tokenizer_sha256": _tokenizer_sha256(cfg),
        "tensor_file": STATE_FILE,
        "stages": stages,
        "extra": {"outer_step": t, **dict(extra or {})},
        "saved_at": time.time(),
    }
    try:
        root.mkdir(parents=True, exist_ok=True)
        with atomic_directory(final) as tmp:
            save_file(tensors, str(tmp / STATE_FILE), metadata={"format": FORMAT})
            meta["tensor_sha256"] = file_sha256(tmp / STATE_FILE)
            meta["tensor_bytes"] = (tmp / STATE_FILE).stat().st_size
            (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    except (OSError, SafetensorError) as exc:
        _clean_leftovers(root)
        raise _write_error(final, previous, exc) from exc
    _prune(root, final, keep)
    log.info(
        "saved checkpoint %s (outer step %d, %d tensors, %.1f MB, %.2fs)",
        final,
        t,
        len(tensors),
        meta["tensor_bytes"] / 1e6,
        time.perf_counter() - started,
    )
    return final


def _write_error(final: Path, previous: Path | None, exc: BaseException) -> CheckpointError:
    kept = f"the previous checkpoint at {previous} is kept" if previous is not None else "no earlier checkpoint exists"
    no_space = getattr(exc, "errno", None) in _NO_SPACE or "os error 28" in str(exc) or "No space left" in str(exc)
    if no_space:
        return CheckpointError(f"could not write checkpoint {final}: disk full; free space in {final.parent} — {kept}")
    why = getattr(exc, "strerror", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
    return CheckpointError(
        f"could not write checkpoint {final}: {why}; check that {final.parent} is writable and has free space — {kept}"
    )


def complete_stage_checkpoints(root: Path) -> dict[int, Path]:
    """{outer step: directory} of the complete checkpoints under root (`_complete`: no hashing)."""
    return {_step_of(p): p for p in list_stage_checkpoints(root) if _complete(p)}


def _complete(path: Path) -> bool:
    """Cheap completeness check (meta.json parses, tensor file has the recorded size); no hashing."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        return (path / STATE_FILE).stat().st_size == meta["tensor_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _step_of(path: Path) -> int:
    """The outer step in a step-NNNNNN directory's name."""
    m = _STEP_DIR.match(path.name)
    if m is None:
        raise ValueError(f"{path} is not a step-NNNNNN checkpoint directory")
    return int(m.group(1))


def _clean_leftovers(root: Path) -> None:
    """Remove temporary / moved-aside directories of interrupted writes (`.step-….tmp-…`)."""
    for p in root.iterdir() if root.is_dir() else ():
        if p.is_dir() and p.name.startswith(".step-") and (".tmp-" in p.name or ".old-" in p.name):
            shutil.rmtree(p, ignore_errors=True)


def _prune(root: Path, newest: Path, keep: int) -> None:
    """Keep `newest` and the keep-1 newest complete checkpoints older than it; drop the rest."""
    t_new = _step_of(newest)
    kept = 1
    for p in list_stage_checkpoints(root):
        if p == newest:
            continue
        t = _step_of(p)
        if t < t_new and kept < keep and _complete(p):
            kept += 1
            continue
        why = "stale (newer than the state just saved)" if t > t_new else "old" if _complete(p) else "incomplete"
        log.info("removing %s checkpoint %s", why, p)
        shutil.rmtree(p, ignore_errors=True)
    _clean_leftovers(root)


# ---------------------------------------------------------------------- load
def _read_verified(
    path: Path, workers: Mapping[int, StageWorker], fingerprint: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """meta and tensors of one checkpoint, checked against the workers; CheckpointError if unusable."""
    meta = read_stage_meta(path)
    stages = meta["stages"]
    if meta.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"{path}: saved by another run configuration (fingerprint {meta.get('fingerprint')}, "
            f"this run {fingerprint})"
        )
    if sorted(stages) != sorted(str(s) for s in workers):
        raise CheckpointError(f"{path}: holds stages {sorted(stages)}, this peer holds {sorted(workers)}")
    state_path = path / STATE_FILE
    try:
        raw = state_path.read_bytes()  # hashed and parsed from the same bytes; tensors own their memory
        if hashlib.sha256(raw).hexdigest() != meta.get("tensor_sha256"):
            raise CheckpointError(f"{path}: {STATE_FILE} does not match its recorded sha256")
        tensors = load_bytes(raw)
        del raw
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{path}: unreadable {STATE_FILE} ({exc})") from None
    for s, w in workers.items():
        info = stages[str(s)]
        if bool(info.get("compressed")) != w.compressed:
            raise CheckpointError(
                f"{path}: stage {s} was saved by a "
                f"{'compressed pipeline' if info.get('compressed') else 'full replica'}"
            )
        own = w.state_dict()
        expected = {f"s{s}/param/{n}": tuple(p.shape) for n, p in own["params"].items()}
        expected[f"s{s}/perp"] = tuple(own["perp"].shape)
        for key, shape in expected.items():
            if key not in tensors or tuple(tensors[key].shape) != shape:
                got = tuple(tensors[key].shape) if key in tensors else "missing"
                raise CheckpointError(f"{path}: {key} is {got}, this model needs {shape}")
        params = set(own["params"])
        groups = info.get("adamw_param_groups")
        own_groups = [g["params"] for g in own["optimizer"]["param_groups"]]
        if not isinstance(groups, list) or [g.get("params") for g in groups] != own_groups:
            raise CheckpointError(f"{path}: stage {s}'s optimizer parameter groups do not match this model")
        for key, value in tensors.items():
            head, _, rest = key.partition("/")
            if head != f"s{s}" or key in expected:
                continue
            kind, _, name = rest.partition("/")
            name = name.rsplit("/", 1)[0] if kind == "opt" else name
            if kind not in ("start", "err", "opt") or name not in params:
                raise CheckpointError(f"{path}: unexpected tensor {key}")
            if (kind != "opt" or not key.endswith("/step")) and tuple(value.shape) != expected[f"s{s}/param/{name}"]:
                raise CheckpointError(
                    f"{path}: {key} has shape {tuple(value.shape)}, expected {expected[f's{s}/param/{name}']}"
                )
    unknown = [k for k in tensors if k.split("/", 1)[0] not in {f"s{s}" for s in workers}]
    if unknown:
        raise CheckpointError(f"{path}: unexpected tensor {unknown[0]}")
    return meta, tensors


def read_stage_meta(path: Path) -> dict[str, Any]:
    """The meta.json of checkpoint `path`, its format, stages and outer step (an int) checked against
    the folder's name; CheckpointError when it is not a readable peer stage checkpoint."""
    try:
        meta = json.loads((path / META_FILE).read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError("not a peer stage checkpoint")
        t, stages = int(meta["outer_step"]), meta["stages"]
        if not isinstance(stages, dict) or not all(isinstance(v, dict) for v in stages.values()):
            raise ValueError("'stages' is not a mapping of stage records")
        if path.name != f"step-{t:06d}":
            raise ValueError(f"records outer step {t}, the folder name says otherwise")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable {META_FILE} ({exc})") from None
    meta["outer_step"] = t
    return meta


def read_committed_states(path: Path, meta: Mapping[str, Any], stages: Iterable[int]) -> dict[int, dict[str, Any]]:
    """The committed state of each of `stages` in checkpoint `path` (meta from `read_stage_meta`),
    in the form `StageState.load_state_dict` takes and a state sync carries: outer step, θ_start,
    T⊥ and bans, without the error buffer and the optimizer.

    θ_start is θ where the checkpoint stores no `start/` tensor (right after a commit, `_collect`).
    The tensor file is checked against its recorded sha256 first; only these tensors are read.
    """
    state_path = path / STATE_FILE
    try:
        if file_sha256(state_path) != meta.get("tensor_sha256"):
            raise CheckpointError(f"{path}: {STATE_FILE} does not match its recorded sha256")
        out: dict[int, dict[str, Any]] = {}
        with safe_open(str(state_path), "pt") as f:
            names = list(f.keys())

            def part(prefix: str) -> dict[str, torch.Tensor]:
                return {k[len(prefix) :]: f.get_tensor(k) for k in names if k.startswith(prefix)}

            for s in stages:
                if f"s{s}/perp" not in names:
                    raise CheckpointError(f"{path}: holds no T⊥ of stage {s} (s{s}/perp)")
                out[s] = {
                    "outer_step": meta["outer_step"],
                    "start": {**part(f"s{s}/param/"), **part(f"s{s}/start/")},  # start/: only where θ_start ≠ θ
                    "perp": f.get_tensor(f"s{s}/perp"),
                    "bans": meta["stages"][str(s)].get("bans"),
                }
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"{path}: unreadable {STATE_FILE} ({exc})") from None
    return out


def _restore(worker: StageWorker, s: int, info: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], t: int) -> None:
    pre = f"s{s}/"
    mine = {k[len(pre) :]: v for k, v in tensors.items() if k.startswith(pre)}

    def part(kind: str) -> dict[str, torch.Tensor]:
        return {k[len(kind) + 1 :]: v for k, v in mine.items() if k.startswith(kind + "/")}

    params = part("param")
    worker.load_state_dict(
        {
            "outer_step": t,
            "params": params,
            "start": {**params, **part("start")},  # θ_start is stored only where it differs from θ
            "perp": mine["perp"],
            "errors": part("err") if info.get("errors") else None,
            "optimizer": {"state": part("opt"), "param_groups": info["adamw_param_groups"]},
            "bans": info.get("bans"),
            "link": info.get("link"),
        }
    )
    if info.get("param_hash") and worker.param_hash() != info["param_hash"]:
        raise CheckpointError(f"stage {s}: restored parameters do not match the checkpoint's param_hash")


def load_latest_stage_checkpoint(
    root: Path, workers: Mapping[int, StageWorker], fingerprint: str
) -> dict[str, Any] | None:
    """Restore the newest checkpoint under root that verifies into `workers`.

    Returns its meta (with "path", "outer_step", "extra"), or None when root holds no checkpoint.
    A corrupt newest checkpoint is skipped with a warning; CheckpointError when none is usable.
    """
    root = Path(root)
    candidates = list_stage_checkpoints(root)
    if not candidates:
        return None
    problems: list[str] = []
    for path in candidates:
        try:
            meta, tensors = _read_verified(path, workers, fingerprint)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s", exc)
            problems.append(str(exc))
            continue
        if problems:
            log.warning("the newest checkpoint is unusable; resuming from the older %s instead", path)
        for s, w in workers.items():
            _restore(w, s, meta["stages"][str(s)], tensors, meta["outer_step"])
        meta["path"] = str(path)
        log.info("restored checkpoint %s at outer step %d", path, meta["outer_step"])
        return meta
    raise CheckpointError(
        f"no usable checkpoint in {root} ({len(problems)} tried; newest: {problems[0]}); "
        f"move the folder away or join without --resume to start from the swarm's state"
    )
