"""A ranges round over a loopback swarm: real hivemind DHT nodes and PeerServers on 127.0.0.1.

Eight holders of a stage (the small preset's real stage shapes) each contribute a random Δ as R = 8
parts and run `gather_ranges` in threads of this process. They must
- all take the same roster and the same shard of every range, so a commit from the same start gives
  the same sha256 on every holder, and each downloads at most 3 payloads' worth of bytes (measured
  by the round's own counters: parts, proofs, shards, roster);
- survive an owner that dies after the roster (a ninth holder in its own process, SIGKILLed before it
  publishes its shards): its co-owners' shards are taken past the shard deadline;
- refuse an owner that publishes and serves a shard other than the aggregate of the parts it names,
  and commit the honest shard;
and four full replicas (tiny preset, round rule "ranges") run two rounds through their own
`Rounds.full_round` and end each with one state id.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from peer.config import build_config
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import commit_summed
from peer.core.sparseloco.ranges import assemble, encode_parts, n_ranges_for, n_units, owner, plan_ranges
from peer.core.sparseloco.ranges.exact import ExactBody
from peer.core.sparseloco.ranges.owner import Shard, shard_delta
from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.range_records import RosterRecord, ShardsRecord
from peer.net.transport.server import PeerServer
from peer.node.round.context import RoundContext
from peer.node.round.payloads import PayloadStore
from peer.node.round.ranges.exchange import RangesResult, gather_ranges
from peer.node.round.ranges.ownership import owners
from peer.node.round.ranges.rounds import own_job, summary
from peer.node.round.ranges.voted import values_stage
from peer.node.round.refusals import Refusals
from peer.node.round.timings import RoundTimings
from peer.node.service import PeerService
from peer.node.session import Session, SessionOptions
from peer.node.stage.worker import StageWorker
from tests.round_helpers import round_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

M = 8
STAGE = 1
TIMINGS = RoundTimings(deadline_s=14.0, grace_s=2.0, poll_s=0.1, ttl_s=60)  # shard deadline 7 s: a loaded 2-core CI box


@dataclass
class Node:
    dht: SwarmDHT
    store: PayloadStore
    clients: ClientPool
    server: PeerServer | None = None
    refusals: Refusals = dataclasses.field(default_factory=Refusals)
    shard: int = 0

    def present(self) -> None:
        """Announce (again) this node's full-replica record, as a live peer's presence loop does: a
        module's rounds on a loaded machine outlast one TTL, and an expired record binds no announcement."""
        record = {"address": self.address, "kind": "full", "outer_step": 5, "shard": self.shard, "joined_at": 0}
        self.dht.announce_replica(record, ttl_s=120)

    @property
    def id(self) -> str:
        return self.dht.peer_id

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def context(self, cfg) -> RoundContext:
        return round_context(self.dht, self.clients, self.store, self.address, refusals=self.refusals, cfg=cfg)


def _small(shard: str):
    """The small preset (47 kB payloads: a roster's and proofs' bytes are small beside them) with `swarm.shard`."""
    return build_config(overrides={"preset": "small", "swarm.shard": shard}, environ={})


@contextlib.contextmanager
def holders(cfg, run: str, m: int = M) -> Iterator[list[Node]]:
    """`m` full-replica holders on loopback: a hivemind DHT node, a PeerServer and a client pool each, their
    replica records announced; every part stopped on the way out."""
    nodes: list[Node] = []
    try:
        first = SwarmDHT()  # every DHT node first: hivemind forks, and no gRPC thread may exist when it does
        nodes.append(Node(first, PayloadStore(), ClientPool(timeout_s=5.0)))
        for _ in range(m - 1):
            nodes.append(
                Node(SwarmDHT(initial_peers=first.visible_maddrs()), PayloadStore(), ClientPool(timeout_s=5.0))
            )
        for i, node in enumerate(nodes):
            node.dht.set_run(run, cfg.stages)
            node.server = PeerServer(PeerService(cfg, {}, node.store, node.id, "full"), host="127.0.0.1", port=0)
            node.shard = i
            node.present()
        yield nodes
    finally:
        for node in nodes:
            if node.server is not None:
                node.server.stop(grace_s=0.5)
            node.clients.close()
            node.dht.shutdown()


