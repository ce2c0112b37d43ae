"""Checking a claimed committed set: its payloads, found by content and proven genuine.

A claim names each payload of its set as (replica id prefix, sha256 prefix) (`peer.node.round.claims`).
An entry is
- GENUINE when a signed announcement of round (t, s) in the DHT carries that replica and a
  sha256 with that prefix, from a sender bound to the replica: the replica itself, or the stage
  peer that the head's own round-t announcement of stage 0 (or, before it, the head's replica
  record) names for s (the binding rule of docs/protocol.md);
- FORGED when no announcement of that replica exists for the round while the round's announcements
  are visible (the claimer made the replica up: a padded set), or when the replica's announcements
  are visible and none carries that sha256 (a payload the replica never announced for this round:
  an old round's set relabelled, a made-up payload in a real replica's name). A sender announces
  one payload per round, once (`peer.node.round.payloads.first_payload`: a holder that redoes a
  round sends its first payload again, a restarted one observes a round its killed process
  announced), so an honest claim never names a sha256 its replica's announcements lack;
- UNKNOWN otherwise (the round's records expired, the binding changed): the claim cannot be
  checked now, and is neither adopted nor held against its claimer.
A genuine entry's bytes may come from anyone — our own store, the sender, the claimer, another
holder — because the announced sha256 is checked whoever serves them (`SetFetcher`, through the one
fetcher `peer.node.round.fetcher.Fetcher`).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from peer.config import RunConfig, history_ttl_s
from peer.errors import NetworkError, PeerError
from peer.net.dht import dht_time
from peer.net.pool import ClientPool
from peer.net.records import Announcement
from peer.node.round.agreement import Announcements, Replicas, bound_to
from peer.node.round.bans import PREFIX
from peer.node.round.claims import Entry
from peer.node.round.contribution import Contribution, Reading, ViewReader
from peer.node.round.fetcher import Fetcher, Unreadable
from peer.node.round.payloads import PayloadStore

log = logging.getLogger(__name__)


class Verdict(enum.Enum):
    GENUINE = "genuine"
    FORGED = "forged"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Resolved:
    """One entry of a set, read against the round's announcements."""

    verdict: Verdict
    sender: str = ""
    record: Announcement = Announcement()


def alive(announcements: Announcements, now: float, ttl_s: float | None) -> bool:
    """Whether every announcement of a round is still in the DHT, judged by the oldest one visible
    (`now`: DHT time; `ttl_s`: their lifetime, `peer.config.history_ttl_s`; None: not judged, True).
    A round's honest announcements are all made within its deadline and grace, far less than half
    their lifetime, so while the oldest visible one is younger than half of it none can have expired.
    Past that an entry missing from a read may only have expired first: not proof of a forgery (a
    joiner replaying the oldest rounds of the history window reads them as they expire one by one)."""
    if ttl_s is None:
        return True
    stamps = [a.time for a in announcements.values() if a.time]
    return not stamps or now - min(stamps) < ttl_s / 2


def resolve(
    item: Entry,
    stage: int,
    announcements: Announcements,
    stage0: Announcements,
    replicas: Replicas,
    complete: bool = True,
) -> Resolved:
    """The verdict on one entry of a set of round (t, `stage`) (module docstring); `announcements`
    are the round's, `stage0` those of (t, 0) (the heads' bindings), `replicas` the replica records.
    `complete`: every announcement of the round can still be read (`alive`); else nothing is FORGED."""
    rid, sha = item
    same_sha = False
    for sender, ann in sorted(announcements.items()):
        full = ann.replica_of(sender)
        if full[:PREFIX] != rid:
            continue
        if ann.sha256.startswith(sha):
            same_sha = True
            if bound_to(sender, full, stage, stage0, replicas):
                return Resolved(Verdict.GENUINE, sender, ann)
    if announcements and not same_sha and complete:  # the replica made up, or a payload it never announced
        return Resolved(Verdict.FORGED)
    return Resolved(Verdict.UNKNOWN)


@dataclass
class Fetched:
    """What `SetFetcher.fetch` found for a set: contributions by entry, and the entries it could not get."""

    payloads: dict[Entry, Contribution] = field(default_factory=dict)
    forged: list[Entry] = field(default_factory=list)
    missing: list[Entry] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.forged and not self.missing


class SetFetcher:
    """Fetches the payloads a claimed set names, each proven genuine by its announcement, through the
    one fetcher of a round's payloads (`peer.node.round.fetcher.Fetcher`)."""

    def __init__(
        self,
        dht: Any,
        clients: ClientPool,
        store: PayloadStore,
        me: str,
        rpc_timeout_s: float,
        holders: bool = False,
        ttl_s: float | None = None,
    ) -> None:
        """`holders`: as a last resort ask the stage's holders and attesters too (a replay of rounds
        whose contributors may all have left; a live round does not wait on them). `ttl_s`: the
        announcements' lifetime (`alive`: a round read as it expires proves no forgery)."""
        self.dht, self.clients, self.store, self.me = dht, clients, store, me
        self.rpc_timeout_s, self.holders, self.ttl_s = rpc_timeout_s, holders, ttl_s

    @classmethod
    def of_run(
        cls, cfg: RunConfig, dht: Any, clients: Any, store: PayloadStore, me: str, holders: bool = False
    ) -> SetFetcher:
        """A fetcher with the run's clocks: one try at a source takes at most 3 s (`swarm.rpc_timeout_s`
        if shorter), and the announcements live `peer.config.history_ttl_s`."""
        return cls(dht, clients, store, me, min(3.0, cfg.swarm.rpc_timeout_s), holders, history_ttl_s(cfg.swarm))

    def fetch(
        self,
        t: int,
        stage: int,
        entries: Sequence[Entry],
        parse: Reading,
        have: Mapping[str, Contribution] | None = None,
        claimer_address: str | None = None,
        n_stages: int = 1,
    ) -> Fetched:
        """The contributions of `entries` (round t, `stage`), read by `parse` (whole, or as views): from
        `have` (id → what we hold; a view only when views are read), else
        `Fetcher.fetch` (our store, the sender, the claimer at `claimer_address`, any holder of the
        round). Raises NetworkError when the DHT cannot be read."""
        announcements = self.dht.get_payloads(t, stage)
        stage0 = announcements if stage == 0 else self.dht.get_payloads(t, 0)
        replicas = self.dht.get_replicas()
        fetcher = Fetcher(self.dht, self.clients, self.store, self.me, self.rpc_timeout_s, n_stages, self.holders)
        out = Fetched()
        complete = alive(announcements, dht_time(), self.ttl_s)
        for item in entries:
            found = resolve(item, stage, announcements, stage0, replicas, complete)
            if found.verdict is not Verdict.GENUINE:
                (out.forged if found.verdict is Verdict.FORGED else out.missing).append(item)
                continue
            replica, want = found.record.replica_of(found.sender), found.record.sha256
            if have is not None and want in have and (isinstance(parse, ViewReader) or not have[want].view):
                out.payloads[item] = dataclasses.replace(have[want], replica=replica)
                continue
            try:
                out.payloads[item] = fetcher.fetch(
                    t, stage, found.sender, found.record, parse, announcements, claimer=claimer_address
                )
            except Unreadable:  # the DHT, not the payload: the caller retries the whole check
                raise
            except NetworkError:  # nobody serves it now
                out.missing.append(item)
            except PeerError as exc:  # a genuine announcement of a payload that does not parse here
                log.warning("round %d stage %d: payload of %s is invalid: %s", t, stage, item[0][:12], exc)
                out.missing.append(item)
        return out
