"""Who readers of the DHT listen to: the swarm's admission policy (set at the bootstrap).

Modes (the manifest's ``config.swarm.admission``):
- ``open``: every signed record counts;
- ``secret``: every record carries ``admission`` = HMAC-SHA256(secret, label + peer id) and readers
  drop records without a valid one; the manifest carries only ``swarm_secret_commitment`` =
  sha256(HMAC-SHA256(secret, label)), so a joiner with the wrong secret fails at `get_manifest`;
- ``allowlist``: readers drop records whose signer is not listed; an unlisted non-client node fails
  at `get_manifest`.

Invariants: the secret never leaves this process (only proofs and the commitment do); proofs are
compared in constant time. Admission filters what readers LISTEN to: records stay readable by
anyone who reaches the DHT, and the gRPC data plane is not authenticated here.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.errors import ConfigError, ManifestMismatch

logger = logging.getLogger(__name__)

ADMISSION_MODES = ("open", "secret", "allowlist")  # the values of config.swarm.admission
SECRET_ENV = "PEER_SWARM_SECRET"
PROOF_FIELD = "admission"  # record field holding HMAC(secret, peer id) in secret mode
_PROOF_LABEL = b"peer-admission/v1/peer/"
_COMMITMENT_LABEL = b"peer-admission/v1/commitment"


def load_swarm_secret(
    path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> bytes | None:
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
        found = (os.environ if environ is None else environ).get(SECRET_ENV)
        if found is None:
            return None
        text, where = found, f"${SECRET_ENV}"
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
        """The policy a manifest sets; `ManifestMismatch` if it is malformed or unknown."""
        config = manifest.get("config")
        found = config.get("swarm") if isinstance(config, Mapping) else None
        swarm: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
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
        return cls(str(mode), frozenset(allowlist), commitment if isinstance(commitment, str) else None)

    def admits(self, peer_id: str, record: Mapping[str, Any], secret: bytes | None) -> bool:
        """Whether a record signed by `peer_id` counts under this policy (`secret`: this reader's)."""
        if self.mode == "allowlist":
            return peer_id in self.allowlist
        if self.mode == "secret":
            proof = record.get(PROOF_FIELD)
            return (
                secret is not None
                and isinstance(proof, str)
                and hmac.compare_digest(proof, admission_proof(secret, peer_id))
            )
        return True

    def check_member(self, peer_id: str, secret: bytes | None, client_mode: bool) -> None:
        """Raise `ManifestMismatch` unless this node (`peer_id`, holding `secret`) is admitted.

        A client-mode node (it serves nothing) needs no place on the allow-list.
        """
        if self.mode == "secret":
            if self.commitment is None:
                raise ManifestMismatch(
                    "the swarm's manifest has no secret commitment; the bootstrap is broken or too old"
                )
            if secret is None:
                raise ManifestMismatch(
                    "this swarm admits only peers that know its secret; pass --swarm-secret-file FILE "
                    f"(or set {SECRET_ENV})"
                )
            if not hmac.compare_digest(secret_commitment(secret), self.commitment):
                raise ManifestMismatch(
                    "wrong swarm secret: it does not match the swarm's commitment; check --swarm-secret-file "
                    f"(or {SECRET_ENV}) against the bootstrap's"
                )
        if self.mode == "allowlist" and not client_mode and peer_id not in self.allowlist:
            raise ManifestMismatch(
                f"this peer ({peer_id}) is not on the swarm's allow-list; ask the bootstrap operator to add "
                f"`--allow-peer {peer_id}` and keep using the same --identity file"
            )


def committed_manifest(manifest: Mapping[str, Any], secret: bytes | None) -> dict[str, Any]:
    """The manifest as published: a secret-mode one gets the secret's commitment (never the secret)."""
    if Admission.of_manifest(manifest).mode != "secret":
        return dict(manifest)
    if secret is None:
        raise ConfigError(
            "admission 'secret' needs the swarm secret: pass --swarm-secret-file FILE (or set PEER_SWARM_SECRET)"
        )
    return {**manifest, "swarm_secret_commitment": secret_commitment(secret)}
