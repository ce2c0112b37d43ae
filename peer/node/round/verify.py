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
  one payload per round, once (a restarted sender observes the round: its `joined_at` is past it),
  so an honest claim never names a sha256 its replica's announcements lack;
- UNKNOWN otherwise (the round's records expired, the binding changed): the claim cannot be
  checked now, and is neither adopted nor held against its claimer.
A genuine entry's bytes may come from anyone — our own store, the sender, the claimer, another
holder — because the announced sha256 is checked whoever serves them (`SetFetcher`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from peer.core.sparseloco.codec.format import Payload
from peer.errors import PeerError
from peer.net.pool import ClientPool
from peer.net.records import Announcement
from peer.net.transport.messages import PayloadRequest
from peer.node.round.agreement import Announcements, Replicas, bound_to
from peer.node.round.bans import PREFIX
from peer.node.round.claims import Entry
from peer.node.round.payloads import PayloadStore, from_another_holder, sha256

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


def resolve(
    item: Entry,
    stage: int,
    announcements: Announcements,
    stage0: Announcements,
    replicas: Replicas,
) -> Resolved:
    """The verdict on one entry of a set of round (t, `stage`) (module docstring); `announcements`
    are the round's, `stage0` those of (t, 0) (the heads' bindings), `replicas` the replica records."""
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
    if announcements and not same_sha:  # the replica made up, or a payload it never announced
        return Resolved(Verdict.FORGED)
    return Resolved(Verdict.UNKNOWN)


@dataclass
class Fetched:
    """What `SetFetcher.fetch` found for a set: payloads by entry, and the entries it could not get."""

    payloads: dict[Entry, tuple[bytes, Payload]] = field(default_factory=dict)
    replicas: dict[Entry, str] = field(default_factory=dict)  # the full replica id of each entry
    forged: list[Entry] = field(default_factory=list)
    missing: list[Entry] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.forged and not self.missing


class SetFetcher:
    """Fetches the payloads a claimed set names, checking each against its genuine announcement."""

    def __init__(
        self, dht: Any, clients: ClientPool, store: PayloadStore, me: str, rpc_timeout_s: float, holders: bool = False
    ) -> None:
        """`holders`: as a last resort ask the stage's holders and attesters too (a replay of rounds
        whose contributors may all have left; a live round does not wait on them)."""
        self.dht, self.clients, self.store, self.me = dht, clients, store, me
        self.rpc_timeout_s, self.holders = rpc_timeout_s, holders

    def fetch(
        self,
        t: int,
        stage: int,
        entries: Sequence[Entry],
        parse: Callable[[bytes], Payload],
        have: Mapping[str, bytes] | None = None,
        claimer_address: str | None = None,
        n_stages: int = 1,
    ) -> Fetched:
        """The payloads of `entries` (round t, `stage`): from `have` (sha256 → bytes we hold), our
        store, the sender, the claimer (at `claimer_address`), then any holder of the round. Each
        entry's full replica id is in `Fetched.replicas`. Raises NetworkError when the DHT cannot be
        read."""
        announcements = self.dht.get_payloads(t, stage)
        stage0 = announcements if stage == 0 else self.dht.get_payloads(t, 0)
        replicas = self.dht.get_replicas()
        out = Fetched()
        for item in entries:
            found = resolve(item, stage, announcements, stage0, replicas)
            if found.verdict is not Verdict.GENUINE:
                (out.forged if found.verdict is Verdict.FORGED else out.missing).append(item)
                continue
            want = found.record.sha256
            out.replicas[item] = found.record.replica_of(found.sender)
            data = self._bytes(t, stage, found, want, have or {}, claimer_address, announcements, n_stages)
            if data is None:
                out.missing.append(item)
                continue
            try:
                out.payloads[item] = (data, parse(data))
            except PeerError as exc:  # a genuine announcement of a payload that does not parse here
                log.warning("round %d stage %d: payload of %s is invalid: %s", t, stage, item[0][:12], exc)
                out.missing.append(item)
        return out

    def _bytes(
        self,
        t: int,
        stage: int,
        found: Resolved,
        want: str,
        have: Mapping[str, bytes],
        claimer_address: str | None,
        announcements: Announcements,
        n_stages: int,
    ) -> bytes | None:
        if want in have:
            return have[want]
        for data in (self.store.get(t, stage), self.store.get(t, stage, found.sender)):
            if data is not None and sha256(data) == want:
                return data
        request = PayloadRequest(t, stage, found.sender)
        for address in dict.fromkeys(a for a in (found.record.address, claimer_address) if a):
            try:
                data = self.clients.get(address).get_payload(request, timeout_s=self.rpc_timeout_s)
            except PeerError:
                continue
            if sha256(data) == want:
                self.store.put_fetched(t, stage, found.sender, data)
                return data
        others = dict(announcements)
        for x in range(1, n_stages) if stage == 0 else ():  # observers of stage 0 keep it too
            others.update(self.dht.get_payloads(t, x))
        data = from_another_holder(
            self.clients, t, stage, found.sender, found.record, others, self.me, self.rpc_timeout_s
        )
        if data is None and self.holders:
            data = self._from_holders(t, stage, found.sender, want)
        if data is not None:
            self.store.put_fetched(t, stage, found.sender, data)
        return data

    def _from_holders(self, t: int, stage: int, sender: str, want: str) -> bytes | None:
        """Last resort: the stage's holders and attesters now (observers and spares keep what they
        fetched for the window; the round's own contributors may all have left since)."""
        try:
            holders = {**self.dht.get_stage_peers(stage), **self.dht.get_stage_peers(stage, kind="attest")}
        except PeerError:
            return None
        request = PayloadRequest(t, stage, sender)
        for pid, rec in sorted(holders.items()):
            if pid in (sender, self.me) or not rec.address or rec.left:
                continue
            try:
                data = self.clients.get(rec.address).get_payload(request, timeout_s=self.rpc_timeout_s)
            except PeerError:
                continue
            if sha256(data) == want:
                log.info("round %d stage %d: payload of %s served by holder %s", t, stage, sender[:12], pid[:12])
                return data
        return None
