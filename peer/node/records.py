"""What one peer publishes in the DHT about itself, and the thread that keeps it fresh (DESIGN §3).

Records: `stage.{s}` (one per stage this process holds: address, role, state, outer step,
parameter and T⊥ hashes, claiming pipeline, last committed replica ids and ban state
(`peer.node.round.bans`), the state claim — state id and link (`peer.node.round.claims`) — and the holders
this peer refused, tokens/s, a head's in-flight window) and `replica` (a head or full replica:
address, kind, outer step, data shard, loss, tokens/s, joined_at, its last committed rounds'
losses (`peer.net.round_points`) and, for heads, "pipeline_peers",
which binds its stage peers' payload announcements: `peer.node.round.agreement.binding`).
Each is a typed record of `peer.net.records` (`StageRecord`, `ReplicaRecord`), published as its `to_record()`.

Invariants: records are republished every `swarm.announce_interval_s` and after every round with
ttl `swarm.record_ttl_s`, so a dead peer's records expire on their own (the same thread re-publishes
the bootstrap's sealed manifest and pings the initial peers now and then); every record carries the
process's incarnation "inc" (`peer.node.round.agreement.fresh`); one lock serialises
publishing; `close` stops the thread and withdraws every record it published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from peer.config import SwarmConfig, history_ttl_s
from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.net.records import NetFields, ReplicaRecord, StageRecord
from peer.net.round_points import MAX_ROUNDS, RoundPoint
from peer.node.presence import Presence
from peer.node.round.claims import Link
from peer.node.round.refusals import Refusals
from peer.node.round.replay import publish_links
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

PING_EVERY = 5  # refreshes between two pings of the initial peers
WITHDRAW_S = 3.0  # leaving spends at most this long withdrawing records (they expire by TTL anyway)


@dataclass(frozen=True)
class Own:
    """One record this peer publishes: a `stage.{stage}` record, or (stage None) its replica record."""

    record: StageRecord | ReplicaRecord
    stage: int | None = None
    links: tuple[Link, ...] = ()  # a stage's committed links of the history window (`chain.{t}.{s}`)


class Serving(Protocol):
    """What the records say about the service (`peer.node.service.PeerService`)."""

    claimed_by: str | None
    in_round: bool
    tokens: int
    started: float
    schedule: dict[str, Any]


class Records:
    """Builds this peer's records and republishes them until `close`.

    `service` is read at each publish (None until the peer serves: state "syncing");
    `net` gives the connectivity, caps and refused calls every record carries."""

    def __init__(
        self,
        dht: SwarmDHT,
        swarm: SwarmConfig,
        me: Presence,
        refusals: Refusals,
        net: Callable[[], NetFields],
        service: Callable[[], Serving | None],
    ) -> None:
        self.dht, self.swarm, self.me, self.refusals = dht, swarm, me, refusals
        self.net, self.service = net, service
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._publish: Callable[[], None] | None = None
        self._lock = threading.Lock()
        self._stages: set[int] = set()
        self._links: dict[int, dict[int, str]] = {}  # stage → {round: state id} of the links published
        self._rounds: deque[RoundPoint] = deque(maxlen=MAX_ROUNDS)  # a replica's last committed rounds

    def committed(self, t: int, loss: float | None, val_loss: float | None, wall_s: float) -> None:
        """Round t committed (a head or full replica): its point goes into the next `replica` record."""
        with self._lock:
            self._rounds.append(RoundPoint(t, loss, val_loss, wall_s))

    def stage(self, worker: StageWorker, role: str) -> Own:
        svc = self.service()
        state = "syncing" if svc is None else ("busy" if svc.claimed_by or svc.in_round else "ready")
        record = StageRecord(
            address=self.me.address,
            role=role,
            state=state,
            outer_step=worker.outer_step,
            training=worker.train_step if worker.train_step != worker.outer_step else None,
            param_hash=worker.param_hash(),
            perp_hash=worker.perp_hash(),
            inc=self.me.incarnation,
            pipeline=svc.claimed_by if svc else None,
            committed=tuple(r[:16] for r in worker.ledger.last_committed),
            bans=worker.ledger.bans.to_record(),  # part of the committed state (peer.node.round.bans)
            state_id=worker.state_id(),  # the claim (peer.node.round.claims): checked, never taken on trust
            link=worker.ledger.link.to_record() if worker.ledger.link is not None else None,
            refused=tuple(self.refusals.record()),  # holders whose state failed its check
            tokens_per_s=svc.tokens / max(1e-9, time.monotonic() - svc.started) if svc else 0.0,
            in_flight=svc.schedule.get("in_flight") if svc else None,  # a head's K (peer.node.pipeline.schedule)
            net=self.net(),  # connectivity, relay, caps, refused calls
        )
        with worker.lock:
            links = tuple(worker.ledger.history.values())
        return Own(record, worker.stage, links)

    def replica(
        self,
        kind: str,
        outer_step: int,
        shard: int,
        loss: float | None,
        tokens_per_s: float,
        ranks: int | None = None,
        batch_size: int | None = None,
        pipeline_peers: dict[str, str] | None = None,
        mode: str | None = None,
    ) -> Own:
        """`pipeline_peers` ({"<stage>": peer id}, heads only) binds the stage peers' payload
        announcements to this replica (`peer.node.round.agreement.binding`); `mode` (heads only) is the
        outer step's boundary mode, "compressed" or "uncompressed" (`peer.node.pipeline.mode`). A full replica says how
        many processes train it (`ranks`, torchrun) and its global batch, ranks × `batch_size`."""
        record = ReplicaRecord(
            address=self.me.address,
            kind=kind,
            outer_step=outer_step,
            shard=shard,
            loss=loss,
            tokens_per_s=tokens_per_s,
            joined_at=self.me.joined_at,
            inc=self.me.incarnation,
            done=self.me.finishing,
            pipeline_peers=pipeline_peers,
            mode=mode,
            ranks=ranks,
            global_batch=None if ranks is None or batch_size is None else ranks * batch_size,
            rounds=tuple(self._rounds),  # read by dashboards (`peer.net.round_points`)
            net=self.net(),  # connectivity, relay, caps, refused calls
        )
        return Own(record)

    def publish_once(self, *record_fns: Callable[[], Own]) -> None:
        """Publish these records once, now (a joiner's first replica record, before `announce`);
        a failure is logged: the loop `announce` starts publishes them again."""
        self._guarded(lambda: self._publish_all(record_fns))

    def _publish_all(self, record_fns: tuple[Callable[[], Own], ...]) -> None:
        dht, swarm_cfg = self.dht, self.swarm
        for fn in record_fns:
            own = fn()
            if own.stage is not None:
                self._stages.add(own.stage)
                dht.announce_stage(own.stage, own.record.to_record(), ttl_s=swarm_cfg.record_ttl_s)
                # joiners replay these (peer.node.round.replay): each round's link as finally held
                sent = self._links.setdefault(own.stage, {})
                publish_links(dht, own.stage, own.links, sent, history_ttl_s(swarm_cfg))
            else:
                dht.announce_replica(own.record.to_record(), ttl_s=swarm_cfg.record_ttl_s)

    def announce(self, *record_fns: Callable[[], Own]) -> None:
        """Publish the records now and then every `announce_interval_s` until close()."""
        dht, swarm_cfg = self.dht, self.swarm

        def publish() -> None:
            self._publish_all(record_fns)

        def loop() -> None:
            ticks = 0
            while not self._stop.wait(swarm_cfg.announce_interval_s):
                self.refresh()
                try:  # the manifest outlives the bootstrap: every peer keeps its sealed copy alive
                    dht.republish_manifest(ttl_s=swarm_cfg.record_ttl_s)
                except PeerError as exc:
                    log.debug("could not re-publish the manifest: %s", exc)
                ticks += 1
                if ticks % PING_EVERY == 0:  # a restarted bootstrap is an island until someone calls it
                    try:
                        dht.ping_initial_peers(timeout_s=swarm_cfg.rpc_timeout_s)
                    except PeerError as exc:
                        log.debug("initial peers not reachable: %s", exc)

        self._publish = publish
        publish()
        self._thread = threading.Thread(target=loop, name="peer-announce", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        """Publish this peer's records now (after every round, so peers see its new outer step)."""
        if self._publish is not None:
            self._guarded(self._publish)

    def _guarded(self, publish: Callable[[], None]) -> None:
        """Publish under the lock; a DHT failure is logged (the next refresh tries again)."""
        with self._lock:
            try:
                publish()
            except PeerError as exc:
                log.warning("could not publish DHT records: %s", exc)

    def close(self) -> None:
        """Stop republishing and withdraw what this peer published, best effort within `WITHDRAW_S`:
        when the whole swarm leaves at once nobody may answer, and the records expire by their TTL
        anyway (a failure is logged)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        deadline = time.monotonic() + WITHDRAW_S
        dht = self.dht
        try:
            for stage in sorted(self._stages):
                dht.withdraw_stage(stage, timeout_s=_left(deadline))
            if self.me.role in ("head", "full"):
                dht.withdraw_replica(timeout_s=_left(deadline))
        except PeerError as exc:
            ttl = self.swarm.record_ttl_s
            log.warning(
                "could not withdraw records within %.0f s (they expire within %.0f s): %s", WITHDRAW_S, ttl, exc
            )


def _left(deadline: float) -> float:
    """Seconds to a deadline, at least a moment (a DHT call with no time left fails at once)."""
    return max(0.2, deadline - time.monotonic())
