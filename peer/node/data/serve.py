"""Serving the run's prepared dataset on the data plane: its index and its shards, by sha256.

The bootstrap and every head or full replica that holds the run's prepared dataset answer
`GetArtifact` for:
- `INDEX_ARTIFACT` ("dataset-index"): the index's canonical bytes (`DatasetIndex.to_json`, whose
  sha256 the manifest names);
- a shard's sha256 (64 hex characters): that shard's bytes, content-addressed, so a joiner may take
  any shard from any peer and check it by its hash (`peer.node.data.fetch`).
Both from `ArtifactRequest.offset` on, so an interrupted download resumes where it stopped. A shard
is answered as a `FileSlice`: the transport streams it from disk chunk by chunk, through this
peer's upload bucket at artefact priority like every reply (`peer.net.transport.gate`).

Invariants: only a shard whose file is complete (its size is the index's) is served; one this peer
lacks (a head holds only the shards its data shard reads) is NotFoundError, so the asker tries
another peer; an offset past the end is a TransportError (INVALID_ARGUMENT). The dataset held can
be set once it is on disk (`hold`, after a fetch) and is then read under a lock.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Any

from peer.core.data.shards import PreparedDataset
from peer.net.transport import ArtifactRequest, FileSlice, NotFoundError, TransportError

INDEX_ARTIFACT = "dataset-index"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def is_dataset_artifact(name: str) -> bool:
    """Whether `name` asks for the dataset index or a shard (by sha256)."""
    return name == INDEX_ARTIFACT or bool(_SHA256.match(name))


class DatasetServer:
    """The prepared dataset this peer serves (none until `hold`), answering artefact requests."""

    def __init__(self, dataset: PreparedDataset | None = None) -> None:
        self._lock = threading.Lock()
        self._dataset: PreparedDataset | None = None
        self._index_bytes = b""
        self._held = 0  # complete shards on disk when `hold` was called
        self._served = {"index": 0, "shards": 0}
        if dataset is not None:
            self.hold(dataset)

    def hold(self, dataset: PreparedDataset) -> None:
        """Serve `dataset` (its index and whichever of its shards are complete on disk) from now on."""
        raw, held = dataset.index.to_json(), len(dataset.index.shards) - len(dataset.missing())
        with self._lock:
            self._dataset, self._index_bytes, self._held = dataset, raw, held

    @property
    def dataset(self) -> PreparedDataset | None:
        with self._lock:
            return self._dataset

    def answer(self, request: ArtifactRequest) -> bytes | FileSlice:
        """The index's bytes or a shard's file slice from `request.offset` on; NotFoundError when
        this peer holds no dataset or not that shard."""
        with self._lock:
            dataset, raw = self._dataset, self._index_bytes
        if dataset is None:
            raise NotFoundError(f"this peer holds no prepared dataset (asked for {request.name[:16]})")
        if request.name == INDEX_ARTIFACT:
            self._count("index")
            return raw[_checked(request.offset, len(raw), request.name) :]
        shard = dataset.index.by_sha256(request.name)
        if shard is None:
            raise NotFoundError(f"the run's dataset has no shard with sha256 {request.name[:12]}")
        path, size = dataset.path(shard), dataset.nbytes(shard)
        try:
            complete = os.stat(path).st_size == size
        except OSError:
            complete = False
        if not complete:
            raise NotFoundError(f"this peer does not hold shard {shard.name} ({request.name[:12]}); ask another")
        self._count("shards")
        offset = _checked(request.offset, size, shard.name)
        return FileSlice(path, offset, size - offset)

    def _count(self, what: str) -> None:
        with self._lock:
            self._served[what] += 1

    def info(self) -> dict[str, Any]:
        """For Peer.Info: which dataset this peer serves, how many of its shards, what it served."""
        with self._lock:
            dataset, served, held = self._dataset, dict(self._served), self._held
        if dataset is None:
            return {}
        index = dataset.index
        return {
            "fingerprint": index.fingerprint,
            "val_fingerprint": index.val_fingerprint,
            "shards_held": held,
            "shards": len(index.shards),
            "served": served,
        }


def _checked(offset: int, size: int, what: str) -> int:
    if offset > size:
        raise TransportError(f"offset {offset} is past the end of {what} ({size} bytes)")
    return offset
