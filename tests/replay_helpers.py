"""An honest committed history on real workers, for the replay tests (tests/unit/test_replay.py,
tests/integration/test_join_replay.py): real payloads from the real encoder, real commits.

`History.run(rounds)`: every replica trains a little (seeded noise on its parameters), encodes its
payload of each stage, and every holder commits the same set in the same order (stage 1's T⊥ moved
by stage 0's embedding change, as a stage peer observes it); the links and payload bytes are kept
by (t, stage) for a DHT or a payload server to publish.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peer.config import RunConfig, build_config
from peer.core.sparseloco.commit import embedding_update
from peer.node.round.claims import Link, entry
from peer.node.round.payloads import payload_id
from peer.node.stage.worker import StageWorker

REPLICAS = ("ReplicaAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "ReplicaBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb")


def replay_config(history_rounds: int = 16) -> RunConfig:
    """The tiny 2-stage run, a little training per round."""
    return build_config(overrides={"swarm.history_rounds": history_rounds}, environ={})


@dataclass
class History:
    cfg: RunConfig
    replicas: tuple[str, ...] = REPLICAS
    workers: dict[tuple[str, int], StageWorker] = field(default_factory=dict)
    payloads: dict[tuple[int, int, str], bytes] = field(default_factory=dict)  # (t, stage, replica) → bytes
    links: dict[tuple[int, int], Link] = field(default_factory=dict)  # (t, stage) → the honest link

    def __post_init__(self) -> None:
        for rid in self.replicas:
            for s in range(self.cfg.stages):
                self.workers[(rid, s)] = StageWorker(self.cfg, s)

    def state(self, stage: int) -> str:
        return self.workers[(self.replicas[0], stage)].state_id()

    def run(self, rounds: int) -> None:
        for _ in range(rounds):
            self._round()

    def _round(self) -> None:
        t = self.workers[(self.replicas[0], 0)].outer_step
        sent: dict[int, list] = {}
        for s in range(self.cfg.stages):
            for i, rid in enumerate(self.replicas):
                w = self.workers[(rid, s)]
                gen = torch.Generator().manual_seed(1000 * t + 10 * s + i)
                with torch.no_grad():
                    for p in w.module.parameters():
                        p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
                payload = w.contribute(rid)
                self.payloads[(t, s, rid)] = payload.to_bytes()
                sent.setdefault(s, []).append(payload)
        embed_set = [entry(r, payload_id(self.payloads[(t, 0, r)])) for r in self.replicas]
        update = embedding_update(sent[0], self.cfg.sparseloco, keys=list(self.replicas))
        for s in range(self.cfg.stages):
            for rid in self.replicas:
                w = self.workers[(rid, s)]
                if s == 0:
                    w.apply_round(sent[0], None, self.replicas)
                else:
                    w.apply_round(sent[s], update, self.replicas, embed_set)
            link = self.workers[(self.replicas[0], s)].ledger.link
            assert link is not None and len({self.workers[(r, s)].state_id() for r in self.replicas}) == 1
            self.links[(t, s)] = link
