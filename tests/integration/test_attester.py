"""The bootstrap's attester (issue 34, Deliver 3): real hivemind DHT nodes, real gRPC on 127.0.0.1.

Two honest holders A and B of stage 0 committed `ROUNDS` rounds (tests/replay_helpers.py: real
payloads, real portable commits), serve their payloads and publish each round's link; the links of
all but the last round are published with a short ttl, so they expire — the history window moves
on. Before they do, the attester (`peer.bootstrap.attester`, on a DHT node and a gRPC server of its own,
as the bootstrap runs it) follows the stage by replay. After they expired:
- a joiner that trusts only a key whose attestation is false (its state id is not the state served)
  cannot verify the swarm's state and says so;
- a joiner that trusts the attester downloads the attested state over gRPC, checks it against the
  attestation's state id and ends on the honest holders' state, ignoring a forged attestation by a
  key nobody named;
- a restarted attester resumes from its own saved state, not from the initial one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from peer.bootstrap.artifacts import ArtifactHandler
from peer.bootstrap.attester import Attester
from peer.config import history_ttl_s
from peer.errors import NetworkError
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.transport.server import PeerServer
from peer.node.round.payloads import payload_id
from peer.node.round.replay import chain_record
from peer.node.round.resync import Resync
from peer.node.service import PeerService
from peer.node.session import Session, SessionOptions
from peer.node.stage.worker import StageWorker
from tests.replay_helpers import History, replay_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROUNDS = 5
STAGE = 0
SHORT_TTL_S = 4.0  # the early links' life: they expire while the test runs


def _session(dht: SwarmDHT, cfg, root: Path, name: str) -> Session:
    return Session(SessionOptions(initial_peers=(), data_dir=root / name), dht, {}, cfg, role="full", stage=None)


def _serve_history(dht: SwarmDHT, cfg, root: Path, history: History, ttl: float) -> Session:
    """A holder of `history`: its session serves the stage and every round's payload, announced as its own."""
    session = _session(dht, cfg, root, dht.peer_id[-6:])
    worker = history.workers[(dht.peer_id, STAGE)]
    session.service = PeerService(cfg, {STAGE: worker}, session.store, session.peer_id, "full")
    session.server = PeerServer(session.service, host="127.0.0.1", port=0)
    for t in range(ROUNDS):
        data = history.payloads[(t, STAGE, dht.peer_id)]
        session.store.put(t, STAGE, data)
        ann = {"sha256": payload_id(data), "size": len(data), "address": session.server.address}
        dht.announce_payload(t, STAGE, {**ann, "replica": dht.peer_id}, ttl_s=ttl)
    return session


def _joiner_resync(session: Session, cfg, attesters: tuple[str, ...]) -> Resync:
    s = session
    return Resync(dataclasses.replace(s.rounds.ctx, cfg=cfg, publish=lambda: None), s.checkpoints, attesters)


