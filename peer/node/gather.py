"""Gathering one round (t, s): announce our payload, fetch the others', decide when the set is closed.

Round (t, s) — DESIGN §3, docs/protocol.md. A contributor keeps its encoded payload in its
`PayloadStore` (served by gRPC `get_payload`) and announces {sha256, size, address, replica, inc,
closes} under `round.{t}.{s}` (a head adds "peers", the stage peers that did its last inner step:
the round's binding); then it polls the DHT, fetching each bound announcement's payload once and
checking its sha256 and format, until the set is closed:
- every expected replica's payload is held, rejected or dropped, and neither the lone guard, the
  observer rule, the start-up quorum, the settle after a lost payload nor the deadline fence holds
  it open (`peer.node.agreement`);
- or another holder has committed round t FROM OUR STATE (its claim's `prev` is our state id:
  `peer.node.claims.followable`; an observer of a stage it does not hold takes the set most of
  that stage's holders committed: `observed`): we take exactly its set, every entry fetched by
  content and proven genuine (`peer.node.verify`) — a set naming payloads no replica announced
  gets its claimer refused — or, when it cannot be fetched within the grace, re-sync (`behind`);
- or the swarm's clock is two rounds past us (`peer.node.claims.closed_elsewhere`): the others
  closed round t a round ago, so we re-sync (`behind`) and never commit a set of our own;
- or the deadline passes.
A close is decided only on a view whose read began moments before (`FRESH_S`): a process frozen
mid-round (a stopped peer, a stalled machine) — even inside a DHT read, whose answer its DHT child
took before the freeze — wakes to a fresh read and follows what the others committed meanwhile, or
re-syncs, never a set decided on what it read before the freeze.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from peer.core.sparseloco import Payload
from peer.errors import NetworkError, PeerError
from peer.net.dht import SwarmDHT, dht_time
from peer.net.pool import ClientPool
from peer.net.transport.errors import NotFoundError
from peer.net.transport.messages import PayloadRequest
from peer.node.agreement import IGNORED, RoundView, fenced_by, round_view, sender_alive
from peer.node.claims import Claim, closed_elsewhere, followable, observed, parse_claims, swarm_clock
from peer.node.refusals import Refusals
from peer.node.round_payloads import SETTLE_S, PayloadStore, from_another_holder, poll_pause, read_round, sha256
from peer.node.verify import SetFetcher

log = logging.getLogger(__name__)

FRESH_S = 1.0  # a set is closed only on a DHT read begun at most this long ago (a frozen process re-reads)
MAX_SLOW_READS = 3  # reads in a row that each took longer than FRESH_S: the DHT is slow, not we frozen
FOLLOW_FETCH_S = 1.0  # between two tries at fetching a followed set's missing payloads


@dataclass
class RoundResult:
    """What one peer committed for round (t, s), in commit order, and why it stopped waiting."""

    t: int
    stage: int
    replicas: list[str] = field(default_factory=list)  # replica ids, commit order
    payloads: list[bytes] = field(default_factory=list)
    parsed: list[Payload] = field(default_factory=list)  # the payloads, parsed once (same order)
    expected: int = 0
    rejected: list[str] = field(default_factory=list)  # replica ids whose payload failed its checks
    dropped: list[str] = field(default_factory=list)  # replicas out of the round for everyone
    timed_out: bool = False
    behind: bool = False  # the round was committed elsewhere and cannot be reproduced here: re-sync
    followed: Claim | None = None  # the claim whose set we took (its state is checked after our commit)
    wall_s: float = 0.0
    bytes_fetched: int = 0

    @property
    def participants(self) -> int:
        return len(self.replicas)


@dataclass
class _Held:
    """The payloads one gather holds, by replica id."""

    data: dict[str, bytes] = field(default_factory=dict)
    parsed: dict[str, Payload] = field(default_factory=dict)

    def by_digest(self) -> dict[str, bytes]:
        return {sha256(b): b for b in self.data.values()}


class _Follow:
    """Taking another holder's committed set of the round (see the module docstring)."""

    def __init__(self, fetcher: SetFetcher, refusals: Refusals | None, t: int, stage: int, n_stages: int) -> None:
        self.fetcher, self.refusals, self.t, self.stage, self.n_stages = fetcher, refusals, t, stage, n_stages
        self.since: float | None = None
        self.tried_at = 0.0

    def take(self, claim: Claim, held: _Held, holders: Mapping[str, Any], parse: Callable[[bytes], Payload]) -> bool:
        """Hold exactly `claim`'s set (fetching what is missing, now and then); True once held."""
        assert claim.link is not None
        self.since = time.monotonic() if self.since is None else self.since
        digests = {sha256(b): rid for rid, b in held.data.items()}
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
            address = holders.get(claim.peer, {}).get("address")
            got = self.fetcher.fetch(
                self.t,
                self.stage,
                missing,
                parse,
                held.by_digest(),
                address if isinstance(address, str) else None,
                self.n_stages,
            )
            if got.forged and self.refusals is not None:
                names = ", ".join(r[:12] for r, _ in got.forged)
                self.refusals.refuse(
                    claim.peer, self.stage, self.t, f"its committed set names payloads no replica announced ({names})"
                )
            for item, (data, payload) in got.payloads.items():
                rid = got.replicas[item]
                held.data[rid], held.parsed[rid] = data, payload
                have[item[0]] = rid
            missing = [e for e in missing if e[0] not in have]
        if missing:
            return False
        keep = set(have.values())
        held.data = {r: b for r, b in held.data.items() if r in keep}
        held.parsed = {r: p for r, p in held.parsed.items() if r in keep}
        return True

    def expired(self, grace_s: float) -> bool:
        return self.since is not None and time.monotonic() - self.since >= grace_s


