"""What one stage's rounds left behind on a holder: the ban state, the claim, our recent links.

The ban state (`peer.node.round.bans`, advanced by every commit in `peer.node.stage.commit.compute`) is
part of the committed state. The link says how the committed state was reached (round t, the state
committed from, the committed set; None for an initial, downloaded or resumed state): it is what
this holder claims (`peer.node.round.claims`). Our links of the last HISTORY rounds audit other holders'
claims of those rounds; `prev`, the state the last round was committed from, lets a claim of the
same round be checked by recomputation. The last round's committed set, clip stats and screened
replicas feed the records and metrics; our payload waits in `last_contribution` until its round
is checked.

Invariants: a commit replaces all of it at once (`committed`), an adopted state resets it
(`adopted`); the holder's lock guards it.
"""

from __future__ import annotations

from collections.abc import Sequence

from peer.core.sparseloco.codec.clip import ClipStats
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import NO_CLIP
from peer.core.sparseloco.ranges import RangePlan
from peer.node.round.bans import NONE as NO_BANS
from peer.node.round.bans import Bans
from peer.node.round.claims import Entry, Link, entry
from peer.node.round.contribution import Contribution
from peer.node.stage.commit import Outcome, Prev

HISTORY = 16  # rounds of our own links kept to audit other holders' claims of those rounds


class RoundLedger:
    """The ban state, claim and round records of one stage's holder."""

    def __init__(self, keep: int = HISTORY) -> None:
        self.keep = keep  # rounds of links kept (`swarm.history_rounds`: served to joiners that replay)
        self.bans: Bans = NO_BANS  # repeated outliers not fetched from (peer.node.round.bans), with the committed state
        self.link: Link | None = None  # how the committed state was reached (None: initial or downloaded)
        self.history: dict[int, Link] = {}  # our links of the last `keep` rounds (audits; joiners replay them)
        self.prev: Prev | None = None  # the state the last round was committed from (checks recompute from it)
        self.last_contribution: Contribution | None = None  # ours, until its round commits
        # a ranges round's contribution: (replica id, plan, parts in range order) until its round commits
        self.last_parts: tuple[str, RangePlan, list[Payload]] | None = None
        self.last_committed: list[str] = []  # replica ids committed in the last round
        self.last_clip: ClipStats = NO_CLIP  # what median clipping did in the last round
        self.last_dropped: list[str] = []  # replicas outlier screening dropped in the last round

    def committed(self, out: Outcome, link: Link) -> None:
        """A computed commit became our state: its bans, its link, its round's records."""
        self.bans = out.bans
        self.last_clip = out.committed.commit.clip
        self.last_dropped = list(out.dropped)
        self.last_committed = list(out.replicas)
        self.last_contribution = None
        self.last_parts = None
        self.link = link
        self.history[link.t] = link
        for old in [t for t in self.history if t <= link.t - max(HISTORY, self.keep)]:
            del self.history[old]

    def adopted(self, bans: Bans, link: Link | None) -> None:
        """A loaded state: its bans and link; the state committed from is unknown (majority checks only)."""
        self.bans = bans
        self.link = link
        self.last_committed = link.replicas if link is not None else []
        self.prev = None
        self.history = {} if link is None else {link.t: link}


def make_link(
    t: int,
    prev_state: str,
    out: Outcome,
    committed: Sequence[Contribution],
    embed_set: Sequence[Entry] | None,
) -> Link:
    """The link of commit `out` of round t from state `prev_state`: its set named by (replica id
    prefix, payload sha256 prefix) in commit order — each sha256 the one its contribution carries,
    never recomputed (positions stand in for the ids of anonymous contributions) — and stage 0's set
    `embed_set` the commit used."""
    replicas = out.replicas
    ids = list(replicas) if len(replicas) == len(committed) else [f"{i:016d}" for i in range(len(committed))]
    entries = tuple(entry(r, c.sha256) for r, c in zip(ids, committed, strict=True))
    return Link(t, prev_state, out.state, entries, None if embed_set is None else tuple(embed_set))
