"""A training peer's checkpoint duties: restore with `--resume`, save on the round cadence.

`resume` restores the newest good checkpoint of `<data-dir>/checkpoints` into the peer's stage
workers before training (`peer.node.checkpoints.stage`), and remembers its outer step
(`resumed_at`: `peer.node.round.resync.Resync.late_join` keeps a resumed state that is not behind).
`after_round` saves every `swarm.checkpoint_every_rounds` committed rounds and after the last.

Invariants: a failed save is logged and recorded (`checkpoint_failed`) but never stops training,
and the previous checkpoint stays on disk; saving happens while nothing trains the workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.errors import CheckpointError
from peer.node.checkpoints.stage import (
    checkpoint_fingerprint,
    list_stage_checkpoints,
    load_latest_stage_checkpoint,
    save_stage_checkpoint,
)
from peer.node.metrics import MetricsWriter
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)


class PeerCheckpoints:
    """Resume and periodic saves of one peer's stage workers under `<data-dir>/checkpoints`."""

    def __init__(self, data_dir: Path, cfg: RunConfig, metrics: MetricsWriter, resume: bool) -> None:
        self.cfg, self.metrics, self.resume_asked = cfg, metrics, resume  # `peer join --resume`
        self.root = data_dir / "checkpoints"
        self.resumed_at: int | None = None  # outer step of the checkpoint restored by `resume`

    def resume(self, workers: Mapping[int, StageWorker]) -> dict[str, Any] | None:
        """With `--resume`, restore the newest good checkpoint of <data_dir>/checkpoints; its meta or None."""
        if not self.resume_asked:
            found = list_stage_checkpoints(self.root)
            if found:
                log.warning(
                    "starting without --resume: %s will be replaced as this peer saves its own checkpoints "
                    "(pass --resume to continue from it)",
                    found[0],
                )
            return None
        meta = load_latest_stage_checkpoint(self.root, workers, checkpoint_fingerprint(self.cfg))
        if meta is None:
            log.warning("--resume: no checkpoint in %s yet; starting from the swarm's state", self.root)
            return None
        self.resumed_at = meta["outer_step"]
        self.metrics.log("resume", t=meta["outer_step"], path=meta["path"], extra=meta.get("extra", {}))
        return meta

    def after_round(self, workers: Mapping[int, StageWorker], extra: dict[str, Any] | None = None) -> Path | None:
        """After a committed round: save every `swarm.checkpoint_every_rounds` rounds (and after the last).

        Call while nothing trains the workers. A failed save is logged (and recorded in the
        metrics) but does not stop training: the previous checkpoint stays on disk.
        """
        cfg, metrics = self.cfg, self.metrics
        every, t = cfg.swarm.checkpoint_every_rounds, next(iter(workers.values())).outer_step
        if every == 0 or (t % every and t != cfg.train.outer_steps):
            return None
        steps = {w.outer_step for w in workers.values()}
        if len(steps) > 1:  # one stage re-synced ahead of the others: save once they are aligned
            log.warning("not saving a checkpoint: stage workers are at outer steps %s", sorted(steps))
            return None
        started = time.monotonic()
        try:
            path = save_stage_checkpoint(self.root, workers, extra, keep=cfg.swarm.keep_checkpoints)
        except CheckpointError as exc:
            log.error("%s", exc)
            metrics.log("checkpoint_failed", t=t, reason=str(exc))
            return None
        metrics.log(
            "checkpoint",
            t=t,
            path=str(path),
            save_s=time.monotonic() - started,
            bytes=sum(f.stat().st_size for f in path.iterdir()),
        )
        return path
