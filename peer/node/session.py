"""One peer's session in the swarm: join, serve, and leave cleanly — its duties live next door.

`Session.connect` joins the DHT first (forked before any gRPC object exists), waits for the
bootstrap's manifest (`peer.node.manifest.wait_for_manifest`), verifies it against this build
(`verify_manifest`), refuses a head's or full replica's local dataset of another corpus, downloads
and checks the tokenizer, and opens `<data-dir>/metrics.jsonl`. Once a head or full replica has
claimed its data shard, `data` (peer.node.data.shard) fetches the dataset files it reads.
The session is the composition root: it builds the duties below and hands each what it uses (the
config, the DHT, the client pool, the refusals, a `publish` callable, this peer's `Presence`); none
receives the session. The trainer (`peer.node.trainer`) then serves its stage workers and uses them:
- `rounds`      outer rounds: gather, commit, record, catch up after a download (peer.node.round.rounds);
- `resync`      late join, the canonical-state check, downloads, catch-up (peer.node.round.resync);
- `refusals`    holders whose published state failed its check (peer.node.round.refusals);
- `records`     this peer's DHT records and their refresh thread (peer.node.records);
- `checkpoints` `--resume` and periodic saves (peer.node.checkpoints.peer);
- `metrics`     `<data-dir>/metrics.jsonl` (peer.node.metrics).
- `connectivity` the reachability check and reverse streams (peer.node.connectivity; docs/connectivity.md).
`Session.open` always records why the role ended and `close` leaves cleanly (records withdrawn,
server and DHT stopped), whether the role finished, was stopped or failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.core.data.shards import PreparedDataset
from peer.core.model.precision import resolve_precision
from peer.errors import ConfigError, NetworkError, PeerError
from peer.net.addresses import advertised_host
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.prometheus import watch_pool
from peer.net.ratelimit import Link, LinkCaps
from peer.net.records import NetFields, ReplicaRecord, StageRecord
from peer.net.transport import auth
from peer.net.transport.dialer import Outbound
from peer.net.transport.gate import Gate
from peer.net.transport.server import PeerServer
from peer.node.checkpoints.peer import PeerCheckpoints
from peer.node.connectivity import Connectivity
from peer.node.data.fetch import fetch_tokenizer, held_dataset
from peer.node.data.serve import DatasetServer
from peer.node.data.shard import ShardData, peer_addresses
from peer.node.link_config import LinkConfig
from peer.node.manifest import verify_manifest, wait_for_manifest
from peer.node.metrics import MetricsWriter
from peer.node.presence import Presence
from peer.node.records import Records
from peer.node.round.agreement import expected_replicas
from peer.node.round.claims import swarm_clock
from peer.node.round.context import RoundContext
from peer.node.round.payload_disk import PayloadDisk
from peer.node.round.payloads import PayloadStore
from peer.node.round.refusals import Refusals
from peer.node.round.resync import Resync
from peer.node.round.rounds import Rounds
from peer.node.service import PeerService
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SessionOptions:
    """Where this peer listens and how it finds the swarm (everything else is in the manifest)."""

    initial_peers: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 0  # gRPC data plane
    dht_port: int = 0
    announce_host: str | None = None
    data_dir: Path = Path("runs/peer")
    identity: str | None = None
    device: str = "cpu"
    precision: str = "auto"  # compute dtype of inner steps: auto, bf16, fp16, fp32 (`peer join --precision`)
    activation_checkpointing: bool = False  # recompute layer activations in backward (`--activation-checkpointing`)
    max_memory: int | None = None  # bytes this peer may use (`--max-memory`; None: the device's free memory)
    manifest_timeout_s: float = 60.0
    swarm_secret: bytes | None = field(default=None, repr=False)  # secret-mode swarms (None: $PEER_SWARM_SECRET)
    resume: bool = False  # restore <data_dir>/checkpoints before training (`peer join --resume`)
    dataset: Path | None = None  # the run's prepared dataset (`peer join --dataset`; default <data_dir>/dataset)
    link: LinkConfig = LinkConfig()  # upload/download caps, relaying (`peer join --max-upload-mbps`, `--relay`)
    in_flight: int | None = None  # a head's own window K (`peer join --in-flight`; None: the run's train.in_flight)
    compression: str = "auto"  # a head's boundary mode: auto (by its links), always, never (`peer join --compression`)
    sharded: bool = False  # a full replica's torchrun ranks shard it (FSDP2, `peer join --sharded`); else DDP
    gather_per_step: bool = False  # with sharded: gather and reduce once per inner step (`ShardedChain`)


def quorum_over(replicas: Mapping[str, ReplicaRecord], me: str, have: int, need: int) -> bool:
    """Whether a peer at outer step 0 stops waiting for `swarm.min_replicas`: `have` of `need`
    replicas are online, or the other replicas are past outer step 0 (the run started without us: a
    fresh joiner re-syncs instead of waiting)."""
    return have >= need or swarm_clock({p: r for p, r in replicas.items() if p != me}) > 0


class Session:
    """One peer of the swarm: its identity, DHT node, server and clients, and its duties."""

    def __init__(
        self,
        opts: SessionOptions,
        dht: SwarmDHT,
        manifest: dict[str, Any],
        cfg: RunConfig,
        role: str,
        stage: int | None,
        outbound: Outbound | None = None,
        dataset: PreparedDataset | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        """`outbound` (default: from the DHT's admission and `opts.link`): what every call this
        peer makes carries, its admission proof and its one link with the caps; `dataset`: the
        run's prepared dataset this peer already holds (served from `serve` on); `stop`: set when
        the peer is asked to leave (re-syncs give up at once)."""
        self.opts, self.dht, self.manifest, self.cfg = opts, dht, manifest, cfg
        self.outbound = outbound or _outbound(opts, dht)
        self.role, self.stage = role, stage
        self.peer_id = dht.peer_id
        self.me = Presence(dht.peer_id, role)  # address, joined_at, finishing: shared with the parts below
        # joiners replay the window: its whole payloads also on disk (this run's folder: another run's
        # payloads of the same rounds and senders are never served), served again after --resume
        if dht.run_id is None:
            raise RuntimeError("call dht.set_run(run_id) (from the manifest) before building a Session")
        disk = PayloadDisk(opts.data_dir / "payloads" / dht.run_id, resume=opts.resume)
        self.store = PayloadStore(history=cfg.swarm.history_rounds, disk=disk)
        if opts.resume and (kept := self.store.restore()):
            log.info("serving again %d payload(s) of the last %d rounds kept on disk", kept, cfg.swarm.history_rounds)
        self.clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype, self.outbound)
        watch_pool(self.clients)  # --metrics-port: bytes per gRPC method, read at each scrape
        self.server: PeerServer | None = None
        self.service: PeerService | None = None
        self.gate: Gate | None = None  # admission, reverse streams, caps (peer.net.transport.gate)
        self.datasets = DatasetServer(dataset)  # the run's dataset as far as this peer holds it
        self.data = ShardData(
            dht,
            dht.peer_id,
            lambda: self.me.address,
            opts.dataset,
            opts.data_dir,
            manifest,
            self.clients.get,
            self.datasets,
        )  # a head's or full replica's shard, its files and its corpus
        self.connectivity: Connectivity | None = None
        opts.data_dir.mkdir(parents=True, exist_ok=True)
        # the composition root: each part gets what it uses, none gets the session
        self.metrics = MetricsWriter(opts.data_dir, role)
        self.refusals = Refusals(on_refuse=self.metrics.log)  # holders whose state failed its check
        self.records = Records(dht, cfg.swarm, self.me, self.refusals, self.net, lambda: self.service)
        self.checkpoints = PeerCheckpoints(opts.data_dir, cfg, self.metrics, resume=opts.resume)
        publish = self.records.refresh
        attesters = [dht.manifest_signer] if dht.manifest_signer else []  # the bootstrap attests by default
        ctx = RoundContext(cfg, dht, self.clients, self.store, self.me, self.refusals, self.metrics, publish)
        self.resync = Resync(ctx, self.checkpoints, attesters, stop)
        self.rounds = Rounds(ctx, self.resync)

    # ------------------------------------------------------------------ joining and leaving
    @classmethod
    def connect(
        cls, opts: SessionOptions, role: str, stage: int | None, stop: threading.Event | None = None
    ) -> Session:
        if not opts.initial_peers:
            raise PeerError("--initial-peers is required: paste the line `peer bootstrap` printed")
        dht = _start_dht(opts, stop)
        if opts.device == "auto":  # only now: the DHT process has forked, CUDA may be touched
            import torch

            opts = dataclasses.replace(opts, device="cuda" if torch.cuda.is_available() else "cpu")
        opts = dataclasses.replace(opts, precision=resolve_precision(opts.precision, opts.device))
        try:
            manifest = wait_for_manifest(dht, opts.manifest_timeout_s, opts.initial_peers[0], stop)
            cfg = verify_manifest(manifest)
            dht.set_run(manifest["run_id"], cfg.stages)
            outbound = _outbound(opts, dht)  # the manifest's admission is known now
            held = held_dataset(opts.dataset, opts.data_dir, manifest, role)  # another corpus: one line, first
            addresses = peer_addresses(dht, cfg)
            local = held.tokenizer_path if held is not None else None
            cfg = fetch_tokenizer(cfg, manifest, opts.data_dir, opts.manifest_timeout_s, addresses, outbound, local)
            session = cls(opts, dht, manifest, cfg, role, stage, outbound, held, stop)
        except BaseException:
            dht.shutdown()
            raise
        session.me.joined_at = swarm_clock(dht.get_replicas())  # the lower median: no single record moves it
        log.info("joined run %s as %s%s", manifest["run_id"], role, "" if stage is None else f" of stage {stage}")
        log.info(
            "inner steps on %s in %s (weights, θ_start and commits in fp32), activation checkpointing %s",
            opts.device,
            opts.precision,
            "on" if opts.activation_checkpointing else "off",
        )
        return session

    @classmethod
    @contextlib.contextmanager
    def open(cls, opts: SessionOptions, role: str, stage: int | None, stop: threading.Event) -> Iterator[Session]:
        """`connect`, then always record why the role ended and leave cleanly (records withdrawn,
        server and DHT stopped), whether it finished, was stopped or failed."""
        session = cls.connect(opts, role=role, stage=stage, stop=stop)
        try:
            yield session
        except BaseException as exc:
            session.log_exit("stopped" if stop.is_set() else f"error: {exc}")
            raise
        finally:
            session.close()

    def serve(
        self, workers: dict[int, StageWorker], on_last_step: Callable[[str, int], None] | None = None
    ) -> PeerService:
        """Serve the stage workers over gRPC; returns the service (claims, round state)."""
        self.resync.checks.stage0 = workers.get(0)  # its set moves the other stages' T⊥ (`Resync.reconcile`)
        tokenizer = {"tokenizer": Path(self.cfg.data.tokenizer).read_bytes()} if self.cfg.data.tokenizer else {}
        self.service = PeerService(  # serves the tokenizer and dataset too: joins work once the bootstrap is gone
            self.cfg,
            workers,
            self.store,
            self.peer_id,
            self.role,
            on_last_step,
            tokenizer,
            self.outbound,
            self.datasets,
        )
        self.server = PeerServer(
            self.service,
            host=self.opts.host,
            port=self.opts.port,
            max_message_bytes=max_request_bytes(self.cfg),
            vocab_size=self.cfg.model.vocab_size,
            wire_dtype=self.cfg.subspace.wire_dtype,
            interceptors=[self._gate()],
        )
        o = self.opts  # on every interface: the address facing the swarm (peer.net.addresses)
        host = advertised_host(o.host, o.announce_host, o.initial_peers, self.dht.visible_maddrs())
        self.me.address = f"{host}:{self.server.port}"
        assert self.gate is not None
        self.gate.bind(f"{self.opts.host}:{self.server.port}")
        self.connectivity = Connectivity(
            self.dht,
            self.me,
            self.cfg.stages,
            self.cfg.swarm.announce_interval_s,
            str(self.manifest.get("bootstrap_address", "")),
            self.gate.hub.local_address,
            self.outbound,
        )
        self.connectivity.start()  # the reachability check; reverse streams when this peer cannot be dialled
        self.metrics.log("connectivity", **self.connectivity.fields(), address=self.me.address)
        self.metrics.log(
            "start",
            stage=self.stage,
            peer_id=self.peer_id,
            address=self.me.address,
            config=self.cfg.to_dict(),
            fingerprint=self.cfg.fingerprint(),
        )
        return self.service

    def _gate(self) -> Gate:
        admission = self.dht.admission
        verifier, _ = auth.for_swarm(admission.mode, admission.allowlist, self.peer_id, *self.dht.auth_material)
        self.gate = Gate(
            self.peer_id,
            verifier,
            relay=self.opts.link.relay,
            net_info=lambda: self.net().to_record(),
            outbound=self.outbound,
        )
        return self.gate

    def net(self) -> NetFields:
        """Connectivity, caps and refused calls, for this peer's records and Info."""
        c, link = self.connectivity, self.opts.link
        return NetFields(
            connectivity=c.mode if c is not None else "direct",
            via=tuple(c.via()) if c is not None else None,
            relay=link.relay,
            auth_failures=self.gate.verifier.failure_count() if self.gate else 0,
            max_upload_mbps=link.max_upload_mbps or None,
            max_download_mbps=link.max_download_mbps or None,
        )

    def finish(self, stop: threading.Event) -> int:
        """The end of a role's loop: keep serving until nobody is behind, record why we stop; exit 0.

        A stopped peer (Ctrl+C, SIGTERM) hands off instead: it takes no more pipeline work but
        serves its last round's payload until the holders still gathering that round have it."""
        self.me.finishing = True
        self.records.refresh()
        if stop.is_set():
            self.hand_off()
        else:
            self.linger(stop)
        self.log_exit("finished" if not stop.is_set() else "stopped")
        return 0

    def hand_off(self, max_s: float = 10.0) -> None:
        """Leaving mid-run right after a round: until no other live holder of our stages is still at
        that round (bounded), keep serving its payload, so they commit it instead of re-syncing."""
        svc = self.service
        if svc is None or not svc.workers:
            return
        svc.leaving = True  # pipelines get NotFoundError and pick another peer at once
        t = min(w.outer_step for w in svc.workers.values())
        if t == 0:
            return
        deadline = time.monotonic() + max_s
        waited = False

        def at_round(rec: StageRecord | ReplicaRecord) -> bool:
            return rec.outer_step == t - 1

        while time.monotonic() < deadline:
            try:
                gathering = self._others_where(at_round, at_round, svc.workers)
            except PeerError as exc:
                log.info("leaving: cannot read who still gathers round %d: %s", t - 1, exc)
                return
            if not gathering:
                return
            if not waited:
                log.info(
                    "leaving: serving round %d's payload until %d peer(s) still gathering it have it (at most %.0fs)",
                    t - 1,
                    len(gathering),
                    max_s,
                )
                waited = True
            time.sleep(0.25)
        log.info("leaving: gave up waiting for %s to commit round %d", ", ".join(p[:12] for p in gathering), t - 1)

    def log_exit(self, reason: str) -> None:
        self.metrics.log("exit", reason=reason)

    def close(self) -> None:
        self.records.close()
        if self.connectivity is not None:
            self.connectivity.close()
        if self.server is not None:
            self.server.stop(grace_s=1.0)
        self.clients.close()
        self.dht.shutdown()
        self.metrics.close()

    def check_alive(self) -> None:
        """Between steps: a PeerError once this peer's DHT process has exited (killed, crashed).
        Every DHT wait would then time out forever and the peer would look alive while doing
        nothing; the error ends the role (the CLI prints it, exit 2) so a supervisor restarts it."""
        if not self.dht.alive:
            raise dht_exited(self.opts.data_dir)

    # ------------------------------------------------------------------ the swarm around us
    def wait_for_quorum(self, t: int, stop: threading.Event) -> None:
        """Before the run's first step, wait (bounded) until `swarm.min_replicas` replicas are online.

        A late joiner (t > 0, or a fresh peer whose swarm is past outer step 0: it re-syncs first) joins a
        swarm that is already training and does not wait."""
        if t > 0:
            return
        need = self.cfg.swarm.min_replicas
        wait_s = max(self.cfg.swarm.round_timeout_s, self.cfg.swarm.claim_timeout_s)  # heads form pipelines first
        deadline = time.monotonic() + wait_s
        while not stop.is_set():
            replicas = self.dht.get_replicas()
            have = len(expected_replicas(self.dht, t, replicas))
            if quorum_over(replicas, self.dht.peer_id, have, need):
                return
            if time.monotonic() >= deadline:
                log.warning("starting with %d of %d replicas after %.0fs", have, need, wait_s)
                return
            stop.wait(0.5)

    def linger(self, stop: threading.Event, max_s: float = 15.0) -> None:
        """After the last round keep serving payloads until no live peer of the run is behind and
        every live head has finished (its validation after the last round uses our stage; bounded)."""
        T = self.cfg.train.outer_steps
        deadline = time.monotonic() + max_s

        def behind(rec: StageRecord | ReplicaRecord) -> bool:
            return rec.outer_step is not None and rec.outer_step < T

        def replica_behind(rec: ReplicaRecord) -> bool:
            return behind(rec) or (rec.kind == "pipeline" and rec.done is False)

        while not stop.is_set() and time.monotonic() < deadline:
            if not self._others_where(replica_behind, behind, range(self.cfg.stages)):
                return
            stop.wait(0.5)

    def _others_where(
        self, replica: Callable[[ReplicaRecord], bool], stage: Callable[[StageRecord], bool], stages: Iterable[int]
    ) -> list[str]:
        """Other peers of the run whose replica record, or stage record of one of `stages`, matches."""
        out = {pid for pid, rec in self.dht.get_replicas().items() if replica(rec)}
        for s in stages:
            out |= {pid for pid, rec in self.dht.get_stage_peers(s).items() if stage(rec)}
        out.discard(self.peer_id)
        return sorted(out)


def dht_exited(data_dir: Path) -> PeerError:
    """The one error a role ends with once its hivemind DHT process has exited (killed, crashed),
    whichever wait noticed it first; the CLI prints it and exits 2 so a supervisor restarts the peer."""
    return PeerError(
        "the hivemind DHT process of this peer exited, so it can no longer reach the swarm; "
        f"start `peer join` again (add --resume to continue from {data_dir / 'checkpoints'})"
    )


def usable_data_dir(path: Path) -> Path:
    """`path`, created if missing, once a small file could be written there and removed; else a
    one-line ConfigError (not a directory, not writable, full)."""
    probe = path / f".peer-write-test-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 65536)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except FileExistsError:
        raise ConfigError(f"--data-dir {path} is not a directory (a file has that name)") from None
    except OSError as exc:
        with contextlib.suppress(OSError):  # a half-written probe on a full disk
            probe.unlink(missing_ok=True)
        raise ConfigError(f"--data-dir {path} is not usable: {exc.strerror or exc}") from None
    return path


def max_request_bytes(cfg: RunConfig) -> int:
    """The largest request a peer's server accepts: 4x the largest legitimate one, at least 4 MiB.

    That is a forward with an uncompressed (b, L, d) float32 boundary, int32 tokens and targets,
    at the largest batch and sequence the service accepts. Replies (our state) are not bounded by it.
    """
    b, L, d = cfg.train.batch_size, cfg.model.max_seq_len, cfg.model.d_model
    boundary = b * L * d * 4 + 2 * b * L * 4 + (64 << 10)  # hidden + tokens + targets + fields
    return max(4 << 20, 4 * boundary)


def _start_dht(opts: SessionOptions, stop: threading.Event | None = None, attempts: int = 2) -> SwarmDHT:
    """Start this peer's DHT node; one retry when the forked node did not come up in time
    (a fork from a busy multi-threaded process can stall; the stalled child is reaped), never
    once `stop` is set (asked to leave while starting: a SIGTERM to the group killed the child)."""
    for attempt in range(attempts):
        if stop is not None and stop.is_set():  # asked to leave before anything started: nothing to undo
            raise PeerError("asked to leave before this peer's DHT node started")
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
            if attempt + 1 == attempts or "did not start" not in str(exc) or (stop is not None and stop.is_set()):
                raise
            log.warning("%s; retrying once", exc)
    raise AssertionError("unreachable")


def _outbound(opts: SessionOptions, dht: SwarmDHT) -> Outbound:
    """This peer's admission proof under the swarm's policy and its link with the `opts.link` caps."""
    admission = dht.admission
    _, credentials = auth.for_swarm(admission.mode, admission.allowlist, dht.peer_id, *dht.auth_material)
    caps = LinkCaps(opts.link.max_upload_mbps, opts.link.max_download_mbps, opts.link.relay_max_mbps)
    return Outbound(credentials, Link(caps))