@pytest.fixture(scope="module", params=["topk", "exact"])
def swarm(request):
    cfg = _small(request.param)
    with holders(cfg, "ranges-round-test") as nodes:
        yield cfg, nodes


def _shapes(cfg):
    return stage_shapes(cfg.model, STAGE, cfg.stages)


def _plan(cfg):
    shapes = _shapes(cfg)
    return plan_ranges(shapes, cfg.sparseloco.chunk, n_ranges_for(M, n_units(shapes, cfg.sparseloco.chunk)))


def _parts(cfg, plan, seed: int):
    gen = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in _shapes(cfg).items()}
    return encode_parts(delta, None, cfg.sparseloco, plan)[0]


def _round(cfg, nodes: list[Node], t: int) -> list[RangesResult | None]:
    """Every node contributes and gathers round (t, STAGE) in its own thread; None for a node that died."""
    plan = _plan(cfg)
    for node in nodes:
        node.present()

    def run(i: int) -> RangesResult | None:
        node = nodes[i]
        try:
            own = (node.id, _parts(cfg, plan, 100 * t + i))
            return gather_ranges(node.context(cfg), t, STAGE, TIMINGS, plan, own=own)
        except PeerError:
            return None

    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        return list(pool.map(run, range(len(nodes))))


@contextlib.contextmanager
def _on_put_shard(node: Node, wrap: Callable[[int, bytes], bytes]):
    """Every shard `node` computes or takes goes through `wrap(r, bytes)` before its store serves it
    (fault injection by wrapping a collaborator: the round's code is the production code)."""
    put = node.store.put_shard

    def put_shard(t: int, stage: int, r: int, data: bytes) -> None:
        put(t, stage, r, wrap(r, data))

    node.store.put_shard = put_shard  # type: ignore[method-assign]
    try:
        yield
    finally:
        del node.store.put_shard


@contextlib.contextmanager
def _lying(cfg, node: Node):
    """`node` as a lying owner: each shard it serves is `_liar`'s, and the hashes it publishes are
    those of the lies (a consistent lie: only a recomputation from the parts shows it)."""
    plan, lies = _plan(cfg), {}

    def lie(r: int, data: bytes) -> bytes:
        n_roster = owner._HEAD.unpack_from(data)[-1]  # the shard's header names its roster's size
        exact = cfg.swarm.shard == "exact"
        bad = _liar(r, Shard.from_bytes(data, plan, cfg.sparseloco, n_roster, exact=exact)).to_bytes()
        lies[hashlib.sha256(data).hexdigest()] = hashlib.sha256(bad).hexdigest()
        return bad

    announce = node.dht.announce_round

    def announce_round(kind, t, stage, record, ttl_s):
        if kind == "shards":
            record = {**record, "shards": {r: lies.get(h, h) for r, h in record["shards"].items()}}
        announce(kind, t, stage, record, ttl_s)

    node.dht.announce_round = announce_round  # type: ignore[method-assign]
    try:
        with _on_put_shard(node, lie):
            yield
    finally:
        del node.dht.announce_round


def _committed(cfg, result: RangesResult) -> str:
    """sha256 of the parameters a commit of the round's shards gives from one fixed start."""
    shapes = _shapes(cfg)
    gen = torch.Generator().manual_seed(7)
    start = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    summed = assemble(_plan(cfg), {r: shard_delta(s) for r, s in result.parsed.items()}, shapes)
    done = commit_summed(start, None, summed, cfg.sparseloco, None)
    digest = hashlib.sha256()
    for name in shapes:
        digest.update(done.params[name].numpy().tobytes())
    return digest.hexdigest()


def _check_agreed(cfg, results: list[RangesResult]) -> None:
    first = results[0]
    assert first.roster is not None and first.complete, first
    for result in results:
        assert result.complete and not result.timed_out
        assert result.roster == first.roster
        assert result.shards == first.shards  # the same bytes of every range
    assert len({_committed(cfg, r) for r in results}) == 1


