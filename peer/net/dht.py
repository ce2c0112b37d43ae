"""Control plane of `peer`: a small synchronous wrapper around a hivemind DHT node.

Only `peer/net/` imports hivemind (DESIGN.md §3, STYLE.md points 4 and 12); this module holds the
node and its record I/O, `identity` its key, `admission` and `records` which records count,
`processes` its child-process tree. hivemind runs its DHT node and the libp2p daemon (`p2pd`) in a
child process; every call here sends one request to that process and waits on its future with a
deadline, so callers never see asyncio and never wait forever.

Records (all values are msgpack-friendly; every record has an expiration):
- ``peer.manifest.signed``: the run's manifest as canonical JSON **text** under the subkey
  ``[owner:<bootstrap's RSA public key>]``, signed by the bootstrap. Readers take the copy signed
  by one of their --initial-peers (or the only copy) and apply its admission policy.
- ``peer.manifest.sealed``: the text with the bootstrap's signature inside (`identity.seal`),
  re-published by every peer under its own subkey: the manifest outlives the bootstrap.
- ``peer.manifest`` (fixed key, no run id): the same text, unsigned, for stock hivemind clients
  (``DHT(...).get("peer.manifest", latest=True)``); anyone can overwrite it, `peer` never trusts it.
- ``peer.{run}.stage.{s}``, ``peer.{run}.attest.{s}`` (an attester's state of the stage),
  ``peer.{run}.replica``, ``peer.{run}.round.{t}.{s}``, ``chain.{t}.{s}`` (committed links) and a ranges
  round's ``roster.{t}.{s}``, ``shards.{t}.{s}``: one signed subkey per peer (`peer.net.records`); readers
  return ``{peer id: typed record}`` (`StageRecord`, `ReplicaRecord`, `Announcement`, ...).

Invariants:
- hivemind keeps, per (key, subkey), the value with the LATEST expiration and refuses an older
  one. This node therefore never stores an expiration earlier than one it stored before for the
  same (key, subkey); this is what lets `withdraw_*` overwrite a long-lived record with a
  ``{"state": "left"}`` record, which every reader here filters out.
- Every network wait has a deadline; a timeout or a hivemind failure becomes a one-line
  `NetworkError` that says what to check.
- `shutdown` is idempotent and reaps the hivemind child process and its p2pd; should this process
  die without it (``kill -9``), a watchdog (`peer.net.watchdog`) stops them.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from peer.errors import ConfigError, NetworkError, ProcessGoneError
from peer.net import unreachable
from peer.net.addresses import check_initial_peer, listen_maddr
from peer.net.admission import (
    ADMISSION_MODES,
    SECRET_ENV,
    Admission,
    admission_proof,
    committed_manifest,
    load_swarm_secret,
    secret_commitment,
)
from peer.net.answers import await_answer
from peer.net.dht_child import DHTProcess, grpc_running, start_forkserver
from peer.net.hivemind_logs import quiet_cancelled_futures
from peer.net.identity import make_identity, node_identity, peer_id_of, seal
from peer.net.processes import ProcessTree, stop_dht_node
from peer.net.records import (
    Announcement,
    RecordReader,
    ReplicaRecord,
    StageRecord,
    check_plain,
    choose_manifest,
    unsealed_copies,
)
from peer.net.watchdog import Watchdog

__all__ = [  # the admission and identity names are re-exported: callers import them from here
    "ADMISSION_MODES",
    "LEFT_TTL_S",
    "MANIFEST_KEY",
    "SECRET_ENV",
    "SIGNED_MANIFEST_KEY",
    "Admission",
    "SwarmDHT",
    "admission_proof",
    "dht_time",
    "load_swarm_secret",
    "make_identity",
    "peer_id_of",
    "secret_commitment",
]

logger = logging.getLogger(__name__)

MANIFEST_KEY = "peer.manifest"  # unsigned mirror for stock hivemind clients
SIGNED_MANIFEST_KEY = "peer.manifest.signed"  # subkey = the bootstrap's owner key
SEALED_MANIFEST_KEY = "peer.manifest.sealed"  # subkey = any re-publisher; the value carries the bootstrap's seal
LEFT_TTL_S = 30.0  # minimum lifetime of a {"state": "left"} record
# announcements, a ranges round's records (a voted round's supports and values too), links
RoundKind = Literal["round", "roster", "shards", "supports", "values", "chain"]
StageKind = Literal["stage", "attest"]  # holders' records of a stage, or attesters' (`peer.bootstrap.attester`)
RoundRead = tuple[RoundKind, int, int, Callable[[Any], Any]]  # (kind, t, stage, parse): `SwarmDHT.get_rounds`
R = TypeVar("R")
# One DHT start (and its watchdog's spawn) at a time in this process, so a watchdog always guards
# the DHT process started just before it.
_SPAWN_LOCK = threading.Lock()
_RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHECK_HINT = "check --initial-peers (each ends in /p2p/<peer id>) and that this host can reach them"
_GONE = "the hivemind DHT process exited; restart this peer"


def dht_time() -> float:
    """The DHT's clock (seconds since the epoch), the one every record's "time" uses."""
    return float(get_dht_time())


# Functions run inside the hivemind child through the public DHT.run_coroutine API.
async def _node_peer_id(_dht: Any, node: Any) -> str:
    return str(node.peer_id.to_base58())


async def _node_visible_maddrs(_dht: Any, node: Any) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs(latest=True)]


async def _ping_peers(peer_ids: Sequence[str], _dht: Any, node: Any) -> int:
    """Ping each peer by id (each side adds the other to its routing table); how many answered."""
    pings = [await node.protocol.call_ping(PeerID.from_base58(pid), strict=False) for pid in peer_ids]
    return sum(p is not None for p in pings)


class SwarmDHT:
    """One hivemind DHT node with `peer`'s records on top. Synchronous; use as a context manager.

    The hivemind DHT process is forked from this process while it runs no gRPC, else from a clean
    forkserver (`peer.net.dht_child`), so it inherits none of this process's gRPC servers, channels
    or threads.
    """

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        identity_path: str | os.PathLike[str] | None = None,
        client_mode: bool = False,
        start_timeout_s: float = 30,
        request_timeout_s: float = 15.0,
        swarm_secret: bytes | str | None = None,
    ) -> None:
        """`identity_path`: the persistent key file (created if missing); None = a throw-away key.
        `swarm_secret`: the secret of a secret-mode swarm (None: $PEER_SWARM_SECRET, if set)."""
        initial = [check_initial_peer(str(a)) for a in initial_peers]
        if announce_host is not None and port == 0:
            raise ConfigError("--announce-host needs an explicit --port (port 0 cannot be announced)")
        if isinstance(swarm_secret, str):
            swarm_secret = swarm_secret.strip().encode()
        self._secret: bytes | None = load_swarm_secret() if swarm_secret is None else bytes(swarm_secret)
        if self._secret is not None and not self._secret:
            raise ConfigError("the swarm secret is empty; put a long random string in it")
        self.client_mode = bool(client_mode)
        self.request_timeout_s = float(request_timeout_s)
        self.run_id: str | None = None
        self.n_stages = 0
        self.manifest_signer: str | None = None
        self._seal: dict[str, Any] | None = None  # the verified manifest's seal, re-published by `republish_manifest`
        self._initial_ids = {str(Multiaddr(a)["p2p"]) for a in initial}
        self._last_expiration: dict[tuple[str, bytes | None], float] = {}
        self._tree = ProcessTree()
        self._watchdog = Watchdog()
        self._closed = False
        t0 = time.monotonic()
        if grpc_running():
            start_forkserver()  # its imports run while this process reads the identity (peer.net.dht_child)
        with node_identity(identity_path) as identity:  # a throw-away key is deleted once p2pd has read it
            validator = RSASignatureValidator(identity.key)
            self._key = identity.key  # seals the manifest this node publishes (`identity.seal`)
            self.auth_material = (self._secret, identity.key)  # data-plane proofs: peer.net.transport.auth
            self.owner_subkey: bytes = validator.local_public_key  # the DHT subkey of this peer's records
            self._reader = RecordReader(identity.peer_id, self._secret)
            kwargs: dict[str, Any] = dict(
                host_maddrs=[listen_maddr(host, port)],
                client_mode=client_mode,
                startup_timeout=start_timeout_s,
                identity_path=str(identity.path),
            )
            if announce_host is not None:
                kwargs["announce_maddrs"] = [listen_maddr(announce_host, port)]
            if identity.fresh:
                kwargs["check_if_identity_free"] = False  # a key made just now is not in use elsewhere
            quiet_cancelled_futures()  # this side's fd hand-offs (the DHT process installs its own)
            self._dht = DHTProcess(initial_peers=initial or None, start=False, record_validators=[validator], **kwargs)
            # Runs at interpreter exit if shutdown() was never called, so no p2pd outlives us.
            self._finalizer = weakref.finalize(self, stop_dht_node, self._dht, self._tree, self._watchdog)
            self.peer_id: str = self._start(start_timeout_s, initial, identity_path)
        if self.peer_id != identity.peer_id:
            self.shutdown()
            raise NetworkError(f"the DHT node runs as {self.peer_id}, not as the identity in {identity.path}")
        self.start_time_s = time.monotonic() - t0
        logger.info(
            "DHT node %s started in %.2f s (%d initial peers, client_mode=%s)",
            self.peer_id,
            self.start_time_s,
            len(initial),
            client_mode,
        )

    def _start(self, timeout_s: float, initial: Sequence[str], identity_path: object) -> str:
        """Start the hivemind child under a watchdog, remember its process tree; the peer id it runs as."""
        try:
            with _SPAWN_LOCK:
                self._dht.start()  # forked where no gRPC runs (peer.net.dht_child); it starts p2pd
                self._watchdog.start(self._dht.pid)  # from now on a crash of this process does not orphan them
            if not self._dht.wait_ready(timeout_s):  # a SIGTERM to the group while it started: fail at once
                raise ProcessGoneError("the DHT node did not start: its hivemind process exited")
            self._tree.add(self._dht.pid)
            return str(self._wait(self._dht.run_coroutine(_node_peer_id, return_future=True), "start", timeout_s))
        except TimeoutError as e:
            self.shutdown()
            raise NetworkError(f"DHT node did not start within {timeout_s:.0f} s; {_CHECK_HINT}") from e
        except NetworkError:
            self.shutdown()
            raise
        except Exception as e:
            self.shutdown()
            raise NetworkError(unreachable.start_error(e, initial, identity_path)) from e

    # --- lifecycle -----------------------------------------------------------------------------

    def __enter__(self) -> SwarmDHT:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the node, its child process and p2pd. Idempotent; makes no network request."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        logger.debug("DHT node shut down")

    @property
    def alive(self) -> bool:
        """Whether the hivemind DHT process still runs: once it has exited nothing brings it back,
        and every request would only wait for its deadline."""
        return not self._closed and self._dht.is_alive()

    @property
    def process_pid(self) -> int:
        """Process id of the hivemind DHT process (forked by this process's forkserver, `peer.net.dht_child`)."""
        return int(self._dht.pid)

    @property
    def child_pids(self) -> list[int]:
        """Process ids of the hivemind DHT process and its p2pd (for tests and status)."""
        return self._tree.pids

    @property
    def watchdog_pid(self) -> int | None:
        """Process id of the watchdog that stops the child and p2pd if this process dies (None: none)."""
        return self._watchdog.pid

    @property
    def admission(self) -> Admission:
        """The swarm's admission policy, from the manifest (open until one is read or published)."""
        return self._reader.admission

    @property
    def dropped_records(self) -> dict[str, int]:
        """How many records were ignored, by reason: unsigned, forged, not_admitted."""
        return self._reader.dropped

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (ending in /p2p/<peer id>) that another peer passes as --initial-peers."""
        self._check_open()
        found = self._wait(self._dht.run_coroutine(_node_visible_maddrs, return_future=True), "address lookup", None)
        return [str(m) for m in found]

    def ping_initial_peers(self, timeout_s: float | None = None) -> int:
        """Ping the --initial-peers again (a restarted bootstrap learns of us); how many answered."""
        self._check_open()
        future = self._dht.run_coroutine(functools.partial(_ping_peers, sorted(self._initial_ids)), return_future=True)
        return int(self._wait(future, "ping of the initial peers", timeout_s))

    def set_run(self, run_id: str, n_stages: int = 0) -> None:
        """Namespace the per-run keys (call after reading the manifest)."""
        if not _RUN_ID_RE.fullmatch(run_id):
            raise ConfigError(f"run id {run_id!r} must be 1-64 characters of letters, digits, '_' or '-'")
        if n_stages < 0:
            raise ConfigError(f"n_stages must be >= 0, got {n_stages}")
        self.run_id, self.n_stages = run_id, int(n_stages)

    # --- low level: every wait has a deadline ----------------------------------------------------

    def _wait(self, future: Any, what: str, timeout_s: float | None) -> Any:
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        return await_answer(
            future, f"DHT {what}", timeout_s, self.request_timeout_s, _CHECK_HINT, self._dht.is_alive, _GONE
        )

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this SwarmDHT was shut down")
        if not self._dht.is_alive():
            raise ProcessGoneError(_GONE)

    def _store(self, key: str, value: Any, ttl_s: float, subkey: bytes | None, timeout_s: float | None) -> None:
        """Store with a later expiration than any before it; up to 3 attempts under one deadline.

        hivemind reports the answer of the LAST node to reply, and a node that gets the same record
        twice answers False, so a refusal is retried (with a new, later expiration) before it counts;
        a record of ours from an earlier process with this key (a "left" one) is outlived, not fought.
        """
        self._check_open()
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        for attempt in range(3):
            expiration = dht_time() + ttl_s
            previous = self._last_expiration.get((key, subkey))
            if previous is not None and expiration <= previous:
                expiration = previous + 1e-3  # hivemind keeps the latest expiration: stay the newest
            future = self._dht.store(key, value, expiration, subkey=subkey, return_future=True)
            stored = self._wait(future, f"store of {key!r}", max(0.0, deadline - time.monotonic()))
            self._last_expiration[(key, subkey)] = expiration  # some nodes may hold it even if refused
            if stored:
                logger.debug("stored %s (%s) for %.0f s", key, "signed" if subkey else "plain", expiration - dht_time())
                return
            logger.debug("DHT store of %r refused (attempt %d of 3)", key, attempt + 1)
            (held,) = self._get_many([key], max(0.0, deadline - time.monotonic())) if subkey else (None,)
            if isinstance(held, dict) and subkey in held:
                self._last_expiration[(key, subkey)] = max(expiration, float(held[subkey].expiration_time))
        raise NetworkError(
            f"DHT store of {key!r} was refused (no node accepted it, or a newer record exists); {_CHECK_HINT}"
        )

    def _get_many(self, keys: Sequence[str], timeout_s: float | None) -> list[Any]:
        """Values of `keys` (None where absent), fetched concurrently under one deadline."""
        self._check_open()
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        futures = [self._dht.get(k, latest=True, return_future=True) for k in keys]
        out = []
        for key, future in zip(keys, futures, strict=True):
            found = self._wait(future, f"lookup of {key!r}", max(0.0, deadline - time.monotonic()))
            out.append(None if found is None else found.value)
        return out

    def _run_key(self, suffix: str) -> str:
        if self.run_id is None:
            raise RuntimeError("call set_run(run_id) (from the manifest) before using per-run DHT records")
        return f"peer.{self.run_id}.{suffix}"

    def _announce(self, key: str, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None) -> None:
        signed = self._reader.sign(record, dht_time())
        check_plain(signed, "record")
        self._store(key, signed, ttl_s, self.owner_subkey, timeout_s)

    def _withdraw(self, key: str, timeout_s: float | None) -> None:
        self._store(key, self._reader.sign({"state": "left"}, dht_time()), LEFT_TTL_S, self.owner_subkey, timeout_s)

    # --- manifest --------------------------------------------------------------------------------

    def publish_manifest(self, manifest: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None) -> None:
        """Store the manifest as canonical JSON text, signed by this node; call again to refresh it.

        A secret-mode manifest (``config.swarm.admission == "secret"``) gets the secret's commitment
        added (never the secret), so this node needs the secret.
        """
        manifest = committed_manifest(manifest, self._secret)
        admission = Admission.of_manifest(manifest)
        text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False)
        self._store(SIGNED_MANIFEST_KEY, text, ttl_s, self.owner_subkey, timeout_s)
        self._reader.admission, self.manifest_signer = admission, self.peer_id
        self._seal = seal(self._key, self.owner_subkey, text)
        self._store(SEALED_MANIFEST_KEY, self._seal, ttl_s, self.owner_subkey, timeout_s)
        try:  # the unsigned mirror is a convenience for stock clients: anyone may overwrite it
            self._store(MANIFEST_KEY, text, ttl_s, None, timeout_s)
        except NetworkError as e:
            logger.warning("could not refresh the unsigned manifest mirror %r: %s", MANIFEST_KEY, e)

    def get_manifest(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The run's manifest as signed by the bootstrap, or None if none is published (yet).

        Takes the copy signed by one of --initial-peers, else the only copy (with a warning; several
        copies from different signers and none from an initial peer is a `ManifestMismatch`). Then
        applies the manifest's admission policy to this node's readers and raises `ManifestMismatch`
        if this node is not admitted: a wrong or missing swarm secret, or (unless client_mode) a
        peer id missing from the allow-list.
        """
        value, sealed = self._get_many([SIGNED_MANIFEST_KEY, SEALED_MANIFEST_KEY], timeout_s)
        copies, seals = unsealed_copies(sealed)
        copies.update(value if isinstance(value, dict) else {})  # the bootstrap's own record first
        chosen = choose_manifest(copies, self._initial_ids, self._reader.drop)
        if chosen is None:
            return None
        signer, manifest = chosen
        admission = Admission.of_manifest(manifest)
        admission.check_member(self.peer_id, self._secret, self.client_mode)
        self._reader.admission, self.manifest_signer = admission, signer
        self._seal = seals.get(signer, self._seal)
        return manifest

    def republish_manifest(self, ttl_s: float, timeout_s: float | None = None) -> bool:
        """Re-publish the seal of the manifest we verified (joins outlive the bootstrap); False if none."""
        if self._seal is not None:
            self._store(SEALED_MANIFEST_KEY, self._seal, ttl_s, self.owner_subkey, timeout_s)
        return self._seal is not None

    # --- stages, replicas, rounds ----------------------------------------------------------------

    def announce_stage(
        self,
        stage: int,
        record: Mapping[str, Any],
        ttl_s: float,
        timeout_s: float | None = None,
        kind: StageKind = "stage",
    ) -> None:
        """Publish this peer's record for `stage` (address, capacity, state, outer_step, ...); kind
        "attest": an attester's state of the stage (`peer.bootstrap.attester`), kept apart from holders'."""
        self._announce(self._run_key(f"{kind}.{int(stage)}"), record, ttl_s, timeout_s)

    def get_stage_peers(
        self,
        stage: int,
        max_age_s: float | None = None,
        timeout_s: float | None = None,
        keep_left: bool = False,
        kind: StageKind = "stage",
    ) -> dict[str, StageRecord]:
        """{peer id: record} of the peers holding `stage` (`keep_left`: and {"state": "left"} of graceful leaves)."""
        (value,) = self._get_many([self._run_key(f"{kind}.{int(stage)}")], timeout_s)
        return self._reader.records(value, dht_time(), max_age_s, StageRecord.parse, keep_left)

    def withdraw_stage(self, stage: int, timeout_s: float | None = None) -> None:
        """Graceful leave: replace this peer's stage record by a short-lived {"state": "left"}."""
        self._withdraw(self._run_key(f"stage.{int(stage)}"), timeout_s)

    def announce_replica(self, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None) -> None:
        """Publish this peer's replica record (outer_step, inner step, tokens/s, loss, ...)."""
        self._announce(self._run_key("replica"), record, ttl_s, timeout_s)

    def get_replicas(self, max_age_s: float | None = None, timeout_s: float | None = None) -> dict[str, ReplicaRecord]:
        """{peer id: record} of full replicas and pipeline heads."""
        (value,) = self._get_many([self._run_key("replica")], timeout_s)
        return self._reader.records(value, dht_time(), max_age_s, ReplicaRecord.parse)

    def withdraw_replica(self, timeout_s: float | None = None) -> None:
        """Graceful leave: replace this peer's replica record by a short-lived {"state": "left"}."""
        self._withdraw(self._run_key("replica"), timeout_s)

    def announce_payload(
        self, outer_step: int, stage: int, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None
    ) -> None:
        """Announce this peer's payload (hash, size, address) for round (outer_step, stage)."""
        self._announce(self._run_key(f"round.{int(outer_step)}.{int(stage)}"), record, ttl_s, timeout_s)

    def get_payloads(self, outer_step: int, stage: int, timeout_s: float | None = None) -> dict[str, Announcement]:
        """{peer id: announcement} of payloads announced for round (outer_step, stage)."""
        return self.get_rounds([("round", outer_step, stage, Announcement.parse)], timeout_s)[0]

    def announce_round(self, kind: RoundKind, t: int, stage: int, record: Mapping[str, Any], ttl_s: float) -> None:
        """Publish this peer's `kind` record of round (t, stage) (a payload announcement, or a ranges
        round's roster or shard hashes: `peer.net.range_records`)."""
        self._announce(self._run_key(f"{kind}.{int(t)}.{int(stage)}"), record, ttl_s, None)

    def get_round(self, kind: RoundKind, t: int, stage: int, parse: Callable[[Any], R | None]) -> dict[str, R]:
        """{peer id: record} of round (t, stage)'s `kind` records, each parsed by `parse` (None: malformed)."""
        return self.get_rounds([(kind, t, stage, parse)])[0]

    def get_rounds(self, wanted: Sequence[RoundRead], timeout_s: float | None = None) -> list[dict[str, Any]]:
        """`get_round` of many (kind, t, stage, parse) at once, fetched concurrently under one deadline
        (a joiner's replay reads a window of rounds: `peer.node.round.replay`)."""
        keys = [self._run_key(f"{kind}.{int(t)}.{int(stage)}") for kind, t, stage, _ in wanted]
        values, now = self._get_many(keys, timeout_s), dht_time()
        return [self._reader.records(v, now, None, w[3]) for v, w in zip(values, wanted, strict=True)]

    def current_outer_step(self, timeout_s: float | None = None) -> int:
        """Largest "outer_step" in live replica and stage records (stages 0..n_stages-1), 0 if none."""
        keys = [self._run_key("replica")] + [self._run_key(f"stage.{s}") for s in range(self.n_stages)]
        (replicas, *stages), now = self._get_many(keys, timeout_s), dht_time()
        steps = [r.outer_step for r in self._reader.records(replicas, now, None, ReplicaRecord.parse).values()]
        for value in stages:
            steps += [r.outer_step for r in self._reader.records(value, now, None, StageRecord.parse).values()]
        return max([0, *(s for s in steps if s is not None)])
