"""A head's or full replica's data: the shard it claims, the dataset files that shard reads, the corpus.

DESIGN: every replica trains on its own data shard. `ShardData.claim` takes the lowest shard no live
replica uses (a resumed peer's own when still free); `fetch` makes sure the local prepared folder
(`--dataset`, else `<data-dir>/dataset`) holds every file that shard reads, fetching the missing ones
from the bootstrap and the run's live peers (`peer.node.data.fetch`: verified by sha256, resumable,
within the download cap), serves them to others from then on (`DatasetServer.hold`) and returns the
config naming that folder and its tokenizer; `load` opens the corpus with the one loader.
`peer_addresses` lists who may serve artefacts the bootstrap cannot (the tokenizer at join, shards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.core.data.loader import Corpus, load_corpus, needed_shards
from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.node.data.fetch import DatasetFetch, RunDataset, dataset_folder, mismatch_fix
from peer.node.data.serve import DatasetServer


def peer_addresses(dht: SwarmDHT, cfg: RunConfig) -> list[str]:
    """Data-plane addresses of the run's live peers (any stage), for artefacts the bootstrap cannot serve."""
    found: list[str] = []
    for s in range(cfg.stages):
        try:
            found += [r.address for r in dht.get_stage_peers(s).values() if r.address]
        except PeerError:
            continue
    return list(dict.fromkeys(found))


@dataclasses.dataclass
class ShardData:
    """The data side of one head or full replica (module docstring). Built by the session, which
    hands it what it uses: the DHT, this peer's id and address, its `--dataset` / `--data-dir`, the
    manifest, a client factory and the server of the dataset it holds."""

    dht: SwarmDHT
    peer_id: str
    address: Callable[[], str]  # this peer's data-plane address, once it serves
    dataset: Path | None  # --dataset
    data_dir: Path
    manifest: dict[str, Any]
    client: Callable[[str], Any]
    served: DatasetServer

    def claim(self, cfg: RunConfig, prefer: int | None = None) -> int:
        """The lowest data shard no live replica uses; `prefer` (a resumed peer's shard) when still free."""
        used = {rec.shard for pid, rec in self.dht.get_replicas().items() if pid != self.peer_id}
        if isinstance(prefer, int) and 0 <= prefer < cfg.swarm.n_shards and prefer not in used:
            return prefer
        for shard in range(cfg.swarm.n_shards):
            if shard not in used:
                return shard
        raise PeerError(f"all {cfg.swarm.n_shards} data shards are taken; raise swarm.n_shards at the bootstrap")

    def fetch(self, cfg: RunConfig, shard: int) -> RunConfig:
        """Every file data shard `shard` reads, local or fetched, served from now on; the config
        naming the folder and its tokenizer."""
        folder = dataset_folder(self.dataset, self.data_dir)
        fetch = DatasetFetch(
            folder, RunDataset.of(self.manifest), self._sources(cfg), self.client, cfg.swarm.rpc_timeout_s
        )
        assert cfg.data.tokenizer is not None  # the session fetched and checked it at join
        held = fetch.ensure(
            cfg.data.tokenizer,
            lambda index: needed_shards(index, cfg.train.seq_len, shard, cfg.swarm.n_shards),
            mismatch_fix(self.dataset, self.data_dir),
        )
        self.served.hold(held)
        return dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, dataset=str(folder), tokenizer=held.tokenizer_path)
        )

    def load(self, cfg: RunConfig) -> Corpus:
        """The run's corpus, read by the one loader (`peer.core.data.loader`)."""
        return load_corpus(cfg.data)

    def _sources(self, cfg: RunConfig) -> Callable[[], list[str]]:
        """Who may hold the dataset: the bootstrap first, then the run's live peers (not this one)."""

        def sources() -> list[str]:
            others = [a for a in peer_addresses(self.dht, cfg) if a != self.address()]
            return list(dict.fromkeys([str(self.manifest["bootstrap_address"]), *others]))

        return sources
