"""A training peer's connection to the swarm: manifest, records, server, rounds and metrics.

`Swarm.connect` joins the DHT first (hivemind forks; nothing else may run yet), waits for the
bootstrap's manifest, verifies it against this build (`peer.manifest.verify_manifest`), downloads
and checks the tokenizer, and opens `<data-dir>/metrics.jsonl`. The trainer then calls `serve`,
`sync_late_join`, `start_announcing` and the round helpers; `close` leaves cleanly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from peer.config import RunConfig
from peer.data import TokenData, build_token_data
from peer.dht import SwarmDHT
from peer.errors import DataError, ManifestMismatch, NetworkError, PeerError
from peer.manifest import verify_manifest
from peer.rounds import ClientPool, PayloadStore, RoundResult, expected_replicas, gather_round
from peer.service import PeerService
from peer.sparseloco import Payload
from peer.stage_worker import StageWorker
from peer.transport.client import PeerClient
from peer.transport.messages import ArtifactRequest, StateRequest
from peer.transport.server import PeerServer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SwarmOptions:
    """Where this peer listens and how it finds the swarm (everything else is in the manifest)."""

    initial_peers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0  # gRPC data plane
    dht_port: int = 0
    announce_host: str | None = None
    data_dir: Path = Path("runs/peer")
    identity: str | None = None
    device: str = "cpu"
    manifest_timeout_s: float = 60.0


class Swarm:
    def __init__(self, opts: SwarmOptions, dht: SwarmDHT, manifest: dict, cfg: RunConfig, role: str,
                 stage: int | None) -> None:
        self.opts, self.dht, self.manifest, self.cfg = opts, dht, manifest, cfg
        self.role, self.stage = role, stage
        self.peer_id = dht.peer_id
        self.joined_at = 0
        self.store = PayloadStore()
        self.clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype)
        self.server: PeerServer | None = None
        self.service: PeerService | None = None
        self.address = ""
        self.pg_bytes = 0
        self._stop_announce = threading.Event()
        self._announcer: threading.Thread | None = None
        self._publish: Callable[[], None] | None = None
        self._publish_lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        opts.data_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(opts.data_dir / "metrics.jsonl", "a", buffering=1)

    # ------------------------------------------------------------------ joining
    @classmethod
    def connect(cls, opts: SwarmOptions, role: str, stage: int | None) -> "Swarm":
        if not opts.initial_peers:
            raise PeerError("--initial-peers is required: paste the line `peer bootstrap` printed")
        dht = SwarmDHT(opts.initial_peers, host=opts.host, port=opts.dht_port, announce_host=opts.announce_host,
                       identity_path=opts.identity)
        if opts.device == "auto":  # only now: the DHT process has forked, CUDA may be touched
            import torch

            opts = dataclasses.replace(opts, device="cuda" if torch.cuda.is_available() else "cpu")
        try:
            manifest = _wait_for_manifest(dht, opts.manifest_timeout_s)
            cfg = verify_manifest(manifest)
            dht.set_run(manifest["run_id"], cfg.stages)
            cfg = _with_tokenizer(cfg, manifest, opts.data_dir, opts.manifest_timeout_s)
            swarm = cls(opts, dht, manifest, cfg, role, stage)
        except BaseException:
            dht.shutdown()
            raise
        swarm.joined_at = dht.current_outer_step()
        log.info("joined run %s as %s%s", manifest["run_id"], role, "" if stage is None else f" of stage {stage}")
        return swarm

    def serve(self, workers: dict[int, StageWorker], on_last_step: Callable[[str, int], None] | None = None) -> None:
        self.service = PeerService(self.cfg, workers, self.store, self.peer_id, self.role, on_last_step)
        self.server = PeerServer(self.service, host=self.opts.host, port=self.opts.port,
                                 vocab_size=self.cfg.model.vocab_size, wire_dtype=self.cfg.subspace.wire_dtype)
        self.address = f"{self.opts.announce_host or self.opts.host}:{self.server.port}"
        self.log_event("start", stage=self.stage, peer_id=self.peer_id, address=self.address)

    def sync_late_join(self, worker: StageWorker) -> None:
        """If the swarm is past outer step 0, download this stage's committed state from a holder."""
        t_swarm = self.dht.current_outer_step()
        if t_swarm <= worker.outer_step:
            return
        holders = {pid: rec for pid, rec in self.dht.get_stage_peers(worker.stage).items()
                   if pid != self.peer_id and rec.get("outer_step", -1) >= t_swarm - 1 and rec.get("address")}
        for pid, rec in sorted(holders.items(), key=lambda kv: -kv[1].get("outer_step", 0)):
            try:
                reply = self.clients.get(rec["address"]).get_state(StateRequest(worker.stage))
                worker.load_snapshot(reply.tensors, reply.outer_step)
            except (PeerError, ValueError) as exc:
                log.warning("state download of stage %d from %s failed: %s", worker.stage, pid[:12], exc)
                continue
            if reply.meta.get("param_hash") and worker.param_hash() != reply.meta["param_hash"]:
                log.warning("stage %d state from %s fails its hash check; trying another holder", worker.stage, pid[:12])
                continue
            self.joined_at = reply.outer_step
            log.info("late join: stage %d state at outer step %d from %s (hash %s)", worker.stage,
                     reply.outer_step, pid[:12], worker.param_hash())
            self.log_event("sync", stage=worker.stage, t=reply.outer_step, param_hash=worker.param_hash())
            return
        raise NetworkError(f"the swarm is at outer step {t_swarm} but no peer served stage {worker.stage}'s state; "
                           "retry when a holder of that stage is online")

    # ------------------------------------------------------------------ records
    def stage_record(self, worker: StageWorker, role: str) -> dict[str, Any]:
        svc = self.service
        state = "syncing" if svc is None else ("busy" if svc.claimed_by or svc.in_round else "ready")
        return {"kind": "stage", "stage": worker.stage, "record": {
            "address": self.address, "role": role, "state": state, "outer_step": worker.outer_step,
            "param_hash": worker.param_hash(), "pipeline": svc.claimed_by if svc else None,
            "tokens_per_s": svc.tokens / max(1e-9, time.monotonic() - svc.started) if svc else 0.0}}

    def replica_record(self, kind: str, outer_step: int, shard: int, loss: float | None,
                       tokens_per_s: float) -> dict[str, Any]:
        return {"kind": "replica", "record": {
            "address": self.address, "kind": kind, "outer_step": outer_step, "shard": shard,
            "loss": loss, "tokens_per_s": tokens_per_s, "joined_at": self.joined_at}}

    def start_announcing(self, *record_fns: Callable[[], dict[str, Any]]) -> None:
        """Publish the records now and then every `announce_interval_s` until close()."""
        ttl = self.cfg.swarm.record_ttl_s

        def publish() -> None:
            for fn in record_fns:
                item = fn()
                if item["kind"] == "stage":
                    self.dht.announce_stage(item["stage"], item["record"], ttl_s=ttl)
                else:
                    self.dht.announce_replica(item["record"], ttl_s=ttl)

        def loop() -> None:
            while not self._stop_announce.wait(self.cfg.swarm.announce_interval_s):
                self.refresh_records()

        self._publish = publish
        publish()
        self._announcer = threading.Thread(target=loop, name="peer-announce", daemon=True)
        self._announcer.start()

    def wait_for_quorum(self, t: int, stop: threading.Event) -> None:
        """Before training, wait (bounded) until `swarm.min_replicas` replicas are online."""
        need = self.cfg.swarm.min_replicas
        deadline = time.monotonic() + self.cfg.swarm.round_timeout_s
        while not stop.is_set():
            have = len(expected_replicas(self.dht, t))
            if have >= need:
                return
            if time.monotonic() >= deadline:
                log.warning("starting with %d of %d replicas after %.0fs", have, need, self.cfg.swarm.round_timeout_s)
                return
            stop.wait(0.5)

    def linger(self, stop: threading.Event, max_s: float = 15.0) -> None:
        """After the last round keep serving payloads until no live peer of the run is behind (bounded)."""
        T = self.cfg.train.outer_steps
        deadline = time.monotonic() + max_s
        while not stop.is_set() and time.monotonic() < deadline:
            behind = [pid for pid, rec in self.dht.get_replicas().items() if rec.get("outer_step", T) < T]
            for s in range(self.cfg.stages):
                behind += [pid for pid, rec in self.dht.get_stage_peers(s).items() if rec.get("outer_step", T) < T]
            if not [pid for pid in behind if pid != self.peer_id]:
                return
            stop.wait(0.5)

    def refresh_records(self) -> None:
        """Publish this peer's records now (after every round, so peers see its new outer step)."""
        if self._publish is None:
            return
        with self._publish_lock:
            try:
                self._publish()
            except PeerError as exc:
                log.warning("could not refresh DHT records: %s", exc)

    def claim_shard(self) -> int:
        """The lowest data shard no live replica uses (DESIGN: disjoint data per replica)."""
        used = {rec.get("shard") for pid, rec in self.dht.get_replicas().items() if pid != self.peer_id}
        for shard in range(self.cfg.swarm.n_shards):
            if shard not in used:
                return shard
        raise PeerError(f"all {self.cfg.swarm.n_shards} data shards are taken; raise swarm.n_shards at the bootstrap")

    def load_data(self) -> TokenData:
        return build_token_data(self.cfg.data)

    # ------------------------------------------------------------------ rounds
    def _validator(self, worker: StageWorker) -> Callable[[bytes], None]:
        n = sum(v.numel() for v in worker.start.values())
        return lambda data: Payload.from_bytes(data, max_elements=n, cfg=self.cfg.sparseloco)

    def gather_for(self, worker: StageWorker, t: int, replica_id: str | None, stop: threading.Event,
                   stage: int | None = None) -> RoundResult:
        """Contribute worker's payload (if replica_id) and collect round (t, stage)."""
        stage = worker.stage if stage is None else stage
        own = (replica_id, worker.encode_round().to_bytes()) if replica_id is not None else None
        result = gather_round(self.dht, self.clients, t, stage, self.cfg.swarm.round_timeout_s, own=own,
                              store=self.store, address=self.address, validate=self._validator(worker),
                              ttl_s=max(60.0, 2 * self.cfg.swarm.round_timeout_s), stop=stop)
        self.pg_bytes += result.bytes_fetched
        return result

    def contribute(self, worker: StageWorker, t: int, replica_id: str, stop: threading.Event) -> RoundResult:
        """Stage 0 of a head: contribute, gather and apply."""
        result = self.gather_for(worker, t, replica_id, stop)
        worker.apply_round([Payload.from_bytes(p) for p in result.payloads], None)
        return result

    def round_complete(self, t: int, stage: int) -> bool:
        """Every expected replica has announced its payload for (t, stage): a hot spare may apply it.

        Until then the spare stays claimable: a head still at outer step t may need it.
        """
        announced = {rec.get("replica", pid) for pid, rec in self.dht.get_payloads(t, stage).items()}
        expected = expected_replicas(self.dht, t)
        return bool(announced) and expected <= announced

    def run_stage_round(self, worker: StageWorker, contributor: str | None, stop: threading.Event) -> None:
        """A stage > 0 peer: its own round (contributing if it trained) + stage 0's for T⊥."""
        t = worker.outer_step
        result = self.gather_for(worker, t, contributor, stop)
        embed = self.gather_for(worker, t, None, stop, stage=0)
        embed_update = StageWorker.embed_update([Payload.from_bytes(p) for p in embed.payloads], self.cfg) \
            if embed.payloads else None
        worker.apply_round([Payload.from_bytes(p) for p in result.payloads], embed_update)
        self.log_round(t, {worker.stage: (worker, result.participants)}, None, None, result.wall_s)

    # ------------------------------------------------------------------ metrics and exit
    def log_event(self, event: str, **fields: Any) -> None:
        record = {"event": event, "role": self.role, **fields, "time": time.time()}
        with self._metrics_lock:
            self._metrics.write(json.dumps(record) + "\n")

    def log_round(self, t: int, stages: dict[int, tuple[StageWorker, int]], train_loss: float | None,
                  val_loss: float | None, wall_s: float, activations: tuple[int, int] = (0, 0)) -> None:
        self.log_event("round", t=t, stages={str(s): {"param_hash": w.param_hash(), "perp_hash": w.perp_hash(),
                                                      "participants": n} for s, (w, n) in stages.items()},
                       train_loss=train_loss, val_loss=val_loss, round_wall_s=wall_s,
                       bytes={"activations": activations[0], "activations_uncompressed_equiv": activations[1],
                              "pseudo_gradients": self.pg_bytes})
        self.refresh_records()
        log.info("round %d committed: %s train %s val %s", t,
                 {s: n for s, (_, n) in stages.items()}, train_loss, val_loss)

    def log_exit(self, reason: str) -> None:
        self.log_event("exit", reason=reason)

    def close(self) -> None:
        self._stop_announce.set()
        if self._announcer is not None:
            self._announcer.join(timeout=5)
        try:
            if self.stage is not None:
                self.dht.withdraw_stage(self.stage)
            if self.role in ("head", "full"):
                self.dht.withdraw_replica()
        except PeerError as exc:
            log.warning("could not withdraw records: %s", exc)
        if self.server is not None:
            self.server.stop(grace_s=1.0)
        self.clients.close()
        self.dht.shutdown()
        with self._metrics_lock:
            self._metrics.close()


def _wait_for_manifest(dht: SwarmDHT, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        manifest = dht.get_manifest()
        if manifest is not None:
            return manifest
        if time.monotonic() >= deadline:
            raise NetworkError(f"no manifest found within {timeout_s:.0f}s: is `peer bootstrap` running, "
                               "and is --initial-peers the address it printed?")
        time.sleep(0.5)


def _with_tokenizer(cfg: RunConfig, manifest: dict, data_dir: Path, timeout_s: float) -> RunConfig:
    """Download the run's tokenizer from the bootstrap, check its sha256, point the data config at it."""
    path = data_dir / "tokenizer.model"
    want = manifest["tokenizer_sha256"]
    if not (path.exists() and hashlib.sha256(path.read_bytes()).hexdigest() == want):
        with PeerClient(manifest["bootstrap_address"], timeout_s=timeout_s) as client:
            raw = client.get_artifact(ArtifactRequest("tokenizer"))
        if hashlib.sha256(raw).hexdigest() != want:
            raise ManifestMismatch("the tokenizer served by the bootstrap does not match the manifest's sha256")
        data_dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(raw)
        tmp.replace(path)
    if not path.exists():
        raise DataError(f"tokenizer {path} missing after download")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=path))
