"""The dashboard's history: a bounded ring per series, on disk, that survives a restart.

One SQLite file (stdlib `sqlite3`: atomic commits, readable while written) holds
- `points`: every series' ring. A point goes to slot `seq % capacity` of its series, so a series
  never holds more than `capacity` points: the newest replace the oldest. Series are "loss:<replica>"
  (t, train loss, val loss, round wall s), "run" (unix time, tokens/s of all replicas, outer step) and
  "steps" (t, wall seconds of outer step t as the bootstrap saw it);
- `series`: each series' next sequence number, last t and when it was last written; at most
  `max_series` of them, the least recently written dropped first (replicas come and go);
- `claims`: the state id each holder of a stage claimed at each outer step, for the last
  `claim_rounds` outer steps of that stage (agreement);
- `peers`: each peer's contribution as seen (first and last seen, rounds, tokens), at most
  `max_peers`, the least recently seen dropped first.

Invariants: every table is bounded by the limits above whatever the swarm publishes, so the file
and the bootstrap's memory stay bounded after any number of rounds (docs/monitoring.md states the
measured bound); only this module writes SQL; every method takes the one lock (the collector writes
from the serve loop, HTTP handlers read from their threads).
"""

from __future__ import annotations

import math
import sqlite3
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CAPACITY = 4096  # points per series: the last 4096 rounds of each replica's loss
MAX_SERIES = 512
CLAIM_ROUNDS = 32  # outer steps of claims kept per stage
MAX_HOLDERS = 4096  # claims kept per (stage, outer step)
MAX_PEERS = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS series (name TEXT PRIMARY KEY, next INTEGER NOT NULL, last_t INTEGER, kind TEXT,
                                   updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS points (series TEXT NOT NULL, slot INTEGER NOT NULL, seq INTEGER NOT NULL,
                                   t REAL NOT NULL, a REAL, b REAL, c REAL, PRIMARY KEY (series, slot));
CREATE TABLE IF NOT EXISTS claims (stage INTEGER NOT NULL, t INTEGER NOT NULL, peer TEXT NOT NULL,
                                   state_id TEXT NOT NULL, PRIMARY KEY (stage, t, peer));
CREATE TABLE IF NOT EXISTS peers (peer_id TEXT PRIMARY KEY, role TEXT, stage INTEGER, first_seen REAL NOT NULL,
                                  last_seen REAL NOT NULL, rounds INTEGER NOT NULL, tokens REAL NOT NULL,
                                  outer_step INTEGER);
"""


@dataclass(frozen=True)
class Limits:
    """How much history one file keeps (see the module docstring)."""

    capacity: int = CAPACITY
    max_series: int = MAX_SERIES
    claim_rounds: int = CLAIM_ROUNDS
    max_holders: int = MAX_HOLDERS
    max_peers: int = MAX_PEERS


@dataclass(frozen=True)
class Sighting:
    """One peer as one poll saw it: what `History.seen` adds to its contribution."""

    peer_id: str
    role: str
    stage: int | None
    outer_step: int | None
    tokens_per_s: float | None


class History:
    """The bounded rings of one run (see the module docstring). `path` ":memory:" keeps nothing on disk."""

    def __init__(self, path: str | Path, limits: Limits = Limits()) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path, self.limits = str(path), limits
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL" if self.path != ":memory:" else "PRAGMA journal_mode=MEMORY")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses no commit, a power cut the last few
        self._db.execute("PRAGMA cache_size=-2048")  # at most 2 MiB of pages in memory
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ---------------------------------------------------------------------------------- writes

    def append(self, series: str, points: Iterable[Sequence[float | None]], now: float, kind: str = "") -> int:
        """Append points (t, a, b, c) to `series`, skipping those whose t is not above the last one
        appended (a replica repeats its last rounds in every record); returns how many it kept."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            row = self._db.execute("SELECT next, last_t FROM series WHERE name = ?", (series,)).fetchone()
            seq, last_t = (0, None) if row is None else row
            kept = 0
            for t, *rest in points:
                if t is None or (last_t is not None and t <= last_t):
                    continue
                a, b, c = (list(rest) + [None, None, None])[:3]
                slot = seq % self.limits.capacity
                self._db.execute(
                    "INSERT OR REPLACE INTO points VALUES (?, ?, ?, ?, ?, ?, ?)", (series, slot, seq, t, a, b, c)
                )
                seq, last_t, kept = seq + 1, t, kept + 1
            self._db.execute("INSERT OR REPLACE INTO series VALUES (?, ?, ?, ?, ?)", (series, seq, last_t, kind, now))
            self._drop_oldest_series()
        return kept

    def _drop_oldest_series(self) -> None:
        (n,) = self._db.execute("SELECT COUNT(*) FROM series").fetchone()
        if n <= self.limits.max_series:
            return
        old = [
            r[0]
            for r in self._db.execute("SELECT name FROM series ORDER BY updated LIMIT ?", (n - self.limits.max_series,))
        ]
        self._db.executemany("DELETE FROM points WHERE series = ?", [(s,) for s in old])
        self._db.executemany("DELETE FROM series WHERE name = ?", [(s,) for s in old])

    def claim(self, stage: int, claims: Iterable[tuple[int, str, str]]) -> None:
        """Holders' claims (outer step, peer id, state id) of `stage`; keeps the last `claim_rounds` outer steps."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for t, peer, state_id in claims:
                (n,) = self._db.execute("SELECT COUNT(*) FROM claims WHERE stage = ? AND t = ?", (stage, t)).fetchone()
                if n < self.limits.max_holders:
                    self._db.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?)", (stage, t, peer, state_id))
            row = self._db.execute("SELECT MAX(t) FROM claims WHERE stage = ?", (stage,)).fetchone()
            if row[0] is not None:
                self._db.execute(
                    "DELETE FROM claims WHERE stage = ? AND t <= ?", (stage, row[0] - self.limits.claim_rounds)
                )

    def seen(self, sightings: Iterable[Sighting], now: float, gap_s: float) -> None:
        """Add one poll's sightings to the peers' contributions: uptime runs from the first sighting,
        tokens add tokens/s × the time since the last sighting when that is under `gap_s` (a peer seen
        again after a gap is not credited for it; a total that would not be finite is not credited at
        all), rounds add the outer steps it advanced."""
        with self._lock, self._db:
            self._db.execute("BEGIN")
            for s in sightings:
                row = self._db.execute(
                    "SELECT last_seen, rounds, tokens, outer_step FROM peers WHERE peer_id = ?", (s.peer_id,)
                ).fetchone()
                if row is None:
                    self._db.execute(
                        "INSERT INTO peers VALUES (?, ?, ?, ?, ?, 0, 0, ?)",
                        (s.peer_id, s.role, s.stage, now, now, s.outer_step),
                    )
                    continue
                last_seen, rounds, tokens, step = row
                dt = now - last_seen
                credit = s.tokens_per_s * dt if 0 < dt <= gap_s and s.tokens_per_s is not None else 0.0
                if credit > 0 and math.isfinite(tokens + credit):  # a claimed inf or 1e308 tokens/s adds nothing
                    tokens += credit
                if s.outer_step is not None and step is not None and s.outer_step > step:
                    rounds += s.outer_step - step
                self._db.execute(
                    "UPDATE peers SET role = ?, stage = ?, last_seen = ?, rounds = ?, tokens = ?, outer_step = ? "
                    "WHERE peer_id = ?",
                    (s.role, s.stage, max(now, last_seen), rounds, tokens, s.outer_step, s.peer_id),
                )
            (n,) = self._db.execute("SELECT COUNT(*) FROM peers").fetchone()
            if n > self.limits.max_peers:
                self._db.execute(
                    "DELETE FROM peers WHERE peer_id IN (SELECT peer_id FROM peers ORDER BY last_seen LIMIT ?)",
                    (n - self.limits.max_peers,),
                )

    # ---------------------------------------------------------------------------------- reads

    def points(self, series: str) -> list[tuple[float, float | None, float | None, float | None]]:
        """The points of `series`, oldest first (at most `capacity`)."""
        with self._lock:
            rows = self._db.execute("SELECT t, a, b, c FROM points WHERE series = ? ORDER BY seq", (series,))
            return [tuple(r) for r in rows]  # type: ignore[misc]

    def series(self, prefix: str, limit: int = MAX_SERIES) -> dict[str, str]:
        """{series name: kind} of the series whose name starts with `prefix`: the `limit` most recently written."""
        with self._lock:
            rows = self._db.execute(
                "SELECT name, kind FROM series WHERE substr(name, 1, ?) = ? ORDER BY updated DESC LIMIT ?",
                (len(prefix), prefix, limit),
            )
            return {name: kind or "" for name, kind in rows}

    def claims(self, stage: int) -> dict[int, dict[str, str]]:
        """{outer step: {peer id: state id}} of `stage`, for the outer steps kept."""
        out: dict[int, dict[str, str]] = {}
        with self._lock:
            for t, peer, state_id in self._db.execute("SELECT t, peer, state_id FROM claims WHERE stage = ?", (stage,)):
                out.setdefault(t, {})[peer] = state_id
        return out

    def peers(self, peer_id: str | None = None) -> list[dict[str, Any]]:
        """Every peer's contribution as seen (or the one of `peer_id`), most recently seen first."""
        query = "SELECT peer_id, role, stage, first_seen, last_seen, rounds, tokens, outer_step FROM peers"
        args: tuple[Any, ...] = ()
        if peer_id is not None:
            query, args = query + " WHERE peer_id = ?", (peer_id,)
        names = ("peer_id", "role", "stage", "first_seen", "last_seen", "rounds", "tokens", "outer_step")
        with self._lock:
            rows = self._db.execute(query + " ORDER BY last_seen DESC, peer_id", args).fetchall()
        return [dict(zip(names, r, strict=True)) for r in rows]
