"""A training peer's connection to the swarm: manifest, records, server, rounds and metrics.

`Swarm.connect` joins the DHT first (hivemind forks; nothing else may run yet), waits for the
bootstrap's manifest, verifies it against this build (`peer.node.manifest.verify_manifest`), downloads
and checks the tokenizer, and opens `<data-dir>/metrics.jsonl`. The trainer then calls `serve`,
`sync_late_join`, `start_announcing` and the round helpers; `close` leaves cleanly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.core.data import TokenData, build_token_data
from peer.core.model import stage_shapes
from peer.core.outer import EMBED
from peer.core.sparseloco import Payload
from peer.errors import CheckpointError, DataError, ManifestMismatch, NetworkError, PeerError
from peer.net.dht import SwarmDHT
from peer.net.transport.client import PeerClient
from peer.net.transport.messages import ArtifactRequest, StateRequest
from peer.net.transport.server import PeerServer
from peer.node.checkpoints.stage import (
    checkpoint_fingerprint,
    list_stage_checkpoints,
    load_latest_stage_checkpoint,
    save_stage_checkpoint,
)
from peer.node.manifest import verify_manifest
from peer.node.metrics import MetricsWriter
from peer.node.rounds import (
    ClientPool,
    PayloadStore,
    RoundResult,
    announced_replicas,
    expected_replicas,
    gather_round,
    payload_validator,
)
from peer.node.service import PeerService
from peer.node.stage_worker import StageWorker

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
    swarm_secret: bytes | None = field(default=None, repr=False)  # secret-mode swarms (None: $PEER_SWARM_SECRET)
    resume: bool = False  # restore <data_dir>/checkpoints before training (`peer join --resume`)


class Swarm:
    def __init__(
        self, opts: SwarmOptions, dht: SwarmDHT, manifest: dict, cfg: RunConfig, role: str, stage: int | None
    ) -> None:
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
        self.resyncs = 0
        self.resumed_at: int | None = None  # outer step of the checkpoint restored by `resume`
        self._stop_announce = threading.Event()
        self._announcer: threading.Thread | None = None
        self._publish: Callable[[], None] | None = None
        self._publish_lock = threading.Lock()
        self._announced_stages: set[int] = set()
        opts.data_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsWriter(opts.data_dir, role)

    # ------------------------------------------------------------------ joining
    @classmethod
    def connect(cls, opts: SwarmOptions, role: str, stage: int | None, stop: threading.Event | None = None) -> Swarm:
        if not opts.initial_peers:
            raise PeerError("--initial-peers is required: paste the line `peer bootstrap` printed")
        dht = _start_dht(opts)
        if opts.device == "auto":  # only now: the DHT process has forked, CUDA may be touched
            import torch

            opts = dataclasses.replace(opts, device="cuda" if torch.cuda.is_available() else "cpu")
        try:
            manifest = _wait_for_manifest(dht, opts.manifest_timeout_s, stop or threading.Event())
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

    @classmethod
    @contextlib.contextmanager
    def session(cls, opts: SwarmOptions, role: str, stage: int | None, stop: threading.Event) -> Iterator[Swarm]:
        """`connect`, then always record why the role ended and leave cleanly (records withdrawn,
        server and DHT stopped), whether it finished, was stopped or failed."""
        swarm = cls.connect(opts, role=role, stage=stage, stop=stop)
        try:
            yield swarm
        except BaseException as exc:
            swarm.log_exit("stopped" if stop.is_set() else f"error: {exc}")
            raise
        finally:
            swarm.close()

    def serve(self, workers: dict[int, StageWorker], on_last_step: Callable[[str, int], None] | None = None) -> None:
        self.service = PeerService(self.cfg, workers, self.store, self.peer_id, self.role, on_last_step)
        self.server = PeerServer(
            self.service,
            host=self.opts.host,
            port=self.opts.port,
            max_message_bytes=max_request_bytes(self.cfg),
            vocab_size=self.cfg.model.vocab_size,
            wire_dtype=self.cfg.subspace.wire_dtype,
        )
        self.address = f"{self.opts.announce_host or self.opts.host}:{self.server.port}"
        self.log_event("start", stage=self.stage, peer_id=self.peer_id, address=self.address)

    def sync_late_join(self, worker: StageWorker) -> None:
        """If the swarm is past this worker's outer step, download the stage's committed state.

        A state resumed from a checkpoint at (or past) the swarm's outer step is kept; one that is
        behind loses to the swarm's (error buffer and optimizer reset, as for any late joiner).
        """
        t_swarm = self.dht.current_outer_step()
        if t_swarm > worker.outer_step:
            if self.resumed_at is not None:
                log.warning(
                    "stage %d: checkpoint at outer step %d is behind the swarm (%d); taking the swarm's "
                    "state, error buffer and optimizer reset",
                    worker.stage,
                    worker.outer_step,
                    t_swarm,
                )
            self.sync_state(
                worker,
                "late join"
                if self.resumed_at is None
                else f"checkpoint behind the swarm (outer step {worker.outer_step} < {t_swarm})",
            )
        elif self.resumed_at is not None:
            log.info(
                "stage %d: keeping the resumed state at outer step %d (swarm at %d)",
                worker.stage,
                worker.outer_step,
                t_swarm,
            )
            self.log_event(
                "resume_kept", stage=worker.stage, t=worker.outer_step, swarm_t=t_swarm, param_hash=worker.param_hash()
            )

    # ------------------------------------------------------------------ checkpoints
    def resume(self, workers: dict[int, StageWorker]) -> dict[str, Any] | None:
        """With `--resume`, restore the newest good checkpoint of <data_dir>/checkpoints; its meta or None."""
        root = self.opts.data_dir / "checkpoints"
        if not self.opts.resume:
            found = list_stage_checkpoints(root)
            if found:
                log.warning(
                    "starting without --resume: %s will be replaced as this peer saves its own checkpoints "
                    "(pass --resume to continue from it)",
                    found[0],
                )
            return None
        meta = load_latest_stage_checkpoint(root, workers, checkpoint_fingerprint(self.cfg))
        if meta is None:
            log.warning("--resume: no checkpoint in %s yet; starting from the swarm's state", root)
            return None
        self.resumed_at = meta["outer_step"]
        self.log_event("resume", t=meta["outer_step"], path=meta["path"], extra=meta.get("extra", {}))
        return meta

    def checkpoint(self, workers: dict[int, StageWorker], extra: dict[str, Any] | None = None) -> Path | None:
        """After a committed round: save every `swarm.checkpoint_every_rounds` rounds (and after the last).

        Call while nothing trains the workers. A failed save is logged (and recorded in the
        metrics) but does not stop training: the previous checkpoint stays on disk.
        """
        every, t = self.cfg.swarm.checkpoint_every_rounds, next(iter(workers.values())).outer_step
        if every == 0 or (t % every and t != self.cfg.train.outer_steps):
            return None
        started = time.monotonic()
        try:
            path = save_stage_checkpoint(
                self.opts.data_dir / "checkpoints", workers, extra, keep=self.cfg.swarm.keep_checkpoints
            )
        except CheckpointError as exc:
            log.error("%s", exc)
            self.log_event("checkpoint_failed", t=t, reason=str(exc))
            return None
        self.log_event(
            "checkpoint",
            t=t,
            path=str(path),
            save_s=time.monotonic() - started,
            bytes=sum(f.stat().st_size for f in path.iterdir()),
        )
        return path

    def sync_state(
        self, worker: StageWorker, reason: str, want_hash: str | None = None, keep_errors: bool = False
    ) -> None:
        """Download stage state from the most advanced holder (with `want_hash`, if given).

        Raises NetworkError when no holder serves a state that passes its hash check.
        """
        t_swarm = self.dht.current_outer_step()
        holders = {
            pid: rec
            for pid, rec in self.dht.get_stage_peers(worker.stage).items()
            if pid != self.peer_id and rec.get("address") and (want_hash is None or rec.get("param_hash") == want_hash)
        }
        for pid, rec in sorted(holders.items(), key=lambda kv: (-kv[1].get("outer_step", 0), kv[0])):
            try:
                reply = self.clients.get(rec["address"]).get_state(StateRequest(worker.stage))
                if reply.meta.get("param_hash") is None:
                    raise PeerError("state reply without a parameter hash")
                worker.load_snapshot(reply.tensors, reply.outer_step, keep_errors=keep_errors)
            except (PeerError, ValueError) as exc:
                log.warning("state download of stage %d from %s failed: %s", worker.stage, pid[:12], exc)
                continue
            if worker.param_hash() != reply.meta["param_hash"]:
                log.warning(
                    "stage %d state from %s fails its hash check; trying another holder", worker.stage, pid[:12]
                )
                continue
            # a peer that (re)synced at t contributes from t + 1 (DESIGN §3: late joiners)
            self.joined_at = max(self.joined_at, reply.outer_step + 1)
            self.resyncs += 1
            log.info(
                "%s: stage %d state at outer step %d from %s (hash %s)",
                reason,
                worker.stage,
                reply.outer_step,
                pid[:12],
                worker.param_hash(),
            )
            self.log_event(
                "sync", stage=worker.stage, t=reply.outer_step, param_hash=worker.param_hash(), reason=reason
            )
            self.refresh_records()
            return
        raise NetworkError(
            f"the swarm is at outer step {t_swarm} but no peer served stage {worker.stage}'s state; "
            "retry when a holder of that stage is online"
        )

    def catch_up(self, workers: dict[int, StageWorker], stop: threading.Event) -> None:
        """After a state download at outer step t, apply round t as an observer instead of
        contributing to it: the others did not expect this replica in round t."""
        t = min(w.outer_step for w in workers.values())
        if self.joined_at <= t or not expected_replicas(self.dht, t):
            return
        results = {s: self.gather_for(w, t, None, stop) for s, w in workers.items()}
        if 0 in results:
            embed = results[0]
        else:
            embed = self.gather_for(next(iter(workers.values())), t, None, stop, stage=0)
        embed_update = (
            StageWorker.embed_update([Payload.from_bytes(p) for p in embed.payloads], self.cfg)
            if embed.payloads
            else None
        )
        for s, w in workers.items():
            w.apply_round([Payload.from_bytes(p) for p in results[s].payloads], embed_update)
        self.log_event("catch_up", t=t)
        self.refresh_records()

    def maintain(self, worker: StageWorker, max_lag: int = 1) -> None:
        """Re-sync a worker that fell more than `max_lag` rounds behind, or whose committed parameters
        disagree with the majority of its stage's holders at the same outer step (DESIGN §3)."""
        if self.dht.current_outer_step() > worker.outer_step + max_lag:
            self.sync_state(worker, f"behind (outer step {worker.outer_step})")
            return
        same = [
            rec
            for pid, rec in self.dht.get_stage_peers(worker.stage).items()
            if pid != self.peer_id and rec.get("outer_step") == worker.outer_step and rec.get("param_hash")
        ]
        if not same:
            return
        mine = worker.param_hash()
        votes = Counter([rec["param_hash"] for rec in same] + [mine])
        top, n = votes.most_common(1)[0]
        if top == mine or 2 * n <= len(same) + 1:
            return
        committed = next((rec.get("committed", []) for rec in same if rec["param_hash"] == top), [])
        missed = worker.last_contribution is not None and worker.last_contribution[0][:16] not in committed
        unsent = worker.last_contribution[1] if missed else None
        self.sync_state(
            worker, f"hash {mine} disagrees with {n}/{len(same) + 1} holders", want_hash=top, keep_errors=True
        )
        if unsent is not None:
            worker.return_unsent(unsent)  # our payload missed their commit: nothing is lost
            log.info("stage %d: our payload missed the majority's commit; returned to the error buffer", worker.stage)

    # ------------------------------------------------------------------ records
    def stage_record(self, worker: StageWorker, role: str) -> dict[str, Any]:
        svc = self.service
        state = "syncing" if svc is None else ("busy" if svc.claimed_by or svc.in_round else "ready")
        return {
            "kind": "stage",
            "stage": worker.stage,
            "record": {
                "address": self.address,
                "role": role,
                "state": state,
                "outer_step": worker.outer_step,
                "param_hash": worker.param_hash(),
                "pipeline": svc.claimed_by if svc else None,
                "committed": [r[:16] for r in worker.last_committed],
                "tokens_per_s": svc.tokens / max(1e-9, time.monotonic() - svc.started) if svc else 0.0,
            },
        }

    def replica_record(
        self,
        kind: str,
        outer_step: int,
        shard: int,
        loss: float | None,
        tokens_per_s: float,
        pipeline_peers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """`pipeline_peers` ({"<stage>": peer id}, heads only) binds the stage peers' payload
        announcements to this replica (peer.node.rounds.bound_replica)."""
        record = {
            "address": self.address,
            "kind": kind,
            "outer_step": outer_step,
            "shard": shard,
            "loss": loss,
            "tokens_per_s": tokens_per_s,
            "joined_at": self.joined_at,
        }
        if pipeline_peers is not None:
            record["pipeline_peers"] = pipeline_peers
        return {"kind": "replica", "record": record}

    def start_announcing(self, *record_fns: Callable[[], dict[str, Any]]) -> None:
        """Publish the records now and then every `announce_interval_s` until close()."""
        ttl = self.cfg.swarm.record_ttl_s

        def publish() -> None:
            for fn in record_fns:
                item = fn()
                if item["kind"] == "stage":
                    self._announced_stages.add(item["stage"])
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
        """Before the run's first step, wait (bounded) until `swarm.min_replicas` replicas are online.

        A late joiner (t > 0) joins a swarm that is already training and does not wait."""
        if t > 0:
            return
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

    def claim_shard(self, prefer: int | None = None) -> int:
        """The lowest data shard no live replica uses (DESIGN: disjoint data per replica).

        `prefer` (a resumed peer's shard) is taken when it is still free.
        """
        used = {rec.get("shard") for pid, rec in self.dht.get_replicas().items() if pid != self.peer_id}
        if isinstance(prefer, int) and 0 <= prefer < self.cfg.swarm.n_shards and prefer not in used:
            return prefer
        for shard in range(self.cfg.swarm.n_shards):
            if shard not in used:
                return shard
        raise PeerError(f"all {self.cfg.swarm.n_shards} data shards are taken; raise swarm.n_shards at the bootstrap")

    def load_data(self) -> TokenData:
        return build_token_data(self.cfg.data)

    # ------------------------------------------------------------------ rounds
    def _validator(self, worker: StageWorker, stage: int) -> Callable[[bytes], None]:
        """Payloads of round (t, stage): the format, and entries that fit the stage's parameters."""
        if stage == worker.stage:
            shapes = {name: tuple(v.shape) for name, v in worker.start.items()}
        else:  # an observer gather (stage 0 for T⊥)
            shapes = stage_shapes(self.cfg.model, stage, self.cfg.stages)
        return payload_validator(shapes, self.cfg.sparseloco, required=[EMBED] if stage == 0 else [])

    def gather_for(
        self, worker: StageWorker, t: int, replica_id: str | None, stop: threading.Event, stage: int | None = None
    ) -> RoundResult:
        """Contribute worker's payload (if replica_id) and collect round (t, stage)."""
        own_stage = stage is None or stage == worker.stage
        stage = worker.stage if stage is None else stage
        own = None
        if replica_id is not None:
            payload = worker.encode_round()
            worker.last_contribution = (replica_id, payload)
            own = (replica_id, payload.to_bytes())
        elif own_stage:
            worker.last_contribution = None
        result = gather_round(
            self.dht,
            self.clients,
            t,
            stage,
            self.cfg.swarm.round_timeout_s,
            own=own,
            store=self.store,
            address=self.address,
            validate=self._validator(worker, stage),
            ttl_s=max(60.0, 2 * self.cfg.swarm.round_timeout_s),
            stop=stop,
        )
        if own_stage:
            worker.last_committed = result.replicas
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
        announced = announced_replicas(self.dht, t, stage)
        expected = expected_replicas(self.dht, t)
        return bool(announced) and expected <= announced

    def run_stage_round(self, worker: StageWorker, contributor: str | None, stop: threading.Event) -> None:
        """A stage > 0 peer: its own round (contributing if it trained) + stage 0's for T⊥."""
        t = worker.outer_step
        result = self.gather_for(worker, t, contributor, stop)
        embed = self.gather_for(worker, t, None, stop, stage=0)
        embed_update = (
            StageWorker.embed_update([Payload.from_bytes(p) for p in embed.payloads], self.cfg)
            if embed.payloads
            else None
        )
        worker.apply_round([Payload.from_bytes(p) for p in result.payloads], embed_update)
        self.log_round(t, {worker.stage: (worker, result.participants)}, None, None, result.wall_s)

    # ------------------------------------------------------------------ metrics and exit
    def log_event(self, event: str, **fields: Any) -> None:
        self.metrics.log(event, **fields)

    def log_round(
        self,
        t: int,
        stages: dict[int, tuple[StageWorker, int]],
        train_loss: float | None,
        val_loss: float | None,
        wall_s: float,
        activations: tuple[int, int] = (0, 0),
    ) -> None:
        self.log_event(
            "round",
            t=t,
            stages={
                str(s): {
                    "param_hash": w.param_hash(),
                    "perp_hash": w.perp_hash(),
                    "participants": n,
                    "clipped": w.last_clip.n_clipped,
                    "max_norm_ratio": w.last_clip.max_ratio,
                }
                for s, (w, n) in stages.items()
            },
            train_loss=train_loss,
            val_loss=val_loss,
            round_wall_s=wall_s,
            bytes={
                "activations": activations[0],
                "activations_uncompressed_equiv": activations[1],
                "pseudo_gradients": self.pg_bytes,
            },
        )
        self.refresh_records()
        log.info(
            "round %d committed: %s train %s val %s", t, {s: n for s, (_, n) in stages.items()}, train_loss, val_loss
        )

    def finish(self, stop: threading.Event) -> int:
        """The end of a role's loop: keep serving until nobody is behind, record why we stop; exit 0."""
        self.linger(stop)
        self.log_exit("finished" if not stop.is_set() else "stopped")
        return 0

    def log_exit(self, reason: str) -> None:
        self.log_event("exit", reason=reason)

    def close(self) -> None:
        self._stop_announce.set()
        if self._announcer is not None:
            self._announcer.join(timeout=5)
        try:
            for stage in sorted(self._announced_stages):
                self.dht.withdraw_stage(stage)
            if self.role in ("head", "full"):
                self.dht.withdraw_replica()
        except PeerError as exc:
            log.warning("could not withdraw records: %s", exc)
        if self.server is not None:
            self.server.stop(grace_s=1.0)
        self.clients.close()
        self.dht.shutdown()
        self.metrics.close()


def max_request_bytes(cfg: RunConfig) -> int:
    """The largest request a peer's server accepts: 4x the largest legitimate one, at least 4 MiB.

    That is a forward with an uncompressed (b, L, d) float32 boundary, int32 tokens and targets,
    at the largest batch and sequence the service accepts. Replies (our state) are not bounded by it.
    """
    b, L, d = cfg.train.batch_size, cfg.model.max_seq_len, cfg.model.d_model
    boundary = b * L * d * 4 + 2 * b * L * 4 + (64 << 10)  # hidden + tokens + targets + fields
    return max(4 << 20, 4 * boundary)


def _start_dht(opts: SwarmOptions, attempts: int = 2) -> SwarmDHT:
    """Start this peer's DHT node; one retry when the forked node did not come up in time
    (a fork from a busy multi-threaded process can stall; the stalled child is reaped)."""
    for attempt in range(attempts):
        try:
            return SwarmDHT(
                opts.initial_peers,
                host=opts.host,
                port=opts.dht_port,
                announce_host=opts.announce_host,
                identity_path=opts.identity,
                swarm_secret=opts.swarm_secret,
            )
        except NetworkError as exc:
            if attempt + 1 == attempts or "did not start" not in str(exc):
                raise
            log.warning("%s; retrying once", exc)
    raise AssertionError("unreachable")


def _wait_for_manifest(dht: SwarmDHT, timeout_s: float, stop: threading.Event) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        manifest = dht.get_manifest()
        if manifest is not None:
            return manifest
        if stop.is_set():
            raise PeerError("stopped before the manifest arrived")
        if time.monotonic() >= deadline:
            raise NetworkError(
                f"no manifest found within {timeout_s:.0f}s: is `peer bootstrap` running, "
                "and is --initial-peers the address it printed?"
            )
        stop.wait(0.5)


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
