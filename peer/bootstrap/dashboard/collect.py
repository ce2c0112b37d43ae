"""What the dashboard knows about a run: the live records of the last poll, and their history.

`Collector.ingest(stages, replicas)` takes one read of the run's `stage.{s}` and `replica` records
(the read `peer status` and the bootstrap's metrics make: `peer.bootstrap.monitor.SwarmMonitor`
hands its reads here, so the dashboard adds no DHT traffic to a bootstrap that serves metrics) and
writes their history (`peer.bootstrap.dashboard.history`): each replica's committed rounds (the
"rounds" of its record: `peer.net.round_points`), the swarm's tokens/s and outer step over time, the
wall time of each outer step as seen here, each stage's state-id claims per outer step, and each
peer's contribution. `Collector.poll(dht)` makes the read itself (`peer dashboard` on any machine).

Invariants: what a record says is a claim and is shown as one — nothing here changes the run; an
outer step outside [0, 2**53) is ignored (junk no store holds exactly); a failed read is counted and
keeps the last view; the live view is replaced whole by each read (its
size is the swarm's live records, already bounded by the DHT), the history is bounded by its limits.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from peer.bootstrap.dashboard.history import History, Sighting
from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.net.records import ReplicaRecord, StageRecord

logger = logging.getLogger(__name__)


def run_info(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The run as its manifest describes it: id, model, stages, k/d, H, the planned outer steps."""
    config = manifest.get("config")
    config = config if isinstance(config, Mapping) else {}

    def section(name: str) -> Mapping[str, Any]:
        value = config.get(name)
        return value if isinstance(value, Mapping) else {}

    model, train, subspace = section("model"), section("train"), section("subspace")
    return {
        "run_id": manifest.get("run_id"),
        "preset": config.get("preset"),
        "stages": config.get("stages"),
        "d_model": model.get("d_model"),
        "n_layers": model.get("n_layers"),
        "k": manifest.get("k"),
        "k_ratio": subspace.get("k_ratio"),
        "inner_steps": train.get("inner_steps"),
        "outer_steps": train.get("outer_steps"),
        "admission": section("swarm").get("admission", "open"),
    }


@dataclass
class Live:
    """The records of the last successful read, and when it was made (unix seconds)."""

    stages: dict[int, dict[str, StageRecord]] = field(default_factory=dict)
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    at: float | None = None


MAX_STEP = 2**53  # an outer step at or past it is junk (SQLite and JavaScript hold integers below it exactly)


def _step(value: int | None) -> int | None:
    """An outer step the history can hold, else None."""
    return value if value is not None and 0 <= value < MAX_STEP else None


def _top(*values: float | None) -> Any:
    """The largest of the values that are not None (None if all are)."""
    return max((v for v in values if v is not None), default=None)


def _sightings(
    stages: Mapping[int, Mapping[str, StageRecord]], replicas: Mapping[str, ReplicaRecord]
) -> list[Sighting]:
    """One sighting per peer: a head or full replica publishes several records, counted once (its
    replica record's tokens/s, else the largest of its stage records')."""
    out: dict[str, Sighting] = {}
    for s, recs in sorted(stages.items()):
        for pid, rec in recs.items():
            had = out.get(pid)
            if had is None:
                out[pid] = Sighting(pid, rec.role, s, _step(rec.outer_step), rec.tokens_per_s)
            else:
                step, speed = _top(_step(rec.outer_step), had.outer_step), _top(rec.tokens_per_s, had.tokens_per_s)
                out[pid] = Sighting(pid, had.role, had.stage, step, speed)
    for pid, rep in replicas.items():
        had = out.get(pid)
        stage = None if had is None or rep.kind == "full" else had.stage
        step = _top(_step(rep.outer_step), had.outer_step if had else None)
        out[pid] = Sighting(pid, rep.kind or (had.role if had else ""), stage, step, rep.tokens_per_s)
    return [out[p] for p in sorted(out)]


class Collector:
    """The dashboard's data (see the module docstring); thread-safe."""

    def __init__(self, history: History, manifest: Mapping[str, Any], poll_s: float) -> None:
        self.history, self.run, self.poll_s = history, run_info(manifest), poll_s
        self.started = time.time()
        self.failures = 0
        self._lock = threading.Lock()
        self._live = Live()
        self._step: tuple[int, float] | None = None  # (largest outer step, when it was first seen)

    def live(self) -> Live:
        with self._lock:
            return self._live

    def poll(self, dht: SwarmDHT) -> None:
        """Read the run's records once and ingest them; a failed read or write is counted and logged."""
        try:
            stages = {s: dht.get_stage_peers(s) for s in range(int(self.run["stages"] or 0))}
            replicas = dht.get_replicas()
        except PeerError as exc:
            with self._lock:
                self.failures += 1
            logger.debug("dashboard: could not read the swarm's records: %s", exc)
            return
        try:
            self.ingest(stages, replicas)
        except sqlite3.Error as exc:  # a full disk: the page keeps what it has, the next read tries again
            with self._lock:
                self.failures += 1
            logger.warning("dashboard: could not write its history (%s); free space in %s", exc, self.history.path)

    def ingest(
        self,
        stages: Mapping[int, Mapping[str, StageRecord]],
        replicas: Mapping[str, ReplicaRecord],
        now: float | None = None,
    ) -> None:
        """One read of the records: the live view replaced, the history extended."""
        now = time.time() if now is None else now
        h = self.history
        for pid, rep in replicas.items():
            points = [(p.t, p.loss, p.val_loss, p.wall_s) for p in rep.rounds if _step(p.t) is not None]
            if points:
                h.append(f"loss:{pid}", points, now, kind=rep.kind)
        steps = [_step(r.outer_step) for recs in stages.values() for r in recs.values()]
        steps += [_step(r.outer_step) for r in replicas.values()]
        outer = max([0, *(x for x in steps if x is not None)])
        tokens = sum(r.tokens_per_s or 0.0 for r in replicas.values() if not r.left)
        h.append("run", [(now, tokens, outer)], now)
        with self._lock:
            prev, self._live = self._step, Live({s: dict(r) for s, r in stages.items()}, dict(replicas), now)
            if prev is None or outer > prev[0]:
                self._step = (outer, now)
        if prev is not None and outer > prev[0]:
            h.append("steps", [(outer, (now - prev[1]) / (outer - prev[0]))], now)
        for s, recs in stages.items():
            claims = [(_step(r.outer_step), pid, r.state_id) for pid, r in recs.items()]
            h.claim(s, [(t, pid, sid) for t, pid, sid in claims if t is not None and sid])
        h.seen(_sightings(stages, replicas), now, gap_s=3 * self.poll_s + 1.0)
