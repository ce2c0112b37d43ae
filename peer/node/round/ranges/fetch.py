"""Fetching a ranges round's parts and shards, each checked before it is used (docs/protocol.md, RANGES).

A *part* (range r of one contribution) comes from its sender (or, when the sender is gone, from
another owner of r that fetched it) with its merkle path; it counts only if the path proves it
against the root the sender signed in its announcement (`peer.core.sparseloco.ranges.parts.merkle_check`)
and it parses as range r's band entries (`RangePlan.validator`). A *shard* comes from whoever
holds it and counts only if its sha256 is the one its owners published and its header names the
round, the range and the roster (taken as a `peer.node.round.ranges.shard.RangeShard`: hashed
and parsed here, once). So a part or a shard may be served by anyone: the check, not the
server, makes it genuine.

`RangeBytes` counts what one holder fetched, by kind (parts, their proofs, shards, the roster,
parts fetched to check a disagreement or to compute a range whose owners are gone), so the round's
per-peer traffic is measured, not modelled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.ranges import RangePlan, merkle_check
from peer.core.sparseloco.ranges.owner import Shard
from peer.errors import PeerError
from peer.net.pool import ClientPool
from peer.net.range_records import Roster, RosterEntry
from peer.net.transport.messages import PayloadKind, PayloadRequest
from peer.node.round.payloads import PayloadStore, sha256
from peer.node.round.ranges.ownership import owners
from peer.node.round.ranges.shard import RangeShard

log = logging.getLogger(__name__)

MAX_FETCHERS = 64  # requests of one holder in flight (`peer bench swarm --fetch-parallel`: docs/scaling.md)


@dataclass
class RangeBytes:
    """Bytes one holder fetched in a ranges round, by kind (thread-safe counters)."""

    parts: int = 0  # parts of the ranges it owns
    proofs: int = 0  # their merkle paths
    shards: int = 0
    roster: int = 0  # the roster record it took
    verify: int = 0  # parts (with proofs) fetched to check a disagreement or compute an orphaned range
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, kind: str, n: int) -> None:
        with self._lock:
            setattr(self, kind, getattr(self, kind) + n)

    @property
    def total(self) -> int:
        return self.parts + self.proofs + self.shards + self.roster + self.verify


class RangeFetcher:
    """Parts and shards of round (t, stage), checked, counted in `counts` (module docstring)."""

    def __init__(
        self,
        clients: ClientPool,
        store: PayloadStore,
        me: str,
        t: int,
        stage: int,
        plan: RangePlan,
        cfg: SparseLoCoConfig,
        rpc_s: float,
        counts: RangeBytes,
        backups: int,
    ) -> None:
        self.clients, self.store, self.me, self.t, self.stage = clients, store, me, t, stage
        self.plan, self.cfg, self.rpc_s, self.counts, self.backups = plan, cfg, rpc_s, counts, backups
        self.cache: dict[tuple[str, int], tuple[str, Any]] = {}  # (sender, r) -> (root, part) checked
        self.shard_topk: int | None = None  # as the owners' aggregate_range
        self.exact = False  # swarm.shard == "exact"
        # what a part is and where it lives: a ranges round's Payload parts under (t, stage); a voted
        # round's vote parts, and its values parts under `values_stage(stage)` (`peer.node.round.ranges.voted`)
        self.wire_stage = stage  # the stage key of the parts in the store and in requests
        self.parse_part: Callable[[int, bytes], Any] = lambda r, data: plan.validator(r, cfg)(data)

    def parts(self, roster: Roster, ranges: Sequence[int], kind: str = "parts") -> dict[int, list[Any]]:
        """{r: [part of roster member i, or None when nobody served a proven one]} for each of `ranges`
        (parts already held are not fetched again); `kind` is the counter the bytes go to."""
        ranges = sorted(set(ranges))
        out: dict[int, list[Any]] = {r: [None] * len(roster.entries) for r in ranges}
        if not ranges:
            return out

        def member(i: int) -> None:
            for r, part in self._member(roster, roster.entries[i], ranges, kind).items():
                out[r][i] = part

        with ThreadPoolExecutor(max_workers=min(MAX_FETCHERS, len(roster.entries))) as pool:
            list(pool.map(member, self.order(roster)))
        return out

    def order(self, roster: Roster) -> list[int]:
        """Roster positions in the order we ask them: starting after our own, so the owners of a round,
        which all start when the roster is out, spread their first requests over every member instead of
        queueing on the roster's first `MAX_FETCHERS` (`peer bench swarm`: docs/scaling.md)."""
        n = len(roster.entries)
        mine = next((i for i, e in enumerate(roster.entries) if e.sender == self.me), -1)
        return [(mine + 1 + j) % n for j in range(n)]

    def _member(self, roster: Roster, entry: RosterEntry, ranges: Sequence[int], kind: str) -> dict[int, Any]:
        """One member's parts of `ranges`: held, ours, from its sender, else from another owner."""
        got: dict[int, Any] = {}
        if not entry.root:
            return got  # nothing committed to (a voted round's sender without values): nothing to prove
        for r in ranges:
            cached = self.cache.get((entry.sender, r))
            if cached is not None and cached[0] == entry.root:
                got[r] = cached[1]
        want = [r for r in ranges if r not in got]
        if want and entry.sender == self.me:
            for r, data, proof in self.store.parts(self.t, self.wire_stage, None, want):
                self._accept(entry, r, data, proof, got)
            return got
        sources = [entry.address] + self._second_sources(roster, entry, want)
        for address in dict.fromkeys(a for a in sources if a):
            want = [r for r in want if r not in got]
            if not want:
                break
            request = PayloadRequest(self.t, self.wire_stage, entry.sender, PayloadKind.PART, tuple(want))
            try:
                reply = self.clients.get(address).get_ranges(request, timeout_s=self.rpc_s)
            except PeerError as exc:  # unreachable, or it does not hold them: the next source
                log.info(
                    "round %d stage %d: parts of %s not served by %s: %s",
                    self.t,
                    self.stage,
                    entry.sender[:12],
                    address,
                    exc,
                )
                continue
            for item in reply.items:
                if item.range in want and item.range not in got:
                    self.counts.add(kind, len(item.data))
                    self.counts.add("proofs" if kind == "parts" else kind, 16 * len(item.proof))
                    self._accept(entry, item.range, item.data, item.proof, got)
        return got

    def _second_sources(self, roster: Roster, entry: RosterEntry, ranges: Sequence[int]) -> list[str]:
        """Addresses of the other owners of `ranges` (they fetched the parts; a proof makes any source good)."""
        senders = [e.sender for e in roster.entries]
        by_sender = {e.sender: e.address for e in roster.entries}
        out = []
        for r in ranges:
            for o in owners(self.t, self.stage, r, senders, 1 + self.backups):
                if o not in (self.me, entry.sender):
                    out.append(by_sender[o])
        return out

    def _accept(self, entry: RosterEntry, r: int, data: bytes, proof: Sequence[bytes], got: dict[int, Any]) -> None:
        """Keep `entry`'s part of range r if its merkle path proves it against the signed root and it
        parses as range r's bands; else log (a wrong part from anyone only costs that try)."""
        if not merkle_check(entry.root, r, self.plan.n, data, [h.hex() for h in proof]):
            log.warning(
                "round %d stage %d: part %d of %s fails its merkle proof; ignored",
                self.t,
                self.stage,
                r,
                entry.sender[:12],
            )
            return
        try:
            part = self.parse_part(r, data)
        except PeerError as exc:
            log.warning(
                "round %d stage %d: part %d of %s is invalid: %s", self.t, self.stage, r, entry.sender[:12], exc
            )
            return
        got[r] = part
        self.cache[(entry.sender, r)] = (entry.root, part)
        if entry.sender != self.me:
            self.store.put_part(self.t, self.wire_stage, entry.sender, r, data, proof)

    def shard(
        self,
        roster: Roster,
        r: int,
        want: str,
        addresses: Sequence[str],
        parse: Callable[[Roster, int, bytes], Any] | None = None,
    ) -> RangeShard | None:
        """The shard of range r whose sha256 is `want`: held here (stored under it), else from
        `addresses` in turn; checked (hash, format, header: round, range, roster), hashed and parsed
        once here (`parse`: another record served by hash, a voted round's support). None when nobody served it."""
        parse = parse or self._parse_shard
        held = self.store.shards(self.t, self.stage, [r], want)
        if held:
            return RangeShard(want, held[0][1], parse(roster, r, held[0][1]))
        request = PayloadRequest(self.t, self.stage, want, PayloadKind.SHARD, (r,))
        for address in dict.fromkeys(a for a in addresses if a):
            try:
                reply = self.clients.get(address).get_ranges(request, timeout_s=self.rpc_s)
            except PeerError as exc:
                log.info("round %d stage %d: shard %d not served by %s: %s", self.t, self.stage, r, address, exc)
                continue
            for item in reply.items:
                if item.range != r:
                    continue
                self.counts.add("shards", len(item.data))
                if sha256(item.data) != want:
                    log.warning(
                        "round %d stage %d: shard %d from %s is not the one published", self.t, self.stage, r, address
                    )
                    continue
                try:
                    shard = parse(roster, r, item.data)
                except PeerError as exc:
                    log.warning(
                        "round %d stage %d: shard %d from %s is invalid: %s", self.t, self.stage, r, address, exc
                    )
                    continue
                self.store.put_shard(self.t, self.stage, r, item.data)
                return RangeShard(want, item.data, shard)
        return None

    def _parse_shard(self, roster: Roster, r: int, data: bytes) -> Shard:
        shard = Shard.from_bytes(data, self.plan, self.cfg, len(roster.entries), self.shard_topk, exact=self.exact)
        if (shard.t, shard.stage, shard.r, shard.roster) != (self.t, self.stage, r, roster.digest):
            raise PeerError(f"its header names round {shard.t} stage {shard.stage} range {shard.r} of another roster")
        return shard


def wait_until(deadline: float, stop: threading.Event | None, poll_s: float) -> None:
    """One poll pause, never past `deadline`; PeerError once `stop` is set."""
    pause = max(0.0, min(poll_s, deadline - time.monotonic()))
    if stop is not None and stop.wait(pause):
        raise PeerError("stopped while waiting for a round")
    if stop is None:
        time.sleep(pause)
