"""Step 4 of a ranges round: one checked shard per range, whatever its owners did (docs/protocol.md, RANGES).

Per range r, from the owners' published hashes (`shards.{t}.{s}` records for our roster), as
`peer.node.round.ranges.ownership.range_step` decides:
- every owner published and all agree, or those that published agree `owner_grace_s` after we read the
  range's first hash or past the shard deadline (the others vanished or lag): take that hash, fetch the
  shard from them, each holder asking them in its own order (`_spread`), or hold it, as an owner;
- two owners disagree: fetch the range's parts and every claimed shard, recompute each from exactly
  the contributions it lists as included (`aggregate_range` is portable: an honest owner's shard is
  reproduced to the bit), refuse an owner whose shard is not that recomputation, and take the valid
  shard that includes the most contributions (then the smallest hash): the same pick on every
  holder that sees the same records; none valid: compute the range ourselves;
- no owner published by the shard deadline (all gone): compute the range ourselves from its parts.
A better-ranked roster seen meanwhile ends the resolution: the caller restarts with it.
A voted round (docs/protocol.md, VOTED) resolves its supports and its mean shards by the same steps:
`kind`, `fetch_one` and `aggregate` say which record, how it is fetched and how it is recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.ranges import RangePlan
from peer.core.sparseloco.ranges.owner import Shard, aggregate_range
from peer.core.sparseloco.ranges.voted_range import Support
from peer.errors import NetworkError
from peer.net.dht import RoundKind, SwarmDHT
from peer.net.range_records import Roster, ShardsRecord
from peer.node.round.ranges.fetch import MAX_FETCHERS, RangeFetcher, wait_until
from peer.node.round.ranges.ownership import RangeStep, owners, range_step
from peer.node.round.ranges.shard import RangeShard, made
from peer.node.round.refusals import Refusals

log = logging.getLogger(__name__)


def _count(shard: Shard | Support) -> int:
    return sum(shard.is_included(i) for i in range(shard.n_roster))


Aggregate = Callable[[Roster, int, Sequence[Any]], RangeShard]  # range r of the roster from its parts, made
FetchOne = Callable[[Roster, int, str, Sequence[str]], RangeShard | None]  # range r's record by its sha256


class Resolver:
    """Resolves every range of one roster to a checked shard (module docstring)."""

    def __init__(
        self,
        dht: SwarmDHT,
        fetcher: RangeFetcher,
        t: int,
        stage: int,
        plan: RangePlan,
        cfg: SparseLoCoConfig,
        refusals: Refusals | None,
    ) -> None:
        self.dht, self.fetcher, self.t, self.stage, self.plan, self.cfg = dht, fetcher, t, stage, plan, cfg
        self.refusals = refusals
        self.shard_topk: int | None = None
        self.exact = False  # swarm.shard == "exact"
        self.backups = 1
        self.poll_s = 0.2
        # a range's silent owners are waited for this long after its first hash (0: to the shard deadline)
        self.owner_grace_s = 0.0
        self.wanted = list(range(plan.n))  # the ranges to resolve (an observer may want a few)
        # what a range's record is: a shard by `aggregate_range` (None), or a voted round's support or
        # mean shard (`peer.node.round.ranges.voted`): its DHT kind, how it is fetched and recomputed
        self.kind: RoundKind = "shards"
        self.fetch_one: FetchOne | None = None
        self.aggregate: Aggregate | None = None
        self.shards: dict[int, RangeShard] = {}  # the checked shard of each range resolved
        self.computed: list[int] = []
        self.refused: list[str] = []

    def run(
        self,
        roster: Roster,
        best_roster: Callable[[], Roster | None],
        stop: threading.Event | None,
        deadlines: tuple[float, float],
    ) -> Roster | None:
        """Resolve every range of `roster` by the hard deadline; a better-ranked roster if one appears."""
        shard_deadline, hard = deadlines
        senders = [e.sender for e in roster.entries]
        address = {e.sender: e.address for e in roster.entries}
        k = 1 + self.backups
        first: dict[int, float] = {}  # range -> when we first read a hash of it (its owners' grace runs from then)
        while not self._done():
            try:
                records = self.dht.get_round(self.kind, self.t, self.stage, ShardsRecord.parse)
            except NetworkError as exc:  # decide nothing on a failed read (no owner would look published)
                log.info("round %d stage %d: DHT read failed, polling again: %s", self.t, self.stage, exc)
                if time.monotonic() >= hard:
                    break
                wait_until(hard, stop, self.poll_s)
                continue
            better = best_roster()
            if better is not None and better.digest != roster.digest:
                log.warning("round %d stage %d: a better-ranked roster appeared; taking it", self.t, self.stage)
                return better
            now = time.monotonic()
            past = now >= shard_deadline
            takes: list[tuple[int, str, list[str]]] = []  # (range, sha256, owners' addresses): fetched at once
            for r in [r for r in self.wanted if r not in self.shards]:
                range_owners = [o for o in owners(self.t, self.stage, r, senders, k) if not self._refused(o)]
                claims = self._claims(records, roster, range_owners, r)
                if claims:
                    first.setdefault(r, now)
                waited = self.owner_grace_s > 0 and r in first and now >= first[r] + self.owner_grace_s
                step = range_step(claims, len(range_owners), past or waited)  # a refused owner is not waited for
                if step is RangeStep.TAKE:
                    (want,) = set(claims.values())
                    takes.append((r, want, [address[o] for o in self._spread(sorted(claims))]))
                elif step is RangeStep.CHECK:
                    self._arbitrate(roster, r, claims, address)
                elif step is RangeStep.COMPUTE:
                    log.warning(
                        "round %d stage %d: range %d has no live owner; computing it here", self.t, self.stage, r
                    )
                    self._compute(roster, r)
            self._take_all(roster, takes)
            if self._done() or time.monotonic() >= hard:
                break
            wait_until(hard, stop, self.poll_s)
        return None

    def _spread(self, publishers: Sequence[str]) -> list[str]:
        """The owners that published a range's hash, in the order we ask them: by sha256(us ‖ owner), so
        the holders of a round share each range's download between its owners instead of all asking the
        first."""
        me = self.fetcher.me
        return sorted(publishers, key=lambda o: hashlib.sha256(f"{me}|{o}".encode()).digest())

    def _take_all(self, roster: Roster, takes: Sequence[tuple[int, str, list[str]]]) -> None:
        """Fetch the agreed shards of `takes`, MAX_FETCHERS requests in flight (one range after another
        would cost a round trip each: R ≈ M of them), and take each one that arrives checked."""
        if not takes:
            return
        with ThreadPoolExecutor(max_workers=min(MAX_FETCHERS, len(takes))) as pool:
            fetched = list(pool.map(lambda x: self._fetch(roster, *x), takes))
        for (r, _, _), got in zip(takes, fetched, strict=True):
            if got is not None:
                self._take(r, got)

    def _fetch(self, roster: Roster, r: int, want: str, addresses: Sequence[str]) -> RangeShard | None:
        if self.fetch_one is not None:
            return self.fetch_one(roster, r, want, addresses)
        return self.fetcher.shard(roster, r, want, addresses)

    def _aggregate(self, roster: Roster, r: int, parts: Sequence[Any]) -> RangeShard:
        """Range r's record from these parts (None: left out), made here (hashed once)."""
        if self.aggregate is not None:
            return self.aggregate(roster, r, parts)
        shard, _ = aggregate_range(
            self.t, self.stage, r, self.plan, parts, roster.digest, self.cfg, self.shard_topk, exact=self.exact
        )
        return made(shard)

    def _done(self) -> bool:
        return all(r in self.shards for r in self.wanted)

    def _claims(
        self, records: Mapping[str, ShardsRecord], roster: Roster, range_owners: Sequence[str], r: int
    ) -> dict[str, str]:
        """{owner: the shard hash it published for range r of `roster`}."""
        out = {}
        for o in range_owners:
            rec = records.get(o)
            if rec is None or rec.roster != roster.digest:
                continue
            h = (rec.shards or {}).get(r)
            if h:
                out[o] = h
        return out

    def _refused(self, owner: str) -> bool:
        return owner in self.refused or (self.refusals is not None and owner in self.refusals)

    def _take(self, r: int, got: RangeShard) -> None:
        self.shards[r] = got
        self.fetcher.store.put_shard(self.t, self.stage, r, got.data)

    def _arbitrate(self, roster: Roster, r: int, claims: Mapping[str, str], address: Mapping[str, str]) -> None:
        """Owners disagree on range r: check each claimed shard by recomputation (module docstring)."""
        log.warning(
            "round %d stage %d: owners of range %d disagree (%s); checking their shards",
            self.t,
            self.stage,
            r,
            ", ".join(f"{o[:12]}={h[:8]}" for o, h in sorted(claims.items())),
        )
        parts = self.fetcher.parts(roster, [r], kind="verify")[r]
        valid: dict[str, RangeShard] = {}
        for o, h in sorted(claims.items()):
            got = self._fetch(roster, r, h, [address[o]])
            if got is None:
                continue  # not served: cannot be checked, nor taken
            shard = got.shard
            masked = [p if shard.is_included(i) else None for i, p in enumerate(parts)]
            if any(shard.is_included(i) and p is None for i, p in enumerate(parts)):
                continue  # it includes a part we could not fetch: not checkable here
            if self._aggregate(roster, r, masked).data == got.data:
                valid[h] = got
            else:
                self._refuse(o, r)
        if valid:
            pick = min(valid, key=lambda h: (-_count(valid[h].shard), h))
            self._take(r, valid[pick])
        else:
            self._compute(roster, r, parts)

    def _refuse(self, owner: str, r: int) -> None:
        self.refused.append(owner)
        reason = f"its shard of range {r} is not the aggregate of the parts it names"
        if self.refusals is not None:
            self.refusals.refuse(owner, self.stage, self.t, reason)
        else:
            log.warning("round %d stage %d: %s: %s", self.t, self.stage, owner[:12], reason)

    def _compute(self, roster: Roster, r: int, parts: Sequence[Any] | None = None) -> None:
        """Compute range r here, from every part of it we can fetch (its owners are gone or failed)."""
        if parts is None:
            parts = self.fetcher.parts(roster, [r], kind="verify")[r]
        self._take(r, self._aggregate(roster, r, parts))
        self.computed.append(r)
        log.info("round %d stage %d: computed range %d here (%s)", self.t, self.stage, r, self.shards[r].sha256[:8])
