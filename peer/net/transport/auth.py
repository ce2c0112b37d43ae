"""Proof of an admitted caller on every data-plane call (secret and allow-list swarms).

Each call carries gRPC metadata `peer-id`, `peer-ts` (unix time, ms) and `peer-proof` over the
message "peer-auth/v1|<peer id>|<ts>|<full method name>":
- secret swarms: proof = HMAC-SHA256(K, message), K = HMAC-SHA256(swarm secret, "peer-auth/v1/key");
- allow-list swarms: proof = the caller's RSA-PSS signature with its identity key (the key that
  signs its DHT records) and `peer-key` = its public key; the callee checks that the key hashes to
  the peer id and that the id is on the allow-list;
- open swarms: no proof is asked for or sent.
The callee (`Verifier.check`, run by the server interceptor before any request byte is read) turns
away a missing, malformed, stale (|now − ts| > `max_skew_s`), forged or unlisted proof with
UNAUTHENTICATED and counts it by reason.

Invariants: the secret never leaves the process (proofs only, compared in constant time); a proof
binds the caller's id, the time and the method, not the request bytes (the channel is plaintext;
see docs/connectivity.md for what this does and does not stop); verified proofs are cached until
they go stale so an RSA verification costs once per caller, method and `REFRESH_S`.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

ID_KEY, TS_KEY, PROOF_KEY, PUBKEY_KEY = "peer-id", "peer-ts", "peer-proof", "peer-key"
REFRESH_S = 30.0  # a caller re-uses one proof per method this long
MAX_SKEW_S = 120.0  # accepted |callee clock − caller ts|: REFRESH_S plus clock skew
_KEY_LABEL = b"peer-auth/v1/key"
_CACHE = 4096


def _message(peer_id: str, ts_ms: int, method: str) -> bytes:
    return f"peer-auth/v1|{peer_id}|{ts_ms}|{method}".encode()


def _secret_key(secret: bytes) -> bytes:
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


def secret_proof(secret: bytes, peer_id: str, ts_ms: int, method: str) -> str:
    """The secret-mode proof of (peer id, time, method)."""
    return hmac.new(_secret_key(secret), _message(peer_id, ts_ms, method), hashlib.sha256).hexdigest()


class Credentials:
    """What this peer attaches to its calls: `mode` is "open" (its id only), "secret" or "allowlist"."""

    def __init__(
        self,
        mode: str,
        peer_id: str,
        secret: bytes | None = None,
        key: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode == "secret" and secret is None:
            raise ValueError("secret-mode credentials need the swarm secret")
        if mode == "allowlist" and key is None:
            raise ValueError("allow-list credentials need the identity key")
        self.mode, self.peer_id, self._clock = mode, peer_id, clock
        self._secret_key = _secret_key(secret) if secret is not None else b""
        self._key = key
        self._public = key.get_public_key().to_bytes().decode() if key is not None else ""
        self._cache: dict[str, tuple[float, tuple[tuple[str, str], ...]]] = {}
        self._lock = threading.Lock()

    def metadata(self, method: str) -> tuple[tuple[str, str], ...]:
        """The (key, value) pairs proving this peer's admission for one call of `method`."""
        now = self._clock()
        with self._lock:
            hit = self._cache.get(method)
            if hit is not None and now - hit[0] < REFRESH_S:
                return hit[1]
        ts_ms = int(now * 1000)
        msg = _message(self.peer_id, ts_ms, method)
        if self.mode == "open":  # no proof: the id only names the caller (e.g. to its own reverse stream)
            return ((ID_KEY, self.peer_id),)
        if self.mode == "secret":
            pairs: tuple[tuple[str, str], ...] = (
                (ID_KEY, self.peer_id),
                (TS_KEY, str(ts_ms)),
                (PROOF_KEY, hmac.new(self._secret_key, msg, hashlib.sha256).hexdigest()),
            )
        else:
            signature = self._key.sign(msg).decode()
            pairs = ((ID_KEY, self.peer_id), (TS_KEY, str(ts_ms)), (PROOF_KEY, signature), (PUBKEY_KEY, self._public))
        with self._lock:
            self._cache[method] = (now, pairs)
        return pairs


