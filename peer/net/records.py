"""What a DHT record may hold, and which records a reader believes.

Per-peer records live under one subkey per peer, the subkey being ``[owner:<that peer's RSA
public key>]``; hivemind's `RSASignatureValidator` (on every node running `peer.net.dht`) refuses
a store under an owner subkey unless that key signed it, and drops such a record from other
nodes' answers if its signature is wrong. A `RecordReader` then maps the subkey back to the
signer's peer id and keeps a record only if
- its subkey is an owner key (else "unsigned"),
- its ``"peer_id"`` field is the signer's (else "forged"),
- the swarm's `Admission` admits the signer (else "not_admitted"),
- it is not a ``{"state": "left"}`` record and not older than the caller's `max_age_s`.

Invariants: values are msgpack-friendly builtins (`check_plain`); a dropped record is counted and
warned about once per (reason, peer), with the warnings bounded so forged keys cannot flood the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from peer.errors import ManifestMismatch
from peer.net.admission import PROOF_FIELD, Admission, admission_proof
from peer.net.identity import owner_peer_id, unseal

logger = logging.getLogger(__name__)

DROP_REASONS = ("unsigned", "forged", "not_admitted")
_MAX_WARNED = 64  # distinct (reason, peer) warnings per reader: keys are free to make


def check_plain(value: Any, where: str) -> None:
    """Raise TypeError unless `value` is made of msgpack-friendly builtins (str dict keys)."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if type(value) is dict:
        for k, item in value.items():
            if type(k) is not str:
                raise TypeError(f"DHT record key {where}.{k!r} must be a str")
            check_plain(item, f"{where}.{k}")
        return
    raise TypeError(f"DHT record field {where} has type {type(value).__name__}; use plain int/float/str/list/dict")


class RecordReader:
    """Signs this peer's records and filters other peers' records under the swarm's admission policy."""

    def __init__(self, peer_id: str, secret: bytes | None) -> None:
        self.peer_id = peer_id
        self.admission = Admission()  # set from the manifest
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self._secret = secret
        self._warned: set[tuple[str, str]] = set()

    def drop(self, reason: str, who: str, detail: str) -> None:
        """Count a dropped record; warn once per (reason, peer) so a flood does not flood the log."""
        self.dropped[reason] += 1
        if (reason, who) not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add((reason, who))
            logger.warning("ignoring DHT records from %s: %s", who, detail)

    def sign(self, record: Mapping[str, Any], now: float) -> dict[str, Any]:
        """`record` with this peer's "time", "peer_id" and (secret mode) admission proof added."""
        out = dict(record)
        out["time"] = now
        out["peer_id"] = self.peer_id
        if self._secret is not None:
            out[PROOF_FIELD] = admission_proof(self._secret, self.peer_id)
        return out

    def records(
        self, value: Any, now: float, max_age_s: float | None, keep_left: bool = False
    ) -> dict[str, dict[str, Any]]:
        """Live, signed, admitted per-peer records of a subkeyed DHT value, keyed by the signer's peer id
        (with `keep_left`, graceful leaves' {"state": "left"} records too).

        Signatures themselves were checked by this node's hivemind validator before we see them.
        """
        if value is None:
            return {}
        if not isinstance(value, dict):
            logger.warning("ignoring a DHT value of type %s where per-peer records were expected", type(value).__name__)
            return {}
        out: dict[str, dict[str, Any]] = {}
        for subkey, item in value.items():
            record = getattr(item, "value", None)
            signer = owner_peer_id(subkey)
            if signer is None:
                self.drop("unsigned", str(subkey)[:16], "its subkey is not a signing key (an old or forged record)")
                continue
            if not isinstance(record, dict):
                continue
            if record.get("peer_id") != signer:
                self.drop("forged", signer, f"it claims to be {str(record.get('peer_id'))[:16]} but signs as {signer}")
                continue
            if not self.admission.admits(signer, record, self._secret):
                self.drop("not_admitted", signer, f"it is not admitted to this {self.admission.mode}-mode swarm")
                continue
            if record.get("state") == "left" and not keep_left:
                continue
            stamp = record.get("time")
            if max_age_s is not None and (not isinstance(stamp, (int, float)) or now - stamp > max_age_s):
                continue
            out[signer] = {k: v for k, v in record.items() if k != PROOF_FIELD}
        return out


def choose_manifest(
    value: Any, initial_ids: Collection[str], drop: Callable[[str, str, str], None]
) -> tuple[str, dict[str, Any]] | None:
    """(signer, manifest) of the signed manifest copies in `value`; None if there is none.

    Takes the copy signed by one of `initial_ids` (the newest such), else the only copy (with a
    warning); several copies from different signers and none from an initial peer is a
    `ManifestMismatch`, and so is a copy that is not a JSON object.
    """
    copies: dict[str, tuple[float, Any]] = {}
    for subkey, item in value.items() if isinstance(value, dict) else ():
        signer = owner_peer_id(subkey)
        if signer is None:
            drop("unsigned", str(subkey)[:16], "an unsigned manifest copy")
            continue
        copies[signer] = (item.expiration_time, item.value)
    if not copies:
        return None
    trusted = [s for s in copies if s in initial_ids]
    if trusted:
        signer = max(trusted, key=lambda s: copies[s][0])
    elif len(copies) == 1:
        (signer,) = copies
        if initial_ids:
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
    return signer, manifest


@dataclass(frozen=True)
class _Copy:
    """A manifest copy as `choose_manifest` reads it (like hivemind's ValueWithExpiration)."""

    value: Any
    expiration_time: float


def unsealed_copies(sealed: Any) -> tuple[dict[bytes, _Copy], dict[str, dict[str, Any]]]:
    """The valid seals of `peer.manifest.sealed` (whoever re-published them) as manifest copies keyed
    by their signer's owner subkey, and {signer peer id: seal}."""
    copies: dict[bytes, _Copy] = {}
    seals: dict[str, dict[str, Any]] = {}
    for item in sealed.values() if isinstance(sealed, dict) else ():
        opened = unseal(item.value)
        if opened is None:
            continue
        signer, text = opened
        owner = item.value["owner"]
        if owner not in copies or copies[owner].expiration_time < item.expiration_time:
            copies[owner] = _Copy(text, item.expiration_time)
            seals[signer] = item.value
    return copies, seals
