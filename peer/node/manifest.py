"""The run's manifest: what the bootstrap publishes and every joining peer checks.

A manifest is a JSON object with the full `RunConfig` and the hashes of the artefacts every peer
must agree on: the config fingerprint, the subspace basis U (rebuilt locally from the seed and
compared), the fingerprint of the portable arithmetic (the initial state and commits are computed
alike: `peer.core.portable.arithmetic_fingerprint`), the tokenizer file and the protocol version.
`verify_manifest` rebuilds everything from the manifest on this machine and raises
`ManifestMismatch` naming the first disagreement, so a peer with a different build refuses to join
instead of training on different math.
`wait_for_manifest` is the one bounded wait for the bootstrap's manifest (`peer join`, `peer status`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from peer import __version__
from peer.config import RunConfig, config_from_dict
from peer.core.portable import arithmetic_fingerprint
from peer.core.subspace import basis_hash, make_basis
from peer.errors import ManifestMismatch, NetworkError, PeerError
from peer.net.dht import SwarmDHT

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 5  # 5: portable initial state and commit, state claims (state_id, link), checked adoption
# 4: streamed pipeline (route/window/attempt), data-plane proofs, Tunnel service, screening
# 3: payload format v3 (entropy-coded indices, sign-magnitude values), global-norm clipping fields
POLL_S = 0.5  # pause between two manifest lookups while waiting for it


def wait_for_manifest(
    dht: SwarmDHT, timeout_s: float = 20.0, where: str = "the DHT", stop: threading.Event | None = None
) -> dict[str, Any]:
    """Poll the DHT for the run's manifest until `timeout_s` (or `stop`); NetworkError naming `where`.

    A failed lookup is retried until the deadline and reported if it was the last word; a
    `ManifestMismatch` (this node is not admitted) ends the wait at once.
    """
    stop = stop or threading.Event()
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            manifest = dht.get_manifest(timeout_s=min(remaining, dht.request_timeout_s))
        except ManifestMismatch:
            raise
        except NetworkError as exc:  # retried until the deadline; reported if it is the last word
            last_error, manifest = exc, None
            log.debug("manifest lookup failed: %s", exc)
        if manifest is not None:
            return manifest
        if stop.wait(max(0.0, min(POLL_S, deadline - time.monotonic()))):
            raise PeerError("stopped before the manifest arrived")
    cause = f" (last error: {last_error})" if last_error is not None else ""
    raise NetworkError(
        f"no manifest at {where} within {timeout_s:.0f} s: is the bootstrap running? check --initial-peers{cause}"
    )


def run_id_for(cfg: RunConfig) -> str:
    """A DHT-safe run id: the run name plus the config fingerprint."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in cfg.run_name)[:40] or "run"
    return f"{name}-{cfg.fingerprint()[:8]}"


def basis_hash_for(cfg: RunConfig) -> str:
    return basis_hash(make_basis(cfg.model.d_model, cfg.k, cfg.seed))


def build_manifest(cfg: RunConfig, tokenizer_sha256: str, bootstrap_address: str) -> dict[str, Any]:
    """The manifest for `cfg`; `bootstrap_address` is the gRPC host:port serving the artefacts."""
    config = cfg.to_dict()
    config["data"].pop("cache_dir", None)  # a local path, not part of the run
    config["data"]["tokenizer"] = None  # joiners download the bootstrap's tokenizer
    return {
        "protocol": PROTOCOL_VERSION,
        "peer_version": __version__,
        "run_id": run_id_for(cfg),
        "config": config,
        "fingerprint": cfg.fingerprint(),
        "u_hash": basis_hash_for(cfg),
        "arithmetic": arithmetic_fingerprint(),
        "k": cfg.k,
        "tokenizer_sha256": tokenizer_sha256,
        "bootstrap_address": bootstrap_address,
        "created": time.time(),
    }


def verify_manifest(manifest: dict[str, Any]) -> RunConfig:
    """Rebuild the run's config here and check it against the manifest's hashes."""
    protocol = manifest.get("protocol")
    if protocol != PROTOCOL_VERSION:
        raise ManifestMismatch(
            f"the swarm speaks protocol {protocol}, this peer speaks {PROTOCOL_VERSION}; "
            f"install the peer version the swarm runs ({manifest.get('peer_version', 'unknown')})"
        )
    swarm_version = manifest.get("peer_version") or "unknown"
    for key in ("config", "fingerprint", "u_hash", "tokenizer_sha256", "bootstrap_address", "run_id"):
        if key not in manifest:
            raise ManifestMismatch(
                f"the manifest has no '{key}' (the bootstrap runs peer {swarm_version}, broken or too old); "
                f"restart the bootstrap with this peer version ({__version__})"
            )
    try:
        cfg = config_from_dict(manifest["config"])
    except PeerError as exc:
        raise ManifestMismatch(f"this peer cannot read the run's config ({exc}); upgrade peer") from None
    if cfg.fingerprint() != manifest["fingerprint"]:
        raise ManifestMismatch(
            f"config fingerprint {cfg.fingerprint()} != manifest {manifest['fingerprint']}: this build "
            f"(peer {__version__}) resolves the run's config differently from the swarm's (peer {swarm_version}); "
            + (
                "restart the bootstrap: its manifest does not match its own config"
                if swarm_version == __version__
                else f"install peer {swarm_version} like the swarm"
                if swarm_version != "unknown"
                else "install the peer version the swarm runs"
            )
        )
    local = arithmetic_fingerprint()
    if manifest.get("arithmetic", local) != local:
        raise ManifestMismatch(
            f"this build's portable arithmetic ({local}) differs from the bootstrap's ({manifest['arithmetic']}): "
            "it would compute other initial states and commits and fork the model; "
            f"install the peer version the swarm runs ({swarm_version})"
        )
    local_u = basis_hash_for(cfg)
    if local_u != manifest["u_hash"]:
        raise ManifestMismatch(
            f"subspace basis hash {local_u} != manifest {manifest['u_hash']}: this build computes a different "
            f"U from the seed; install the peer version the swarm runs ({swarm_version})"
        )
    return cfg
