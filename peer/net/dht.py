"""Control plane of `peer`: a small synchronous wrapper around a hivemind DHT node.

This is the ONLY module of `peer` that imports hivemind (DESIGN.md §3, STYLE.md points 4 and 12).
hivemind runs its DHT node and the libp2p daemon (`p2pd`) in a child process; every call here
sends one request to that process and waits on its future with a deadline, so callers never see
asyncio and never wait forever.

Identity. Every node runs on a file-backed libp2p RSA key: `--identity PATH` (created on first
run, so the peer id survives restarts) or a throw-away key in a temporary file. The same key signs
this peer's DHT records through hivemind's own `RSASignatureValidator`, so a peer id and the key
that signs for it are one thing: peer id = multihash(sha256(libp2p public key)).

Records (all values are msgpack-friendly; every record has an expiration):
- ``peer.node.manifest.signed``: the run's manifest as canonical JSON **text** under the subkey
  ``[owner:<bootstrap's RSA public key>]``, signed by the bootstrap. Readers take the copy signed
  by one of their --initial-peers (or the only copy) and apply its admission policy.
- ``peer.node.manifest`` (fixed key, no run id): the same text, unsigned, for stock hivemind clients:
  ``json.loads(hivemind.DHT(initial_peers=[...], start=True).get("peer.node.manifest", latest=True).value)``.
  Anyone can overwrite it; `peer` itself never trusts it.
- ``peer.{run}.stage.{s}``, ``peer.{run}.replica``, ``peer.{run}.round.{t}.{s}``: one subkey per
  peer, the subkey being ``[owner:<that peer's RSA public key>]``. Every hivemind node running this
  module refuses a store under an owner subkey unless it is signed by that key, and drops such a
  record from other nodes' answers if its signature is wrong. Readers map the subkey back to the
  peer id derived from the key, drop records whose ``"peer_id"`` field disagrees or whose subkey is
  not an owner key, and return ``{peer id: record}`` with ``"time"`` (DHT time at announcement) and
  ``"peer_id"`` added.

Admission (set at the bootstrap, in the manifest's ``config.swarm``): ``open``; ``secret`` (every
record carries ``admission`` = HMAC-SHA256(secret, peer id), readers drop records without a valid
one; the manifest carries only ``swarm_secret_commitment`` = sha256(HMAC(secret, label)), so a
joiner with the wrong secret fails at `get_manifest`); ``allowlist`` (readers drop records whose
signer is not listed; an unlisted non-client node fails at `get_manifest`). Admission filters what
readers LISTEN to: records stay readable by anyone who reaches the DHT, and the gRPC data plane is
not authenticated by this module.

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

import base64
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hivemind
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import PrivateKey, RSAPublicKey
from hivemind.utils.multiaddr import Multiaddr

from peer.errors import ConfigError, ManifestMismatch, NetworkError

logger = logging.getLogger(__name__)

MANIFEST_KEY = "peer.node.manifest"  # unsigned mirror for stock hivemind clients
SIGNED_MANIFEST_KEY = "peer.node.manifest.signed"  # subkey = the bootstrap's owner key
LEFT_TTL_S = 30.0  # minimum lifetime of a {"state": "left"} record
ADMISSION_MODES = ("open", "secret", "allowlist")  # the values of config.swarm.admission
SECRET_ENV = "PEER_SWARM_SECRET"
_PROOF = "admission"  # record field holding HMAC(secret, peer id) in secret mode
_PROOF_LABEL = b"peer-admission/v1/peer/"
_COMMITMENT_LABEL = b"peer-admission/v1/commitment"
_RUN_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX, re.DOTALL)
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


# --- signing keys and peer ids -------------------------------------------------------------------

_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


class _IdentityKey(PrivateKey):
    """A libp2p RSA identity as a hivemind signing key.

    Signs exactly like hivemind's `RSAPrivateKey` (RSA-PSS, MGF1-SHA256, maximal salt, base64), so
    hivemind's `RSASignatureValidator` and `RSAPublicKey.verify` accept its signatures.
    """

    def __init__(self, der: bytes):
        self._der = der
        key = serialization.load_der_private_key(der, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"expected an RSA key, got {type(key).__name__}")
        self._key = key

    def sign(self, data: bytes) -> bytes:
        return base64.b64encode(self._key.sign(data, _PSS, hashes.SHA256()))

    def get_public_key(self) -> RSAPublicKey:
        return RSAPublicKey(self._key.public_key())

    def __getstate__(self) -> dict:  # picklable for hivemind's child process
        return {"der": self._der}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["der"])


def _load_identity_key(path: Path) -> _IdentityKey:
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if proto.key_type != crypto_pb2.RSA:
            raise ValueError("not an RSA key")
        return _IdentityKey(proto.data)
    except Exception as e:
        raise ConfigError(
            f"identity file {path} is not a libp2p RSA private key ({e}); delete it to make a new one"
        ) from e


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key (multihash sha2-256 of the libp2p PublicKey protobuf)."""
    der = serialization.load_ssh_public_key(public_key.to_bytes()).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58()  # 0x12 = sha2-256, 32 bytes


