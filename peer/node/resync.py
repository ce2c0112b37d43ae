"""Keeping one peer's stages on the swarm's committed state, adopting nothing on a claim alone.

- `reconcile` (after every commit, and before a stage peer's round): the canonical-state check.
  Every claim is first audited cheaply, whatever its round (`_audit`): a set naming payloads no
  replica announced, or our own set of a round from our own state with another state, is false.
  Claims of the same round from the same state as ours that the canonical order puts first (the
  most committed payloads, then the smallest state id: `peer.node.claims.better`) are CHECKED by
  recomputing their set from the state we committed from (`StageWorker.recompute`): a claim whose
  set is genuine and whose state follows from it replaces our commit (`StageWorker.switch`, no
  download); one that names payloads no replica announced, or whose state does not follow, gets
  its holder refused (`peer.node.refusals`). Only when a strict majority of the holders at our
  step agrees on another state that cannot be checked do we re-sync (`sync_state`: a replay that
  decides by the canonical order, not by the count).
- `sync_state`: replay the committed rounds from a state we trust — our own checked state
  (`StageWorker.verified`) or the canonical initial state, recomputed — checking each round's link
  by recomputation (`peer.node.replay`, docs/protocol.md "Joining by replay"); nothing is
  downloaded and nothing is counted. At the swarm's outer step 0 the state is the canonical initial
  one. No round can be checked: NetworkError, retry later.
- `late_join`: a worker behind the swarm's clock replays to it (a resumed checkpoint of our own is
  a trusted start; one at or past the clock is kept);
- `maintain`: a worker more than `max_lag` rounds behind the clock re-syncs, else `reconcile`;
(`catch_up`, applying the round after a download as an observer, is a round: `peer.node.round.rounds`.)

Invariants: a state is adopted only through `StageWorker.switch` or `StageWorker.advance` (checked
recomputations) or `StageWorker.reset_initial` (the canonical initial state); a peer that (re)synced
at t contributes from t + 1 (`Presence.joined_at`); a state that cannot be verified is a
`NetworkError` that says why and when to retry.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

from peer.config import RunConfig
from peer.core.codec.format import Payload
from peer.errors import NetworkError, PeerError
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.net.transport.messages import StateReply, StateRequest
from peer.node.bans import PREFIX
from peer.node.checkpoints.peer import PeerCheckpoints
from peer.node.claims import Claim, Entry, better, majority, parse_claims, swarm_clock
from peer.node.metrics import MetricsWriter
from peer.node.presence import Presence
from peer.node.refusals import Refusals
from peer.node.replay import Replayed, Replayer, RoundReads, SkipDead
from peer.node.round.payloads import PayloadStore
from peer.node.round.recheck import Recomputed, recompute_set, stage0_set
from peer.node.round.verify import SetFetcher, Verdict, resolve
from peer.node.stage_commit import Outcome
from peer.node.stage_worker import StageWorker

log = logging.getLogger(__name__)


class Resync:
    """State checks, switches and downloads of one peer's stage workers."""

    def __init__(
        self,
        cfg: RunConfig,
        dht: SwarmDHT,
        clients: ClientPool,
        store: PayloadStore,
        me: Presence,
        refusals: Refusals,
        metrics: MetricsWriter,
        publish: Callable[[], None],
        checkpoints: PeerCheckpoints,
    ) -> None:
        """`publish` refreshes this peer's DHT records (after a download or a switch);
        `checkpoints.resumed_at` tells `late_join` whether the state came from `--resume`."""
        self.cfg, self.dht, self.clients, self.store = cfg, dht, clients, store
        self.me, self.refusals, self.metrics = me, refusals, metrics
        self.publish, self.checkpoints = publish, checkpoints
        self.count = 0  # states adopted over the run (`sync_state`: replayed, or the initial one recomputed)
        self.switches = 0  # commits replaced by a checked better claim (recomputed, no download)
        self._audited: set[tuple[str, str]] = set()  # (holder, state id) claims already audited
        self.stage0: StageWorker | None = None  # our stage-0 worker, when we hold stage 0 beside others
        self.replayed: list[Replayed] = []  # every replay of this run (rounds, bytes, seconds)

    def clock(self) -> int:
        """The swarm's outer step: the lower median of the other live replicas' (`swarm_clock`)."""
        others = {pid: rec for pid, rec in self.dht.get_replicas().items() if pid != self.me.peer_id}
        return swarm_clock(others, self.refusals.peers())

    def late_join(self, worker: StageWorker) -> None:
        """If the swarm's clock is past this worker's outer step, replay the rounds to it (`sync_state`).

        A state resumed from a checkpoint at (or past) the clock is kept; one that is behind loses
        to the swarm's (error buffer and optimizer reset, as for any late joiner).
        """
        t_swarm = self.clock()
        resumed = self.checkpoints.resumed_at is not None
        if resumed:
            worker.verified = True  # our own checkpoint: a state we trust, replayed on from
        if t_swarm > worker.outer_step:
            if resumed:
                log.warning(
                    "stage %d: checkpoint at outer step %d is behind the swarm (%d); taking the swarm's "
                    "state, error buffer and optimizer reset",
                    worker.stage,
                    worker.outer_step,
                    t_swarm,
                )
            self.sync_state(
                worker,
                f"checkpoint behind the swarm (outer step {worker.outer_step} < {t_swarm})" if resumed else "late join",
            )
        elif resumed:
            log.info(
                "stage %d: keeping the resumed state at outer step %d (swarm at %d)",
                worker.stage,
                worker.outer_step,
                t_swarm,
            )
            self.metrics.log(
                "resume_kept", stage=worker.stage, t=worker.outer_step, swarm_t=t_swarm, param_hash=worker.param_hash()
            )

    def sync_state(
        self,
        worker: StageWorker,
        reason: str,
        keep_errors: bool = False,
        vote: bool = False,
        wait_s: float | None = None,
    ) -> bool:
        """Bring `worker` to the swarm's state by replaying the committed rounds from a state it
        trusts (`peer.node.replay`), never by counting who claims a state: True when its state changed.

        The trusted start: our own state when it was reached by a checked path (`worker.verified`),
        else the canonical initial state, recomputed (`StageState.reset_initial`); with `vote` (a
        majority of our step disagrees with us) the initial state when the history window reaches
        back to it, so the replay decides between the two histories by the canonical order. At the
        swarm's outer step 0 nothing is replayed: the state is the canonical initial one. Holders
        that are still committing the last round publish its link a moment later: we replay again
        until we reach the swarm's clock, for at most `wait_s` (default `swarm.round_timeout_s`).
        Raises NetworkError (with the reason) when the swarm's state cannot be verified by then;
        the rounds checked so far are kept.
        """
        deadline = time.monotonic() + (self.cfg.swarm.round_timeout_s if wait_s is None else wait_s)
        before = (worker.outer_step, worker.state_id(), worker.loads)
        replayer = Replayer(self.cfg, self.dht, self._fetcher, self.refusals)
        while True:
            clock = self.clock()
            if clock == 0 and worker.outer_step == 0:  # no vote where bytes decide (docs/protocol.md)
                if worker.state_id() != worker.initial_state_id or not worker.verified:
                    self._reset_initial(worker, keep_errors, reason)
                break
            self._start(worker, replayer, vote, clock, keep_errors, reason)
            vote = False  # the start is chosen once; later tries go on from where the replay stopped
            done = replayer.run(worker, clock + 1)
            self.replayed = [*self.replayed[-63:], done]
            if worker.outer_step >= clock:
                if done.rounds and self.clock() > clock:  # the swarm went on while we replayed: once more
                    self.replayed = [*self.replayed[-63:], replayer.run(worker, self.clock() + 1)]
                break
            if not done.rounds and self._attested(worker, clock, keep_errors, reason):
                continue  # beyond the window: an attester's state, replayed on from
            if time.monotonic() >= deadline:
                raise NetworkError(
                    f"stage {worker.stage}: cannot verify the swarm's state (swarm at outer step {clock}, "
                    f"replayed to {worker.outer_step}): {done.stopped}. A state is adopted only by replaying "
                    "it from the initial state or our own checked state (docs/protocol.md, 'Joining by "
                    "replay'); retry when holders serve the rounds"
                )
            time.sleep(min(1.0, self.cfg.swarm.announce_interval_s))
        changed = (worker.outer_step, worker.state_id(), worker.loads) != before
        if changed:
            if not keep_errors:
                worker.fresh_optimizer()  # a late joiner starts with an empty error buffer and AdamW
            # a peer that (re)synced at t contributes from t + 1 (DESIGN §3: late joiners)
            self.me.joined_at = max(self.me.joined_at, worker.outer_step + 1)
            self.count += 1
            log.info(
                "%s: stage %d replayed to outer step %d (state %s)",
                reason,
                worker.stage,
                worker.outer_step,
                worker.state_id(),
            )
            self.metrics.log(
                "sync", stage=worker.stage, t=worker.outer_step, param_hash=worker.param_hash(), reason=reason
            )
            self.publish()
        return changed

    def _start(
        self, worker: StageWorker, replayer: Replayer, vote: bool, clock: int, keep_errors: bool, reason: str
    ) -> None:
        """Put `worker` on the state the replay starts from (sync_state's docstring): our own state
        when a link goes on from it; else, when our last commit was overtaken, the state we committed
        it from (`StageState.rewind`); else the canonical initial state when the window reaches back
        to it. None of them: our own state (the replay then says why it cannot go on)."""
        stage, held = worker.stage, worker.state_id()
        if worker.outer_step == 0 and worker.verified and held == worker.initial_state_id:
            return  # we hold it already
        if worker.verified and not vote:
            if worker.outer_step >= clock or replayer.has_links_from(worker.outer_step, stage, held):
                return
            prev = worker.ledger.prev
            if prev is not None and replayer.has_links_from(prev.t, stage, prev.state) and worker.rewind():
                log.info("%s: stage %d back at outer step %d (state %s) to replay", reason, stage, prev.t, prev.state)
                return
        if not worker.verified or replayer.has_links_from(0, stage, worker.initial_state_id):
            self._reset_initial(worker, keep_errors, reason)

    def _attested(self, worker: StageWorker, clock: int, keep_errors: bool, reason: str) -> bool:
        """Download a state that an attester (`swarm.attesters`) claims in its own signed stage record,
        at a step past ours that the clock admits, checked against its state id (`download_claimed`):
        a trusted start past the history window. True when one loaded."""
        attesters = set(self.cfg.swarm.attesters)
        if not attesters:
            return False
        holders = self.dht.get_stage_peers(worker.stage)
        claims = parse_claims(holders, self.me.peer_id, self.refusals.peers())
        ours = worker.outer_step
        found = [c for p, c in claims.items() if p in attesters and ours < c.outer_step <= clock + 1]
        for claim in sorted(found, key=lambda c: (-c.outer_step, c.state, c.peer)):
            address = holders[claim.peer].address
            errors = worker.state_dict()["errors"] if keep_errors else None
            if address and download_claimed(self.clients, worker, claim.peer, address, claim, errors) is not None:
                with worker.lock:
                    worker.verified = True  # attested: a start the manifest names, replayed on from
                log.info(
                    "%s: stage %d at the state %s attested by %s at outer step %d",
                    reason,
                    worker.stage,
                    claim.state,
                    claim.peer[:12],
                    claim.outer_step,
                )
                return True
        return False

    def _reset_initial(self, worker: StageWorker, keep_errors: bool, reason: str) -> None:
        errors = worker.state_dict()["errors"] if keep_errors else None
        worker.reset_initial(errors)
        log.info("%s: stage %d at the canonical initial state %s (recomputed)", reason, worker.stage, worker.state_id())

    def _fetcher(self, reads: RoundReads) -> SetFetcher:
        timeout_s = min(3.0, self.cfg.swarm.rpc_timeout_s)
        clients = cast(ClientPool, SkipDead(self.clients))  # SetFetcher calls get(address).get_payload only
        return SetFetcher(reads, clients, self.store, self.me.peer_id, timeout_s)

    def maintain(self, worker: StageWorker, max_lag: int = 1) -> None:
        """Re-sync a worker more than `max_lag` rounds behind the swarm's clock, else `reconcile`."""
        if self.clock() > worker.outer_step + max_lag:
            self.sync_state(worker, f"behind (outer step {worker.outer_step})")
            return
        self.reconcile(worker)

    def reconcile(self, worker: StageWorker, before_round: bool = False) -> bool:
        """The canonical-state check (module docstring). True if the worker's state changed.

        `before_round`: a claimed stage peer checks again at the start of a round, after encoding
        its payload; that payload is a pseudo-gradient of our inner steps and stays ours to send
        (applied to whichever θ_start the round starts from).
        """
        holders = self.dht.get_stage_peers(worker.stage)
        claims = parse_claims(holders, self.me.peer_id, self.refusals.peers())
        self._audit(worker, claims.values())
        claims = {p: c for p, c in claims.items() if p not in self.refusals}
        mine = Claim(self.me.peer_id, worker.outer_step, worker.state_id(), worker.ledger.link)
        embed = self._stage0_set(worker)
        prev = worker.ledger.prev
        own = prev.own[0][:PREFIX] if prev is not None and prev.own is not None else None
        committed = mine.link.replicas if mine.link is not None else []
        mine_embed = mine.link.embed if mine.link is not None else None
        for claim in better(claims.values(), mine):
            assert claim.link is not None
            if claim.link.embed not in (None, embed) and (embed is not None or claim.link.embed != mine_embed):
                continue  # its T⊥ moved by another set than stage 0's (or ours, while stage 0's is not known)
            if own in committed and own not in claim.link.replicas:
                continue  # it leaves out our own payload, which we committed: never adopted
            if self._check_and_switch(worker, claim, holders):
                return True
        stale_embed = embed is not None and mine.link is not None and mine.link.embed not in (None, embed)
        if stale_embed and embed is not None and self._rebase_embed(worker, embed, holders):
            return True
        same = [c for c in claims.values() if c.outer_step == worker.outer_step]
        win = majority(same, worker.outer_step, (worker.outer_step, mine.state))
        if win is None or win.state == mine.state or not _worse(mine, [claims[p] for p in win.holders]):
            return False
        changed = self.sync_state(
            worker,
            f"state {mine.state} disagrees with {win.state}, claimed by {len(win.holders)} of "
            f"{len(same) + 1} holders at outer step {worker.outer_step}",
            keep_errors=True,
            vote=True,
        )
        if not changed:  # the replay kept our state (docs/protocol.md, "Joining by replay")
            return False
        if prev is not None and not before_round:  # our commit's share of our payload, redone for theirs
            worker.optim.feed_back(prev.adjustment, -1.0)
            if prev.own is not None and (
                worker.ledger.link is None or prev.own[0][:16] not in worker.ledger.link.replicas
            ):
                worker.return_unsent(prev.own[1])
        return True

    def _audit(self, worker: StageWorker, claims: Iterable[Claim]) -> None:
        """Cheap checks of every claim, whatever its round (once per claim): a set naming payloads
        no replica announced (`peer.node.round.verify.resolve`), or our own set of that round from our
        own state with another state, is false: its holder is refused. Claims of other sets are
        checked by recomputation in `reconcile` (same round and state only)."""
        reads: dict[tuple[int, int], Mapping[str, Announcement]] = {}

        def announcements(t: int, stage: int) -> Mapping[str, Announcement]:
            if (t, stage) not in reads:
                reads[(t, stage)] = self.dht.get_payloads(t, stage)
            return reads[(t, stage)]

        replicas: Mapping[str, ReplicaRecord] | None = None
        for c in claims:
            if (c.peer, c.state) in self._audited:
                continue
            if c.link is None:  # an initial, downloaded or resumed state
                if c.outer_step == 0 and c.state != worker.initial_state_id:
                    self._audited.add((c.peer, c.state))
                    reason = f"it claims {c.state} as the initial state, which is {worker.initial_state_id}"
                    self.refusals.refuse(c.peer, worker.stage, 0, reason)
                continue
            self._audited.add((c.peer, c.state))
            link, ours = c.link, worker.ledger.history.get(c.link.t)
            if ours is not None and (ours.prev, ours.entries, ours.embed) == (link.prev, link.entries, link.embed):
                if ours.state != c.state:
                    self.refusals.refuse(c.peer, worker.stage, link.t, f"it claims state {c.state} for our set")
                continue
            replicas = self.dht.get_replicas() if replicas is None else replicas
            for stage, entries in ((worker.stage, link.entries), (0, link.embed or ())):
                anns, anns0 = announcements(link.t, stage), announcements(link.t, 0)
                forged = [e for e in entries if resolve(e, stage, anns, anns0, replicas).verdict is Verdict.FORGED]
                if forged:
                    names = ", ".join(r[:12] for r, _ in forged)
                    reason = f"its committed set names payloads no replica announced ({names})"
                    self.refusals.refuse(c.peer, worker.stage, link.t, reason)
                    break

    def _stage0_set(self, worker: StageWorker) -> tuple[Entry, ...] | None:
        """Stage 0's committed set of the round our stage > 0 last committed (`recheck.stage0_set`):
        the set T⊥ must have moved by; None on stage 0, in a ranges round, or while stage 0's holders
        have no strict majority for one set."""
        link = worker.ledger.link
        if worker.stage == 0 or link is None or link.embed is None or link.ranges is not None:
            return None
        own = self.stage0.ledger.history.get(link.t) if self.stage0 is not None else None
        holders = self.dht.get_stage_peers(0)
        mine = own.entries if own is not None and own.ranges is None else None
        refused = self.refusals.peers() | {self.me.peer_id}
        return stage0_set(holders, link.t, refused, mine)

    def _recompute(
        self, worker: StageWorker, claim: Claim, holders: Mapping[str, StageRecord], embed: Sequence[Entry] | None
    ) -> Recomputed:
        link = claim.link
        assert link is not None
        holder = holders.get(claim.peer)
        address = holder.address if holder is not None and holder.address else None
        return recompute_set(
            self.cfg, self.dht, self.clients, self.store, self.me.peer_id, worker, link.t, link.entries, embed, address
        )

    def _check_and_switch(self, worker: StageWorker, claim: Claim, holders: Mapping[str, StageRecord]) -> bool:
        """Check `claim` by recomputing its set from the state we committed its round from; switch
        to it when it holds (True), refuse its holder when it is false (False), or leave it for now
        when its payloads cannot be fetched (False)."""
        link, own = claim.link, worker.ledger.link
        assert link is not None and own is not None
        if (link.entries, link.embed) == (own.entries, own.embed):
            self.refusals.refuse(claim.peer, worker.stage, link.t, f"it claims state {claim.state} for our set")
            return False
        got = self._recompute(worker, claim, holders, link.embed)
        if got.forged:
            names = ", ".join(r[:12] for r, _ in got.forged)
            self.refusals.refuse(
                claim.peer, worker.stage, link.t, f"its committed set names payloads no replica announced ({names})"
            )
            return False
        if got.missing:
            log.info(
                "stage %d: cannot check the state %s of %s yet (%d payload(s) not available)",
                worker.stage,
                claim.state,
                claim.peer[:12],
                got.missing,
            )
            return False
        out = got.outcome
        if out is None:
            return False
        if out.state != claim.state:
            self.refusals.refuse(
                claim.peer,
                worker.stage,
                link.t,
                f"its state {claim.state} does not follow from its set (gives {out.state})",
            )
            return False
        why = f"the checked state {claim.state} of {claim.peer[:12]}"
        self._switch(worker, out, got.payloads, link.embed, why, claim.peer)
        return True

    def _rebase_embed(self, worker: StageWorker, embed: tuple[Entry, ...], holders: Mapping[str, StageRecord]) -> bool:
        """Our stage > 0 moved T⊥ by another stage-0 set than the one stage 0 committed: recompute our
        own set with stage 0's set and take it (no download). True if the state changed."""
        own = worker.ledger.link
        assert own is not None
        mine = Claim(self.me.peer_id, worker.outer_step, worker.state_id(), own)
        got = self._recompute(worker, mine, holders, embed)
        if got.outcome is None:
            log.info("stage %d: T⊥ not moved to stage 0's set of round %d yet (payloads missing)", worker.stage, own.t)
            return False
        self._switch(worker, got.outcome, got.payloads, embed, "stage 0's committed set for T⊥", self.me.peer_id)
        return True

    def _switch(
        self,
        worker: StageWorker,
        out: Outcome,
        payloads: Sequence[Payload],
        embed: Sequence[Entry] | None,
        why: str,
        peer: str,
    ) -> None:
        """Take a checked recomputation of our last round (`StageWorker.switch`), logged and published;
        `peer`: the holder whose claim it is (ours: a rebase of T⊥ onto stage 0's set)."""
        own = worker.ledger.link
        n_before = len(own.entries) if own is not None else 0
        worker.switch(out, payloads, embed)
        self.switches += 1
        log.info(
            "stage %d round %d: switched to %s (%d payloads; ours had %d)",
            worker.stage,
            out.t,
            why,
            len(payloads),
            n_before,
        )
        self.metrics.log(
            "switch",
            stage=worker.stage,
            t=worker.outer_step,
            round=out.t,
            state=worker.state_id(),
            param_hash=worker.param_hash(),
            perp_hash=worker.perp_hash(),
            peer=peer,
            why=why,
        )
        self.publish()


