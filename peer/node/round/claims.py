"""State claims: what a holder says about its committed state, and the pure rules that read them.

A holder's stage record is a claim, never an authority (docs/protocol.md, "Claims"). It names

    outer_step  t + 1 after committing round t
    state       the state id: sha256 of (parameter hash, T⊥ hash, bans), 16 hex chars
    link        how the state was reached: {"t": t, "prev": state id before the round,
                "set": [[replica, payload sha256], ...] in commit order,
                "embed": stage 0's committed set its T⊥ moved by (stages > 0 of a compressed run),
                "ranges": [roster digest, shards digest] (a ranges round: docs/protocol.md, RANGES)}

Every payload of a set is named by content (the first `SHA_CHARS` hex chars of its sha256, 128
bits) and must match a signed announcement of round (t, s) by a sender bound to that replica
(`peer.node.round.verify`). Because the commit is portable (`peer.core.sparseloco.commit`), a claim whose `prev` is
a holder's own state can be CHECKED by that holder: recompute the commit of the named payloads and
compare state ids. Claims are adopted only that way: a peer that holds no comparable state (a
late joiner, a holder rounds behind) replays the rounds from a state it trusts, checking each
link the same way (`peer.node.round.replay`). `majority` (counted by peer id, at a step the swarm's clock
admits: `swarm_clock`) only weighs a same-step state RECONCILE cannot check (docs/protocol.md).

Everything here reads typed records (`peer.net.records`) and returns decisions, so every rule is tested row by row.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from peer.net.records import ReplicaRecord, StageRecord
from peer.node.round.bans import PREFIX

SHA_CHARS = 32  # hex chars of a payload's sha256 named in a committed set (128 bits)
MAX_SET = 4096  # entries of a committed set read from a record (larger sets are malformed)

Entry = tuple[str, str]  # (replica id prefix, payload sha256 prefix)


def state_id(param_hash: str, perp_hash: str, bans: Mapping[str, Any]) -> str:
    """The id of a committed state: parameters, T⊥ and the ban state, 16 hex chars."""
    text = json.dumps([param_hash, perp_hash, bans], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def entry(replica: str, sha256: str) -> Entry:
    """A committed set's name of one payload: (replica id prefix, sha256 prefix)."""
    return (replica[:PREFIX], sha256[:SHA_CHARS])


def _entries(value: Any) -> tuple[Entry, ...] | None:
    if not isinstance(value, list | tuple) or len(value) > MAX_SET:
        return None
    out = []
    for item in value:
        if not (isinstance(item, list | tuple) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            return None
        rid, sha = item
        if not rid or len(sha) != SHA_CHARS or any(c not in "0123456789abcdef" for c in sha):
            return None
        out.append((rid[:PREFIX], sha))
    return tuple(out)


@dataclass(frozen=True)
class Link:
    """How a committed state was reached: round `t`'s set applied to state `prev` gave `state`."""

    t: int
    prev: str
    state: str
    entries: tuple[Entry, ...]
    embed: tuple[Entry, ...] | None = None  # stage 0's set this stage's T⊥ moved by (stages > 0)
    ranges: tuple[str, str] | None = None  # a ranges round: (roster digest, digest of its shards' digests)

    @property
    def replicas(self) -> list[str]:
        return [rid for rid, _ in self.entries]

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"t": self.t, "prev": self.prev, "set": [list(e) for e in self.entries]}
        if self.embed is not None:
            out["embed"] = [list(e) for e in self.embed]
        if self.ranges is not None:
            out["ranges"] = list(self.ranges)
        return out

    @classmethod
    def from_record(cls, value: Any, state: Any) -> Link | None:
        """Parse a record's "link" (with its "state"); None when absent or malformed in any way."""
        if not isinstance(value, Mapping) or not isinstance(state, str) or not state:
            return None
        t, prev = value.get("t"), value.get("prev")
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or not isinstance(prev, str) or not prev:
            return None
        entries = _entries(value.get("set"))
        embed = _entries(value["embed"]) if "embed" in value else None
        if entries is None or ("embed" in value and embed is None):
            return None
        ranges = value.get("ranges")
        if ranges is not None and not (
            isinstance(ranges, list | tuple) and len(ranges) == 2 and all(isinstance(x, str) and x for x in ranges)
        ):
            return None
        return cls(t, prev, state, entries, embed, None if ranges is None else (ranges[0], ranges[1]))


@dataclass(frozen=True)
class Claim:
    """One holder's stage record, parsed once: its step, state id and link (None: none published)."""

    peer: str
    outer_step: int
    state: str
    link: Link | None

    @property
    def key(self) -> tuple[int, str]:
        """The canonical order among CHECKED states of one round: the most committed payloads, then
        the smallest state id (a total order: two holders agree on the winner without a majority)."""
        return (-len(self.link.entries) if self.link is not None else 0, self.state)


def parse_claims(holders: Mapping[str, StageRecord], me: str = "", refused: Collection[str] = ()) -> dict[str, Claim]:
    """{peer: Claim} of the stage's other live holders with a well-formed state claim (not ours, not
    a refused holder's, not one that is leaving or still syncing)."""
    out = {}
    for pid, rec in holders.items():
        if pid == me or pid in refused or rec.state in ("left", "syncing"):
            continue
        step, state = rec.outer_step, rec.state_id
        if step is None or not state:
            continue
        out[pid] = Claim(pid, step, state, Link.from_record(rec.link, state))
    return out


