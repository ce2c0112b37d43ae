"""A ranges round of a mixed swarm: a pipeline (its head and its stage peer) beside two full replicas.

Real hivemind DHT nodes and PeerServers on 127.0.0.1, one `Session` per peer in threads of this
process, each round run through the peer's own entry point (`Rounds.head_round`,
`Rounds.stage_round`, `Rounds.full_round`) under the "auto" rule with `ranges_from` = 3. Every holder
of a stage must run the same rule in the same round, all-to-all, mixed (stage 0 by ranges, stage 1
all-to-all) and by ranges: after each round the head and the full replicas hold one state of stage
0, the stage peer and the full replicas one state of stage 1 — including T⊥, which the stage peer
moves by stage 0's embedding change read from the shards of the embedding's ranges alone (a full
replica takes it from its own stage-0 commit), so the same state id means the same bits of u. A
state adopted without its link reads round t − 1's size, hence the rule, from the stage's claims.
The same swarm all-to-all (outlier screening on, as by default): the stage peer reads stage 0's
payloads as embedding views (docs/protocol.md, "Embedding views") and still holds the full replicas' stage-1 state.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from peer.config import build_config
from peer.core.model.decoder import stage_shapes
from peer.net.dht import SwarmDHT
from peer.net.transport.server import PeerServer
from peer.node.round.ranges.rounds import n_prev_of, stage0_n_prev
from peer.node.service import PeerService
from peer.node.session import Session, SessionOptions
from peer.node.stage.embed import embed_ranges
from peer.node.stage.ranges import range_plan
from peer.node.stage.worker import StageWorker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROLES = [("head", 0), ("stage", 1), ("full", None), ("full", None)]


@dataclass
class Peer:
    session: Session
    workers: dict[int, StageWorker]

    @property
    def id(self) -> str:
        return self.session.peer_id


def _records(session: Session, role: str, workers: dict[int, StageWorker], shard: int, stage_peer: str):
    """The records each kind of peer publishes in the trainer (`peer.node.trainer`)."""
    records = session.records
    if role == "head":
        w = workers[0]
        return [
            lambda: records.stage(w, role="head"),
            lambda: records.replica("pipeline", w.outer_step, shard, None, 0.0, pipeline_peers={"1": stage_peer}),
        ]
    if role == "stage":
        return [lambda: records.stage(workers[1], role="trainer")]
    return [
        lambda: records.replica("full", workers[0].outer_step, shard, None, 0.0),
        *[lambda w=w: records.stage(w, role="full") for w in workers.values()],
    ]


@pytest.fixture(params=["topk", "exact", "voted"])
def mixed(tmp_path, reap_children, request):
    """Peers 0 (head, stage 0), 1 (its stage peer, stage 1), 2 and 3 (full replicas, both stages);
    range owners publish `swarm.shard` shards as parametrized."""
    yield from _swarm(tmp_path, build_config(overrides={"swarm.shard": request.param}, environ={}), round_rule="auto")


@pytest.fixture
def views(tmp_path, reap_children):
    """The same four peers, all-to-all (screening on, the default): stage 0's change is read from views."""
    cfg = build_config(environ={})
    assert cfg.sparseloco.screening
    yield from _swarm(tmp_path, cfg, round_rule="all")


def _swarm(tmp_path, cfg, round_rule: str):
    assert cfg.stages == 2 and cfg.k > 0  # the run uses a subspace: stage 1's T⊥ moves with stage 0
    swarm = dataclasses.replace(
        cfg.swarm, rpc_timeout_s=3.0, round_timeout_s=10.0, round_rule=round_rule, ranges_from=3
    )
    cfg = dataclasses.replace(cfg, swarm=swarm)
    dhts: list[SwarmDHT] = [SwarmDHT()]
    dhts += [SwarmDHT(initial_peers=dhts[0].visible_maddrs()) for _ in range(len(ROLES) - 1)]
    peers: list[Peer] = []
    try:
        for i, (dht, (role, stage)) in enumerate(zip(dhts, ROLES, strict=True)):
            dht.set_run("ranges-pipeline-test", cfg.stages)
            opts = SessionOptions(initial_peers=(), data_dir=tmp_path / str(i))
            session = Session(opts, dht, {}, cfg, role=role, stage=stage)
            if stage is None:
                workers = {s: StageWorker(cfg, s, compressed=False) for s in range(cfg.stages)}
            else:
                workers = {stage: StageWorker(cfg, stage)}
            session.service = PeerService(cfg, workers, session.store, session.peer_id, role)
            session.server = PeerServer(session.service, host="127.0.0.1", port=0)
            session.me.address = session.server.address
            session.records.announce(*_records(session, role, workers, i, dhts[1].peer_id))
            peers.append(Peer(session, workers))
        yield cfg, peers
    finally:
        for p in peers:
            p.session.close()
        for dht in dhts[len(peers) :]:
            dht.shutdown()


def _train(peers: list[Peer], t: int) -> None:
    """Each peer "trains": its parameters move apart from θ_start."""
    for i, p in enumerate(peers):
        for s, w in p.workers.items():
            gen = torch.Generator().manual_seed(100 * t + 10 * i + s)
            with torch.no_grad():
                for param in w.module.parameters():
                    param.add_(torch.randn(param.shape, generator=gen) * 1e-2)