def download_claimed(
    clients: ClientPool,
    worker: StageWorker,
    pid: str,
    address: str,
    claim: Claim,
    errors: Mapping[str, Any] | None = None,
) -> StateReply | None:
    """Load the state that `pid` at `address` serves for `worker`'s stage (`GetState`) into `worker`
    and check it against `claim`: the reply when it loaded and has the claimed (outer step, state id),
    None (logged) otherwise; the worker then holds whatever was served. `errors`: the error buffer to
    keep (default: an empty one, as for any late joiner). The one check of every state download
    (`Resync.sync_state`, `peer export --initial-peers`)."""
    try:
        reply = clients.get(address).get_state(StateRequest(worker.stage))
        state: dict[str, Any] = {
            "outer_step": reply.outer_step,
            "start": {k: v for k, v in reply.tensors.items() if k != "perp"},
            "perp": reply.tensors["perp"],
            "bans": reply.meta.get("bans"),
            "link": None if claim.link is None else {**claim.link.to_record(), "state": claim.state},
        }
        if errors is not None:
            state["errors"] = errors
        worker.load_state_dict(state)
    except (PeerError, ValueError, KeyError) as exc:
        log.warning("state download of stage %d from %s failed: %s", worker.stage, pid[:12], exc)
        return None
    if (worker.outer_step, worker.state_id()) != (claim.outer_step, claim.state):
        log.warning("stage %d state from %s is not the state it claims; trying another holder", worker.stage, pid[:12])
        return None
    return reply


def _worse(mine: Claim, theirs: list[Claim]) -> bool:
    """Whether a majority state that we could not check should replace ours: always when it was
    reached from another state than ours (we are the odd one out since an earlier round), else
    only when the canonical order puts it first (if ours is first, they will switch to ours)."""
    other = theirs[0]
    if mine.link is None or other.link is None or other.link.prev != mine.link.prev:
        return True
    return (other.key, other.state) < (mine.key, mine.state)
