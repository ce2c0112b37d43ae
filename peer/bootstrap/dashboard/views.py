"""The dashboard's JSON API: plain dicts built from the collector's live view and its history.

`dashboard(c)` is everything the page paints first (`/api/dashboard`); `run_view`, `loss_view`,
`stages_view`, `peers_view` and `peer_view` are its parts (`/api/run`, `/api/loss`, `/api/stages`,
`/api/peers`, `/api/peers/<id>`). Shapes are in docs/monitoring.md.

Invariants: the output is data, never markup — every string a peer chose is passed through `text`
(cut to `MAX_TEXT` characters) and the page sets it with textContent; a float that is not finite
becomes None (strict JSON); agreement is computed here from the claims kept, the same rule for every
stage: the outer steps whose holders all claim one state id agree.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from typing import Any

from peer.bootstrap.dashboard.collect import Collector
from peer.net.records import ReplicaRecord, StageRecord

MAX_TEXT = 200  # characters of any string a record carries
AGREEMENT_ROUNDS = 8  # outer steps the agreement column looks back on
MAX_CURVES = 64  # replicas whose loss the page draws: the most recently updated (an answer stays < ~10 MB)


def num(value: Any) -> float | None:
    """A finite number, else None (NaN and infinities are not JSON)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def text(value: Any) -> str | None:
    """A string from a record, cut to `MAX_TEXT` characters (None stays None)."""
    return None if value is None else str(value)[:MAX_TEXT]


def run_view(c: Collector, now: float | None = None) -> dict[str, Any]:
    """The run: its manifest's settings, the outer step, tokens/s over time, wall seconds per outer step."""
    now = time.time() if now is None else now
    live = c.live()
    run = c.history.points("run")
    steps = c.history.points("steps")
    info = {k: (num(v) if isinstance(v, (int, float)) else text(v)) for k, v in c.run.items()}
    return info | {
        "outer_step": int(run[-1][2] or 0) if run else 0,
        "tokens_per_s": num(run[-1][1]) if run else None,
        "uptime_s": num(now - c.started),
        "updated_s_ago": None if live.at is None else num(now - live.at),
        "poll_failures": c.failures,
        "tokens_per_s_series": [[num(p[0]), num(p[1])] for p in run],
        "step_wall_s_series": [[int(p[0]), num(p[1])] for p in steps],
    }


def loss_view(c: Collector) -> dict[str, Any]:
    """Every replica's (t, train loss, val loss) per committed round, its kind (pipeline: a compressed
    pipeline's head; full: a full replica), and the replica-mean validation loss per outer step: of the
    `MAX_CURVES` replicas most recently updated."""
    replicas = []
    vals: dict[int, list[float]] = {}
    for name, kind in sorted(c.history.series("loss:", MAX_CURVES).items()):
        points = [(int(p[0]), num(p[1]), num(p[2])) for p in c.history.points(name)]
        replicas.append({"replica": text(name.removeprefix("loss:")), "kind": text(kind), "points": points})
        for t, _, val in points:
            if val is not None:
                vals.setdefault(t, []).append(val)
    mean = [[t, num(sum(v) / len(v))] for t, v in sorted(vals.items())]
    return {"replicas": replicas, "mean_val": mean}


def _holder(pid: str, r: StageRecord, majority: str | None, rep: ReplicaRecord | None = None) -> dict[str, Any]:
    """One holder's row; `rep`: its replica record when it is a head or a full replica (a head's boundary
    mode this outer step; the tokens/s it trains every stage it holds at, where its stage record has none)."""
    mode = None if rep is None else rep.mode
    speed = r.tokens_per_s or (None if rep is None else rep.tokens_per_s) or r.tokens_per_s
    return {
        "peer_id": text(pid),
        "role": text(r.role or None),
        "mode": text(mode) if r.role == "head" else None,
        "state": text(r.state or None),
        "outer_step": r.outer_step,
        "state_id": text(r.state_id),
        "agrees": None if majority is None or r.state_id is None else r.state_id == majority,
        "tokens_per_s": num(speed),
        "address": text(r.address or None),
        "connectivity": text(r.net.connectivity),
    }


