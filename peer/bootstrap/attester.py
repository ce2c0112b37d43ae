"""The bootstrap's attester: it follows the run's committed rounds of every stage by replay and
attests the states it reached, so that a joiner past the history window has a start it may trust.

A joiner adopts a state only by recomputing it from a state it trusts (docs/protocol.md, "Joining
by replay"): the canonical initial state, its own checked state, or a state attested by a key the
run names — the bootstrap's (the manifest's signer) by default, plus `swarm.attesters`. The
attester earns that trust the same way any joiner would: it starts from the canonical initial state
(or its own checkpoint), and replays each round's link only after recomputing it from the payloads
(`peer.node.round.replay.Replayer`: genuine payloads, the portable commit, false links refused). It holds
no pipeline, trains nothing and contributes nothing.

Every `poll` (the bootstrap's serve loop, on a thread of its own):
1. replay every stage up to the swarm's clock (`swarm_clock`, as a joiner reads it: the outer step
   the lower median of the live replicas reached), never into the round still being committed;
2. publish one `attest.{s}` record per stage (a stage record: address, outer step, state id, link),
   signed by the bootstrap's key like every record;
3. save each stage's state to `folder` (`stage-{s}.pt`, atomically) when it moved, so a restarted
   bootstrap goes on from its own checked state instead of the initial one, and keep the last
   `KEEP_STATES` of them (`stage-{s}/`): a state on a branch the swarm left further back than one
   round goes back to the newest kept one from which the published links reach the clock.
`state_reply(stage)` serves the attested state (`GetState`); a joiner checks it against the state
id of the attestation before it replays on from it (`peer.node.round.resync.download_claimed`).
`payload` serves what the replays fetched in the history window (`GetPayload`, sender named), so a
round whose contributors all left can still be replayed by a joiner.

Invariants: the attester's states are reached only by `StageState.advance` (a checked replay),
`reset_initial` or its own checkpoint; it never downloads a state. A stage it cannot follow (it
fell out of the history window) keeps its last attestation's state and says why, every
`WARN_EVERY_S`, until the rounds it needs are served again.
Cost: one stage state per stage (parameters, θ_start, T⊥) in memory, `KEEP_STATES` + 1 of them
per stage on disk, and every committed payload of every stage fetched once per round — a machine
that could hold a full replica (docs/protocol.md).
"""

from __future__ import annotations

import io
import logging
import time
from pathlib import Path
from typing import Any

import torch

from peer.config import RunConfig
from peer.core.files import atomic_write_bytes
from peer.core.subspace.state import perp_of
from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.transport.messages import PayloadKind, PayloadRequest, StateReply
from peer.node.round.claims import swarm_clock
from peer.node.round.payload_disk import PayloadDisk
from peer.node.round.payloads import PayloadStore
from peer.node.round.refusals import Refusals
from peer.node.round.replay import Replayed, Replayer, RoundReads, SkipDead, parse_chain
from peer.node.round.verify import SetFetcher
from peer.node.stage.state import StageState

log = logging.getLogger(__name__)

WARN_EVERY_S = 60.0  # a stage that cannot be followed says so this often
KEEP_STATES = 8  # checked states kept per stage (`folder`/stage-{s}/): how far back a dead end can go


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


