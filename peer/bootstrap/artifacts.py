"""The bootstrap's data plane: serves the run's artefacts over `peer.net.transport` (DESIGN §3).

A joining peer reads the manifest from the DHT, then downloads the artefacts it names from the
bootstrap's gRPC address: the sentencepiece tokenizer (checked against the manifest's
`tokenizer_sha256`), the manifest itself as canonical JSON bytes (the same text the DHT holds), and
the run's prepared dataset: its index ("dataset-index") and each shard by sha256, streamed from
disk (`peer.node.data.serve`). Every artefact is answered from `ArtifactRequest.offset` on.

Invariants: an artefact is added once and never changed (the manifest names the gRPC address, so
it is added right after the server is listening; until then asking for it answers NOT_FOUND);
handler calls may run concurrently, so the artefact table and counters sit behind one lock. The
bootstrap holds no stage, so every training RPC (forward, backward, step) is answered NOT_FOUND with
a message that says where to go; `get_state` and `get_payload` answer the states its attester
reached and the payloads it fetched in the history window (`peer.bootstrap.attester`), NOT_FOUND else.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from peer.net.transport import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    FileSlice,
    ForwardReply,
    ForwardRequest,
    NotFoundError,
    PayloadRequest,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
    TransportError,
)
from peer.node.data.serve import INDEX_ARTIFACT, DatasetServer, is_dataset_artifact

if TYPE_CHECKING:
    from peer.bootstrap.attester import Attester

logger = logging.getLogger(__name__)

# Names a client may ask for, and the canonical artefact each one means.
ARTIFACT_ALIASES = {
    "tokenizer": "tokenizer",
    "tokenizer.model": "tokenizer",
    "manifest": "manifest",
    "manifest.json": "manifest",
}


def manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    """Canonical JSON of the manifest (sorted keys, no spaces): the exact text published in the DHT."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


class ArtifactHandler:
    """`PeerHandler` of the bootstrap: artefacts and `info`, nothing else.

    `artifacts` maps canonical names ("tokenizer", "manifest") to bytes; `identity` is merged into
    `info()` (run id, peer id, addresses). `stats` counts served artefacts and manifest refreshes.
    """

    def __init__(
        self, artifacts: Mapping[str, bytes], identity: Mapping[str, Any], dataset: DatasetServer | None = None
    ):
        self.dataset = dataset or DatasetServer()
        self.attester: Attester | None = None  # set once it runs: attested states for `get_state`
        self._artifacts: dict[str, bytes] = {}
        self._identity = dict(identity)
        self._started = time.monotonic()
        self._lock = threading.Lock()
        self._stats: dict[str, int] = {"artifacts_served": 0, "manifest_refreshes": 0, "manifest_refresh_failures": 0}
        for name, data in artifacts.items():
            self.add_artifact(name, data)

    def add_artifact(self, name: str, data: bytes) -> None:
        """Serve `data` under the canonical `name` from now on; an artefact never changes once added."""
        if name not in ARTIFACT_ALIASES.values():
            raise ValueError(f"unknown artefact name {name!r}")
        with self._lock:
            if name in self._artifacts:
                raise ValueError(f"artefact {name!r} is already served")
            self._artifacts[name] = bytes(data)

    # --- counters (the refresh loop reports here so `info` shows them) ---------------------------

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] = self._stats.get(name, 0) + n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    # --- the handler protocol --------------------------------------------------------------------

    def get_artifact(self, request: ArtifactRequest) -> bytes | FileSlice:
        if is_dataset_artifact(request.name):
            return self.dataset.answer(request)
        name = ARTIFACT_ALIASES.get(request.name)
        with self._lock:
            data = self._artifacts.get(name) if name is not None else None
            if data is not None:
                self._stats["artifacts_served"] += 1
        if data is None:
            if name is not None:
                raise NotFoundError(f"the bootstrap is still starting and has no {name} yet; retry in a second")
            known = ", ".join([*sorted(set(ARTIFACT_ALIASES)), INDEX_ARTIFACT, "a dataset shard's sha256"])
            raise NotFoundError(f"the bootstrap has no artefact {request.name!r}; ask for one of: {known}")
        if request.offset > len(data):
            raise TransportError(f"offset {request.offset} is past the end of {name} ({len(data)} bytes)")
        logger.debug("serving artefact %s (%d bytes from %d)", name, len(data), request.offset)
        return data[request.offset :]

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "bootstrap", **self._identity}
        with self._lock:
            out["artifacts"] = {name: len(data) for name, data in sorted(self._artifacts.items())}
        out["dataset"] = self.dataset.info()
        out["uptime_s"] = round(time.monotonic() - self._started, 3)
        out.update(self.stats())
        if self.attester is not None:
            out["attested"] = self.attester.info()
        return out

    def _not_served(self, method: str) -> NotFoundError:
        run = self._identity.get("run_id", "this run")
        return NotFoundError(
            f"{method}: this is the bootstrap of {run}; it holds no stage. "
            "Find stage peers with `peer status --initial-peers ...`"
        )

    def forward(self, request: ForwardRequest) -> ForwardReply:
        raise self._not_served("forward")

    def backward(self, request: BackwardRequest) -> BackwardReply:
        raise self._not_served("backward")

    def step(self, request: StepRequest) -> StepReply:
        raise self._not_served("step")

    def get_payload(self, request: PayloadRequest) -> bytes:
        """A payload its attester fetched in the history window (sender named), for joiners replaying."""
        sender = request.sender or None
        data = None if self.attester is None or sender is None else self.attester.payload(request)
        if data is None:
            raise self._not_served("get_payload")
        self.count("payloads_served")
        return data

    def get_state(self, request: StateRequest) -> StateReply:
        """The state the bootstrap's attester reached for the stage (`peer.bootstrap.attester`)."""
        reply = None if self.attester is None else self.attester.state_reply(request.stage)
        if reply is None:
            raise self._not_served("get_state")
        self.count("states_served")
        return reply
