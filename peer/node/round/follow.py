"""FOLLOW: taking exactly the set another holder committed for round (t, s) (docs/protocol.md).

A gather (`peer.node.round.gather`) that sees a claim of round t committed from our own state holds
exactly that claim's set: what it holds already is kept, every missing entry is fetched by
content and proven genuine against its signed announcement (`peer.node.round.verify.SetFetcher`), now
and then (`FOLLOW_FETCH_S`); a set naming payloads no replica announced gets its claimer refused.
`Follow.expired` tells the gather when to give up on that claim (the grace).

Speed wins nothing (docs/protocol.md, "FOLLOW"): a claim is followed only when its set leaves out no
payload this holder could still commit — every bound announcement of the round that the set does
not name must be one we tried and rejected (`Omission.unchecked` empty, nothing `validated` left
out). A set that leaves out a payload we validated is a worse claim than the one we will close
(the canonical order prefers more payloads): we go on gathering, and after the round the larger
set wins the RECONCILE. When such a claim also proves its holder a censor: `peer.node.round.censors`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from peer.net.records import StageRecord
from peer.node.round.bans import PREFIX
from peer.node.round.claims import Claim
from peer.node.round.contribution import Contribution, Reading
from peer.node.round.refusals import Refusals
from peer.node.round.verify import SetFetcher

FOLLOW_FETCH_S = 1.0  # between two tries at fetching a followed set's missing payloads


@dataclass(frozen=True)
class Omission:
    """What a claimed set leaves out of the round as this holder sees it (replica ids)."""

    validated: frozenset[str] = frozenset()  # payloads we hold (fetched and checked, or our own)
    unchecked: frozenset[str] = frozenset()  # bound announcements we have not fetched or rejected yet

    @property
    def followable(self) -> bool:
        return not self.validated and not self.unchecked


def omission(
    claim: Claim,
    bound: Collection[str],
    held: Collection[str],
    rejected: Collection[str],
    given_up: Collection[str] = (),
) -> Omission:
    """The payloads of round (t, s) that `claim`'s set leaves out: `bound` are the replicas whose
    announcement is bound and fresh (not banned), `held` the replicas whose payload we hold,
    `rejected` those whose payload we tried and rejected (malformed, or gone with its sender),
    `given_up` those an honest holder may have dropped, left out freely (an observer's: payloads
    whose sender lapsed, `peer.node.round.gather`'s `_targets`)."""
    assert claim.link is not None
    named = set(claim.link.replicas)
    gone = set(rejected) | set(given_up)
    kept = set(held) - set(given_up)
    out = {r for r in set(bound) | kept if r[:PREFIX] not in named}
    return Omission(frozenset(out & kept), frozenset(out - kept - gone))


@dataclass
class Held:
    """The contributions one gather holds, by replica id (each hashed and parsed where it arrived)."""

    data: dict[str, Contribution] = field(default_factory=dict)

    def by_digest(self) -> dict[str, Contribution]:
        return {c.sha256: c for c in self.data.values()}


class Follow:
    """Taking another holder's committed set of the round (see the module docstring)."""

    def __init__(self, fetcher: SetFetcher, refusals: Refusals | None, t: int, stage: int, n_stages: int) -> None:
        self.fetcher, self.refusals, self.t, self.stage, self.n_stages = fetcher, refusals, t, stage, n_stages
        self.since: float | None = None
        self.tried_at = 0.0

    def take(self, claim: Claim, held: Held, holders: Mapping[str, StageRecord], parse: Reading) -> bool:
        """Hold exactly `claim`'s set (fetching what is missing, now and then); True once held."""
        assert claim.link is not None
        self.since = time.monotonic() if self.since is None else self.since
        digests = {c.sha256: rid for rid, c in held.data.items()}
        have: dict[str, str] = {}  # entry's replica prefix -> our replica id
        missing = []
        for rid16, sha in claim.link.entries:
            rid = next((r for d, r in digests.items() if d.startswith(sha) and r[:16] == rid16), None)
            if rid is None:
                missing.append((rid16, sha))
            else:
                have[rid16] = rid
        if missing and time.monotonic() - self.tried_at >= FOLLOW_FETCH_S:
            self.tried_at = time.monotonic()
            holder = holders.get(claim.peer)
            address = holder.address if holder is not None and holder.address else None
            got = self.fetcher.fetch(
                self.t,
                self.stage,
                missing,
                parse,
                held.by_digest(),
                address,
                self.n_stages,
            )
            if got.forged and self.refusals is not None:
                names = ", ".join(r[:12] for r, _ in got.forged)
                self.refusals.refuse(
                    claim.peer, self.stage, self.t, f"its committed set names payloads no replica announced ({names})"
                )
            for item, got_one in got.payloads.items():
                held.data[got_one.replica] = got_one
                have[item[0]] = got_one.replica
            missing = [e for e in missing if e[0] not in have]
        if missing:
            return False
        keep = set(have.values())
        held.data = {r: c for r, c in held.data.items() if r in keep}
        return True

    def expired(self, grace_s: float) -> bool:
        return self.since is not None and time.monotonic() - self.since >= grace_s
