"""Control plane of `peer`: a small synchronous wrapper around a hivemind DHT node.

This is the ONLY module of `peer` that imports hivemind (DESIGN.md §3, STYLE.md points 4 and 12).
hivemind runs its DHT node and the libp2p daemon (`p2pd`) in a child process; every call here
sends one request to that process and waits on its future with a deadline, so callers never see
asyncio and never wait forever.

Records (all values are msgpack-friendly; every record has an expiration):
- ``peer.manifest`` (fixed key, no run id): the run's manifest as a canonical JSON **string**
  (sorted keys, no spaces). A stock hivemind client reads it without `peer` installed:
  ``json.loads(hivemind.DHT(initial_peers=[...], start=True).get("peer.manifest", latest=True).value)``.
  A string keeps the exact bytes the bootstrap hashed and avoids msgpack type quirks.
- ``peer.{run}.stage.{s}``: one subkey per peer holding stage s (subkey = that peer's id).
- ``peer.{run}.replica``: one subkey per full replica or pipeline head.
- ``peer.{run}.round.{t}.{s}``: one subkey per payload announced for outer step t, stage s.
Each per-peer record is the caller's dict plus ``"time"`` (hivemind DHT time at announcement)
so readers can drop stale ones (``max_age_s``).

Invariants:
- hivemind keeps, per (key, subkey), the value with the LATEST expiration and refuses an older
  one. This node therefore never stores an expiration earlier than one it stored before for the
  same (key, subkey); this is what lets `withdraw_*` overwrite a long-lived record with a
  ``{"state": "left"}`` record, which every reader here filters out.
- Every network wait has a deadline; a timeout or a hivemind failure becomes a one-line
  `NetworkError` that says what to check.
- `shutdown` is idempotent and reaps the hivemind child process and its p2pd.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import signal
import time
import weakref
from pathlib import Path
from typing import Any, Mapping, Sequence

import hivemind
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from peer.errors import ConfigError, ManifestMismatch, NetworkError

logger = logging.getLogger(__name__)

MANIFEST_KEY = "peer.manifest"
LEFT_TTL_S = 30.0  # minimum lifetime of a {"state": "left"} record
_RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHECK_HINT = "check --initial-peers (each ends in /p2p/<peer id>) and that this host can reach them"


def dht_time() -> float:
    """The DHT's clock (seconds since the epoch), the one every record's "time" uses."""
    return get_dht_time()


def make_identity(path: str | os.PathLike) -> str:
    """Create a persistent libp2p private key at `path` if it is missing; return its peer id.

    The key is written by hivemind's own generator (RSA, libp2p protobuf, mode 0400), the same file
    hivemind would write for `identity_path`; an existing file is only read.
    """
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
        logger.info("created peer identity %s", path)
    try:
        return PeerID.from_identity(path.read_bytes()).to_base58()
    except Exception as e:  # a truncated or foreign file
        raise ConfigError(f"identity file {path} is not a libp2p private key ({e}); delete it to make a new one") from e


def _maddr(host: str, port: int) -> str:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"/dns/{host}/tcp/{port}"
    return f"/ip{ip.version}/{host}/tcp/{port}"


def _check_initial_peer(addr: str) -> str:
    try:
        maddr = Multiaddr(addr)
        maddr["p2p"]
    except Exception as e:
        raise ConfigError(
            f"initial peer {addr!r} is not a full multiaddr like /ip4/1.2.3.4/tcp/31337/p2p/12D3KooW...; "
            "copy the line the bootstrap printed"
        ) from e
    return str(maddr)


def _check_plain(value: Any, where: str) -> None:
    """Raise TypeError unless `value` is made of msgpack-friendly builtins (str dict keys)."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
        return
    if type(value) is dict:
        for k, item in value.items():
            if type(k) is not str:
                raise TypeError(f"DHT record key {where}.{k!r} must be a str")
            _check_plain(item, f"{where}.{k}")
        return
    raise TypeError(f"DHT record field {where} has type {type(value).__name__}; use plain int/float/str/list/dict")


# Functions run inside the hivemind child through the public DHT.run_coroutine API.
async def _node_peer_id(_dht: Any, node: Any) -> str:
    return node.peer_id.to_base58()