class Verifier:
    """The callee's check of a call's proof under the swarm's admission policy.

    `mode` "open" admits everyone (nothing is checked or counted); "secret" needs `secret`;
    "allowlist" needs `allowlist` (peer ids).
    """

    def __init__(
        self,
        mode: str,
        secret: bytes | None = None,
        allowlist: frozenset[str] = frozenset(),
        max_skew_s: float = MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if mode == "secret" and secret is None:
            raise ValueError("a secret-mode verifier needs the swarm secret")
        self.mode, self.allowlist, self.max_skew_s, self._clock = mode, allowlist, max_skew_s, clock
        self._secret_key = _secret_key(secret) if secret is not None else b""
        self._good: OrderedDict[tuple[str, ...], float] = OrderedDict()
        self._lock = threading.Lock()
        self.failures: Counter[str] = Counter()

    @property
    def active(self) -> bool:
        return self.mode in ("secret", "allowlist")

    def check(self, method: str, metadata: Mapping[str, str]) -> tuple[str | None, str | None]:
        """(caller's peer id, None) when the proof holds, else (None, why); counted by reason."""
        if not self.active:
            return metadata.get(ID_KEY), None
        why = self._why_not(method, metadata)
        if why is not None:
            with self._lock:
                self.failures[why.split(":", 1)[0]] += 1
            return None, why
        return metadata[ID_KEY], None

    def failure_count(self) -> int:
        with self._lock:
            return sum(self.failures.values())

    def _why_not(self, method: str, md: Mapping[str, str]) -> str | None:
        peer_id, ts, proof = md.get(ID_KEY), md.get(TS_KEY), md.get(PROOF_KEY)
        if not peer_id or not ts or not proof:
            return "missing: the call carries no admission proof (peer-id, peer-ts, peer-proof)"
        try:
            ts_ms = int(ts)
        except ValueError:
            return "malformed: peer-ts is not an integer"
        skew = abs(self._clock() - ts_ms / 1000.0)
        if skew > self.max_skew_s:
            return f"stale: the proof is {skew:.0f}s off this peer's clock (limit {self.max_skew_s:.0f}s); sync clocks"
        pubkey = md.get(PUBKEY_KEY, "")
        cache_key = (peer_id, ts, method, proof, pubkey)
        with self._lock:
            if cache_key in self._good:
                return None
        msg = _message(peer_id, ts_ms, method)
        if self.mode == "secret":
            want = hmac.new(self._secret_key, msg, hashlib.sha256).hexdigest()
            if not hmac.compare_digest(want, proof):
                return "forged: the proof does not match the swarm secret"
        else:
            if peer_id not in self.allowlist:
                return f"unlisted: peer {peer_id} is not on the swarm's allow-list"
            why = _check_signature(peer_id, pubkey, msg, proof)
            if why is not None:
                return why
        with self._lock:
            self._good[cache_key] = ts_ms / 1000.0
            while len(self._good) > _CACHE:
                self._good.popitem(last=False)
        return None


def _check_signature(peer_id: str, pubkey: str, msg: bytes, proof: str) -> str | None:
    """None if `proof` is a signature of `msg` by the key `pubkey` and that key's id is `peer_id`."""
    from hivemind.utils.crypto import RSAPublicKey  # only allow-list swarms pay for the import

    from peer.net.identity import peer_id_of

    try:
        public = RSAPublicKey.from_bytes(pubkey.encode())
    except Exception:  # noqa: BLE001 - any unparsable key is a forged proof
        return "forged: peer-key is not an RSA public key"
    if peer_id_of(public) != peer_id:
        return "forged: peer-key does not belong to peer-id"
    try:
        ok = bool(public.verify(msg, proof.encode()))
    except Exception:  # noqa: BLE001 - a malformed signature is a forged one
        ok = False
    return None if ok else "forged: the signature does not verify"


def for_swarm(
    mode: str, allowlist: frozenset[str], peer_id: str, secret: bytes | None, key: Any
) -> tuple[Verifier, Credentials]:
    """A peer's check of its callers and its own proof under the swarm's admission `mode`."""
    verifier = Verifier(mode, secret=secret, allowlist=allowlist)
    return verifier, Credentials(mode, peer_id, secret=secret, key=key)