def _round(head: Peer, stage_peer: Peer, fulls: list[Peer], t: int, bound: bool, stop: threading.Event):
    """Round t through each peer's own entry point; `bound`: the head binds its stage peer (else the
    stage peer did not train this outer step: it observes its stage's round)."""
    with ThreadPoolExecutor(max_workers=2 + len(fulls)) as pool:
        peers = {"1": stage_peer.id} if bound else {}
        h = pool.submit(head.session.rounds.head_round, head.workers[0], t, stop, peers)
        contributor = head.id if bound else None
        sp = pool.submit(stage_peer.session.rounds.stage_round, stage_peer.workers[1], contributor, stop)
        fr = [pool.submit(f.session.rounds.full_round, f.workers, t, stop) for f in fulls]
        head_result, _ = h.result(), sp.result()
        return head_result, [f.result() for f in fr]


def test_a_pipeline_and_full_replicas_follow_each_stages_rule_with_one_state_per_stage(mixed):
    """ranges_from = 3. Round 0: all-to-all (nothing committed before); the stage peer did not train,
    so stage 0 commits 3 contributions and stage 1 two. Round 1: stage 0 by ranges, stage 1
    all-to-all, for every holder of each (a full replica runs both rules at once; the stage peer
    reads stage 0's rule from its link and its embedding change from the embedding's shards).
    Round 2: both stages by ranges. After every round: one state per stage, the same T⊥."""
    cfg, (head, stage_peer, *fulls) = mixed
    stop = threading.Event()
    rules = {0: (False, False), 1: (True, False), 2: (True, True)}  # round: (stage 0, stage 1) by ranges
    for t, by_ranges in rules.items():
        _train([head, stage_peer, *fulls], t)
        head_result, full_results = _round(head, stage_peer, fulls, t, bound=t > 0, stop=stop)
        n = {0: 3, 1: 2 if t == 0 else 3}
        assert not head_result.behind and head_result.participants == n[0]
        assert all(not r[s].behind and r[s].participants == n[s] for r in full_results for s in r)
        for s, pipeline in ((0, head), (1, stage_peer)):
            holders = [pipeline.workers[s]] + [f.workers[s] for f in fulls]
            assert len({w.state_id() for w in holders}) == 1, f"stage {s} split in round {t}"
            assert all(w.outer_step == t + 1 for w in holders)
            assert all((w.ledger.link.ranges is not None) == by_ranges[s] for w in holders), (t, s)
        # the stage peer's T⊥ moved by the same stage-0 set as a full replica's (its link names it)
        assert stage_peer.workers[1].ledger.link.embed == fulls[0].workers[1].ledger.link.embed
        assert stage_peer.workers[1].perp_hash() == fulls[0].workers[1].perp_hash()
        if t == 0:  # a state adopted without its link (an old checkpoint) still reads the holders' rule
            adopted = StageWorker(cfg, 1)
            adopted.load_state_dict({**stage_peer.workers[1].state_dict(), "link": None})
            rounds = stage_peer.session.rounds
            assert adopted.n_prev() is None
            assert n_prev_of(rounds.ctx, adopted) == 2 and stage0_n_prev(rounds.ctx, adopted) == 3
    # rounds 1 and 2 planned R = 4 ranges of stage 0 from 3 contributions; the stage peer took only
    # the shards of the ranges that hold embed.weight's bands
    plan = range_plan(cfg.sparseloco, stage_shapes(cfg.model, 0, cfg.stages), 3)
    for t in (1, 2):
        observed = {r for r, _ in stage_peer.session.store.shards(t, 0, range(plan.n))}
        assert observed == set(embed_ranges(plan)) and len(observed) < plan.n


def test_a_stage_peer_reads_stage_0_as_embedding_views_and_holds_the_same_state(views):
    """All-to-all, outlier screening on: the stage peer fetches each stage-0 payload's
    embedding view (`peer.core.sparseloco.codec.sections`) instead of the payload, and after every round
    its stage-1 state — T⊥ moved by u from the views — is the full replicas' (u from whole payloads)."""
    cfg, (head, stage_peer, *fulls) = views
    stop = threading.Event()
    for t in range(2):
        _train([head, stage_peer, *fulls], t)
        before = stage_peer.session.rounds.pg_bytes
        head_result, _ = _round(head, stage_peer, fulls, t, bound=t > 0, stop=stop)
        for s, pipeline in ((0, head), (1, stage_peer)):
            holders = [pipeline.workers[s]] + [f.workers[s] for f in fulls]
            assert len({w.state_id() for w in holders}) == 1, f"stage {s} split in round {t}"
        assert stage_peer.workers[1].perp_hash() == fulls[0].workers[1].perp_hash()
        store = stage_peer.session.store
        held = [store.fetched(t, 0, sender) for sender in (head.id, fulls[0].id, fulls[1].id)]
        assert all(c is not None and c.view for c in held)
        whole = sum(len(c.data) for c in head_result.contributions)
        fetched1 = sum(len(store.fetched(t, 1, f.id).data) for f in fulls)
        assert (
            stage_peer.session.rounds.pg_bytes - before == fetched1 + sum(len(c.data) for c in held) < fetched1 + whole
        )
