"""The run's manifest: what the bootstrap publishes and every joining peer checks.

A manifest is a JSON object with the full `RunConfig` and the hashes of the artefacts every peer
must agree on: the config fingerprint, the subspace basis U (rebuilt locally from the seed and
compared), the fingerprint of the portable arithmetic (the initial state and commits are computed
alike: `peer.core.sparseloco.portable.arithmetic_fingerprint`), the tokenizer file and the protocol version.
`verify_manifest` rebuilds everything from the manifest on this machine and raises
`ManifestMismatch` naming the first disagreement, so a peer with a different build refuses to join
instead of training on different math.
One corpus per run: the manifest names the bootstrap's prepared dataset (`peer.core.data.shards`) by
its train and validation fingerprints and the sha256 of its index's canonical bytes;
`check_dataset` refuses, in one line, a local dataset whose fingerprints differ, and a fetched index
is accepted only with that sha256 (`peer.node.data.fetch`).
`wait_for_manifest` is the one bounded wait for the bootstrap's manifest (`peer join`, `peer status`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

from peer import __version__
from peer.config import RunConfig, config_from_dict
from peer.core.data.shards import DatasetIndex
from peer.core.sparseloco.portable import arithmetic_fingerprint
from peer.core.subspace.compression import basis_hash, make_basis
from peer.errors import ManifestMismatch, NetworkError, PeerError
from peer.net.dht import SwarmDHT

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 14  # 14: voted means at swarm.mean_bits; owner grace; quiet roster close (issue 37)
# 13: outlier screening by sections (the embedding apart): later stages read stage 0 as views
# 12: the voted round (supports and values records), the default from 14 contributions
# 10: a payload's id is a hash over its sections; GetPayload kind EMBED (embedding views)
# 9: claims checked before adopted (issue 34: FOLLOW's omission rule, forged entries, T⊥ set)
# 8: the round's rule is the manifest's (sparseloco.screening; dense_1d false commits 1-D top-k)
# 7: ranges rounds (PayloadRequest kind/ranges, announcement root/ranges, roster, shards)
# 5: portable initial state and commit, state claims (state_id, link), checked adoption
# 4: streamed pipeline (route/window/attempt), data-plane proofs, Tunnel service, screening
# 3: payload format v3 (entropy-coded indices, sign-magnitude values), global-norm clipping fields
POLL_S = 0.5  # pause between two manifest lookups while waiting for it
DATASET_KEYS = ("dataset_fingerprint", "dataset_val_fingerprint", "dataset_index_sha256")


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


def dataset_index_sha256(index: DatasetIndex) -> str:
    """sha256 (hex) of the index's canonical bytes: what a fetched index must hash to."""
    return hashlib.sha256(index.to_json()).hexdigest()


def build_manifest(
    cfg: RunConfig, tokenizer_sha256: str, bootstrap_address: str, dataset: DatasetIndex
) -> dict[str, Any]:
    """The manifest for `cfg` training on `dataset`; `bootstrap_address` is the gRPC host:port
    serving the artefacts (tokenizer, manifest, the dataset's index and shards)."""
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
        "dataset_fingerprint": dataset.fingerprint,
        "dataset_val_fingerprint": dataset.val_fingerprint,
        "dataset_index_sha256": dataset_index_sha256(dataset),
        "dataset_tokens": {"train": dataset.tokens("train"), "val": dataset.tokens("val")},  # for people
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
    for key in ("config", "fingerprint", "u_hash", "tokenizer_sha256", "bootstrap_address", "run_id", *DATASET_KEYS):
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


def check_dataset(manifest: dict[str, Any], index: DatasetIndex, where: str, fix: str) -> None:
    """ManifestMismatch (one line, naming both sides' fingerprints and `fix`) unless `index`, read
    from `where`, holds the run's dataset: its train and validation fingerprints are the manifest's."""
    want, want_val = str(manifest["dataset_fingerprint"]), str(manifest["dataset_val_fingerprint"])
    if index.fingerprint == want and index.val_fingerprint == want_val:
        return
    raise ManifestMismatch(
        f"{where} holds dataset {index.fingerprint[:12]} (validation {index.val_fingerprint[:12]}) but this run "
        f"trains on {want[:12]} (validation {want_val[:12]}); {fix}"
    )