async def _node_visible_maddrs(_dht: Any, node: Any) -> list[str]:
    return [str(m) for m in await node.get_visible_maddrs(latest=True)]


# --- process reaping (Linux /proc; a no-op elsewhere) -------------------------------------------


def _proc_stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of `pid`, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), fields[0], int(fields[19])


def _descendants(pid: int) -> dict[int, int]:
    """{pid: start time} of every live descendant of `pid`."""
    try:
        entries = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    children: dict[int, list[tuple[int, int]]] = {}
    for p in entries:
        st = _proc_stat(p)
        if st is not None:
            children.setdefault(st[0], []).append((p, st[2]))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            out[child] = start
            todo.append(child)
    return out


def _alive(pid: int, start: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[2] == start and st[1] != "Z"


def _reap(pids: Mapping[int, int], grace_s: float = 2.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`, every process in `pids` that is still the same process."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p, start in pids.items() if _alive(p, start)]
        if not live:
            return
        for p in live:
            logger.debug("sending %s to leftover hivemind process %d", sig.name, p)
            try:
                os.kill(p, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p, pids[p]) for p in live):
            time.sleep(0.02)


def _stop(dht: hivemind.DHT, known: dict[int, int]) -> None:
    """Shut a hivemind DHT down and make sure its child and p2pd are gone."""
    if dht.pid is None:
        return
    if dht.is_alive():
        known.setdefault(dht.pid, (_proc_stat(dht.pid) or (0, "", -1))[2])
        known.update(_descendants(dht.pid))
        try:
            dht.shutdown()  # graceful: the child shuts p2pd down and waits for it; else SIGTERM
        except Exception as e:  # a broken pipe if the child already died
            logger.debug("hivemind DHT shutdown: %r", e)
    dht.join(timeout=5.0)
    _reap(known)
    dht.join(timeout=1.0)


# --- the node ------------------------------------------------------------------------------------


class SwarmDHT:
    """One hivemind DHT node with `peer`'s records on top. Synchronous; use as a context manager.

    hivemind forks its DHT process: create the SwarmDHT before starting a gRPC server or other
    threads in this process (forking a process that runs grpc threads is unsafe).
    """

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        announce_host: str | None = None,
        identity_path: str | os.PathLike | None = None,
        client_mode: bool = False,
        start_timeout_s: float = 30,
        request_timeout_s: float = 15.0,
    ):
        initial = [_check_initial_peer(str(a)) for a in initial_peers]
        if announce_host is not None and port == 0:
            raise ConfigError("--announce-host needs an explicit --port (port 0 cannot be announced)")
        kwargs: dict[str, Any] = dict(
            host_maddrs=[_maddr(host, port)], client_mode=client_mode, startup_timeout=start_timeout_s
        )
        if announce_host is not None:
            kwargs["announce_maddrs"] = [_maddr(announce_host, port)]
        if identity_path is not None:
            make_identity(identity_path)
            kwargs["identity_path"] = str(Path(identity_path).expanduser())
        self.request_timeout_s = float(request_timeout_s)
        self.run_id: str | None = None
        self.n_stages = 0
        self._last_expiration: dict[tuple[str, str | None], float] = {}
        self._known_pids: dict[int, int] = {}
        self._closed = False

        t0 = time.monotonic()
        self._dht = hivemind.DHT(initial_peers=initial or None, start=False, **kwargs)
        # Runs at interpreter exit if shutdown() was never called, so no p2pd outlives us.
        self._finalizer = weakref.finalize(self, _stop, self._dht, self._known_pids)
        try:
            self._dht.run_in_background(await_ready=True, timeout=start_timeout_s)
            self._known_pids[self._dht.pid] = (_proc_stat(self._dht.pid) or (0, "", -1))[2]
            self._known_pids.update(_descendants(self._dht.pid))
            self.peer_id: str = self._wait(
                self._dht.run_coroutine(_node_peer_id, return_future=True), "start", start_timeout_s
            )
        except TimeoutError as e:
            self.shutdown()
            raise NetworkError(f"DHT node did not start within {start_timeout_s:.0f} s; {_CHECK_HINT}") from e
        except NetworkError:
            self.shutdown()
            raise
        except Exception as e:
            self.shutdown()
            raise NetworkError(self._start_error(e, initial, identity_path)) from e
        self.start_time_s = time.monotonic() - t0
        logger.info(
            "DHT node %s started in %.2f s (%d initial peers, client_mode=%s)",
            self.peer_id, self.start_time_s, len(initial), client_mode,
        )

    @staticmethod
    def _start_error(e: Exception, initial: Sequence[str], identity_path: Any) -> str:
        text = " ".join(str(e).split())
        if "already taken" in text:
            return (
                f"identity {identity_path} is already used by a running peer; "
                "stop that peer or use another identity file"
            )
        if initial and ("bootstrap" in text or "initial_peers" in text):
            return f"none of the {len(initial)} initial peer(s) answered; {_CHECK_HINT}"
        if isinstance(e, P2PDaemonError):
            return f"the libp2p daemon failed to start ({text[:200]}); check --host/--port are free and valid"
        return f"DHT node failed to start: {type(e).__name__}: {text[:200]}"

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
    def child_pids(self) -> list[int]:
        """Process ids of the hivemind child and its p2pd (for tests and status)."""
        return sorted(self._known_pids)

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (ending in /p2p/<peer id>) that another peer passes as --initial-peers."""
        self._check_open()
        return self._wait(
            self._dht.run_coroutine(_node_visible_maddrs, return_future=True), "address lookup", None
        )

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
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError as e:
            future.cancel()
            raise NetworkError(f"DHT {what} got no answer within {timeout_s:.0f} s; {_CHECK_HINT}") from e
        except Exception as e:
            text = " ".join(str(e).split())[:200]
            raise NetworkError(f"DHT {what} failed ({type(e).__name__}: {text}); {_CHECK_HINT}") from e

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this SwarmDHT was shut down")
        if not self._dht.is_alive():
            raise NetworkError("the hivemind DHT process exited; restart this peer")

    def _store(self, key: str, value: Any, ttl_s: float, subkey: str | None, timeout_s: float | None) -> None:
        self._check_open()
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        expiration = dht_time() + ttl_s
        previous = self._last_expiration.get((key, subkey))
        if previous is not None and expiration <= previous:
            expiration = previous + 1e-3  # hivemind keeps the latest expiration: stay the newest
        future = self._dht.store(key, value, expiration, subkey=subkey, return_future=True)
        if not self._wait(future, f"store of {key!r}", timeout_s):
            raise NetworkError(
                f"DHT store of {key!r} was refused (no node accepted it, or a newer record exists); {_CHECK_HINT}"
            )
        self._last_expiration[(key, subkey)] = expiration
        logger.debug("stored %s (subkey %s) for %.0f s", key, subkey, expiration - dht_time())

    def _get_many(self, keys: Sequence[str], timeout_s: float | None) -> list[Any]:
        """Values of `keys` (None where absent), fetched concurrently under one deadline."""
        self._check_open()
        timeout_s = self.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        futures = [self._dht.get(k, latest=True, return_future=True) for k in keys]
        out = []
        for key, future in zip(keys, futures):
            found = self._wait(future, f"lookup of {key!r}", max(0.0, deadline - time.monotonic()))
            out.append(None if found is None else found.value)
        return out

    def _records(self, value: Any, max_age_s: float | None) -> dict[str, dict]:
        """Live per-peer records of a subkeyed value: drops "left" records and stale ones."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            logger.warning("ignoring a DHT value of type %s where per-peer records were expected", type(value).__name__)
            return {}
        now = dht_time()
        out: dict[str, dict] = {}
        for subkey, item in value.items():
            record = getattr(item, "value", None)
            if not isinstance(record, dict) or record.get("state") == "left":
                continue
            stamp = record.get("time")
            if max_age_s is not None and (not isinstance(stamp, (int, float)) or now - stamp > max_age_s):
                continue
            out[str(subkey)] = record
        return out

    def _run_key(self, suffix: str) -> str:
        if self.run_id is None:
            raise RuntimeError("call set_run(run_id) (from the manifest) before using per-run DHT records")
        return f"peer.{self.run_id}.{suffix}"

    def _announce(self, key: str, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None) -> None:
        record = dict(record)
        record["time"] = dht_time()
        _check_plain(record, "record")
        self._store(key, record, ttl_s, self.peer_id, timeout_s)

    def _withdraw(self, key: str, timeout_s: float | None) -> None:
        self._store(key, {"state": "left", "time": dht_time()}, LEFT_TTL_S, self.peer_id, timeout_s)

    # --- manifest --------------------------------------------------------------------------------

    def publish_manifest(self, manifest: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None) -> None:
        """Store the manifest under "peer.manifest" as canonical JSON text; call again to refresh it."""
        text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False)
        self._store(MANIFEST_KEY, text, ttl_s, None, timeout_s)

    def get_manifest(self, timeout_s: float | None = None) -> dict | None:
        """The run's manifest, or None if no bootstrap has published one (yet)."""
        (value,) = self._get_many([MANIFEST_KEY], timeout_s)
        if value is None:
            return None
        try:
            manifest = json.loads(value) if isinstance(value, (str, bytes)) else None
        except ValueError:
            manifest = None
        if not isinstance(manifest, dict):
            raise ManifestMismatch(
                f"the DHT record {MANIFEST_KEY!r} is not a JSON object; check --initial-peers points at a peer swarm"
            )
        return manifest

    # --- stages, replicas, rounds ----------------------------------------------------------------

    def announce_stage(
        self, stage: int, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None
    ) -> None:
        """Publish this peer's record for `stage` (address, capacity, state, outer_step, ...)."""
        self._announce(self._run_key(f"stage.{int(stage)}"), record, ttl_s, timeout_s)

    def get_stage_peers(
        self, stage: int, max_age_s: float | None = None, timeout_s: float | None = None
    ) -> dict[str, dict]:
        """{peer id: record} of the peers currently holding `stage`."""
        (value,) = self._get_many([self._run_key(f"stage.{int(stage)}")], timeout_s)
        return self._records(value, max_age_s)

    def withdraw_stage(self, stage: int, timeout_s: float | None = None) -> None:
        """Graceful leave: replace this peer's stage record by a short-lived {"state": "left"}."""
        self._withdraw(self._run_key(f"stage.{int(stage)}"), timeout_s)

    def announce_replica(self, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None) -> None:
        """Publish this peer's replica record (outer_step, inner step, tokens/s, loss, ...)."""
        self._announce(self._run_key("replica"), record, ttl_s, timeout_s)

    def get_replicas(self, max_age_s: float | None = None, timeout_s: float | None = None) -> dict[str, dict]:
        """{peer id: record} of full replicas and pipeline heads."""
        (value,) = self._get_many([self._run_key("replica")], timeout_s)
        return self._records(value, max_age_s)

    def withdraw_replica(self, timeout_s: float | None = None) -> None:
        """Graceful leave: replace this peer's replica record by a short-lived {"state": "left"}."""
        self._withdraw(self._run_key("replica"), timeout_s)

    def announce_payload(
        self, outer_step: int, stage: int, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None
    ) -> None:
        """Announce this peer's payload (hash, size, address) for round (outer_step, stage)."""
        self._announce(self._run_key(f"round.{int(outer_step)}.{int(stage)}"), record, ttl_s, timeout_s)

    def get_payloads(self, outer_step: int, stage: int, timeout_s: float | None = None) -> dict[str, dict]:
        """{peer id: record} of payloads announced for round (outer_step, stage)."""
        (value,) = self._get_many([self._run_key(f"round.{int(outer_step)}.{int(stage)}")], timeout_s)
        return self._records(value, None)

    def current_outer_step(self, timeout_s: float | None = None) -> int:
        """Largest "outer_step" in live replica and stage records (stages 0..n_stages-1), 0 if none."""
        keys = [self._run_key("replica")] + [self._run_key(f"stage.{s}") for s in range(self.n_stages)]
        best = 0
        for value in self._get_many(keys, timeout_s):
            for record in self._records(value, None).values():
                step = record.get("outer_step")
                if isinstance(step, int) and not isinstance(step, bool):
                    best = max(best, step)
        return best
