"""Keeping one peer's stages on the swarm's committed state, adopting nothing on a claim alone.

- `reconcile` (after every commit, and before a stage peer's round): the canonical-state check.
  Every claim is first audited cheaply, whatever its round (`peer.node.round.recheck.ClaimChecks`,
  which makes every check here): a set naming payloads no replica announced, our own set of a round
  from our own state with another state, or another state than the canonical initial one at outer
  step 0, is false.
  Claims of the same round from the same state as ours that the canonical order puts first (the
  most committed payloads, then the smallest state id: `peer.node.round.claims.better`) are CHECKED by
  recomputing their set from the state we committed from (`StageWorker.recompute`): a claim whose
  set is genuine and whose state follows from it replaces our commit (`StageWorker.switch`, no
  download); one that names payloads no replica announced, or whose state does not follow, gets
  its holder refused (`peer.node.round.refusals`); a claim that leaves out our own committed payload, or
  whose T⊥ moved by another stage-0 set than the one stage 0's majority committed, is never taken,
  and our own T⊥ is rebased onto that set. Only when a strict majority of the holders at our
  step agrees on another state that cannot be checked do we re-sync (`sync_state`: a replay that
  decides by the canonical order, not by the count).
- `sync_state`: replay the committed rounds from a state we trust — our own checked state
  (`StageWorker.verified`) or the canonical initial state, recomputed — checking each round's link
  by recomputation (`peer.node.round.replay`, docs/protocol.md "Joining by replay"); nothing is
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
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any, cast

from peer.errors import NetworkError, PeerError, ProcessGoneError
from peer.net.pool import ClientPool
from peer.net.transport.messages import StateReply, StateRequest
from peer.node.checkpoints.peer import PeerCheckpoints
from peer.node.round.bans import PREFIX
from peer.node.round.claims import Claim, better, majority, parse_claims, swarm_clock, voters
from peer.node.round.context import RoundContext
from peer.node.round.recheck import ClaimChecks
from peer.node.round.replay import Replayed, Replayer, RoundReads, SkipDead
from peer.node.round.verify import SetFetcher
from peer.node.stage.ahead import cloned
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

JOIN_WAIT_ROUNDS = 6  # round deadlines a (re)joining peer retries its replay before it gives up


class Resync:
    """State checks, switches and downloads of one peer's stage workers."""

    def __init__(
        self,
        ctx: RoundContext,
        checkpoints: PeerCheckpoints,
        attesters: Collection[str] = (),
        stop: threading.Event | None = None,
    ) -> None:
        """`ctx.publish` refreshes this peer's DHT records (after a download or a switch);
        `checkpoints.resumed_at` tells `late_join` whether the state came from `--resume`;
        `attesters`: whose attested states a joiner past the history window may start from, beside
        `swarm.attesters` (the manifest's signer, the bootstrap: `peer.bootstrap.attester`);
        `stop`: set when the peer is asked to leave: every wait here ends at once (NetworkError)."""
        cfg = ctx.cfg
        self.attesters = frozenset(cfg.swarm.attesters) | frozenset(attesters)
        self.ctx, self.cfg, self.dht, self.clients, self.store = ctx, cfg, ctx.dht, ctx.clients, ctx.store
        self.me, self.refusals, self.metrics = ctx.me, ctx.refusals, ctx.metrics
        self.publish, self.checkpoints = ctx.publish, checkpoints
        self.stop = stop or threading.Event()
        self.count = 0  # states adopted over the run (`sync_state`: replayed, or the initial one recomputed)
        self.checks = ClaimChecks(
            cfg, ctx.dht, ctx.clients, ctx.store, ctx.me.peer_id, ctx.refusals, ctx.metrics, ctx.publish
        )
        self.replayed: list[Replayed] = []  # every replay of this run (rounds, bytes, seconds)
        self.rewound: dict[tuple[int, int, str, str], None] = {}  # (stage, t, prev, ours) we went back from

    def clock(self) -> int:
        """The swarm's outer step: the lower median of the other live replicas' (`swarm_clock`)."""
        others = {pid: rec for pid, rec in self.dht.get_replicas().items() if pid != self.me.peer_id}
        return swarm_clock(others, self.refusals.peers())

    def late_join(self, worker: StageWorker) -> None:
        """If the swarm's clock is past this worker's outer step, replay the rounds to it (`sync_state`).

        A state resumed from a checkpoint at (or past) the clock is kept; one that is behind loses
        to the swarm's (error buffer and optimizer reset, as for any late joiner). A churning swarm
        may not serve the rounds for a while (holders restarting, an attester's record between two
        refreshes): tried again every `swarm.announce_interval_s` for `JOIN_WAIT_ROUNDS` round
        deadlines (each failure logged), then the last NetworkError; at once when asked to leave.
        """
        started, tries = time.monotonic(), 0
        give_up = started + JOIN_WAIT_ROUNDS * self.cfg.swarm.round_timeout_s
        first, count = (worker.outer_step, worker.state_id()), self.count
        while True:
            tries += 1
            try:
                self._late_join(worker)
                if self.count == count and (worker.outer_step, worker.state_id()) != first:
                    self._adopted(worker, False, "late join")  # a failed try replayed part of the way
                return
            except ProcessGoneError:
                raise  # this peer's DHT process is gone: no retry reaches the swarm again
            except NetworkError as exc:
                waited = time.monotonic() - started
                if self.stop.is_set() or time.monotonic() >= give_up:
                    raise NetworkError(f"{exc} (gave up joining after {tries} tries in {waited:.0f} s)") from None
                log.warning(
                    "stage %d: cannot join the swarm's state yet (try %d, retrying for %.0f s more): %s",
                    worker.stage,
                    tries,
                    give_up - time.monotonic(),
                    exc,
                )
            if self.stop.wait(self.cfg.swarm.announce_interval_s):
                raise NetworkError(f"stage {worker.stage}: asked to leave while joining the swarm's state")

    def _late_join(self, worker: StageWorker) -> None:
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
        until: int | None = None,
    ) -> bool:
        """Bring `worker` to the swarm's state by replaying the committed rounds from a state it
        trusts (`peer.node.round.replay`), never by counting who claims a state: True when its state changed.

        The trusted start: our own state when it was reached by a checked path (`worker.verified`),
        else the canonical initial state, recomputed (`StageState.reset_initial`); with `vote` (a
        majority of our step disagrees with us) the initial state when the history window reaches
        back to it, so the replay decides between the two histories by the canonical order. At the
        swarm's outer step 0 nothing is replayed: the state is the canonical initial one. Holders
        that are still committing the last round publish its link a moment later: we replay again
        until we reach the swarm's clock, for at most `wait_s` (default `swarm.round_timeout_s`);
        `until`: replay to exactly that outer step instead (`peer export --initial-peers`).
        A replay that stops where every live holder of the stage stops too (`_at_frontier`: nobody
        committed the stage's next round yet, the heads being past it) has reached the stage's state.
        Raises NetworkError (with the reason) when the swarm's state cannot be verified by then;
        the rounds checked so far are kept.
        """
        deadline = time.monotonic() + (self.cfg.swarm.round_timeout_s if wait_s is None else wait_s)
        before = (worker.outer_step, worker.state_id(), worker.loads)
        replayer = Replayer(self.cfg, self.dht, self._fetcher, self.refusals)
        attested = False
        while True:
            if self.stop.is_set():
                raise NetworkError(f"stage {worker.stage}: asked to leave while re-syncing ({reason})")
            clock = self.clock() if until is None else until
            if clock == 0 and worker.outer_step == 0:  # no vote where bytes decide (docs/protocol.md)
                if worker.state_id() != worker.initial_state_id or not worker.verified:
                    self._reset_initial(worker, keep_errors, reason)
                break
            self._start(worker, replayer, vote, clock, keep_errors, reason, initial=not attested)
            vote = False  # the start is chosen once; later tries go on from where the replay stopped
            done = replayer.run(worker, clock + 1 if until is None else until, self.stop)
            self.replayed = [*self.replayed[-63:], done]
            if worker.outer_step >= clock:
                if until is None and done.rounds and self.clock() > clock:  # the swarm went on meanwhile: once more
                    self.replayed = [*self.replayed[-63:], replayer.run(worker, self.clock() + 1, self.stop)]
                break
            # the clock + 1 is believed, read again: rounds go on while a replay fails (an attester that
            # follows them is past the clock read before it); `until` is exact
            limit = self.clock() + 1 if until is None else until
            if not done.rounds and self._attested(worker, limit, keep_errors, reason):
                attested = True  # from now on never back to the initial state: its rounds failed already
                continue  # beyond the window: an attester's state, replayed on from
            if until is None and self._at_frontier(worker):
                break  # no holder of the stage is past our checked state: its rounds are behind the clock
            if time.monotonic() >= deadline:
                raise NetworkError(
                    f"stage {worker.stage}: cannot verify the swarm's state (swarm at outer step {clock}, "
                    f"replayed to {worker.outer_step}): {done.stopped}. A state is adopted only by replaying "
                    "it from the initial state or our own checked state (docs/protocol.md, 'Joining by "
                    "replay'); retry when holders serve the rounds"
                )
            self.stop.wait(min(1.0, self.cfg.swarm.announce_interval_s))
        changed = (worker.outer_step, worker.state_id(), worker.loads) != before
        if changed:
            self._adopted(worker, keep_errors, reason, moved=(worker.outer_step, worker.state_id()) != before[:2])
        return changed

    def _adopted(self, worker: StageWorker, keep_errors: bool, reason: str, moved: bool = True) -> None:
        """After a re-sync moved `worker`: optimizer, `joined_at`, the count, the log and our records.
        `moved` False: the replay went back and ended on the very state we held (an outvoted holder
        whose own link the canonical order kept): we took part in round t as we were, and its payload
        may be out already, so `joined_at` stays (bumped, others stop expecting a payload we sent, and
        we refuse as censors the holders that closed without it)."""
        if not keep_errors:
            worker.fresh_optimizer()  # a late joiner starts with an empty error buffer and AdamW
        # a peer that (re)synced at t contributes from t + 1 (DESIGN §3: late joiners)
        if moved:
            self.me.joined_at = max(self.me.joined_at, worker.outer_step + 1)
        self.count += 1
        t, state = worker.outer_step, worker.state_id()
        log.info("%s: stage %d replayed to outer step %d (state %s)", reason, worker.stage, t, state)
        self.metrics.log("sync", stage=worker.stage, t=worker.outer_step, param_hash=worker.param_hash(), reason=reason)
        self.publish()

    def _start(
        self,
        worker: StageWorker,
        replayer: Replayer,
        vote: bool,
        clock: int,
        keep_errors: bool,
        reason: str,
        initial: bool = True,
    ) -> None:
        """Put `worker` on the state the replay starts from (sync_state's docstring): our own state
        when a link goes on from it; else, when our last commit was overtaken (another state was
        committed from the same one), the state we committed it from (`StageState.rewind`) — with
        `vote` only past the window, and only when another state was linked from it; else the
        canonical initial state when the window reaches back to it (the clock and our own step below
        `swarm.history_rounds`: round 0's payloads are still kept) — unless `initial` is off (an
        attester's state was loaded in this sync because the rounds from the initial state could not
        be had: their links can outlive their payloads).
        None of them: our own state (the replay then says why it cannot go on)."""
        stage, held = worker.stage, worker.state_id()
        if worker.outer_step == 0 and worker.verified and held == worker.initial_state_id:
            return  # we hold it already
        # round 0's payloads are still kept (`swarm.history_rounds`): its links outlive them, so their
        # presence alone does not say a replay from the initial state can go on. Our own step counts
        # too: the clock is the other replicas' lower median, and one re-syncing shows its replay's step
        in_window = max(clock, worker.outer_step) < self.cfg.swarm.history_rounds
        if (
            worker.verified
            and not vote
            and (worker.outer_step >= clock or replayer.has_links_from(worker.outer_step, stage, held))
        ):
            return
        prev = worker.ledger.prev
        # outvoted past the window: our last round's other outcome, if one was linked, is the one start
        # left that the replay can check (the initial state's rounds are gone)
        if (
            worker.verified
            and prev is not None
            and not (vote and in_window)
            and self._may_rewind(replayer, stage, prev.t, prev.state, held, overtaken_only=vote)
            and worker.rewind()
        ):
            log.info("%s: stage %d back at outer step %d (state %s) to replay", reason, stage, prev.t, prev.state)
            return
        if not worker.verified or (
            initial and in_window and replayer.has_links_from(0, stage, worker.initial_state_id)
        ):
            self._reset_initial(worker, keep_errors, reason)

    def _may_rewind(
        self, replayer: Replayer, stage: int, t: int, prev: str, held: str, overtaken_only: bool = False
    ) -> bool:
        """Whether to go back to `prev`, the state our round t started from: when a link of round t leads
        from it to another state than ours (our commit was overtaken), or to ours the first time only
        (the others' links may not be published yet). Back at our own state by our own link a second
        time is a loop — it kept a holder whose lone commits the swarm never took stuck for 270 s in
        `peer bench chaos`, until it was killed — so it starts over from the initial state instead.
        `overtaken_only` (an outvoted holder): only when another state was linked from `prev`."""
        linked = replayer.states_linked_from(t, stage, prev)  # one DHT read
        if linked - {held}:
            return True
        if overtaken_only or not linked:
            return False
        key = (stage, t, prev, held)
        if key in self.rewound:
            return False
        self.rewound[key] = None
        while len(self.rewound) > 64:
            del self.rewound[next(iter(self.rewound))]
        return True

    def _at_frontier(self, worker: StageWorker) -> bool:
        """Whether our checked state is as far as the stage has gone: no live holder of the stage
        claims a later outer step (a stage whose round t nobody committed yet while the heads moved
        on: the replay cannot pass it, and waiting for it here would keep us out of that round)."""
        if not worker.verified or worker.outer_step == 0:
            return False
        claims = parse_claims(self.dht.get_stage_peers(worker.stage), self.me.peer_id, self.refusals.peers())
        return not any(c.outer_step > worker.outer_step for c in claims.values())

    def _attested(self, worker: StageWorker, limit: int, keep_errors: bool, reason: str) -> bool:
        """Download a state that an attester (`self.attesters`) claims in its own signed stage record,
        at a step past ours up to `limit`, checked against its state id (`download_claimed`):
        a trusted start past the history window. True when one loaded."""
        attesters = self.attesters
        if not attesters:
            return False
        holders = {**self.dht.get_stage_peers(worker.stage), **self.dht.get_stage_peers(worker.stage, kind="attest")}
        claims = parse_claims(holders, self.me.peer_id, self.refusals.peers())
        ours = worker.outer_step
        found = [c for p, c in claims.items() if p in attesters and ours < c.outer_step <= limit]
        held = (cloned(worker.state_dict()), worker.verified) if found else None
        for claim in sorted(found, key=lambda c: (-c.outer_step, c.state, c.peer)):
            address = holders[claim.peer].address
            errors = worker.state_dict()["errors"] if keep_errors else None
            if not address:
                continue
            loads = worker.loads
            if download_claimed(self.clients, worker, claim.peer, address, claim, errors) is None:
                if worker.loads == loads:
                    continue  # nothing loaded (the call failed)
                assert held is not None  # a state that failed its check is never kept: back to ours
                worker.load_state_dict(held[0])
                with worker.lock:
                    worker.verified = held[1]
                continue
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
        clients = cast(ClientPool, SkipDead(self.clients))  # SetFetcher calls get(address).get_payload only
        return SetFetcher.of_run(self.cfg, reads, clients, self.store, self.me.peer_id, holders=True)

    def maintain(self, worker: StageWorker, max_lag: int | None = None) -> None:
        """Re-sync a worker more than `max_lag` rounds behind the swarm's clock (default: one, and one
        more with `train.overlap`: a replica may be a round further on), else `reconcile`."""
        lag = 1 + self.cfg.train.overlap if max_lag is None else max_lag
        if self.clock() > worker.outer_step + lag:
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
        self.checks.audit(worker, claims.values())
        claims = {p: c for p, c in claims.items() if p not in self.refusals}
        mine = Claim(self.me.peer_id, worker.outer_step, worker.state_id(), worker.ledger.link)
        embed = self.checks.stage0_set(worker)
        prev = worker.ledger.prev
        own = prev.own.replica[:PREFIX] if prev is not None and prev.own is not None else None
        committed = mine.link.replicas if mine.link is not None else []
        mine_embed = mine.link.embed if mine.link is not None else None
        for claim in better(claims.values(), mine):
            assert claim.link is not None
            if claim.link.embed not in (None, embed) and (embed is not None or claim.link.embed != mine_embed):
                continue  # its T⊥ moved by another set than stage 0's (or ours, while stage 0's is not known)
            if own in committed and own not in claim.link.replicas:
                continue  # it leaves out our own payload, which we committed: never adopted
            if self.checks.check_and_switch(worker, claim, holders):
                return True
        stale_embed = embed is not None and mine.link is not None and mine.link.embed not in (None, embed)
        if stale_embed and embed is not None and self.checks.rebase_embed(worker, embed, holders):
            return True
        same = voters(claims.values(), worker.outer_step, embed)
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
                worker.ledger.link is None or prev.own.replica[:16] not in worker.ledger.link.replicas
            ):
                worker.return_unsent(prev.own.payload)
        return True


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