def followable(claims: Iterable[Claim], t: int, prev: str) -> list[Claim]:
    """Claims that committed round t from OUR state `prev` (so we can recompute theirs), best first
    by `Claim.key`: the sets a holder still gathering round t may follow."""
    out = [c for c in claims if c.outer_step == t + 1 and c.link is not None and c.link.t == t and c.link.prev == prev]
    return sorted(out, key=lambda c: (c.key, c.peer))


def committed_only_from_others(claims: Iterable[Claim], t: int, prev: str, refused: Collection[str] = ()) -> bool:
    """Whether round t was committed (by holders not `refused`) and every such commit started from
    another state than `prev`: none of them can be followed from `prev`."""
    counted = [c for c in claims if c.peer not in refused]
    froms = {c.link.prev for c in counted if c.outer_step == t + 1 and c.link is not None and c.link.t == t}
    return bool(froms) and prev not in froms


def voters(claims: Iterable[Claim], step: int, embed: Sequence[Entry] | None) -> list[Claim]:
    """The claims at outer step `step` that vote on a stage's state (`majority`): a claim whose T⊥
    moved by another stage-0 set than `embed` — stage 0's committed set of that round, None when not
    known — is no vote: its holder rebases its T⊥ onto stage 0's set itself (RECONCILE), and an
    outvote by such claims once sent the one holder of the right T⊥ back a round."""
    wanted = None if embed is None else tuple(embed)
    return [
        c
        for c in claims
        if c.outer_step == step
        and (wanted is None or c.link is None or c.link.embed is None or tuple(c.link.embed) == wanted)
    ]


def better(claims: Iterable[Claim], mine: Claim) -> list[Claim]:
    """Claims of the same round from the same state as `mine` that the canonical order puts before
    it, best first: each is checked by recomputation before it may replace our state."""
    if mine.link is None:
        return []
    same = followable(claims, mine.link.t, mine.link.prev)
    return [c for c in same if (c.key, c.state) < (mine.key, mine.state) and c.state != mine.state]


def swarm_clock(replicas: Mapping[str, ReplicaRecord], refused: Collection[str] = ()) -> int:
    """The swarm's outer step: the lower median of the live replicas' (heads', full replicas')
    outer steps, so a dishonest minority of replicas cannot move it; 0 without replicas."""
    steps = sorted(
        rec.outer_step
        for pid, rec in replicas.items()
        if pid not in refused and not rec.left and rec.outer_step is not None
    )
    return steps[(len(steps) - 1) // 2] if steps else 0


@dataclass(frozen=True)
class Majority:
    """A state claimed by a strict majority of the voters, and who claims it."""

    outer_step: int
    state: str
    holders: tuple[str, ...]


def majority(
    claims: Iterable[Claim], clock: int, mine: tuple[int, str] | None = None, after: int = -1
) -> Majority | None:
    """The (outer step, state) that a strict majority of the voters claim, or None.

    Voters: the claims at an outer step in (`after`, `clock` + 1] (a step past the swarm's clock is
    not believed), plus our own (outer step, state) `mine` when we hold one at such a step. Counted
    by peer id, so a dishonest minority of holders cannot win; an even split has no winner.
    """
    votes: dict[tuple[int, str], list[str]] = {}
    voters = 0
    for c in claims:
        if after < c.outer_step <= clock + 1:
            votes.setdefault((c.outer_step, c.state), []).append(c.peer)
            voters += 1
    if mine is not None and after < mine[0] <= clock + 1:
        votes.setdefault(mine, []).append("")
        voters += 1
    for (step, state), who in sorted(votes.items(), key=lambda kv: (-len(kv[1]), -kv[0][0], kv[0][1])):
        if 2 * len(who) > voters and who != [""]:
            return Majority(step, state, tuple(sorted(p for p in who if p)))
        break
    return None


def observed(claims: Iterable[Claim], t: int) -> list[Claim]:
    """For a peer that gathers a stage it does not hold (stage 0 for T⊥): the committed sets of
    round t, the set claimed by the most holders first (then `Claim.key`), one claim per set."""
    groups: dict[tuple[Entry, ...], list[Claim]] = {}
    for c in claims:
        if c.outer_step == t + 1 and c.link is not None and c.link.t == t:
            groups.setdefault(c.link.entries, []).append(c)
    best = [min(group, key=lambda c: (c.key, c.peer)) for group in groups.values()]
    return sorted(best, key=lambda c: (-len(groups[c.link.entries]) if c.link else 0, c.key, c.peer))


def closed_elsewhere(clock: int, t: int, stalled: bool = False, overlap: int = 0) -> bool:
    """Whether the swarm closed round t at least a round ago: its clock (the lower median of the
    other replicas' outer steps, which a dishonest minority cannot move) is two or more rounds past
    t. A holder still gathering t then (it woke from a freeze, or stalled) never commits a set of its
    own: it re-syncs to the state a majority of its stage's holders claims (`majority`), whether or
    not one exists at this very moment (holders one round apart split the vote for a while).

    One round past is enough when we `stalled` since the round began for longer than our records
    live (`peer.node.round.stalls`): the others saw us gone, may have given our payload up, and the
    replicas that are past t closed it without waiting for us.

    With `overlap` (`train.overlap`) a replica commits round t + 1 while the holders of its other
    stages may still gather round t (docs/protocol.md, "Overlapped outer steps"): the clock may run
    that many rounds further ahead of an open round."""
    return clock >= t + (1 if stalled else 2) + overlap