def test_a_joiner_past_the_window_starts_from_the_attested_state_and_only_a_named_attesters(tmp_path, reap_children):
    cfg = replay_config(history_rounds=ROUNDS + 2)
    dhts: list[SwarmDHT] = []
    sessions: list[Session] = []
    servers: list[PeerServer] = []
    clients = ClientPool(10.0)
    try:
        dhts.append(SwarmDHT())
        dhts += [SwarmDHT(initial_peers=dhts[0].visible_maddrs()) for _ in range(4)]
        for dht in dhts:
            dht.set_run("attest-test", cfg.stages)
        a_dht, b_dht, att_dht, forger, j_dht = dhts
        history = History(cfg, replicas=(a_dht.peer_id, b_dht.peer_id))
        history.run(ROUNDS)
        ttl = history_ttl_s(cfg.swarm)
        for dht in (a_dht, b_dht):  # the honest holders: serve, announce, link every round
            sessions.append(_serve_history(dht, cfg, tmp_path, history, ttl))
            for t in range(ROUNDS):
                link_ttl = ttl if t == ROUNDS - 1 else SHORT_TTL_S
                dht.announce_round("chain", t, STAGE, chain_record(history.links[(t, STAGE)]), link_ttl)
            replica = {"kind": "full", "outer_step": ROUNDS, "shard": 0, "joined_at": 0, "address": ""}
            dht.announce_replica({**replica, "loss": None, "tokens_per_s": 0.0}, ttl_s=ttl)
        published = time.monotonic()

        handler = ArtifactHandler({}, {"run_id": "attest-test"})
        servers.append(PeerServer(handler, host="127.0.0.1", port=0))
        attester = Attester(cfg, att_dht, clients, servers[-1].address, tmp_path / "attest")
        handler.attester = attester
        attester.poll()
        assert time.monotonic() - published < SHORT_TTL_S, "the attester must follow before the links expire"
        assert attester.stages[STAGE].outer_step == ROUNDS
        assert attester.stages[STAGE].state_id() == history.state(STAGE)
        assert attester.stages[1].outer_step == 0 and "1" in {str(s) for s in attester.stuck}  # nobody links stage 1
        assert (tmp_path / "attest" / f"stage-{STAGE}.pt").exists()

        forged = {"outer_step": ROUNDS, "state_id": "f" * 16, "address": servers[-1].address, "state": "ready"}
        forger.announce_stage(STAGE, forged, ttl_s=ttl, kind="attest")  # a key nobody named

        time.sleep(max(0.0, SHORT_TTL_S + 1.0 - (time.monotonic() - published)))  # the window moved on
        joiner = _session(j_dht, cfg, tmp_path, "joiner")
        sessions.append(joiner)
        with pytest.raises(NetworkError, match="round 0: no holder published a link"):  # named, but lying
            _joiner_resync(joiner, cfg, (forger.peer_id,)).sync_state(StageWorker(cfg, STAGE), "late join", wait_s=0)
        # a joining peer tries again for a bounded time, each failure logged, and at once gives up when asked to leave
        quick = dataclasses.replace(
            cfg, swarm=dataclasses.replace(cfg.swarm, round_timeout_s=0.4, announce_interval_s=0.1)
        )
        liar = _joiner_resync(joiner, quick, (forger.peer_id,))
        started = time.monotonic()
        with pytest.raises(
            NetworkError, match=r"round 0: no holder published a link.*gave up joining after ([2-9]|\d\d) tries"
        ):
            liar.late_join(w := StageWorker(cfg, STAGE))
        assert time.monotonic() - started < 15.0  # JOIN_WAIT_ROUNDS (6) round deadlines of 0.4 s, and one try past them
        assert w.outer_step == 0 and w.verified  # a state that failed its check is never kept
        liar.stop.set()
        started = time.monotonic()
        with pytest.raises(NetworkError, match="asked to leave"):
            liar.late_join(StageWorker(cfg, STAGE))
        assert time.monotonic() - started < 1.0
        served = handler.stats()["states_served"]  # the lie (it points here, with another state id), each try
        assert served >= 3
        resync = _joiner_resync(joiner, cfg, (att_dht.peer_id,))
        worker = StageWorker(cfg, STAGE)
        assert resync.sync_state(worker, "late join", wait_s=0)
        assert worker.outer_step == ROUNDS and worker.state_id() == history.state(STAGE) and worker.verified
        assert handler.stats()["states_served"] == served + 1  # ours

        again = Attester(cfg, att_dht, clients, servers[-1].address, tmp_path / "attest")  # a restart
        assert again.stages[STAGE].outer_step == ROUNDS and again.stages[STAGE].verified
        assert again.stages[STAGE].state_id() == history.state(STAGE)
    finally:
        clients.close()
        for server in servers:
            server.stop(grace_s=0.5)
        for session in sessions:
            session.close()
        for dht in dhts:
            if all(dht is not s.dht for s in sessions):
                dht.shutdown()


@dataclasses.dataclass
class TwoHolders:
    """Holders a and b of `History` (serving every round's payload) and the attester's DHT node."""

    cfg: Any
    history: History
    a: SwarmDHT
    b: SwarmDHT
    attester_dht: SwarmDHT
    clients: ClientPool
    ttl: float

    def at(self, clock: int) -> None:
        """Both holders' replica records at outer step `clock`: the swarm's clock."""
        for dht in (self.a, self.b):
            replica = {"kind": "full", "outer_step": clock, "shard": 0, "joined_at": 0, "address": ""}
            dht.announce_replica({**replica, "loss": None, "tokens_per_s": 0.0}, ttl_s=self.ttl)

    def link(self, dht: SwarmDHT, link: Any) -> None:
        dht.announce_round("chain", link.t, STAGE, chain_record(link), self.ttl)

    def branch(self, alone: set[int], rounds: int) -> dict[int, Any]:
        """Links of another history of `rounds` rounds: rounds in `alone` committed with a's payload
        alone, the others with both (genuine sets, their states off the honest ones from the first)."""
        from peer.core.sparseloco.codec.format import Payload

        worker, links = StageWorker(self.cfg, STAGE), {}
        for t in range(rounds):
            rids = self.history.replicas[:1] if t in alone else self.history.replicas
            worker.apply_round([Payload.from_bytes(self.history.payloads[(t, STAGE, r)]) for r in rids], None, rids)
            links[t] = worker.ledger.link
        return links


@contextlib.contextmanager
def _two_holders(tmp_path: Path, run: str, history_rounds: int) -> Iterator[TwoHolders]:
    cfg = replay_config(history_rounds=history_rounds)
    dhts: list[SwarmDHT] = []
    sessions: list[Session] = []
    clients = ClientPool(10.0)
    try:
        dhts.append(SwarmDHT())
        dhts += [SwarmDHT(initial_peers=dhts[0].visible_maddrs()) for _ in range(2)]
        for dht in dhts:
            dht.set_run(run, cfg.stages)
        a_dht, b_dht, att_dht = dhts
        history = History(cfg, replicas=(a_dht.peer_id, b_dht.peer_id))
        history.run(ROUNDS)
        ttl = history_ttl_s(cfg.swarm)
        for dht in (a_dht, b_dht):
            sessions.append(_serve_history(dht, cfg, tmp_path, history, ttl))
        yield TwoHolders(cfg, history, a_dht, b_dht, att_dht, clients, ttl)
    finally:
        clients.close()
        for session in sessions:
            session.close()
        for dht in dhts:
            if all(dht is not s.dht for s in sessions):
                dht.shutdown()