def test_eight_holders_commit_the_same_state_with_three_payloads_each(swarm):
    cfg, nodes = swarm
    t0 = time.monotonic()
    results = _round(cfg, nodes, t=1)
    wall = time.monotonic() - t0
    assert all(r is not None for r in results)
    done = [r for r in results if r is not None]
    _check_agreed(cfg, done)
    assert len(done[0].replicas) == M and sorted(done[0].replicas) == sorted(n.id for n in nodes)
    for r in done:
        fetched = r.fetched
        print(
            f"ranges round M={M}: {fetched.total / r.payload_bytes:.2f} payloads fetched "
            f"(parts {fetched.parts}, proofs {fetched.proofs}, shards {fetched.shards}, roster {fetched.roster}, "
            f"verify {fetched.verify}; payload {r.payload_bytes} B; owned {r.owned}) in {wall:.1f}s"
        )
        if cfg.swarm.shard == "topk":
            assert fetched.total <= 3 * r.payload_bytes, fetched
        else:  # exact shards: the union of the M contributions, never more than M payloads of shards
            assert fetched.shards <= M * r.payload_bytes, fetched
        assert not r.computed and not r.refused


def _liar(r: int, shard: Shard) -> Shard:
    """A shard whose bytes differ from the true aggregate, well formed and with the right header: its
    first tensor's values (or magnitude table) doubled."""
    if isinstance(shard.payload, ExactBody):
        first, *rest = shard.payload.entries
        if first.codebook is not None:
            first = dataclasses.replace(first, codebook=(first.codebook * 2).astype(np.float32))
        else:
            first = dataclasses.replace(first, values=(first.values * 2).astype(np.float32))
        lie = dataclasses.replace(shard, payload=dataclasses.replace(shard.payload, entries=(first, *rest)))
        assert lie.to_bytes() != shard.to_bytes()
        return lie
    assert isinstance(shard.payload, Payload)
    source = Payload.from_bytes(shard.payload.to_bytes())
    entry = source.entries[0]
    if entry.values is not None:
        entry.values = (entry.values * 2).astype(np.float32)
    else:
        entry.codebook = (entry.codebook * 2).astype(np.float32)
    payload = Payload(source.entries, source.chunk, source.topk, source.quant_bits)  # encoded afresh
    tampered = dataclasses.replace(shard, payload=payload)
    assert tampered.to_bytes() != shard.to_bytes()
    return tampered


def test_a_lying_owner_is_refused_and_the_honest_shard_committed(swarm):
    cfg, nodes = swarm
    liar = nodes[3]
    with _lying(cfg, liar):
        results = _round(cfg, nodes, t=2)
    honest = [r for node, r in zip(nodes, results, strict=True) if node is not liar and r is not None]
    assert len(honest) == M - 1
    _check_agreed(cfg, honest)
    for node, result in zip(nodes, results, strict=True):
        if node is not liar:  # every honest holder saw the disagreement, checked both shards, refused the liar
            assert result is not None and liar.id in result.refused and liar.id in node.refusals
    lied = results[nodes.index(liar)]
    assert lied is not None and lied.owned
    published = nodes[0].dht.get_round("shards", 2, STAGE, ShardsRecord.parse)[liar.id].shards or {}
    for r in lied.owned:  # the shard committed is the honest owner's, not the one the liar published
        assert honest[0].shards[r].sha256 == hashlib.sha256(honest[0].shards[r].data).hexdigest() != published[r]