def gather_round(
    dht: SwarmDHT,
    clients: ClientPool,
    t: int,
    stage: int,
    timeout_s: float,
    own: tuple[str, bytes] | None = None,
    store: PayloadStore | None = None,
    address: str = "",
    validate: Callable[[bytes], Payload] | None = None,
    poll_s: float = 0.2,
    ttl_s: float = 60.0,
    stop: threading.Event | None = None,
    inc: str = "",
    extra: Mapping[str, Any] | None = None,
    grace_s: float = 5.0,
    quorum: int = 1,
    n_stages: int = 1,
    banned: Collection[str] = frozenset(),
    prev: str | None = None,
    refusals: Refusals | None = None,
) -> RoundResult:
    """Contribute `own` = (replica id, payload bytes) if given, then collect the round's payloads.

    `validate(payload)` parses a payload and raises PeerError for a malformed one (it is then
    skipped, and its replica no longer waited for); without it payloads are parsed as they are.
    Every payload is parsed exactly once (`RoundResult.parsed`). When the set is closed: see the
    module docstring. `prev` is the id of our state at outer step t (a holder of the stage; None
    for an observer of a stage it does not hold): the claims we may follow start from it.
    `refusals`: holders whose claims are ignored (and where a forged set's claimer goes). `inc` is
    this process's incarnation and `extra` adds fields to our announcement (a head's "peers").
    `quorum` (the run's first round only: `swarm.min_replicas`) keeps the set open until that many
    payloads are held. A payload whose sender is gone is asked of the round's other contributors
    (for stage 0 also of the other `n_stages` − 1 stages' holders). `banned`: peer.node.bans.
    """
    parse = validate if validate is not None else Payload.from_bytes
    started = time.monotonic()
    deadline = started + timeout_s
    me = dht.peer_id
    held = _Held()
    bad: set[str] = set()  # senders whose payload failed its checks
    rejected: set[str] = set()  # the replicas they stood for
    logged: set[tuple[str, str]] = set()  # (sender, claimed replica) already logged
    retry_at: dict[str, float] = {}  # unreachable senders are retried with backoff, not every poll
    lost_at: float | None = None  # when a sender's payload was last given up as gone
    seen: set[str] = set()  # other holders of the stage seen gathering this round
    rpc_s = min(grace_s, 3.0)  # one try at a second source
    result = RoundResult(t=t, stage=stage)
    follow = _Follow(SetFetcher(dht, clients, store or PayloadStore(), me, rpc_s), refusals, t, stage, n_stages)
    if own is not None and own[0][:16] in banned:  # a repeated outlier: not fetched by anyone
        log.warning("round %d stage %d: replica %s is banned as a repeated outlier; observing", t, stage, own[0][:12])
        own = None
    own_rid = own[0] if own is not None else None
    my_closes: float | None = None
    if own is not None:
        my_closes = _announce(dht, t, stage, own, store, address, inc, extra, timeout_s, ttl_s)
        held.data[own[0]], held.parsed[own[0]] = own[1], Payload.from_bytes(own[1])
    view = RoundView()
    slow_reads = 0  # DHT reads in a row that took longer than FRESH_S themselves
    while True:
        read_at = time.monotonic()  # a read's age counts from its start: one begun before a freeze is stale
        try:
            replicas, holders, payloads, stage0 = read_round(dht, t, stage)
        except NetworkError as exc:  # a DHT read that failed once is a missed poll, until the deadline
            if time.monotonic() >= deadline:
                raise
            log.info("round %d stage %d: DHT read failed, polling again: %s", t, stage, exc)
            poll_pause(stop, poll_s)
            continue
        # a read that took longer than FRESH_S (the process froze while its DHT child answered, and
        # records it read then look expired now) is read again; a DHT that is this slow every time
        # is believed after MAX_SLOW_READS reads in a row, so the gather cannot spin
        slow_reads = slow_reads + 1 if time.monotonic() - read_at > FRESH_S else 0
        left = {pid for pid, rec in holders.items() if rec.get("state") == "left"}  # graceful leaves
        holders = {pid: rec for pid, rec in holders.items() if pid not in left}
        view = round_view(t, stage, payloads, stage0, replicas, holders, me, inc, banned)
        # waited for: seen gathering and now gone (maybe frozen), still gathering, or past t (follow its
        # commit); not one whose live records, at most at t, say it will not send t (restarted, spare)
        seen = view.gathering | {p for p in seen if holders.get(p, {}).get("outer_step", t + 1) > t}
        if own is None and (stage == 0 or replicas.get(me, {}).get("kind") == "full"):
            view.expected.discard(me)  # only we could send our replica's payload, and we observe
        _log_ignored(view, logged, t, stage)
        refused = refusals.peers() if refusals is not None else frozenset()
        claims = parse_claims(holders, me, refused)
        clock = swarm_clock({p: r for p, r in replicas.items() if p != me}, refused)
        if closed_elsewhere(clock, t):
            result.behind = True
            log.warning("round %d stage %d: the swarm is rounds ahead; re-syncing instead", t, stage)
            break
        for sender, (rid, rec) in sorted(view.bound.items()):
            if rid in held.data or sender in bad or retry_at.get(sender, 0.0) > time.monotonic():
                continue
            try:
                data = _fetch(dht, clients, t, stage, sender, rec, payloads, stage0, me, n_stages, deadline, rpc_s)
                if sha256(data) != rec.get("sha256"):
                    raise PeerError(f"payload from {sender} does not match its announced sha256")
                held.parsed[rid] = parse(data)
                if store is not None:
                    store.put_fetched(t, stage, sender, data)
            except NetworkError as exc:
                if not sender_alive(sender, holders, replicas):  # it died after announcing: out for us
                    if rid not in rejected:  # unless a holder that fetched it serves it later (retried)
                        log.warning(
                            "round %d stage %d: dropping %s: it left and its payload is gone", t, stage, rid[:12]
                        )
                        lost_at = time.monotonic()
                    rejected.add(rid)
                    retry_at[sender] = time.monotonic() + 1.0
                    continue
                retry_at[sender] = time.monotonic() + 2.0
                log.info("round %d stage %d: payload of %s not reachable yet: %s", t, stage, sender[:12], exc)
                continue
            except PeerError as exc:
                log.warning("round %d stage %d: rejecting payload of %s: %s", t, stage, sender[:12], exc)
                bad.add(sender)
                rejected.add(rid)
                continue
            held.data[rid] = data
            result.bytes_fetched += len(data)
        result.expected = len(view.expected)
        # decide on a view read moments ago, never an old one
        fresh = time.monotonic() - read_at <= FRESH_S or slow_reads >= MAX_SLOW_READS
        targets = followable(claims.values(), t, prev) if prev is not None else observed(claims.values(), t)
        targets = [c for c in targets if refusals is None or c.peer not in refusals]
        # an earlier closer at (or past) its deadline may commit without our payload: its commit
        # decides (→ FOLLOW), waited for until its deadline + the grace, even past ours
        fenced = fenced_by(view, me, my_closes, dht_time(), grace_s) if not targets else set()
        if targets:  # round t is committed elsewhere, from our state: take exactly that set
            result.followed = targets[0]
            if follow.take(targets[0], held, holders, parse):
                break
            if follow.expired(grace_s):
                result.behind = True
                log.warning("round %d stage %d: cannot fetch the committed set; re-syncing instead", t, stage)
                break
        else:
            follow.since, result.followed = None, None
            # a holder seen gathering this round whose records then expired may only be frozen (a
            # stopped process, a stalled link): a payload of ours alone waits for it until the deadline
            seen_gathering = bool(seen - left)  # a holder that left gracefully is not waited for
            lone = set(held.data) == {own_rid} and seen_gathering
            # an observer (no payload of its own) never decides a set while a contributor is around:
            # it follows the first commit (a frozen contributor's expired records cannot mislead it)
            follower = own is None and seen_gathering
            short = t == 0 and quorum > 1 and len(held.data) < quorum  # start-up: peers still appearing
            # a payload we lost (its sender left) may be held by a holder that already committed it:
            # let its commit reach the DHT before closing without it (→ FOLLOW), bounded by the grace
            settling = lost_at is not None and time.monotonic() - lost_at < min(grace_s, SETTLE_S)
            closed = view.expected <= set(held.data) | rejected | view.dropped
            if closed and fresh and not (lone or follower or short or settling or fenced):
                break
        if time.monotonic() >= deadline and not fenced:
            if not fresh:
                continue  # woke past the deadline (a freeze?): read the round again before closing it
            result.timed_out = True
            log.warning(
                "round %d stage %d: deadline after %.0fs with %d/%d payloads (missing: %s)",
                t,
                stage,
                timeout_s,
                len(held.data),
                len(view.expected),
                ", ".join(sorted(view.expected - set(held.data) - rejected))[:200],
            )
            break
        if fresh:
            poll_pause(stop, poll_s)
    result.rejected = sorted(rejected - set(held.data))
    result.dropped = sorted(view.dropped - set(held.data))
    result.replicas = sorted(held.data)
    result.payloads = [held.data[r] for r in result.replicas]
    result.parsed = [held.parsed[r] for r in result.replicas]
    result.wall_s = time.monotonic() - started
    return result


