"""Outer rounds over the swarm: announce → fetch → commit the same set in the same order.

Round (t, s) — DESIGN §3, docs/protocol.md. Contributors are the replicas working on outer step t:
every pipeline (its stage-s peer sends the payload, tagged with the pipeline's id) and every full
replica (one payload per stage, tagged with its own id). Each contributor
1. keeps its encoded payload in its `PayloadStore` (served by gRPC `get_payload`) and announces
   {sha256, size, address, replica, inc} under `round.{t}.{s}` in the DHT (a head adds "peers",
   the stage peers that did its last inner step: the round's binding);
2. polls the DHT until every expected replica has announced (or was dropped, or the round
   deadline passes), fetching each new payload once and checking its sha256 and format;
3. commits every payload it holds, ordered by replica id, so all holders apply the same sum in the
   same order and stay bit-identical.
Who is bound, expected, dropped or stale, when a round counts as committed elsewhere (then its
committed set is taken, or the peer re-syncs) and which of two different commits wins are the pure
rules of `peer.node.agreement`. A replica whose payload was rejected (bad hash or format), or whose
sender left before serving it, is not waited for.
Hot spares and compressed stages that only need stage 0's embedding change run the same gather
without a payload of their own (observers). `Rounds` holds one peer's round entry points (a head's,
a full replica's and a stage peer's round) and commits every gathered set through
`StageWorker.apply_round` → `peer.core.outer.commit_round`, parsing each payload once.

Expected replicas for round t: live replica records (pipelines' heads and full replicas) that joined
at or before t and are at outer step t − 1 or later. A dead replica drops out when its record
expires; a slow one is waited for until the deadline. The DHT offers no notifications, so the
wait is a bounded poll (`poll_s`) under one deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from peer.core.model import stage_shapes
from peer.core.outer import EMBED, embedding_update
from peer.core.sparseloco import Payload, decompress
from peer.errors import NetworkError, PeerError
from peer.net.dht import SwarmDHT, dht_time
from peer.net.pool import ClientPool
from peer.net.transport.errors import NotFoundError
from peer.net.transport.messages import PayloadRequest
from peer.node.agreement import IGNORED, expected_replicas, fenced_by, round_bans, round_view, sender_alive
from peer.node.bans import Bans
from peer.node.metrics import log_round
from peer.node.round_payloads import (
    SETTLE_S,
    PayloadStore,
    bound_replica,
    from_another_holder,
    payload_validator,
    poll_pause,
    read_round,
    sha256,
)
from peer.node.stage_worker import StageWorker

if TYPE_CHECKING:
    from peer.node.session import Session

log = logging.getLogger(__name__)

__all__ = [
    "PayloadStore",
    "RoundResult",
    "Rounds",
    "bound_replica",
    "expected_replicas",
    "gather_round",
    "payload_validator",
    "sha256",
]


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
    target: list[str] | None = None  # the set another holder committed (16-char id prefixes), if seen
    target_bans: Bans | None = None  # the bans published with that set (adopted with it: peer.node.bans)
    wall_s: float = 0.0
    bytes_fetched: int = 0

    @property
    def participants(self) -> int:
        return len(self.replicas)


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
) -> RoundResult:
    """Contribute `own` = (replica id, payload bytes) if given, then collect the round's payloads.

    `validate(payload)` parses a payload and raises PeerError for a malformed one (it is then
    skipped, and its replica no longer waited for); without it payloads are parsed as they are.
    Every payload is parsed exactly once (`RoundResult.parsed`). Who counts, who is waited for and
    when the set is closed follow `peer.node.agreement` (docs/protocol.md): returns when every
    expected replica's payload is held, rejected or dropped (never with only our own payload
    while another holder still gathers), with exactly the committed set once another holder has
    committed round t (`RoundResult.behind` when it cannot be reproduced within `grace_s`), or at
    the deadline. `inc` is this process's incarnation and `extra` adds fields to our announcement
    (a head's "peers" binding). `quorum` (the run's first round only: `swarm.min_replicas`) keeps
    the set open until that many payloads are held: at start-up a replica whose records are not
    visible yet cannot be counted as gathering, so round 0 waits for it (or the deadline). A payload
    whose sender is gone is asked of the round's other contributors (for stage 0 also of the other
    `n_stages` − 1 stages' holders, which observe it): each keeps what it fetched. `banned`: bans.py.
    """
    parse = validate if validate is not None else Payload.from_bytes
    started = time.monotonic()
    deadline = started + timeout_s
    me = dht.peer_id
    held: dict[str, bytes] = {}
    parsed: dict[str, Payload] = {}
    bad: set[str] = set()  # senders whose payload failed its checks
    rejected: set[str] = set()  # the replicas they stood for
    logged: set[tuple[str, str]] = set()  # (sender, claimed replica) already logged
    retry_at: dict[str, float] = {}  # unreachable senders are retried with backoff, not every poll
    target_since: float | None = None
    lost_at: float | None = None  # when a sender's payload was last given up as gone
    seen: set[str] = set()  # other holders of the stage seen gathering this round
    fenced: set[str] = set()  # earlier closers whose commit we wait for
    rpc_s = min(grace_s, 3.0)  # one try at a second source
    result = RoundResult(t=t, stage=stage)
    if own is not None and own[0][:16] in banned:  # a repeated outlier: not fetched by anyone
        log.warning("round %d stage %d: replica %s is banned as a repeated outlier; observing", t, stage, own[0][:12])
        own = None
    own_rid = own[0] if own is not None else None
    my_closes: float | None = None
    if own is not None:
        replica_id, payload = own
        if store is None:
            raise ValueError("a contributor needs a PayloadStore to serve its payload")
        store.put(t, stage, payload)
        my_closes = dht_time() + timeout_s  # the deadline fence (peer.node.agreement.fenced_by)
        record = {"sha256": sha256(payload), "size": len(payload), "address": address, "replica": replica_id}
        record.update({"inc": inc, "closes": round(my_closes, 3), **(extra or {})})
        dht.announce_payload(t, stage, record, ttl_s=ttl_s)
        held[replica_id] = payload
        parsed[replica_id] = Payload.from_bytes(payload)
    while True:
        try:
            replicas, holders, payloads, stage0 = read_round(dht, t, stage)
        except NetworkError as exc:  # a DHT read that failed once is a missed poll, until the deadline
            if time.monotonic() >= deadline:
                raise
            log.info("round %d stage %d: DHT read failed, polling again: %s", t, stage, exc)
            poll_pause(stop, poll_s)
            continue
        left = {pid for pid, rec in holders.items() if rec.get("state") == "left"}  # graceful leaves
        holders = {pid: rec for pid, rec in holders.items() if pid not in left}
        view = round_view(t, stage, payloads, stage0, replicas, holders, me, inc, banned)
        # waited for: seen gathering and now gone (maybe frozen), still gathering, or past t (follow its
        # commit); not one whose live records, at most at t, say it will not send t (restarted, spare)
        seen = view.gathering | {p for p in seen if holders.get(p, {}).get("outer_step", t + 1) > t}
        if own is None and (stage == 0 or replicas.get(me, {}).get("kind") == "full"):
            view.expected.discard(me)  # only we could send our replica's payload, and we observe
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
        if view.behind:
            result.behind = True
            log.warning("round %d stage %d: other holders are rounds ahead; re-syncing instead", t, stage)
            break
        for sender, (rid, rec) in sorted(view.bound.items()):
            if rid in held or sender in bad or retry_at.get(sender, 0.0) > time.monotonic():
                continue
            try:
                remaining = max(0.5, deadline - time.monotonic())
                if not isinstance(rec.get("address"), str) or not rec["address"]:
                    raise PeerError(f"the announcement of {sender} has no address")
                try:
                    req = PayloadRequest(t, stage, sender)
                    data = clients.get(rec["address"]).get_payload(req, timeout_s=remaining)
                except (NetworkError, NotFoundError):  # the sender is gone, or restarted without it:
                    others = {**payloads, **stage0}
                    for x in range(1, n_stages) if stage == 0 else ():  # observers of stage 0 fetched it too
                        others.update(dht.get_payloads(t, x))
                    second = from_another_holder(clients, t, stage, sender, rec, others, me, rpc_s)
                    if second is None:
                        raise
                    data = second
                if sha256(data) != rec.get("sha256"):
                    raise PeerError(f"payload from {sender} does not match its announced sha256")
                parsed[rid] = parse(data)
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
            held[rid] = data
            result.bytes_fetched += len(data)
        result.expected = len(view.expected)
        # an earlier closer at (or past) its deadline may commit without our payload: its commit
        # decides (→ FOLLOW), waited for until its deadline + the grace, even past ours
        fenced = fenced_by(view, me, my_closes, dht_time(), grace_s) if view.target is None else set()
        if view.target is not None:  # round t is committed elsewhere: take exactly that set
            target_since = time.monotonic() if target_since is None else target_since
            result.target, result.target_bans = view.target, view.target_bans
            mine = {rid for rid in held if rid[:16] in view.target}
            if len(mine) == len(view.target):
                held = {rid: held[rid] for rid in mine}
                break
            if time.monotonic() - target_since >= grace_s:
                result.behind = True
                log.warning("round %d stage %d: cannot fetch the committed set; re-syncing instead", t, stage)
                break
        else:
            target_since = None
            # a holder seen gathering this round whose records then expired may only be frozen (a
            # stopped process, a stalled link): a payload of ours alone waits for it until the deadline
            seen_gathering = bool(seen - left)  # a holder that left gracefully is not waited for
            lone = set(held) == {own_rid} and seen_gathering
            # an observer (no payload of its own) never decides a set while a contributor is around:
            # it follows the first commit (a frozen contributor's expired records cannot mislead it)
            follower = own is None and seen_gathering
            short = t == 0 and quorum > 1 and len(held) < quorum  # start-up: peers still appearing
            # a payload we lost (its sender left) may be held by a holder that already committed it:
            # let its commit reach the DHT before closing without it (→ FOLLOW), bounded by the grace
            settling = lost_at is not None and time.monotonic() - lost_at < min(grace_s, SETTLE_S)
            closed = view.expected <= set(held) | rejected | view.dropped
            if closed and not (lone or follower or short or settling or fenced):
                break
        if time.monotonic() >= deadline and not fenced:
            result.timed_out = True
            log.warning(
                "round %d stage %d: deadline after %.0fs with %d/%d payloads (missing: %s)",
                t,
                stage,
                timeout_s,
                len(held),
                len(view.expected),
                ", ".join(sorted(view.expected - set(held) - rejected))[:200],
            )
            break
        poll_pause(stop, poll_s)
    result.rejected = sorted(rejected - set(held))
    result.dropped = sorted(view.dropped - set(held))
    result.replicas = sorted(held)
    result.payloads = [held[r] for r in result.replicas]
    result.parsed = [parsed[r] for r in result.replicas]
    result.wall_s = time.monotonic() - started
    return result


class Rounds:
    """One peer's outer rounds: gather (contributing or observing), commit, record."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.pg_bytes = 0  # pseudo-gradient bytes this peer fetched, over the run

    def _validator(self, worker: StageWorker, stage: int) -> Callable[[bytes], Payload]:
        """Payloads of round (t, stage): the format, and entries that fit the stage's parameters."""
        cfg = self.session.cfg
        if stage == worker.stage:
            shapes = {name: tuple(v.shape) for name, v in worker.start.items()}
        else:  # an observer gather (stage 0 for T⊥)
            shapes = stage_shapes(cfg.model, stage, cfg.stages)
        return payload_validator(shapes, cfg.sparseloco, required=[EMBED] if stage == 0 else [])

    def gather(
        self,
        worker: StageWorker,
        t: int,
        replica_id: str | None,
        stop: threading.Event,
        stage: int | None = None,
        extra: Mapping[str, Any] | None = None,
        payload: Payload | None = None,
    ) -> RoundResult:
        """Contribute worker's payload (if replica_id; `payload` when already encoded) and collect
        round (t, stage)."""
        sess = self.session
        own_stage = stage is None or stage == worker.stage
        stage = worker.stage if stage is None else stage
        own = None
        if replica_id is not None:
            own = (replica_id, (payload if payload is not None else worker.contribute(replica_id)).to_bytes())
        elif own_stage:
            worker.observe()
        swarm = sess.cfg.swarm
        banned = worker.bans.banned(t) if own_stage else round_bans(sess.dht.get_stage_peers(stage), t, sess.peer_id)
        result = gather_round(
            sess.dht,
            sess.clients,
            t,
            stage,
            swarm.round_timeout_s,
            own=own,
            store=sess.store,
            address=sess.address,
            validate=self._validator(worker, stage),
            ttl_s=max(60.0, 2 * swarm.round_timeout_s),
            stop=stop,
            inc=sess.incarnation,
            extra=extra,
            grace_s=max(2.0, 2 * swarm.rpc_timeout_s),
            quorum=swarm.min_replicas if t == 0 else 1,
            n_stages=sess.cfg.stages,
            banned=banned,
        )
        self.pg_bytes += result.bytes_fetched
        return result

    def commit(
        self,
        workers: Mapping[int, StageWorker],
        results: Mapping[int, RoundResult],
        embed: RoundResult | None = None,
    ) -> bool:
        """Apply each worker's committed round. Stage 0's embedding change moves every other stage's
        T⊥: from stage 0's own commit when this peer holds it, else from `embed` (an observer gather
        of stage 0; no payload there: T⊥ stays). A round committed elsewhere that this peer could
        not reproduce (`behind`) is not applied: the worker re-syncs instead. A payload of ours
        that missed the committed set returns to our error buffer. False if anything re-synced."""
        embed_lost = embed is not None and embed.behind and 0 not in workers
        if embed_lost and not self._stage_ahead(workers):
            # stage 0's committed set cannot be fetched (its sender died) and no holder of our stage
            # is ahead to sync from: commit our own stage with T⊥ unchanged rather than wait for a
            # state nobody will ever have; the canonical-state rule reconciles holders that could
            # fetch it (docs/protocol.md, RECONCILE)
            log.warning(
                "round %d: stage 0's committed set is gone; committing stage(s) %s with T⊥ unchanged",
                embed.t if embed is not None else -1,
                sorted(workers),
            )
            embed, embed_lost = None, False
        behind = [s for s, r in results.items() if r.behind or (s != 0 and embed_lost)]
        if behind:
            for s, w in workers.items():
                self._resync_behind(w, results[s])
            return False
        update: torch.Tensor | None = None
        if 0 in workers:
            done = workers[0].apply_round(results[0].parsed, None, results[0].replicas, results[0].target_bans)
            update = done.embed_update
        elif embed is not None and embed.parsed:
            update = embedding_update([decompress(p) for p in embed.parsed], self.session.cfg.sparseloco)
        for s, w in workers.items():
            if s != 0:
                w.apply_round(results[s].parsed, update, results[s].replicas, results[s].target_bans)
        for s, w in workers.items():
            last = w.last_contribution
            if last is not None and last[0] not in results[s].replicas:
                w.return_unsent(last[1])  # our payload missed the commit: nothing is lost
                w.observe()
        # publish the committed set at once (before validation): a holder closing round t late
        # follows it instead of committing a set of its own (docs/protocol.md, FOLLOW)
        self.session.records.refresh()
        return True

    def _stage_ahead(self, workers: Mapping[int, StageWorker]) -> bool:
        """Another holder of one of these stages is past our outer step (a state to sync to)."""
        sess = self.session
        for s, w in workers.items():
            for pid, rec in sess.dht.get_stage_peers(s).items():
                if pid != sess.peer_id and int(rec.get("outer_step", -1)) > w.outer_step:
                    return True
        return False

    def _resync_behind(self, worker: StageWorker, result: RoundResult) -> None:
        """Round t was committed without us being able to reproduce it: take the winning state."""
        last = worker.last_contribution
        unsent = last is not None and (result.target is None or last[0][:16] not in result.target)
        try:
            self.session.resync.sync_state(worker, f"round {result.t} committed elsewhere", keep_errors=True)
        except PeerError as exc:
            log.warning("stage %d: could not re-sync after round %d: %s", worker.stage, result.t, exc)
            return
        if unsent and last is not None:
            worker.return_unsent(last[1])
        worker.observe()

    def head_round(
        self, worker: StageWorker, t: int, stop: threading.Event, peers: Mapping[str, str] | None = None
    ) -> RoundResult:
        """Stage 0 of a head: contribute (announcing `peers`, {"<stage>": peer id}, the stage peers
        that did this outer step's last inner step: the round's binding), gather and apply."""
        result = self.gather(worker, t, self.session.peer_id, stop, extra={"peers": dict(peers or {})})
        self.commit({worker.stage: worker}, {worker.stage: result})
        return result

    def full_round(self, workers: Mapping[int, StageWorker], t: int, stop: threading.Event) -> dict[int, RoundResult]:
        """A full replica: contribute to and gather every stage's round at once, then apply them."""
        with ThreadPoolExecutor(max_workers=len(workers)) as pool:
            futures = {s: pool.submit(self.gather, w, t, self.session.peer_id, stop) for s, w in workers.items()}
            results = {s: f.result() for s, f in futures.items()}
        self.commit(workers, results)
        return results

    def stage_round(self, worker: StageWorker, contributor: str | None, stop: threading.Event) -> None:
        """A stage > 0 peer: its own round (contributing if it trained) + stage 0's for T⊥.

        A claimed stage peer is never idle between rounds, so the canonical-state check
        (`Resync.reconcile`) runs here, after our payload is encoded and before the round: a
        disagreement seen in round t is repaired before round t commits."""
        t = worker.outer_step
        payload = worker.contribute(contributor) if contributor is not None else None
        try:
            self.session.resync.reconcile(worker, before_round=True)
        except PeerError as exc:
            log.warning("stage %d: canonical state not reachable before round %d: %s", worker.stage, t, exc)
        if worker.outer_step != t:  # the canonical holder had moved on: our payload waits for the next round
            if payload is not None:
                worker.return_unsent(payload)
            worker.observe()
            return
        result = self.gather(worker, t, contributor, stop, payload=payload)
        embed = self.gather(worker, t, None, stop, stage=0)
        if self.commit({worker.stage: worker}, {worker.stage: result}, embed):
            self.record(t, {worker.stage: (worker, result.participants)}, None, None, result.wall_s)

    def complete(self, t: int, stage: int) -> bool:
        """Round (t, stage) can be applied by a hot spare: another holder committed it, or every
        expected replica has announced (or was dropped). Until then the spare stays claimable: a
        head still at outer step t may need it."""
        dht = self.session.dht
        try:
            payloads = dht.get_payloads(t, stage)
            stage0 = payloads if stage == 0 else dht.get_payloads(t, 0)
            replicas, holders = dht.get_replicas(), dht.get_stage_peers(stage)
        except NetworkError as exc:  # not known to be complete: asked again at the next poll
            log.info("round %d stage %d: DHT read failed: %s", t, stage, exc)
            return False
        view = round_view(t, stage, payloads, stage0, replicas, holders, self.session.peer_id, self.session.incarnation)
        if view.target is not None or view.behind:
            return True
        announced = {rid for rid, _ in view.bound.values()}
        return bool(announced or view.dropped) and view.expected <= announced | view.dropped

    def record(
        self,
        t: int,
        stages: Mapping[int, tuple[StageWorker, int]],
        train_loss: float | None,
        val_loss: float | None,
        wall_s: float,
        activations: tuple[int, int] = (0, 0),
    ) -> None:
        """After a committed round: the `round` metrics event, then fresh DHT records."""
        log_round(self.session.metrics, t, stages, train_loss, val_loss, wall_s, self.pg_bytes, activations)
        self.session.records.refresh()
        log.info(
            "round %d committed: %s train %s val %s", t, {s: n for s, (_, n) in stages.items()}, train_loss, val_loss
        )
