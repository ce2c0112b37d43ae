"""What a swarm is doing right now, read from the DHT alone (`peer status`).

Reads the run's manifest (run id, preset, number of stages), then the per-peer records that
peers publish (DESIGN §3): `stage.{s}` (one subkey per stage peer) and `replica` (one subkey per
full replica or pipeline head). Returns one plain dict, the documented shape of `peer status --json`:

    {"run_id": str, "preset": str, "outer_step": int, "admission": "open" | "secret" | "allowlist",
     "stages": {"0": [{"peer_id", "state", "outer_step", "tokens_per_s", "role", "address", "in_flight",
                       "mode", *LINK}, ...], ...},
     "full_replicas": [{"peer_id", "outer_step", "loss", "tokens_per_s", "ranks", "global_batch", *LINK}, ...]}
    LINK = "connectivity", "relay", "max_upload_mbps", "max_download_mbps", "auth_failures"

Invariants: every stage 0..S-1 has a key (an empty list when no peer holds it); lists are sorted
by peer id; "outer_step" is the largest outer step in any live record (0 when there is none), the
same rule as `SwarmDHT.current_outer_step`. Every wait has a deadline: the manifest is polled until
`timeout_s` and then a one-line `NetworkError` says to check the bootstrap and --initial-peers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from peer.errors import ManifestMismatch
from peer.net.dht import SwarmDHT
from peer.net.records import NetFields, ReplicaRecord, StageRecord
from peer.node.manifest import wait_for_manifest

logger = logging.getLogger(__name__)

# in_flight: a head's K; mode: a head's boundary mode this outer step, "compressed" or "uncompressed"
STAGE_FIELDS = ("state", "outer_step", "tokens_per_s", "role", "address", "in_flight", "mode")
REPLICA_FIELDS = ("outer_step", "loss", "tokens_per_s", "ranks", "global_batch")  # ranks: torchrun processes
# docs/connectivity.md: how others reach the peer (direct, reverse, relayed), its caps, refused calls
LINK_FIELDS = ("connectivity", "relay", "max_upload_mbps", "max_download_mbps", "auth_failures")


def _mapping(value: Any) -> Mapping[str, Any]:
    """`value` when it is a mapping (a manifest section), else an empty one."""
    return value if isinstance(value, Mapping) else {}


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _link(net: NetFields) -> dict[str, Any]:
    """The LINK_FIELDS of a record (None where it does not say)."""
    return {
        "connectivity": net.connectivity,
        "relay": net.relay,
        "max_upload_mbps": net.max_upload_mbps,
        "max_download_mbps": net.max_download_mbps,
        "auth_failures": net.auth_failures,
    }


def stage_entry(peer_id: str, record: StageRecord, replica: ReplicaRecord | None = None) -> dict[str, Any]:
    """One stage peer's row of `peer status --json` (STAGE_FIELDS, then LINK_FIELDS); a head's mode
    comes from its `replica` record."""
    r = record
    out = {"peer_id": peer_id, "state": r.state or None, "outer_step": r.outer_step, "tokens_per_s": r.tokens_per_s}
    out.update(role=r.role or None, address=r.address or None, in_flight=r.in_flight)
    out["mode"] = replica.mode if replica is not None and r.role == "head" else None
    return out | _link(r.net)


def replica_entry(peer_id: str, record: ReplicaRecord) -> dict[str, Any]:
    """One full replica's row of `peer status --json` (REPLICA_FIELDS, then LINK_FIELDS)."""
    r = record
    out = {"peer_id": peer_id, "outer_step": r.outer_step, "loss": r.loss, "tokens_per_s": r.tokens_per_s}
    return out | {"ranks": r.ranks, "global_batch": r.global_batch} | _link(r.net)


def collect_status(
    dht: SwarmDHT,
    n_stages: int | None = None,
    *,
    manifest: Mapping[str, Any] | None = None,
    timeout_s: float = 20.0,
    where: str = "the DHT",
) -> dict[str, Any]:
    """The swarm's status as a plain dict (shape in the module docstring).

    `n_stages` defaults to the manifest's `config.stages`; `manifest` skips the lookup when the
    caller already holds it. Sets `dht`'s run namespace to the manifest's run id.
    """
    if manifest is None:
        manifest = wait_for_manifest(dht, timeout_s, where)
    config = _mapping(manifest.get("config"))
    run_id = manifest.get("run_id")
    if not isinstance(run_id, str):
        raise ManifestMismatch("the manifest has no run_id; the bootstrap is broken or too old")
    if n_stages is None:
        n_stages = _int_or_none(config.get("stages"))
        if n_stages is None:
            raise ManifestMismatch("the manifest has no config.stages; the bootstrap is broken or too old")
    dht.set_run(run_id, n_stages)

    stages: dict[str, list[dict[str, Any]]] = {}
    best = 0
    replicas = dht.get_replicas()
    for s in range(n_stages):
        records = dht.get_stage_peers(s)
        stages[str(s)] = [stage_entry(pid, records[pid], replicas.get(pid)) for pid in sorted(records)]
        best = max([best, *(r.outer_step or 0 for r in records.values())])
    best = max([best, *(r.outer_step or 0 for r in replicas.values())])
    full = [replica_entry(pid, replicas[pid]) for pid in sorted(replicas) if replicas[pid].kind == "full"]
    model = _mapping(config.get("model"))
    preset = config.get("preset", model.get("preset"))
    admission = _mapping(config.get("swarm")).get("admission", "open")
    out = {"run_id": run_id, "preset": preset, "outer_step": best, "admission": admission}
    return out | {"stages": stages, "full_replicas": full}
