"""What `peer bench chaos` measured, read back from the swarm's metrics files and logs.

Inputs: every `<workdir>/<holder>/metrics.jsonl` (one holder = one data directory: a role restarted
with --resume keeps its holder, a fresh restart is a new one) and every `<workdir>/*.log`.
- A `round` event of outer step t gives its holder's state (param_hash, perp_hash) of stage s at
  outer step t + 1; a `sync` event gives the state it downloaded at its outer step, a `switch` event
  the checked state it replaced its own commit with (docs/protocol.md, RECONCILE).
- Committed disagreements: (t + 1, s) where holders' round events disagree; unresolved: where the
  holders' last known states still disagree at the end (a re-sync repairs a committed one); a holder
  a fresh restart replaced (killed, its data directory never used again) holds nothing at the end.
- Lone commits: a round event with a one-replica committed set that no other holder of the same
  (t, s) committed.
- Stalls: gaps longer than `stall_s` between two consecutive round events of the whole swarm.
Only events from the first fault to the end of the fault schedule count (start-up is not churn):
when every peer leaves at the end, a round
in flight may close differently on different holders, and nobody is left to reconcile.
Pure functions of files: the report of a finished workdir can be recomputed at any time.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from peer.node.metrics import read_events

TRACEBACK = "Traceback (most recent call last)"
State = tuple[str, str]  # (param_hash, perp_hash)
Table = dict[tuple[int, int], dict[str, list[tuple[str, State]]]]  # (outer step, stage) -> holder -> states


def holder_events(
    workdir: Path, end: float | None = None, start: float | None = None
) -> dict[str, list[dict[str, Any]]]:
    """{holder (data directory name): its metrics events in file order}, from `start` to `end` (unix time)."""
    out = {p.parent.name: read_events(p) for p in sorted(Path(workdir).glob("*/metrics.jsonl"))}
    lo, hi = -math.inf if start is None else start, math.inf if end is None else end
    return {h: [ev for ev in evs if lo <= float(ev.get("time", 0.0)) <= hi] for h, evs in out.items()}


def states(events: Mapping[str, Sequence[Mapping[str, Any]]]) -> Table:
    """{(outer step, stage): {holder: [(source "round"|"sync"|"switch"|"moved", state), ...] in time
    order}}. "moved": the holder re-synced past that outer step later (a sync at a later step of the
    stage: it replayed the swarm's rounds through it), so it no longer holds what it committed there."""
    out: Table = defaultdict(lambda: defaultdict(list))
    committed_at: dict[tuple[str, int, int], float] = {}  # (holder, outer step, stage): when it committed
    syncs: list[tuple[str, int, int, float]] = []  # (holder, stage, outer step synced to, when)
    for holder, evs in events.items():
        for ev in evs:
            at = float(ev.get("time", 0.0))
            if ev.get("event") == "round":
                for s, st in (ev.get("stages") or {}).items():
                    state = (str(st.get("param_hash")), str(st.get("perp_hash")))
                    out[(int(ev["t"]) + 1, int(s))][holder].append(("round", state))
                    committed_at[(holder, int(ev["t"]) + 1, int(s))] = at
            elif ev.get("event") == "sync" and ev.get("stage") is not None:
                out[(int(ev["t"]), int(ev["stage"]))][holder].append(("sync", (str(ev.get("param_hash")), "")))
                syncs.append((holder, int(ev["stage"]), int(ev["t"]), at))
            elif ev.get("event") == "switch" and ev.get("stage") is not None:
                state = (str(ev.get("param_hash")), str(ev.get("perp_hash")))
                out[(int(ev["t"]), int(ev["stage"]))][holder].append(("switch", state))
    for holder, stage, to, at in syncs:
        for (h, t, s), when in committed_at.items():
            entries = out[(t, s)][h]
            if h == holder and s == stage and t < to and when < at and entries[-1][0] == "round":
                entries.append(("moved", ("", "")))
    return out


def abandoned(holders: Iterable[str]) -> set[str]:
    """The holders a fresh restart of their role replaced (`holder_name`: a later generation exists):
    their data directories are never used again, so the swarm keeps none of their states."""
    holders = list(holders)
    newest: dict[str, int] = {}
    for h in holders:
        newest[role_of(h)] = max(newest.get(role_of(h), 0), generation_of(h))
    return {h for h in holders if generation_of(h) < newest[role_of(h)]}


def _last_states(per_holder: Mapping[str, list[tuple[str, State]]], gone: Collection[str]) -> set[str]:
    return {
        entries[-1][1][0]
        for h, entries in per_holder.items()
        if entries and entries[-1][0] != "moved" and h not in gone
    }


def disagreements(table: Table, gone: Collection[str] = ()) -> tuple[int, int]:
    """(committed, unresolved) disagreement counts over (outer step, stage) pairs: holders whose
    commits of one round differ (a split), and those whose last known states still differ.

    A sync event carries no T⊥ hash, so the unresolved check compares parameter hashes only; a holder
    that re-synced past the step since ("moved") holds none of the states there, nor does one in
    `gone` (`abandoned`: a kill and fresh restart replaced it; its split still counts as committed).
    """
    committed = unresolved = 0
    for per_holder in table.values():
        rounds = {st for entries in per_holder.values() for src, st in entries if src == "round"}
        committed += len(rounds) > 1
        unresolved += len(_last_states(per_holder, gone)) > 1
    return committed, unresolved


def disagreement_lines(table: Table, gone: Collection[str] = (), most: int = 8) -> list[str]:
    """The (outer step, stage) pairs `disagreements` counts, one line each ("t/s: holder=source:hash
    ...", a hash as parameters/T⊥; "!" marks an unresolved one), for a report to say where they were;
    at most `most`."""
    out = []
    for (t, s), per_holder in sorted(table.items()):
        rounds = {st for entries in per_holder.values() for src, st in entries if src == "round"}
        last = _last_states(per_holder, gone)
        if len(rounds) > 1 or len(last) > 1:
            held = " ".join(f"{h}=" + ",".join(_short(e) for e in entries) for h, entries in sorted(per_holder.items()))
            out.append(f"{'!' if len(last) > 1 else ''}{t}/{s}: {held}")
    return out[:most]


def _short(entry: tuple[str, State]) -> str:
    src, (param, perp) = entry
    return f"{src}:{param[:8]}" + (f"/{perp[:6]}" if perp else "")


def longest_disagreement(table: Table) -> int:
    """The most consecutive outer steps any one stage's holders committed different states (the
    protocol resolves a disagreement within one round of seeing it: at most 2 here)."""
    by_stage: dict[int, set[int]] = defaultdict(set)
    for (t, s), per_holder in table.items():
        if len({st for entries in per_holder.values() for src, st in entries if src == "round"}) > 1:
            by_stage[s].add(t)
    best = 0
    for steps in by_stage.values():
        for t in steps:
            if t - 1 not in steps:
                n = 1
                while t + n in steps:
                    n += 1
                best = max(best, n)
    return best


def lone_commits(events: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Round events whose committed set has a single replica while another holder of the same (t, s)
    committed a different set: a set that holder alone held. (Events without the committed set, from
    older builds, fall back to comparing parameter hashes.) A T⊥ mismatch alone is a disagreement,
    counted by `disagreements`, not a lone commit."""
    by_key: dict[tuple[int, int], dict[str, tuple[int, tuple[str, ...] | str, float, float]]] = defaultdict(dict)
    for holder, evs in events.items():
        for ev in evs:
            if ev.get("event") != "round":
                continue
            at, wall = float(ev.get("time", 0.0)), float(ev.get("round_wall_s") or 0.0)
            for s, st in (ev.get("stages") or {}).items():
                committed = st.get("committed")
                key = tuple(sorted(committed)) if isinstance(committed, list) else str(st.get("param_hash"))
                by_key[(int(ev["t"]), int(s))][holder] = (int(st.get("participants", 0)), key, at, wall)
    out = []
    for (t, s), held in by_key.items():
        for holder, (n, key, at, wall) in held.items():
            others = [k for h, (_, k, _, _) in held.items() if h != holder]
            if n == 1 and others and key not in others:
                out.append({"t": t, "stage": s, "holder": holder, "time": at, "wall_s": wall})
    return out


def outside_freezes(lone: Sequence[Mapping[str, Any]], faults: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The lone commits whose round ([commit time − its wall time, commit time]) overlapped no freeze
    the harness made (a `stop` or `long_stop`, from its SIGSTOP to its SIGCONT). A holder whose
    round's other payload sits in a frozen process closes alone at the deadline by design (the lone
    guard waits for a second payload, that holder's commit, or the deadline: docs/protocol.md), and
    RECONCILE or a re-sync moves one side within a round; a lone commit with nobody frozen is the
    lone guard failing."""
    stops = [f for f in faults if f["kind"] in ("stop", "long_stop")]
    frozen = [(float(f["time"]), float(f.get("until", f["time"]))) for f in stops]
    return [c for c in lone if not any(a <= c["time"] and c["time"] - c["wall_s"] <= b for a, b in frozen)]


def round_times(events: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[float]:
    return sorted(float(ev["time"]) for evs in events.values() for ev in evs if ev.get("event") == "round")


def stalls(times: Sequence[float], stall_s: float, end: float | None = None) -> list[dict[str, float]]:
    """Gaps longer than `stall_s` between consecutive round events (and before `end`)."""
    marks = list(times) + ([end] if end is not None and times else [])
    return [{"from": a, "gap_s": round(b - a, 1)} for a, b in zip(marks, marks[1:], strict=False) if b - a > stall_s]


def tracebacks(workdir: Path, windows: Sequence[tuple[str, int, int]] = ()) -> tuple[dict[str, int], int]:
    """({log file name: tracebacks in it} for every log that has one, tracebacks inside `windows`).

    `windows` are (log name, start, end) byte ranges written while a process died of `kill -9`
    (its DHT child reports the broken pipe to its parent); those are counted apart."""
    out, in_windows = {}, 0
    for path in sorted(Path(workdir).glob("*.log")):
        data = path.read_bytes()
        spans = [(a, b) for name, a, b in windows if name == path.name]
        n = 0
        for i in (m.start() for m in re.finditer(re.escape(TRACEBACK.encode()), data)):
            if any(a <= i < b for a, b in spans):
                in_windows += 1
            else:
                n += 1
        if n:
            out[path.name] = n
    return out, in_windows


def summary(
    workdir: Path,
    faults: Sequence[Mapping[str, Any]],
    stall_s: float,
    orphans: int,
    end: float | None = None,
    kill_windows: Sequence[tuple[str, int, int]] = (),
    start: float | None = None,
) -> dict[str, Any]:
    """The chaos table: faults by kind, recovery times, stalls, disagreements, lone commits,
    orphans, tracebacks (`faults`: what the harness injected, with "recovery_s" or None)."""
    # the swarm's start-up (before the first fault) and its final shutdown are not churn
    events = holder_events(workdir, end, start)
    table = states(events)
    gone = abandoned(p.parent.name for p in Path(workdir).glob("*/metrics.jsonl"))
    committed, unresolved = disagreements(table, gone)
    crashes = [f for f in faults if f["kind"] == "crash"]  # a role that exited by itself
    faults = [f for f in faults if f["kind"] != "crash"]
    by_kind: dict[str, int] = defaultdict(int)
    for f in faults:
        by_kind[str(f["kind"])] += 1
    recovered = [float(f["recovery_s"]) for f in faults if f.get("recovery_s") is not None]
    lone = lone_commits(events)
    tb, tb_killed = tracebacks(workdir, kill_windows)
    times = round_times(events)
    return {
        "faults": len(faults),
        "faults_by_kind": dict(sorted(by_kind.items())),
        "recovered": len(recovered),
        "not_recovered": len(faults) - len(recovered),
        "recovery_median_s": round(statistics.median(recovered), 1) if recovered else None,
        "recovery_max_s": round(max(recovered), 1) if recovered else None,
        "stalls": len(stalls(times, stall_s, end)),
        "stall_threshold_s": stall_s,
        "rounds_committed": len(times),
        "outer_steps_reached": max((t for t, _ in table), default=0),
        "hash_disagreements_committed": committed,
        "hash_disagreements_unresolved": unresolved,
        "hash_disagreement_longest_run": longest_disagreement(table),
        "lone_commits": len(lone),
        "lone_commits_outside_freezes": len(outside_freezes(lone, faults)),
        "lone_commits_outside_freezes_at": [
            f"{c['holder']} {c['t']}/{c['stage']} at {c['time'] - (start or 0.0):.1f}s"
            for c in outside_freezes(lone, faults)
        ],
        "disagreements_at": disagreement_lines(table, gone),
        "switches": sum(1 for evs in events.values() for ev in evs if ev.get("event") == "switch"),
        "syncs": sum(1 for evs in events.values() for ev in evs if ev.get("event") == "sync"),
        "refusals": sum(1 for evs in events.values() for ev in evs if ev.get("event") == "refused"),
        "orphans": orphans,
        "crashes": len(crashes),
        "tracebacks": sum(tb.values()),
        "traceback_logs": tb,
        "tracebacks_of_killed_processes": tb_killed,
    }


def fault_line(f: Mapping[str, Any]) -> str:
    rec = f.get("recovery_s")
    return f"{f['kind']:<14} {f['target']:<10} " + ("not recovered" if rec is None else f"recovered in {rec:.1f}s")


def holder_name(role: str, generation: int) -> str:
    """The data directory of a role's `generation`-th fresh start (0: the first)."""
    return role if generation == 0 else f"{role}-{generation}"


def role_of(holder: str) -> str:
    return re.sub(r"-\d+$", "", holder)


def generation_of(holder: str) -> int:
    """`holder_name`'s generation: 0 for the role's first start."""
    found = re.search(r"-(\d+)$", holder)
    return int(found.group(1)) if found else 0
