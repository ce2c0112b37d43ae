"""Joining by replay: a state is adopted only by recomputing it from a state we trust.

A holder that holds nothing comparable (a late joiner, a holder rounds behind) never counts who
claims a state (docs/protocol.md, "Joining by replay"). It starts from a state it trusts — the
canonical initial state, recomputed from the config (`StageState.reset_initial`), or its own state
when that was reached by a checked path (`StageState.verified`) — and replays the committed rounds
since, one at a time:

    round t, our state X:  the links of round t from X that holders published (`chain.{t}.{s}`),
                           best first by the canonical order (`candidates`: the most committed
                           payloads, then the smallest state id — `peer.node.round.claims.Claim.key`);
                           for each: its payloads, each genuine (a signed announcement of (t, s) by
                           a sender bound to its replica: `peer.node.round.verify`) and matching its
                           sha256, committed from X (`StageState.replay`: the portable commit);
                           the first whose recomputed state id is the claimed one is installed
                           (`StageState.advance`); a holder whose link is false is refused.

Holders publish the link of every round they committed, as finally held (after a RECONCILE
switch), for `swarm.history_rounds` rounds (`publish_links`, from the records thread) and keep the
payloads that long (`PayloadStore`). Stages > 0 also recompute T⊥'s move from stage 0's payloads the
link names (`link.embed`), which must be a set some stage-0 holder linked for round t.

Invariants: nothing here downloads a state; the worker only ever holds states it computed; a
replay that cannot go on stops with a reason (`Replayed.stopped`), keeping the rounds it checked.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from peer.config import RunConfig
from peer.errors import NetworkError
from peer.net.dht import SwarmDHT
from peer.net.records import Announcement
from peer.node.round.claims import Entry, Link
from peer.node.round.contribution import Contribution
from peer.node.round.recheck import fetch_set
from peer.node.round.refusals import Refusals
from peer.node.round.verify import SetFetcher
from peer.node.stage.commit import Outcome
from peer.node.stage.state import StageState

log = logging.getLogger(__name__)

LOG_EVERY = 8  # replayed rounds between two progress lines
PREFETCH = 16  # rounds whose records are read in one batch


def chain_record(link: Link) -> dict[str, Any]:
    """The `chain.{t}.{s}` record of a holder's link of round t: the link and the state it reached."""
    return {"link": link.to_record(), "state": link.state}


def parse_chain(raw: Any) -> Link | None:
    """A `chain.{t}.{s}` record, parsed once (None: malformed)."""
    if not isinstance(raw, Mapping):
        return None
    return Link.from_record(raw.get("link"), raw.get("state"))


def publish_links(dht: SwarmDHT, stage: int, links: Iterable[Link], sent: dict[int, str], ttl_s: float) -> None:
    """Publish each of our links of `stage` not yet published as it is now (`sent`: round → state id
    published; a RECONCILE switch replaces a round's link, so it is published again)."""
    for link in sorted(links, key=lambda x: x.t):
        if sent.get(link.t) == link.state:
            continue
        dht.announce_round("chain", link.t, stage, chain_record(link), ttl_s)
        sent[link.t] = link.state
    for t in sorted(sent)[: max(0, len(sent) - 4 * 64)]:  # bounded: older rounds are never re-published
        del sent[t]


@dataclass(frozen=True)
class Candidate:
    """A link of round t from the replaying state, and the holders that published it."""

    link: Link
    holders: tuple[str, ...]

    @property
    def key(self) -> tuple[int, int, str]:
        """The canonical order (`Claim.key`: the most committed payloads, then the smallest state id),
        a larger embedding set first between links of one set (stages > 0: T⊥ moved by more)."""
        return (-len(self.link.entries), -len(self.link.embed or ()), self.link.state)


def candidates(
    links: Mapping[str, Link],
    t: int,
    prev: str,
    refused: Iterable[str] = (),
    embed_sets: Iterable[tuple[Entry, ...]] | None = None,
) -> list[Candidate]:
    """The links of round t from state `prev` (one per distinct link, with every holder that published
    it; refused holders' left out), best first by `Candidate.key`. `embed_sets` (stages > 0): stage
    0's sets linked for round t; a link whose T⊥ moved by another set is left out (T⊥ is one tensor
    across stages). None: not checked (stage 0)."""
    gone = set(refused)
    allowed = None if embed_sets is None else set(embed_sets)
    by_link: dict[Link, list[str]] = {}
    for holder, link in links.items():
        if holder in gone or link.t != t or link.prev != prev:
            continue
        if allowed is not None and link.embed is not None and link.embed not in allowed:
            continue
        by_link.setdefault(link, []).append(holder)
    out = [Candidate(link, tuple(sorted(who))) for link, who in by_link.items()]
    return sorted(out, key=lambda c: (c.key, c.holders))


