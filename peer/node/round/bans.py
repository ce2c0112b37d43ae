"""Bans of repeated outliers: stop fetching from a replica that outlier screening keeps dropping.

Outlier screening (`peer.core.sparseloco.robust`) drops a poisoned contribution from the committed set, but
every holder still fetches it every round. A replica whose contribution to stage s is dropped in
`swarm.ban_after` consecutive rounds of s is banned from stage s for the next `swarm.ban_rounds`
rounds: its announcements are neither fetched nor waited for, as if it were dropped from the round
(`gather_round`), and a banned replica running this code observes instead of contributing. The
ban ends by itself. Issue 12, docs/poisoning.md.

State of one stage (`Bans`): {replica id prefix (16 chars): Entry(streak, last, until)}
    streak  drops in a row (rounds in which it was committed and screened out)
    last    the round of its last drop
    until   the first round it may contribute again (banned in round t ⇔ last < t < until)
Transitions at the commit of round t (`Bans.advance`, run by `StageWorker.apply_round` under the
worker's lock, from the committed replica ids and the ones screening dropped):
    dropped                → streak + 1, last = t; at ban_after: until = t + 1 + ban_rounds, streak 0
    committed and kept     → forgotten (a non-drop breaks the streak), unless still banned
    not in the set         → unchanged (absence neither extends nor breaks a streak)
    streak ≥ ban_rounds rounds old, or a ban that is over → forgotten

Determinism: the ban state is part of a stage's committed state. It changes only at a commit and
only as a function of (previous state, round t, committed set, screening's drops), and screening
is exact and order independent, so holders that commit the same set from the same state hold the
same bans. It is published next to "committed" in the holder's stage record and served with the
stage's state (`get_state` meta), and every path that adopts another holder's committed state
adopts its bans too: a holder that follows another's committed set (FOLLOW) takes the winner's
published bans, a re-sync takes the served ones, and the canonical-state rule orders equal states
by their bans (`key`), so two holders whose bans differ converge on one. Honest runs never ban:
screening has no false drops (docs/poisoning.md) and a ban needs `ban_after` in a row.
Pure: no networking; records are plain JSON (`to_record` / `from_record`, lenient on input).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PREFIX = 16  # replica ids are compared by their first 16 characters, as in "committed"
MAX_ENTRIES = 64  # a record stays small whatever a swarm does; the most severe entries are kept


@dataclass(frozen=True)
class Entry:
    streak: int = 0  # consecutive drops
    last: int = -1  # round of the last drop (the ban's start while banned)
    until: int = 0  # banned in round t while last < t < until (0: not banned)


def _severity(item: tuple[str, Entry]) -> tuple[int, int, int, str]:
    prefix, e = item
    return (-e.until, -e.streak, -e.last, prefix)


@dataclass(frozen=True)
class Bans:
    """One stage's ban state (immutable: every transition returns a new one)."""

    entries: Mapping[str, Entry] = field(default_factory=dict)

    def banned(self, t: int) -> frozenset[str]:
        """Replica id prefixes banned from round t (the rounds after the ban began, before `until`)."""
        return frozenset(p for p, e in self.entries.items() if e.last < t < e.until)

    def advance(self, t: int, committed: Iterable[str], dropped: Iterable[str], after: int, rounds: int) -> Bans:
        """The state after committing round t (`committed` replica ids, `dropped` the ones screening
        dropped; full ids or prefixes). `after` = 0 turns banning off (the state stays empty)."""
        if after <= 0 or rounds <= 0:
            return NONE
        kept = {r[:PREFIX] for r in committed}
        out = {r[:PREFIX] for r in dropped}
        kept -= out
        new: dict[str, Entry] = {}
        for p, e in self.entries.items():
            if t + 1 < e.until:  # still banned next round
                new[p] = e
            elif p not in kept and p not in out and e.streak > 0 and t - e.last < rounds:
                new[p] = Entry(e.streak, e.last, 0)  # absent: the streak lives on (for a while)
        for p in sorted(out):
            e = self.entries.get(p, Entry())
            if t < e.until:  # dropped while banned (a set committed elsewhere): the ban runs its course
                continue
            streak = (e.streak if t - e.last < rounds else 0) + 1
            new[p] = Entry(0, t, t + 1 + rounds) if streak >= after else Entry(streak, t, 0)
        return _capped(new)

    def started(self, t: int) -> list[str]:
        """Prefixes whose ban began at the commit of round t (for the log)."""
        return sorted(p for p, e in self.entries.items() if e.until > 0 and e.last == t and e.streak == 0)

    def to_record(self) -> dict[str, list[int]]:
        """{prefix: [streak, last, until]}, sorted: the stage record's "bans"."""
        return {p: [e.streak, e.last, e.until] for p, e in sorted(self.entries.items())}

    def key(self) -> tuple[int, str]:
        """Order of two ban states of one committed state: more entries first, then the record's
        JSON (a total order on contents; `peer.node.round.agreement.state_key`)."""
        return (-len(self.entries), json.dumps(self.to_record(), sort_keys=True, separators=(",", ":")))

    @classmethod
    def from_record(cls, value: Any) -> Bans:
        """Parse a record's "bans"; malformed entries are skipped (None or junk: no bans)."""
        if not isinstance(value, Mapping):
            return NONE
        out: dict[str, Entry] = {}
        for p, triple in value.items():
            if not isinstance(p, str) or not p or not isinstance(triple, list | tuple) or len(triple) != 3:
                continue
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in triple):
                continue
            streak, last, until = triple
            if streak < 0 or until < 0:
                continue
            out[p[:PREFIX]] = Entry(streak, last, until)
        return _capped(out)


def _capped(entries: Mapping[str, Entry]) -> Bans:
    if len(entries) > MAX_ENTRIES:
        entries = dict(sorted(entries.items(), key=_severity)[:MAX_ENTRIES])
    return Bans(dict(sorted(entries.items())))


NONE = Bans()


def record_key(value: Any) -> tuple[int, str]:
    """`Bans.key` of a record's raw "bans" field."""
    return Bans.from_record(value).key()


def after_commit(
    bans: Bans, t: int, committed: Iterable[str], dropped: Iterable[str], after: int, rounds: int, stage: int = 0
) -> Bans:
    """`bans.advance(...)`, logging each ban it starts (once: the round it begins)."""
    new = bans.advance(t, committed, dropped, after, rounds)
    for prefix in new.started(t):
        log.warning(
            "stage %d: replica %s was dropped as an outlier in %d rounds in a row: its payloads are not "
            "fetched before round %d",
            stage,
            prefix[:12],
            after,
            new.entries[prefix].until,
        )
    return new