def _wait_for_the_other_owners(dht: SwarmDHT, cfg, t: int, me: str, timeout_s: float = 30.0) -> None:
    """Until every other owner of a range of round t has published its shard hashes: each has then
    fetched the parts it needed (ours among them) or given up on them, so our death from here on
    takes nothing from them but our own shards (a wait on their records, not on the clock)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rosters = dht.get_round("roster", t, STAGE, RosterRecord.parse)
        if rosters:
            senders = next(iter(rosters.values())).senders
            k = 1 + cfg.swarm.range_backups
            wanted = {o for r in range(_plan(cfg).n) for o in owners(t, STAGE, r, senders, k)} - {me}
            if wanted <= set(dht.get_round("shards", t, STAGE, ShardsRecord.parse)):
                return
        time.sleep(0.1)  # the poll interval of a record that is on its way
    raise AssertionError(f"the other owners of round {t} did not publish their shards within {timeout_s:.0f} s")


def victim_main() -> None:
    """A ninth holder in its own process (argv: the first node's multiaddr): it sets up like the
    others, encodes its parts of round 3, prints its peer id, waits for the go (stdin), runs the
    round and SIGKILLs itself once it has aggregated its ranges, before it publishes their hashes
    (after the roster: it is an owner)."""
    cfg = _small(sys.argv[2])
    dht = SwarmDHT(initial_peers=[sys.argv[1]])
    dht.set_run("ranges-round-test", cfg.stages)
    node = Node(dht, PayloadStore(), ClientPool(timeout_s=5.0))
    node.server = PeerServer(PeerService(cfg, {}, node.store, node.id, "full"), host="127.0.0.1", port=0)
    record = {"address": node.address, "kind": "full", "outer_step": 5, "shard": M, "joined_at": 0}
    dht.announce_replica(record, ttl_s=120)
    plan, t = _plan(cfg), 3
    own = (node.id, _parts(cfg, plan, 100 * t + M))  # encoded (and the codec compiled) before the round starts
    print(node.id, flush=True)
    assert int(sys.stdin.readline()) == t

    def die(r: int, shard: bytes) -> bytes:
        _wait_for_the_other_owners(dht, cfg, t, node.id)  # they have its parts (or gave up on them)
        os.kill(os.getpid(), signal.SIGKILL)
        return shard

    with _on_put_shard(node, die):
        result = gather_ranges(node.context(cfg), t, STAGE, TIMINGS, plan, own=own)
    print(f"survived: owned {result.owned}, position {result.position}, timed out {result.timed_out}", flush=True)


def test_an_owner_killed_after_the_roster_is_covered_by_its_backup(swarm, reap_children):
    """A ninth holder, in its own process, owns ranges of round 3 and is SIGKILLed (its DHT node and
    p2pd go with it) before it publishes their hashes: its co-owners' shards are taken past the shard
    deadline, and the eight others still commit the same state."""
    cfg, nodes = swarm
    for node in nodes:  # round 2's liar is refused for the run (by design): a refused co-owner's shard is never
        node.refusals = Refusals()  # taken, so its ranges would be computed by all; this test starts with none
    maddr = nodes[0].dht.visible_maddrs()[0]
    code = "import sys; from tests.integration.test_ranges_round import victim_main; victim_main()"
    victim = subprocess.Popen(
        [sys.executable, "-c", code, maddr, cfg.swarm.shard], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert victim.stdout is not None and victim.stdin is not None
        victim_id = victim.stdout.readline().strip()
        assert victim_id, "the victim process did not start"
        deadline = time.monotonic() + 20.0  # every holder expects it (its replica record read) before round 3
        while not all(victim_id in node.dht.get_replicas() for node in nodes):
            assert time.monotonic() < deadline, "the victim's replica record did not reach every holder"
            time.sleep(0.2)
        victim.stdin.write("3\n")
        victim.stdin.flush()
        results = _round(cfg, nodes, t=3)
        assert victim.wait(timeout=30) == -signal.SIGKILL, victim.stdout.read()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert all(r is not None for r in results)
    done = [r for r in results if r is not None]
    _check_agreed(cfg, done)
    roster = done[0].roster
    senders = [e.sender for e in roster.entries] if roster is not None else []
    assert victim_id in senders  # it died after the roster
    victim_ranges = [r for r in range(_plan(cfg).n) if victim_id in owners(3, STAGE, r, list(senders), 2)]
    assert victim_ranges, "the victim owned no range: the test covers nothing"
    # every range it owned had a live co-owner: most holders take that shard; on a loaded box a holder may
    # pass the shard deadline first and compute the range itself (the same bits: _check_agreed above)
    assert not any(r.refused for r in done)
    assert sum(1 for r in done if r.computed) <= len(done) // 2, [(r.computed, r.timings) for r in done]


# ------------------------------------------------------------------ the trainer's path: Rounds.full_round
@dataclass
class Holder:
    session: Session
    worker: StageWorker


@pytest.fixture(params=["topk", "exact", "voted"])
def full_replicas(tmp_path, reap_children, request):
    """Four full replicas of stage 1 (tiny preset) with the round rule set to "ranges" (`swarm.shard` as
    parametrized: "voted" runs docs/protocol.md's VOTED phases), each a Session, and a fifth Session
    that publishes no replica record (an observer:
    nobody expects its payload)."""
    cfg = build_config(environ={})
    swarm = dataclasses.replace(
        cfg.swarm, rpc_timeout_s=3.0, round_timeout_s=10.0, round_rule="ranges", shard=request.param
    )
    cfg = dataclasses.replace(cfg, swarm=swarm)
    dhts: list[SwarmDHT] = [SwarmDHT()]
    dhts += [SwarmDHT(initial_peers=dhts[0].visible_maddrs()) for _ in range(4)]
    holders: list[Holder] = []
    try:
        for i, dht in enumerate(dhts):
            dht.set_run("ranges-trainer-test", cfg.stages)
            session = Session(
                SessionOptions(initial_peers=(), data_dir=tmp_path / str(i)), dht, {}, cfg, role="full", stage=None
            )
            worker = StageWorker(cfg, STAGE)
            session.service = PeerService(cfg, {STAGE: worker}, session.store, session.peer_id, "full")
            session.server = PeerServer(session.service, host="127.0.0.1", port=0)
            session.me.address = session.server.address
            if i < 4:
                session.records.announce(
                    lambda s=session, w=worker: s.records.stage(w, role="trainer"),
                    lambda s=session, w=worker, i=i: s.records.replica("full", w.outer_step, i, None, 0.0),
                )
            holders.append(Holder(session, worker))
        yield cfg, holders
    finally:
        for h in holders:
            h.session.close()
        for dht in dhts[len(holders) :]:
            dht.shutdown()


def _observe(holder: Holder, t: int, stop: threading.Event):
    """Round t applied by a holder that does not contribute to it (`Rounds.catch_up`'s jobs)."""
    rounds = holder.session.rounds
    jobs = [own_job(rounds.ctx, holder.worker, None)]
    results = rounds.gather_jobs(jobs, t, stop)
    assert jobs[0].plan is not None  # the rule says "ranges" for it too
    return summary(results[0], behind=not rounds.commit_jobs(jobs, results))


def test_full_replicas_commit_ranges_rounds_through_their_rounds_code(full_replicas):
    """Rounds 0 and 1 by ranges (R = 1, then R = 4 for the 4 contributions of round 0) through
    `Rounds.full_round`: every holder ends each round with the same state id, its claim pinning the
    roster and the shards, and trains on from it. An observer that took the state after round 0
    applies round 1 from the roster and the shards alone (an observer's job, as `Rounds.catch_up`
    runs it) and ends with the same state."""
    cfg, (*holders, observer) = full_replicas
    stop = threading.Event()
    for t in range(2):
        for i, h in enumerate(holders):  # each replica "trains": its parameters move apart from θ_start
            gen = torch.Generator().manual_seed(10 * t + i)
            with torch.no_grad():
                for p in h.worker.module.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
        with ThreadPoolExecutor(max_workers=len(holders) + 1) as pool:
            rounds = [pool.submit(h.session.rounds.full_round, {STAGE: h.worker}, t, stop) for h in holders]
            if t == 1:
                watched = pool.submit(_observe, observer, t, stop)
            results = [r.result()[STAGE] for r in rounds]
        assert all(not r.behind and r.participants == len(holders) for r in results)
        assert len({h.worker.state_id() for h in holders}) == 1
        assert all(h.worker.outer_step == t + 1 and h.worker.ledger.link.ranges is not None for h in holders)
        if cfg.swarm.shard == "voted":  # the voted phases ran: every holder served its values parts
            assert all(h.session.store.parts(t, values_stage(STAGE), None, [0]) for h in holders)
        if t == 0:
            observer.worker.load_state_dict(holders[0].worker.state_dict())  # a state download after round 0
    assert holders[0].worker.n_prev() == len(holders)
    seen = watched.result()
    assert not seen.behind and seen.participants == len(holders)
    assert observer.worker.state_id() == holders[0].worker.state_id()
    assert seen.bytes_fetched < 2 * max(r.bytes_fetched for r in results)  # shards only, no parts