class RoundReads:
    """The DHT records a replay reads, each once per round (announcements of (t, s), links) and the
    replica records once per replay: a replayed round costs a few DHT reads, not one per lookup.
    Past rounds' records only change when a holder switches; a later `sync_state` reads afresh."""

    def __init__(self, dht: SwarmDHT) -> None:
        self.dht = dht
        self._cache: dict[tuple[str, int, int], Any] = {}
        self._replicas: Any = None

    def get_payloads(self, t: int, stage: int) -> Any:
        return self._get(("round", t, stage), lambda: self.dht.get_payloads(t, stage))

    def get_stage_peers(self, stage: int, kind: Any = "stage") -> Any:
        return self._get((kind, -1, stage), lambda: self.dht.get_stage_peers(stage, kind=kind))

    def get_replicas(self) -> Any:
        if self._replicas is None:
            self._replicas = self.dht.get_replicas()
        return self._replicas

    def get_round(self, kind: Any, t: int, stage: int, parse: Any) -> Any:
        return self._get((kind, t, stage), lambda: self.dht.get_round(kind, t, stage, parse))

    def prefetch(self, t0: int, t1: int, stage: int) -> None:
        """Read rounds [t0, t1) of `stage` (and of stage 0, whose sets move a later stage's T⊥) in one
        batch: their links and announcements, concurrently."""
        stages = (stage,) if stage == 0 else (stage, 0)
        wanted: list[tuple[Any, int, int, Any]] = []
        for t in range(t0, t1):
            for s in stages:
                wanted += [("chain", t, s, parse_chain), ("round", t, s, Announcement.parse)]
        wanted = [w for w in wanted if w[:3] not in self._cache]
        if wanted:
            for w, got in zip(wanted, self.dht.get_rounds(wanted), strict=True):
                self._cache[w[:3]] = got

    def reach(self, t: int, stage: int, state: str, until: int, refused: Iterable[str] = ()) -> int:
        """How far the published links of `stage` go on from `state` at outer step t: the first round
        in [t, until) with no link from any state reached so far (`until` when they reach it). Reads
        link records only (a few DHT reads, cached); nothing is recomputed."""
        gone, frontier = set(refused), {state}
        for r in range(t, until):
            if ("chain", r, stage) not in self:
                self.prefetch(r, min(until, r + PREFETCH), stage)
            links = self.get_round("chain", r, stage, parse_chain)
            frontier = {x.state for h, x in links.items() if h not in gone and x.t == r and x.prev in frontier}
            if not frontier:
                return r
        return until

    def forget(self, t: int) -> None:
        """Drop what was read of rounds before t (memory stays a round's worth)."""
        for key in [k for k in self._cache if k[1] < t]:
            del self._cache[key]

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        return key in self._cache

    def _get(self, key: tuple[str, int, int], read: Any) -> Any:
        if key not in self._cache:
            self._cache[key] = read()
        return self._cache[key]


class SkipDead:
    """The client pool as a replay uses it: an address that did not answer once (a sender that left
    rounds ago; its payloads come from the holders that kept them) fails at once for the rest of the
    replay, instead of costing every payload it announced the client's retries."""

    def __init__(self, clients: Any) -> None:
        self.clients, self.dead = clients, set[str]()

    def get(self, address: str) -> Any:
        return _Watched(self, address)


class _Watched:
    def __init__(self, pool: SkipDead, address: str) -> None:
        self.pool, self.address = pool, address

    def get_payload(self, request: Any, timeout_s: float | None = None) -> bytes:
        if self.address in self.pool.dead:
            raise NetworkError(f"peer {self.address} did not answer earlier in this replay")
        try:
            data: bytes = self.pool.clients.get(self.address).get_payload(request, timeout_s=timeout_s)
        except NetworkError:
            self.pool.dead.add(self.address)
            raise
        return data


@dataclass
class Replayed:
    """What a replay did: rounds installed, payload bytes read, seconds, and why it stopped before
    its target ("" when it reached it)."""

    rounds: int = 0
    bytes: int = 0
    seconds: float = 0.0
    stopped: str = ""


