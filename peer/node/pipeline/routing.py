"""Who the head calls for each stage: claims, exclusions and the retry knobs (petals' sequence manager).

The first call of an outer step into a stage claims a ready peer of that stage for this pipeline
until the round (`PeerService`): ready means its record (DHT, `StageRecords`) says it is a spare
or a trainer at this outer step, free or already bound to this pipeline, and not excluded. Every
newly chosen peer is published at once (`on_bind`: the head's replica record's "pipeline_peers"),
which is what lets that peer's round payload speak for this pipeline. A failure decided as
REPLACE or BEHIND (`peer.node.pipeline.failures`) drops the peer and excludes it until the end of
the outer step (`release`); the previous peers stay the first choice.

Retry knobs, all from the config or named here: a claim waits `swarm.claim_timeout_s` for a ready
peer (polling every `CLAIM_POLL_S`); a busy peer is retried every `BUSY_RETRY_S` for up to
`swarm.claim_timeout_s`; an inner step is replayed at most `swarm.inner_step_replays` times.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from peer.config import RunConfig
from peer.errors import PeerError
from peer.net.pool import ClientPool
from peer.net.records import StageRecord
from peer.net.transport.client import PeerClient
from peer.node.pipeline.failures import Action, Failure, NoReadyPeer, PipelineBehind

log = logging.getLogger(__name__)

CLAIM_POLL_S = 0.5  # how often a claim reads the stage's records again while no peer is ready
BUSY_RETRY_S = 0.2  # how soon a busy stage peer (between rounds) is asked again


class StageRecords(Protocol):
    """The stage records a head reads (`peer.net.dht` in a swarm; a fixed map in `peer bench pipeline`)."""

    def get_stage_peers(self, stage: int) -> Mapping[str, StageRecord]:
        """peer id -> its stage record ("role", "outer_step", "address", "pipeline")."""
        ...


class Routing:
    """The peers of one pipeline's stages 1 … S−1, their claims and exclusions."""

    def __init__(
        self,
        cfg: RunConfig,
        pipeline_id: str,
        records: StageRecords,
        clients: ClientPool,
        stop: threading.Event,
        on_bind: Callable[[], None] = lambda: None,
    ) -> None:
        self.cfg, self.pipeline_id, self.records, self.clients, self.stop = cfg, pipeline_id, records, clients, stop
        self.on_bind = on_bind
        self.peers: dict[int, tuple[str, str]] = {}  # stage -> (peer id, address)
        self.excluded: set[str] = set()
        self.claim_timeout_s = cfg.swarm.claim_timeout_s
        self.replays = cfg.swarm.inner_step_replays
        self._lock = threading.Lock()  # the micro-batch threads read peers while a probe may claim

    def client(self, address: str) -> PeerClient:
        return self.clients.get(address)

    def _candidates(self, stage: int, t: int) -> list[tuple[str, str]]:
        ready = [
            (pid, rec.address)
            for pid, rec in self.records.get_stage_peers(stage).items()
            if rec.role in ("spare", "trainer")
            and rec.trains == t
            and rec.address
            and pid not in self.excluded
            and (rec.pipeline in (None, self.pipeline_id))
        ]
        return sorted(ready, key=lambda p: (p[0] != self.peers.get(stage, ("",))[0], p[0]))

    def _ahead(self, stage: int, t: int) -> bool:
        return any(
            rec.outer_step is not None and rec.outer_step > t and rec.role in ("spare", "trainer")
            for rec in self.records.get_stage_peers(stage).values()
        )

    def peer(self, stage: int, t: int) -> tuple[str, str]:
        """(peer id, address) of this stage's peer, claimed now if it has none."""
        with self._lock:
            if stage in self.peers:
                return self.peers[stage]
        deadline = time.monotonic() + self.claim_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            found = self._candidates(stage, t)
            if not found and self._ahead(stage, t):
                raise PipelineBehind(f"stage {stage} peers are past outer step {t}: this head missed a round")
            if found:
                with self._lock:
                    self.peers[stage] = found[0]
                log.info(
                    "pipeline %s: stage %d -> %s at %s", self.pipeline_id[:8], stage, found[0][0][:12], found[0][1]
                )
                # publish the new binding ("pipeline_peers" of the replica record) before that peer can
                # announce a payload for this pipeline (peer.node.round.agreement.binding)
                self.on_bind()
                return found[0]
            self.stop.wait(CLAIM_POLL_S)
        if self.stop.is_set():
            raise PeerError("stopped")
        raise NoReadyPeer(
            f"stage {stage} has no ready peer at outer step {t} after "
            f"{self.claim_timeout_s:.0f}s; start one with `peer join --stage {stage} ...`"
        )

    def route(self, t: int) -> tuple[str, ...]:
        """Addresses of stages 1 … S−1 (claimed now where a stage has no peer)."""
        return tuple(self.peer(s, t)[1] for s in range(1, self.cfg.stages))

    def bound(self) -> dict[int, tuple[str, str]]:
        """A copy of stage -> (peer id, address) as it stands."""
        with self._lock:
            return dict(self.peers)

    def drop(self, stage: int, why: str) -> None:
        """Give up this stage's peer for the rest of the outer step."""
        with self._lock:
            pid, address = self.peers.pop(stage, ("", ""))
        if pid:
            log.warning("pipeline %s: dropping stage %d peer %s (%s)", self.pipeline_id[:8], stage, pid[:12], why)
            self.excluded.add(pid)
            self.clients.drop(address)

    def on_failure(self, failure: Failure, t: int) -> None:
        """Apply a decision to the peers: REPLACE and BEHIND drop the stage's peer; BEHIND raises
        PipelineBehind (the head re-syncs)."""
        if failure.action is Action.REPLACE:
            self.drop(failure.stage, failure.reason)
        elif failure.action is Action.BEHIND:
            self.drop(failure.stage, "past this outer step")
            raise PipelineBehind(f"stage {failure.stage} peer is past outer step {t}: {failure.reason}")

    def release(self) -> None:
        """End of the outer step: claims end with the round; the same peers stay the first choice."""
        self.excluded.clear()