class Attester:
    """Follows every stage of the run by replay and attests the states reached (module docstring)."""

    def __init__(
        self, cfg: RunConfig, dht: SwarmDHT, clients: ClientPool, address: str, folder: Path | None = None
    ) -> None:
        """`address`: the gRPC host:port joiners download attested states from; `folder`: where the
        states are kept across restarts (None: memory only)."""
        self.cfg, self.dht, self.clients, self.address, self.folder = cfg, dht, clients, address, folder
        self.refusals = Refusals()
        # the payloads it replayed, served to joiners as a second source: on disk too, kept across restarts
        disk = PayloadDisk(folder / "payloads", resume=True) if folder is not None else None
        self.store = PayloadStore(history=cfg.swarm.history_rounds, disk=disk)
        self.store.restore()
        self.replayer = Replayer(cfg, dht, self._fetcher, self.refusals)
        self.stages = {s: StageState(cfg, s) for s in range(cfg.stages)}
        self.saved = {s: "" for s in self.stages}  # stage → the state id last saved
        self.stuck: dict[int, str] = {}  # stage → why it cannot follow now
        self._warned_at: dict[int, float] = {}
        self.last: dict[int, Replayed] = {}
        self._rewound: dict[tuple[int, str], float] = {}  # (stage, state) gone back from → not again before
        self._gone_back: dict[int, tuple[str, int]] = {}  # stage → (state, clock) `_go_back` last tried from
        for s, state in self.stages.items():
            self._resume(s, state)

    # ------------------------------------------------------------------ following the run
    def poll(self) -> None:
        """Replay every stage to the swarm's clock, attest, save (module docstring). Never raises
        a network failure: the next poll tries again."""
        try:
            replicas = self.dht.get_replicas()
            clock = swarm_clock(replicas, self.refusals.peers())
            steps = [r.outer_step for r in replicas.values() if r.outer_step is not None]
        except PeerError as exc:
            log.info("attester: cannot read the swarm's clock (%s); next poll", exc)
            return
        for s, state in self.stages.items():
            try:
                self._follow(s, state, clock, max(steps, default=None))
                self._attest(s, state)
            except PeerError as exc:
                log.info("attester: stage %d: %s; next poll", s, exc)
            self._save(s, state)

    def _follow(self, s: int, state: StageState, clock: int, newest: int | None) -> None:
        # ahead of every live replica by more than the window: a kept state of another run (same config
        # and key); a replica that left ahead of the others leaves us a round or two ahead, no more
        if newest is not None and state.outer_step > newest + 1 + self.cfg.swarm.history_rounds:
            log.warning(
                "attester: stage %d's kept state is at outer step %d, every replica of the swarm at %d or "
                "before: starting over from the initial state",
                s,
                state.outer_step,
                newest,
            )
            state.reset_initial()
        if state.outer_step >= clock:
            return
        # to the clock, not past it: round `clock` is still being committed, and the first link of it
        # published may be a lone holder's that the others overtake a moment later; the links of round
        # `clock` (the horizon) weigh between those of the round before (`Replayer.step`)
        done = self.replayer.run(state, clock, horizon=clock + 1)
        if not done.rounds and (self._rewind(s, state) or self._go_back(s, state, clock)):
            done = self.replayer.run(state, clock, horizon=clock + 1)
        self.last[s] = done
        if done.rounds:
            log.debug("attester: stage %d at outer step %d (state %s)", s, state.outer_step, state.state_id())
        if done.rounds or state.outer_step >= clock:
            self.stuck.pop(s, None)
            return
        self.stuck[s] = done.stopped
        if time.monotonic() - self._warned_at.get(s, -WARN_EVERY_S) >= WARN_EVERY_S:
            self._warned_at[s] = time.monotonic()
            log.warning(
                "attester: stage %d cannot follow the swarm (at outer step %d, swarm at %d): %s",
                s,
                state.outer_step,
                clock,
                done.stopped,
            )

    def _rewind(self, s: int, state: StageState) -> bool:
        """Our last replayed round was overtaken: its holders switched to another set of it (a
        RECONCILE switch republishes the round's link) and went on from that state, so no link goes
        on from ours. Back to the state it was replayed from (`StageState.rewind`, one round), when
        round t was committed from another state and a link of the round before goes on from there;
        the next replay takes the link that reaches further (`Replayer.step`). True when it went back."""
        t, held, prev = state.outer_step, state.state_id(), state.ledger.prev
        if prev is None or prev.t != t - 1 or time.monotonic() < self._rewound.get((s, held), 0.0):
            return False  # a further link failed its check from here a moment ago: not every poll
        links = self.dht.get_round("chain", t, s, parse_chain)
        if not links or any(link.prev == held for link in links.values()):
            return False  # round t not committed yet, or a link of it goes on from our state
        if not self.replayer.has_links_from(prev.t, s, prev.state) or not state.rewind():
            return False
        self._rewound[(s, held)] = time.monotonic() + WARN_EVERY_S
        log.info(
            "attester: stage %d back at outer step %d: round %d went on from another state than %s", s, prev.t, t, held
        )
        return True

    def _go_back(self, s: int, state: StageState, clock: int) -> bool:
        """Our state is a dead end further back than one round: round t was committed, from other
        states only (a branch whose holders switched away, or died, while their links stay published).
        Back to the newest state we kept (`_keep`) from which the published links reach the clock —
        the branch the swarm went on along — checked against its state id. True when one loaded."""
        t, held, kept = state.outer_step, state.state_id(), self._kept(s)
        if not kept or self._gone_back.get(s) == (held, clock):
            return False  # nothing kept, or tried from here at this clock already
        links = self.dht.get_round("chain", t, s, parse_chain)
        if not links or any(link.prev == held for link in links.values()):
            return False  # round t not committed yet, or a link of it goes on from our state
        self._gone_back[s] = (held, clock)
        reads, refused = RoundReads(self.dht), self.refusals.peers()
        for step, sid, path in kept:
            if step >= t or reads.reach(step, s, sid, clock, refused) < clock:
                continue
            try:
                saved = torch.load(path, map_location="cpu", weights_only=True)
                if saved.get("state_id") != sid:
                    raise ValueError("it names another state")
                state.load_state_dict(saved)
            except (OSError, RuntimeError, ValueError, KeyError, TypeError, AttributeError) as exc:
                log.warning("attester: ignoring %s (%s)", path, exc)
                continue
            if state.state_id() != sid:  # a file that loads but does not give its state: no start of ours
                log.warning("attester: %s does not hold the state it names; stage %d starts over", path, s)
                state.reset_initial()
                return True
            with state.lock:
                state.verified = True  # our own checked state, kept by us
            log.info(
                "attester: stage %d back at outer step %d (state %s): round %d went on from other states than %s",
                s,
                step,
                sid,
                t,
                held,
            )
            return True
        return False

    def _attest(self, s: int, state: StageState) -> None:
        with state.lock:
            link = state.ledger.link
            record: dict[str, Any] = {
                "address": self.address,
                "role": "attester",
                "state": "ready",
                "outer_step": state.outer_step,
                "param_hash": state.param_hash(),
                "perp_hash": state.perp_hash(),
                "state_id": state.state_id(),
                "bans": state.ledger.bans.to_record(),
                "link": None if link is None else link.to_record(),
            }
        self.dht.announce_stage(s, record, ttl_s=self.cfg.swarm.record_ttl_s, kind="attest")

    # ------------------------------------------------------------------ serving
    def state_reply(self, stage: int) -> StateReply | None:
        """The attested state of `stage` (`GetState`), None when the run has no such stage."""
        state = self.stages.get(stage)
        if state is None:
            return None
        return state.reply()

    def payload(self, request: PayloadRequest) -> bytes | None:
        """A payload of round (t, s) that a replay fetched, from the sender named (`GetPayload`):
        the attester serves the history window too, for joiners whose senders left."""
        if request.kind is not PayloadKind.PAYLOAD or not request.sender:
            return None
        return self.store.get(request.outer_step, request.stage, request.sender)

    def info(self) -> dict[str, Any]:
        """For `info`: each stage's attested outer step and state, and why a stage is stuck."""
        out: dict[str, Any] = {
            str(s): {"outer_step": st.outer_step, "state": st.state_id()} for s, st in self.stages.items()
        }
        for s, why in self.stuck.items():
            out[str(s)]["stuck"] = why
        return out

    # ------------------------------------------------------------------ keeping it across restarts
    def _path(self, s: int) -> Path | None:
        return None if self.folder is None else self.folder / f"stage-{s}.pt"

    def _save(self, s: int, state: StageState) -> None:
        path = self._path(s)
        if path is None or self.saved[s] == state.state_id():
            return  # saved already (a state gone back from and replayed to again is saved again)
        with state.lock:
            kept = {
                "outer_step": state.outer_step,
                "start": dict(state.start),
                "perp": perp_of(state.module).detach().cpu().clone(),
            }
            kept["bans"] = state.ledger.bans.to_record()
            link = state.ledger.link
            kept["link"] = None if link is None else {**link.to_record(), "state": link.state}
            kept["state_id"] = state.state_id()
        buf = io.BytesIO()
        torch.save(kept, buf)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, buf.getvalue())
        self.saved[s] = sid = str(kept["state_id"])
        self._keep(s, state.outer_step, sid, buf.getvalue())

    def _keep(self, s: int, step: int, sid: str, data: bytes) -> None:
        """Keep the state just saved beside the `KEEP_STATES` - 1 newest ones (`_go_back`'s starts)."""
        assert self.folder is not None
        folder = self.folder / f"stage-{s}"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(folder / f"{step:08d}-{sid}.pt", data)
        for _, _, old in self._kept(s)[KEEP_STATES:]:
            old.unlink(missing_ok=True)

    def _kept(self, s: int) -> list[tuple[int, str, Path]]:
        """The states `_keep` kept of stage `s`: (outer step, state id, file), newest first."""
        if self.folder is None:
            return []
        out = []
        for path in (self.folder / f"stage-{s}").glob("*.pt"):
            step, _, sid = path.stem.partition("-")
            if step.isdigit() and sid:
                out.append((int(step), sid, path))
        return sorted(out, key=lambda k: (k[0], _mtime(k[2])), reverse=True)

    def _resume(self, s: int, state: StageState) -> None:
        path = self._path(s)
        if path is None or not path.exists():
            return
        try:
            kept = torch.load(path, map_location="cpu", weights_only=True)
            state.load_state_dict(kept)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError) as exc:
            log.warning("attester: ignoring %s (%s); stage %d starts from the initial state", path, exc, s)
            state.reset_initial()
            return
        if state.state_id() != kept.get("state_id"):
            log.warning(
                "attester: %s does not hold the state it names; stage %d starts from the initial state", path, s
            )
            state.reset_initial()
            return
        with state.lock:
            state.verified = True  # our own checked state, saved by us
        self.saved[s] = state.state_id()
        log.info("attester: stage %d resumed at outer step %d (state %s)", s, state.outer_step, state.state_id())

    def _fetcher(self, reads: RoundReads) -> SetFetcher:
        clients: Any = SkipDead(self.clients)  # SetFetcher calls get(address).get_payload only
        return SetFetcher.of_run(self.cfg, reads, clients, self.store, self.dht.peer_id, holders=True)