def _majority(state_ids: Iterable[str]) -> str | None:
    """The state id most holders claim, None on a tie (then no holder is said to agree or not)."""
    top = Counter(state_ids).most_common(2)
    return top[0][0] if top and (len(top) == 1 or top[0][1] > top[1][1]) else None


def stages_view(c: Collector) -> list[dict[str, Any]]:
    """Per stage: its holders now (each with its state id and whether it is the most claimed one at
    its outer step; None on a tie) and the agreement of its last outer steps' claims."""
    live = c.live()
    n = int(c.run.get("stages") or 0)
    out = []
    for s in range(max([n, *(x + 1 for x in live.stages)])):
        claims = c.history.claims(s)
        rounds = []
        for t in sorted(claims)[-AGREEMENT_ROUNDS:]:
            ids = Counter(claims[t].values())
            rounds.append({"t": t, "holders": sum(ids.values()), "state_ids": len(ids), "agree": len(ids) == 1})
        majority = {t: _majority(v.values()) for t, v in claims.items()}
        recs = live.stages.get(s, {})
        holders = [
            _holder(pid, recs[pid], majority.get(recs[pid].outer_step or -1), live.replicas.get(pid))
            for pid in sorted(recs)
        ]
        agree = all(r["agree"] for r in rounds) if rounds else None
        speed = sum(h["tokens_per_s"] or 0.0 for h in holders)
        out.append({"stage": s, "holders": holders, "tokens_per_s": speed, "agreement": agree, "rounds": rounds})
    return out


def _contribution(row: dict[str, Any], now: float, live_ids: set[str]) -> dict[str, Any]:
    return {
        "peer_id": text(row["peer_id"]),
        "role": text(row["role"]),
        "stage": row["stage"],
        "outer_step": row["outer_step"],
        "rounds": row["rounds"],
        "tokens": int(row["tokens"]),
        "uptime_s": num(row["last_seen"] - row["first_seen"]),
        "last_seen_s_ago": num(now - row["last_seen"]),
        "live": row["peer_id"] in live_ids,
    }


def _live_ids(c: Collector) -> set[str]:
    live = c.live()
    return {pid for recs in live.stages.values() for pid in recs} | set(live.replicas)


def peers_view(c: Collector, now: float | None = None) -> list[dict[str, Any]]:
    """Every peer seen: its contribution (outer steps advanced, tokens, time online), newest first."""
    now = time.time() if now is None else now
    ids = _live_ids(c)
    return [_contribution(row, now, ids) for row in c.history.peers()]


def peer_view(c: Collector, peer_id: str, now: float | None = None) -> dict[str, Any] | None:
    """One peer: its contribution, its live records and, for a replica, its loss per round; None if unseen."""
    now = time.time() if now is None else now
    rows = c.history.peers(peer_id)
    if not rows:
        return None
    live = c.live()
    stages = []
    for s, recs in sorted(live.stages.items()):
        if peer_id in recs:
            stages.append({"stage": s} | _holder(peer_id, recs[peer_id], None, live.replicas.get(peer_id)))
    rep = live.replicas.get(peer_id)
    replica = None
    if rep is not None:
        replica = {"kind": text(rep.kind), "outer_step": rep.outer_step, "loss": num(rep.loss)}
        replica |= {"tokens_per_s": num(rep.tokens_per_s), "shard": rep.shard, "joined_at": rep.joined_at}
        replica["mode"] = text(rep.mode)  # a head's boundary mode this outer step (None: a full replica's)
    points = [[int(p[0]), num(p[1]), num(p[2]), num(p[3])] for p in c.history.points(f"loss:{peer_id}")]
    out = _contribution(rows[0], now, _live_ids(c))
    return out | {"stages": stages, "replica": replica, "loss": points}


def dashboard(c: Collector, now: float | None = None) -> dict[str, Any]:
    """Everything the page paints first: run, loss, stages and peers."""
    now = time.time() if now is None else now
    return {"run": run_view(c, now), "loss": loss_view(c), "stages": stages_view(c), "peers": peers_view(c, now)}