def test_the_attester_goes_back_a_round_when_the_set_it_replayed_was_overtaken(tmp_path, reap_children):
    # the attester replays round R − 2 while the only link of it is a set the holders then switch
    # away from (a RECONCILE switch republishes the round's link); round R − 1 goes on from the
    # switched state only: the attester goes back a round and replays the set the swarm went on from
    with _two_holders(tmp_path, "rewind-test", ROUNDS + 2) as swarm:
        history = swarm.history
        overtaken = swarm.branch({ROUNDS - 2}, ROUNDS - 1)[ROUNDS - 2]  # round R − 2 with a's payload alone
        assert overtaken.state != history.links[(ROUNDS - 2, STAGE)].state
        for dht in (swarm.a, swarm.b):
            for t in range(ROUNDS - 2):
                swarm.link(dht, history.links[(t, STAGE)])
            swarm.link(dht, overtaken)
        swarm.at(ROUNDS - 1)
        attester = Attester(swarm.cfg, swarm.attester_dht, swarm.clients, "127.0.0.1:1")
        attester.poll()
        assert attester.stages[STAGE].state_id() == overtaken.state  # the only link of round R − 2 then

        for dht in (swarm.a, swarm.b):  # switched to the set of both (the link republished), and went on
            for t in (ROUNDS - 2, ROUNDS - 1):
                swarm.link(dht, history.links[(t, STAGE)])
        swarm.at(ROUNDS)
        attester.poll()
        assert attester.stages[STAGE].outer_step == ROUNDS
        assert attester.stages[STAGE].state_id() == history.state(STAGE)


def test_the_attester_stops_at_the_clock_and_takes_the_link_the_next_round_goes_on_from(tmp_path, reap_children):
    # round R − 2 has two genuine links: the set of both holders (first in the canonical order) and a's
    # payload alone; round R − 1 (the round still being committed: the replicas are at R − 1) goes on
    # from the second only. The attester takes the second, the branch the swarm went on from, and stops
    # at the clock: a link of the round in flight may be a lone holder's the others overtake next
    with _two_holders(tmp_path, "horizon-test", ROUNDS + 2) as swarm:
        history = swarm.history
        branch = swarm.branch({ROUNDS - 2}, ROUNDS)
        lone, next_link = branch[ROUNDS - 2], branch[ROUNDS - 1]
        assert lone.state != history.links[(ROUNDS - 2, STAGE)].state and next_link.prev == lone.state
        for t in range(ROUNDS - 1):
            swarm.link(swarm.a, history.links[(t, STAGE)])
        swarm.link(swarm.b, lone)
        swarm.link(swarm.b, next_link)
        swarm.at(ROUNDS - 1)
        attester = Attester(swarm.cfg, swarm.attester_dht, swarm.clients, "127.0.0.1:1")
        attester.poll()
        assert attester.stages[STAGE].outer_step == ROUNDS - 1  # the clock: round R − 1 is not replayed yet
        assert attester.stages[STAGE].state_id() == lone.state  # the branch round R − 1 goes on from


def test_the_attester_on_a_branch_that_died_two_rounds_deep_goes_back_to_a_state_it_kept(tmp_path, reap_children):
    # rounds R − 4 and R − 3 were first committed along a branch (a's payload alone, then both) whose
    # holders then left it; the swarm went on from the other set of round R − 4. Going back one round
    # lands on the branch again: the attester goes back to the newest state it kept from which the
    # published links reach the clock, and replays the swarm's branch from there
    fork = ROUNDS - 4
    with _two_holders(tmp_path, "dead-branch-test", ROUNDS + 4) as swarm:
        history = swarm.history
        dead = swarm.branch({fork}, fork + 2)
        assert dead[fork].state != history.links[(fork, STAGE)].state
        for t in range(fork):
            swarm.link(swarm.a, history.links[(t, STAGE)])
        for t in (fork, fork + 1):
            swarm.link(swarm.b, dead[t])  # b's branch, b then leaves it
        attester = Attester(swarm.cfg, swarm.attester_dht, swarm.clients, "127.0.0.1:1", folder=tmp_path / "attest")
        for clock in range(1, fork + 3):  # one round a poll: a state kept at every outer step
            swarm.at(clock)
            attester.poll()
            assert attester.stages[STAGE].outer_step == clock
        assert attester.stages[STAGE].state_id() == dead[fork + 1].state  # on the branch, the only one yet

        for t in range(fork, ROUNDS):  # the swarm's branch, from the other set of round R − 4
            swarm.link(swarm.a, history.links[(t, STAGE)])
        swarm.at(ROUNDS)
        for _ in range(3):  # one round back lands on the branch again (rewind); then a kept state
            attester.poll()
        assert attester.stages[STAGE].outer_step == ROUNDS
        assert attester.stages[STAGE].state_id() == history.state(STAGE)
        assert len(list((tmp_path / "attest" / f"stage-{STAGE}").glob("*.pt"))) <= 8  # KEEP_STATES