class Replayer:
    """Replays committed rounds onto a worker (module docstring). Receives what it calls: the DHT
    (link records, announcements), `fetcher` (a `SetFetcher` — genuine payloads from anyone — over
    the records it is given) and the refusals."""

    def __init__(
        self, cfg: RunConfig, dht: SwarmDHT, fetcher: Callable[[RoundReads], SetFetcher], refusals: Refusals
    ) -> None:
        self.cfg, self.dht, self.fetcher, self.refusals = cfg, dht, fetcher, refusals

    def has_links_from(self, t: int, stage: int, prev: str) -> bool:
        """Whether some holder published a link of round (t, stage) from state `prev`."""
        return bool(self.states_linked_from(t, stage, prev))

    def states_linked_from(self, t: int, stage: int, prev: str) -> set[str]:
        """The states that holders' published links of round (t, stage) lead to from state `prev`."""
        links = self.dht.get_round("chain", t, stage, parse_chain)
        return {c.link.state for c in candidates(links, t, prev, self.refusals.peers())}

    def run(
        self, worker: StageState, until: int, stop: threading.Event | None = None, horizon: int | None = None
    ) -> Replayed:
        """Replay rounds onto `worker` until its outer step is `until`, no link can be checked, or
        `stop` is set (between two rounds). `horizon` (default `until`): how far the links a round's
        choice weighs may reach (`step`); past `until`, the rounds after the last one installed
        decide between its links too."""
        horizon = until if horizon is None else max(until, horizon)
        done = Replayed()
        started = time.perf_counter()
        reads = RoundReads(self.dht)
        fetcher = self.fetcher(reads)
        while worker.outer_step < until:
            t = worker.outer_step
            if stop is not None and stop.is_set():
                done.stopped = f"round {t}: asked to leave"
                break
            reads.forget(t)
            if ("chain", t, worker.stage) not in reads:
                reads.prefetch(t, min(horizon, t + PREFETCH), worker.stage)
            why = self.step(worker, done, reads, fetcher, horizon)
            if why:
                done.stopped = f"round {t}: {why}"
                break
            done.rounds += 1
            if done.rounds % LOG_EVERY == 0:
                log.info(
                    "stage %d: replayed %d round(s), at outer step %d of %d (%.1f s, %.1f MB of payloads)",
                    worker.stage,
                    done.rounds,
                    worker.outer_step,
                    until,
                    time.perf_counter() - started,
                    done.bytes / 1e6,
                )
        done.seconds = time.perf_counter() - started
        return done

    def step(self, worker: StageState, done: Replayed, reads: RoundReads, fetcher: SetFetcher, horizon: int) -> str:
        """Replay the worker's current round: "" when a checked link was installed, else why not.

        Links are checked in the canonical order (so a false one ahead of the true one gets its
        holders refused), but a genuine link whose state the published links go on from less far
        towards `horizon` than another's (`RoundReads.reach`: a branch its holders left, switching or
        dying with their link still published) is passed over while a further-reaching one may hold;
        it is installed only when none does."""
        t, stage, prev = worker.outer_step, worker.stage, worker.state_id()
        embed_sets = None
        if stage != 0 and worker.compressed:
            embed_sets = {link.entries for link in reads.get_round("chain", t, 0, parse_chain).values() if link.t == t}
        found = candidates(reads.get_round("chain", t, stage, parse_chain), t, prev, self.refusals.peers(), embed_sets)
        if not found:
            return f"no holder published a link from state {prev} (beyond the history window, or not committed yet)"
        reach: dict[str, int] = {}
        if len(found) > 1 and t + 1 < horizon:
            refused = self.refusals.peers()
            reach = {c.link.state: reads.reach(t + 1, stage, c.link.state, horizon, refused) for c in found}
        reasons, passed = [], None
        for i, cand in enumerate(found):
            why, checked = self._check(worker, cand, done, fetcher)
            if checked is not None:
                further = [c for c in found[i + 1 :] if reach.get(c.link.state, 0) > reach.get(cand.link.state, 0)]
                if not further:
                    worker.advance(*checked)
                    return ""
                passed = passed or checked
                why = f"reaches outer step {reach[cand.link.state]}, another link further"
            reasons.append(f"{cand.link.state}: {why}")
        if passed is not None:  # every further-reaching link failed its check: the genuine dead end it is
            worker.advance(*passed)
            return ""
        return "; ".join(reasons)

    def _check(
        self, worker: StageState, cand: Candidate, done: Replayed, fetcher: SetFetcher
    ) -> tuple[str, tuple[Outcome, list[Contribution], tuple[Entry, ...] | None] | None]:
        """Recompute `cand` from the worker's state: ("", what `advance` installs) when it holds; its
        holders refused when it is false, left when its payloads cannot be had (the reason, None)."""
        link, stage, t = cand.link, worker.stage, cand.link.t
        if link.ranges is not None:
            return "a ranges round (replaying one is not supported yet)", None
        got = fetch_set(self.cfg, fetcher, worker, t, link.entries, link.embed)
        if got.forged:
            return self._refuse(cand, stage, "its link names payloads no replica announced"), None
        if got.forged_embed:
            return self._refuse(cand, stage, "its embedding set names payloads no replica announced"), None
        if got.missing:
            return f"{got.missing} payload(s) not available (announcements expired, or nobody serves them)", None
        done.bytes += got.nbytes
        payloads = got.payloads
        out = worker.replay(payloads, got.embed_update)
        if out.state != link.state:
            why = f"its state {link.state} does not follow from its set (gives {out.state})"
            return self._refuse(cand, stage, why), None
        return "", (out, payloads, link.embed)

    def _refuse(self, cand: Candidate, stage: int, reason: str) -> str:
        for holder in cand.holders:
            self.refusals.refuse(holder, stage, cand.link.t, reason)
        return reason