def _announce(
    dht: SwarmDHT,
    t: int,
    stage: int,
    own: tuple[str, bytes],
    store: PayloadStore | None,
    address: str,
    inc: str,
    extra: Mapping[str, Any] | None,
    timeout_s: float,
    ttl_s: float,
) -> float:
    """Serve and announce our payload of (t, stage); returns when we close the round at the latest
    (DHT time: the deadline fence, `peer.node.agreement.fenced_by`)."""
    replica_id, payload = own
    if store is None:
        raise ValueError("a contributor needs a PayloadStore to serve its payload")
    store.put(t, stage, payload)
    closes = dht_time() + timeout_s
    record = {"sha256": sha256(payload), "size": len(payload), "address": address, "replica": replica_id}
    record.update({"inc": inc, "closes": round(closes, 3), **(extra or {})})
    dht.announce_payload(t, stage, record, ttl_s=ttl_s)
    return closes


def _fetch(
    dht: SwarmDHT,
    clients: ClientPool,
    t: int,
    stage: int,
    sender: str,
    rec: Mapping[str, Any],
    payloads: Mapping[str, Any],
    stage0: Mapping[str, Any],
    me: str,
    n_stages: int,
    deadline: float,
    rpc_s: float,
) -> bytes:
    """A bound announcement's payload: from its sender, else from another holder of the round that
    fetched it (the announced sha256 is checked by the caller). NetworkError when nobody serves it."""
    if not isinstance(rec.get("address"), str) or not rec["address"]:
        raise PeerError(f"the announcement of {sender} has no address")
    remaining = max(0.5, deadline - time.monotonic())
    try:
        return clients.get(rec["address"]).get_payload(PayloadRequest(t, stage, sender), timeout_s=remaining)
    except (NetworkError, NotFoundError):  # the sender is gone, or restarted without it:
        others = {**payloads, **stage0}
        for x in range(1, n_stages) if stage == 0 else ():  # observers of stage 0 fetched it too
            others.update(dht.get_payloads(t, x))
        second = from_another_holder(clients, t, stage, sender, rec, others, me, rpc_s)
        if second is None:
            raise
        return second


def _log_ignored(view: RoundView, logged: set[tuple[str, str]], t: int, stage: int) -> None:
    for sender, rid, why in view.ignored:
        if (sender, rid) not in logged and len(logged) < 16:  # bounded log
            logged.add((sender, rid))
            log.warning(
                "round %d stage %d: ignoring the announcement of %s for replica %s: %s",
                t,
                stage,
                sender[:12],
                rid[:12],
                IGNORED[why].format(stage=stage),
            )