@functools.lru_cache(maxsize=4096)
def _owner_peer_id(subkey: Any) -> str | None:
    """Peer id of the key in an owner subkey ``[owner:<ssh-rsa ...>]``; None for any other subkey."""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNER_RE.fullmatch(subkey)
    if match is None:
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(match.group(1)))
    except Exception:
        return None


# --- admission -----------------------------------------------------------------------------------


def load_swarm_secret(path: str | os.PathLike | None = None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The swarm secret: the text of `path` (surrounding whitespace stripped), else $PEER_SWARM_SECRET, else None."""
    if path is not None:
        path = Path(path).expanduser()
        try:
            text = path.read_bytes().decode("utf-8")
        except OSError as e:
            raise ConfigError(f"cannot read the swarm secret file {path} ({e.strerror}); pass an existing file") from e
        except UnicodeDecodeError:
            raise ConfigError(
                f"the swarm secret file {path} is not UTF-8 text; use e.g. `openssl rand -hex 32`"
            ) from None
        where = f"swarm secret file {path}"
    else:
        text = (os.environ if environ is None else environ).get(SECRET_ENV)
        if text is None:
            return None
        where = f"${SECRET_ENV}"
    secret = text.strip().encode()
    if not secret:
        raise ConfigError(f"the {where} is empty; put a long random string in it (e.g. `openssl rand -hex 32`)")
    if len(secret) < 16:
        logger.warning("the %s is only %d bytes; a guessable secret can be brute-forced offline", where, len(secret))
    return secret


def admission_proof(secret: bytes, peer_id: str) -> str:
    """HMAC-SHA256(secret, label + peer id): what a secret-mode record carries to show it is admitted."""
    return hmac.new(secret, _PROOF_LABEL + peer_id.encode(), hashlib.sha256).hexdigest()


def secret_commitment(secret: bytes) -> str:
    """What the manifest carries instead of the secret: sha256(HMAC-SHA256(secret, label))."""
    return hashlib.sha256(hmac.new(secret, _COMMITMENT_LABEL, hashlib.sha256).digest()).hexdigest()


@dataclass(frozen=True)
class Admission:
    """Who readers listen to (from the manifest): mode, allowed peer ids, the secret's commitment."""

    mode: str = "open"
    allowlist: frozenset[str] = frozenset()
    commitment: str | None = None

    @classmethod
    def of_manifest(cls, manifest: Mapping[str, Any]) -> Admission:
        config = manifest.get("config")
        swarm = config.get("swarm") if isinstance(config, Mapping) else None
        swarm = swarm if isinstance(swarm, Mapping) else {}
        mode = swarm.get("admission", "open")
        allowlist = swarm.get("allowlist") or ()
        commitment = manifest.get("swarm_secret_commitment")
        if mode not in ADMISSION_MODES:
            raise ManifestMismatch(
                f"the swarm uses admission {mode!r}, this peer knows {ADMISSION_MODES}; upgrade peer"
            )
        if not isinstance(allowlist, (list, tuple)) or not all(isinstance(p, str) for p in allowlist):
            raise ManifestMismatch("the manifest's swarm.allowlist is not a list of peer ids; the bootstrap is broken")
        if mode == "allowlist" and not allowlist:
            raise ManifestMismatch(
                "the manifest's admission is 'allowlist' with an empty list; the bootstrap is broken"
            )
        return cls(mode, frozenset(allowlist), commitment if isinstance(commitment, str) else None)


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
        swarm_secret: bytes | str | None = None,
    ):
        """`identity_path`: the persistent key file (created if missing); None = a throw-away key.
        `swarm_secret`: the secret of a secret-mode swarm (None: $PEER_SWARM_SECRET, if set)."""
        initial = [_check_initial_peer(str(a)) for a in initial_peers]
        if announce_host is not None and port == 0:
            raise ConfigError("--announce-host needs an explicit --port (port 0 cannot be announced)")
        if isinstance(swarm_secret, str):
            swarm_secret = swarm_secret.strip().encode()
        self._secret: bytes | None = load_swarm_secret() if swarm_secret is None else bytes(swarm_secret)
        if self._secret is not None and not self._secret:
            raise ConfigError("the swarm secret is empty; put a long random string in it")
        kwargs: dict[str, Any] = dict(
            host_maddrs=[_maddr(host, port)], client_mode=client_mode, startup_timeout=start_timeout_s
        )
        if announce_host is not None:
            kwargs["announce_maddrs"] = [_maddr(announce_host, port)]
        # Every node signs with a file-backed RSA identity: p2pd takes its peer id from the same file.
        scratch = None
        if identity_path is None:
            scratch = tempfile.mkdtemp(prefix="peer-identity-")
            key_path = Path(scratch) / "identity.key"
            P2P.generate_identity(str(key_path))
            fresh = True
        else:
            key_path = Path(identity_path).expanduser()
            fresh = not key_path.exists()
            make_identity(key_path)
        key = _load_identity_key(key_path)
        kwargs["identity_path"] = str(key_path)
        if fresh:
            kwargs["check_if_identity_free"] = False  # a key made just now is not in use elsewhere
        validator = RSASignatureValidator(key)
        self.owner_subkey: bytes = validator.local_public_key  # the DHT subkey of this peer's records
        self.client_mode = bool(client_mode)
        self.request_timeout_s = float(request_timeout_s)
        self.run_id: str | None = None
        self.n_stages = 0
        self.admission = Admission()  # set from the manifest by get_manifest / publish_manifest
        self.manifest_signer: str | None = None
        self.dropped_records: dict[str, int] = {"unsigned": 0, "forged": 0, "not_admitted": 0}
        self._warned: set[tuple[str, str]] = set()
        self._initial_ids = {str(Multiaddr(a)["p2p"]) for a in initial}
        self._last_expiration: dict[tuple[str, Any], float] = {}
        self._known_pids: dict[int, int] = {}
        self._closed = False

        t0 = time.monotonic()
        self._dht = hivemind.DHT(initial_peers=initial or None, start=False, record_validators=[validator], **kwargs)
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
        finally:
            if scratch is not None:  # p2pd has read the key by now (or failed)
                shutil.rmtree(scratch, ignore_errors=True)
        if self.peer_id != peer_id_of(key.get_public_key()):
            self.shutdown()
            raise NetworkError(f"the DHT node runs as {self.peer_id}, not as the identity in {key_path}")
        self.start_time_s = time.monotonic() - t0
        logger.info(
            "DHT node %s started in %.2f s (%d initial peers, client_mode=%s)",
            self.peer_id,
            self.start_time_s,
            len(initial),
            client_mode,
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
        return self._wait(self._dht.run_coroutine(_node_visible_maddrs, return_future=True), "address lookup", None)

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

    def _store(self, key: str, value: Any, ttl_s: float, subkey: bytes | None, timeout_s: float | None) -> None:
        """Store with a later expiration than any before it; up to 3 attempts under one deadline.

        hivemind reports the answer of the LAST node to reply, and a node that gets the same record
        twice answers False, so a refusal is retried (with a new, later expiration) before it counts.
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
        for key, future in zip(keys, futures):
            found = self._wait(future, f"lookup of {key!r}", max(0.0, deadline - time.monotonic()))
            out.append(None if found is None else found.value)
        return out

    def _drop(self, reason: str, who: str, detail: str) -> None:
        """Count a dropped record; warn once per (reason, peer) so a flood does not flood the log."""
        self.dropped_records[reason] += 1
        if (reason, who) not in self._warned and len(self._warned) < 64:  # bounded: keys are free to make
            self._warned.add((reason, who))
            logger.warning("ignoring DHT records from %s: %s", who, detail)

    def _admitted(self, peer_id: str, record: Mapping[str, Any]) -> bool:
        mode = self.admission.mode
        if mode == "allowlist":
            return peer_id in self.admission.allowlist
        if mode == "secret":
            proof = record.get(_PROOF)
            return (
                self._secret is not None
                and isinstance(proof, str)
                and hmac.compare_digest(proof, admission_proof(self._secret, peer_id))
            )
        return True

    def _records(self, value: Any, max_age_s: float | None) -> dict[str, dict]:
        """Live, signed, admitted per-peer records of a subkeyed value, keyed by the signer's peer id.

        Drops records whose subkey is not an owner key (unsigned), whose "peer_id" is not the
        signer's (forged), that fail the swarm's admission, that are "left" or older than `max_age_s`.
        Signatures themselves were checked by this node's hivemind validator before we see them.
        """
        if value is None:
            return {}
        if not isinstance(value, dict):
            logger.warning("ignoring a DHT value of type %s where per-peer records were expected", type(value).__name__)
            return {}
        now = dht_time()
        out: dict[str, dict] = {}
        for subkey, item in value.items():
            record = getattr(item, "value", None)
            signer = _owner_peer_id(subkey)
            if signer is None:
                self._drop("unsigned", str(subkey)[:16], "its subkey is not a signing key (an old or forged record)")
                continue
            if not isinstance(record, dict):
                continue
            if record.get("peer_id") != signer:
                self._drop("forged", signer, f"it claims to be {str(record.get('peer_id'))[:16]} but signs as {signer}")
                continue
            if not self._admitted(signer, record):
                self._drop("not_admitted", signer, f"it is not admitted to this {self.admission.mode}-mode swarm")
                continue
            if record.get("state") == "left":
                continue
            stamp = record.get("time")
            if max_age_s is not None and (not isinstance(stamp, (int, float)) or now - stamp > max_age_s):
                continue
            out[signer] = {k: v for k, v in record.items() if k != _PROOF}
        return out

    def _run_key(self, suffix: str) -> str:
        if self.run_id is None:
            raise RuntimeError("call set_run(run_id) (from the manifest) before using per-run DHT records")
        return f"peer.{self.run_id}.{suffix}"

    def _signed(self, record: Mapping[str, Any]) -> dict[str, Any]:
        record = dict(record)
        record["time"] = dht_time()
        record["peer_id"] = self.peer_id
        if self._secret is not None:
            record[_PROOF] = admission_proof(self._secret, self.peer_id)
        return record

    def _announce(self, key: str, record: Mapping[str, Any], ttl_s: float, timeout_s: float | None) -> None:
        record = self._signed(record)
        _check_plain(record, "record")
        self._store(key, record, ttl_s, self.owner_subkey, timeout_s)

    def _withdraw(self, key: str, timeout_s: float | None) -> None:
        self._store(key, self._signed({"state": "left"}), LEFT_TTL_S, self.owner_subkey, timeout_s)

    # --- manifest --------------------------------------------------------------------------------

    def publish_manifest(self, manifest: Mapping[str, Any], ttl_s: float, timeout_s: float | None = None) -> None:
        """Store the manifest as canonical JSON text, signed by this node; call again to refresh it.

        A secret-mode manifest (``config.swarm.admission == "secret"``) gets the secret's commitment
        added (never the secret), so this node needs the secret.
        """
        admission = Admission.of_manifest(manifest)
        if admission.mode == "secret":
            if self._secret is None:
                raise ConfigError(
                    "admission 'secret' needs the swarm secret: pass --swarm-secret-file FILE (or set PEER_SWARM_SECRET)"
                )
            manifest = {**manifest, "swarm_secret_commitment": secret_commitment(self._secret)}
            admission = Admission.of_manifest(manifest)
        text = json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False)
        self._store(SIGNED_MANIFEST_KEY, text, ttl_s, self.owner_subkey, timeout_s)
        self.admission, self.manifest_signer = admission, self.peer_id
        try:  # the unsigned mirror is a convenience for stock clients: anyone may overwrite it
            self._store(MANIFEST_KEY, text, ttl_s, None, timeout_s)
        except NetworkError as e:
            logger.warning("could not refresh the unsigned manifest mirror %r: %s", MANIFEST_KEY, e)

    def get_manifest(self, timeout_s: float | None = None) -> dict | None:
        """The run's manifest as signed by the bootstrap, or None if none is published (yet).

        Takes the copy signed by one of --initial-peers, else the only copy (with a warning; several
        copies from different signers and none from an initial peer is a `ManifestMismatch`). Then
        applies the manifest's admission policy to this node's readers and raises `ManifestMismatch`
        if this node is not admitted: a wrong or missing swarm secret, or (unless client_mode) a
        peer id missing from the allow-list.
        """
        (value,) = self._get_many([SIGNED_MANIFEST_KEY], timeout_s)
        copies: dict[str, tuple[float, Any]] = {}
        for subkey, item in value.items() if isinstance(value, dict) else ():
            signer = _owner_peer_id(subkey)
            if signer is None:
                self._drop("unsigned", str(subkey)[:16], "an unsigned manifest copy")
                continue
            copies[signer] = (item.expiration_time, item.value)
        if not copies:
            return None
        trusted = [s for s in copies if s in self._initial_ids]
        if trusted:
            signer = max(trusted, key=lambda s: copies[s][0])
        elif len(copies) == 1:
            (signer,) = copies
            if self._initial_ids:
                logger.warning(
                    "the manifest is signed by %s, which is not one of --initial-peers; cannot check it comes "
                    "from the bootstrap (pass the bootstrap's own multiaddr to be sure)",
                    signer,
                )
        else:
            raise ManifestMismatch(
                f"{len(copies)} different peers signed a manifest and none of them is an --initial-peers peer; "
                "pass the bootstrap's own multiaddr as --initial-peers"
            )
        text = copies[signer][1]
        try:
            manifest = json.loads(text) if isinstance(text, (str, bytes)) else None
        except ValueError:
            manifest = None
        if not isinstance(manifest, dict):
            raise ManifestMismatch(
                f"the manifest signed by {signer} is not a JSON object; check --initial-peers points at a peer swarm"
            )
        admission = Admission.of_manifest(manifest)
        self._check_admitted(admission)
        self.admission, self.manifest_signer = admission, signer
        return manifest

    def _check_admitted(self, admission: Admission) -> None:
        if admission.mode == "secret":
            if admission.commitment is None:
                raise ManifestMismatch(
                    "the swarm's manifest has no secret commitment; the bootstrap is broken or too old"
                )
            if self._secret is None:
                raise ManifestMismatch(
                    "this swarm admits only peers that know its secret; pass --swarm-secret-file FILE "
                    f"(or set {SECRET_ENV})"
                )
            if not hmac.compare_digest(secret_commitment(self._secret), admission.commitment):
                raise ManifestMismatch(
                    "wrong swarm secret: it does not match the swarm's commitment; check --swarm-secret-file "
                    f"(or {SECRET_ENV}) against the bootstrap's"
                )
        if admission.mode == "allowlist" and not self.client_mode and self.peer_id not in admission.allowlist:
            raise ManifestMismatch(
                f"this peer ({self.peer_id}) is not on the swarm's allow-list; ask the bootstrap operator to add "
                f"`--allow-peer {self.peer_id}` and keep using the same --identity file"
            )

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
