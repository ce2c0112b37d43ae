"""Keeping one peer's stages on the swarm's committed state (DESIGN §3: late joiners, divergence).

- `late_join`: a worker behind the swarm downloads the stage's committed state (a resumed
  checkpoint at or past the swarm's outer step is kept);
- `maintain`: a worker more than `max_lag` rounds behind, or whose committed state is not the
  canonical one of its stage's holders at the same outer step (`peer.node.agreement.canonical`),
  re-syncs (keeping its error buffer, and returning a payload that missed the canonical commit to
  it: nothing is lost);
- `catch_up`: after a download at outer step t the peer applies round t as an observer, since the
  others did not expect it in round t.

Invariants: a downloaded state is adopted only through `StageWorker.load_state_dict` and only when
its parameter hash matches the holder's claim; a peer that (re)synced at t contributes from t + 1
(`Session.joined_at`); no holder serving a good state is a `NetworkError` that says when to retry.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from peer.errors import NetworkError, PeerError
from peer.net.transport.messages import StateRequest
from peer.node.agreement import canonical, state_key
from peer.node.bans import Bans
from peer.node.rounds import expected_replicas
from peer.node.stage_worker import StageWorker

if TYPE_CHECKING:
    from peer.node.session import Session

log = logging.getLogger(__name__)


class Resync:
    """State downloads and divergence checks of one peer's stage workers."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.count = 0  # state downloads adopted over the run

    def late_join(self, worker: StageWorker) -> None:
        """If the swarm is past this worker's outer step, download the stage's committed state.

        A state resumed from a checkpoint at (or past) the swarm's outer step is kept; one that is
        behind loses to the swarm's (error buffer and optimizer reset, as for any late joiner).
        """
        sess = self.session
        t_swarm = sess.dht.current_outer_step()
        resumed = sess.checkpoints.resumed_at is not None
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
            sess.metrics.log(
                "resume_kept", stage=worker.stage, t=worker.outer_step, swarm_t=t_swarm, param_hash=worker.param_hash()
            )

    def sync_state(
        self,
        worker: StageWorker,
        reason: str,
        want_hash: str | None = None,
        keep_errors: bool = False,
        want_perp: str | None = None,
    ) -> None:
        """Download stage state from the most advanced holder (with `want_hash` / `want_perp`, if given).

        Raises NetworkError when no holder serves a state that passes its hash check.
        """
        sess = self.session
        t_swarm = sess.dht.current_outer_step()
        holders = {
            pid: rec
            for pid, rec in sess.dht.get_stage_peers(worker.stage).items()
            if pid != sess.peer_id
            and rec.get("address")
            and (want_hash is None or rec.get("param_hash") == want_hash)
            and (want_perp is None or rec.get("perp_hash") == want_perp)
        }
        for pid, rec in sorted(holders.items(), key=lambda kv: (-kv[1].get("outer_step", 0), kv[0])):
            try:
                reply = sess.clients.get(rec["address"]).get_state(StateRequest(worker.stage))
                if reply.meta.get("param_hash") is None:
                    raise PeerError("state reply without a parameter hash")
                state: dict[str, Any] = {
                    "outer_step": reply.outer_step,
                    "start": {k: v for k, v in reply.tensors.items() if k != "perp"},
                    "perp": reply.tensors["perp"],
                }
                if keep_errors:  # what this peer has not sent yet is not lost
                    state["errors"] = worker.state_dict()["errors"]
                worker.load_state_dict(state)
            except (PeerError, ValueError, KeyError) as exc:
                log.warning("state download of stage %d from %s failed: %s", worker.stage, pid[:12], exc)
                continue
            if worker.param_hash() != reply.meta["param_hash"]:
                log.warning(
                    "stage %d state from %s fails its hash check; trying another holder", worker.stage, pid[:12]
                )
                continue
            committed = rec.get("committed")
            worker.last_committed = [str(r) for r in committed] if isinstance(committed, list) else []
            worker.bans = Bans.from_record(reply.meta.get("bans", rec.get("bans")))  # served with the state
            # a peer that (re)synced at t contributes from t + 1 (DESIGN §3: late joiners)
            sess.joined_at = max(sess.joined_at, reply.outer_step + 1)
            self.count += 1
            log.info(
                "%s: stage %d state at outer step %d from %s (hash %s)",
                reason,
                worker.stage,
                reply.outer_step,
                pid[:12],
                worker.param_hash(),
            )
            sess.metrics.log(
                "sync", stage=worker.stage, t=reply.outer_step, param_hash=worker.param_hash(), reason=reason
            )
            sess.records.refresh()
            return
        raise NetworkError(
            f"the swarm is at outer step {t_swarm} but no peer served stage {worker.stage}'s state; "
            "retry when a holder of that stage is online"
        )

    def catch_up(self, workers: Mapping[int, StageWorker], stop: threading.Event) -> None:
        """After a state download at outer step t, apply round t as an observer instead of
        contributing to it: the others did not expect this replica in round t."""
        sess = self.session
        t = min(w.outer_step for w in workers.values())
        if sess.joined_at <= t or not expected_replicas(sess.dht, t):
            return
        results = {s: sess.rounds.gather(w, t, None, stop) for s, w in workers.items()}
        embed = None if 0 in results else sess.rounds.gather(next(iter(workers.values())), t, None, stop, stage=0)
        sess.rounds.commit(workers, results, embed)
        sess.metrics.log("catch_up", t=t)
        sess.records.refresh()

    def maintain(self, worker: StageWorker, max_lag: int = 1) -> None:
        """Re-sync a worker that fell more than `max_lag` rounds behind, or whose committed state is
        not the canonical one among its stage's holders at the same outer step (`reconcile`)."""
        sess = self.session
        if sess.dht.current_outer_step() > worker.outer_step + max_lag:
            self.sync_state(worker, f"behind (outer step {worker.outer_step})")
            return
        self.reconcile(worker)

    def reconcile(self, worker: StageWorker, before_round: bool = False) -> bool:
        """Adopt the canonical state among the stage's holders at the worker's outer step
        (`peer.node.agreement.canonical`: the most committed replicas, then the smallest hashes —
        the same answer on every holder, even with two of them). True if the worker re-synced.

        After a round (`before_round` False) a payload of ours that the canonical commit lacks
        returns to the error buffer. Before a round (a claimed stage peer, which is never idle
        between rounds) the payload just encoded for this round stays ours to send: it is a
        pseudo-gradient of our inner steps, and the round applies it to the canonical θ_start.
        """
        sess = self.session
        same = [
            rec
            for pid, rec in sess.dht.get_stage_peers(worker.stage).items()
            if pid != sess.peer_id and rec.get("outer_step") == worker.outer_step and rec.get("param_hash")
        ]
        if not same:
            return False
        mine = {
            "committed": [r[:16] for r in worker.last_committed],
            "param_hash": worker.param_hash(),
            "perp_hash": worker.perp_hash(),
            "bans": worker.bans.to_record(),
        }
        win = canonical([*same, mine])
        if win is None or state_key(win) == state_key(mine):
            return False
        committed: list[str] = list(win.get("committed") or [])
        if (win.get("param_hash"), win.get("perp_hash")) == (mine["param_hash"], mine["perp_hash"]):
            worker.last_committed = committed  # the same state (e.g. resumed from a checkpoint): nothing to fetch
            worker.bans = Bans.from_record(win.get("bans"))  # equal states, bans of the winner (peer.node.bans)
            return False
        last = worker.last_contribution
        unsent = last[1] if last is not None and not before_round and last[0][:16] not in committed else None
        self.sync_state(
            worker,
            f"hash {mine['param_hash']}/{str(mine['perp_hash'])[:8]} disagrees with the canonical state "
            f"{win['param_hash']}/{str(win.get('perp_hash'))[:8]} ({len(committed)} replicas committed) "
            f"of {len(same) + 1} holders",
            want_hash=str(win["param_hash"]),
            keep_errors=True,
            want_perp=win.get("perp_hash"),
        )
        if unsent is not None:
            worker.return_unsent(unsent)  # our payload missed their commit: nothing is lost
            worker.observe()
            log.info("stage %d: our payload missed the canonical commit; returned to the error buffer", worker.stage)
        return True
