"""What a joiner fetches of the run's data: its tokenizer, and its prepared dataset (issue 23).

`fetch_tokenizer` (every role): the manifest's tokenizer, downloaded and checked by sha256, unless
the peer's own copy of the dataset holds it.

The manifest names the run's dataset (`RunDataset`: train and validation fingerprints, sha256 of
the index's canonical bytes). A head or full replica trains from a local prepared folder
(`peer.core.data.shards`) whose fingerprints are those; `DatasetFetch.ensure` makes the folder hold the
shards its data shard reads, fetching what is missing over the data plane (`peer.node.data.serve`):
1. the index: the folder's own when it has one (refused in one line when its fingerprints differ),
   else "dataset-index" from the bootstrap or any live peer, accepted only when its bytes hash to
   the manifest's sha256 and parse (`DatasetIndex.from_json`) to the manifest's fingerprints;
2. the tokenizer: the run's verified tokenizer file, copied in when the folder has none;
3. each needed shard that is absent, by its sha256, from the first source that has it (bootstrap
   first, then the others; one without it answers NOT_FOUND): streamed into `<name>.part` from the
   .part's size on (an interrupted fetch resumes), sha256-checked, fsynced and renamed; a bad hash
   deletes the .part and the next source is asked;
4. index.json, written last (the folder is a prepared dataset only once its needed shards are in).
Shards the folder already holds are hashed against the checked index first: a same-size shard of
other text (a corrupted or foreign `--dataset`) is refused in one line, never trained on.

Every call has a deadline: `call_s` plus the bytes asked for at `min_rate_bytes_s`; a call that
runs out resumes from the .part on the next try, so a link slower than that takes several passes.
A shard takes passes over the sources while each pass makes progress (at most `max_passes`); a pass
that moves no byte ends it with a one-line NetworkError saying what was tried. Bytes come
through this peer's download bucket (the client's `Outbound` link), at artefact priority, so
`--max-download-mbps` caps the fetch as it caps rounds. A progress line per shard (bytes, MB/s).

Invariants: a shard appears under its final name only once its sha256 is the index's; the memory
used is one chunk, whatever the shard's size; nothing a peer sends changes local state before it
is checked against the manifest (STYLE 21).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.config import RunConfig
from peer.core.data.shards import INDEX_FILE, TOKENIZER_FILE, DatasetIndex, PreparedDataset, ShardInfo
from peer.core.files import atomic_write_bytes, file_sha256
from peer.errors import DataError, ManifestMismatch, NetworkError, PeerError, one_line
from peer.net.transport import ArtifactRequest, NotFoundError, PeerClient
from peer.net.transport.dialer import Outbound
from peer.node.data.serve import INDEX_ARTIFACT
from peer.node.manifest import check_dataset

log = logging.getLogger(__name__)

MIN_RATE_BYTES_S = 1e6  # a shard call's deadline allows transfers this slow (slower ones resume)
MAX_PASSES = 1000  # passes over the sources one shard may take while every pass makes progress
# (a link slower than MIN_RATE_BYTES_S needs several; a pass that moves no byte ends the fetch)
MB = 1e6
DATASET_DIR = "dataset"  # <data-dir>/dataset: where a joiner keeps the fetched dataset by default


@dataclass(frozen=True)
class RunDataset:
    """The run's dataset as the manifest names it."""

    fingerprint: str
    val_fingerprint: str
    index_sha256: str

    @classmethod
    def of(cls, manifest: Mapping[str, Any]) -> RunDataset:
        return cls(
            str(manifest["dataset_fingerprint"]),
            str(manifest["dataset_val_fingerprint"]),
            str(manifest["dataset_index_sha256"]),
        )

    def manifest_fields(self) -> dict[str, str]:
        return {"dataset_fingerprint": self.fingerprint, "dataset_val_fingerprint": self.val_fingerprint}


def dataset_folder(given: Path | None, data_dir: Path) -> Path:
    """Where a head or full replica keeps the run's dataset: `--dataset DIR`, else <data-dir>/dataset."""
    folder = Path(given).expanduser() if given is not None else Path(data_dir) / DATASET_DIR
    return folder.absolute()  # torchrun's other ranks read the same folder (they get rank 0's config)


def mismatch_fix(given: Path | None, data_dir: Path) -> str:
    """What to do when the local dataset folder holds another corpus than the run's."""
    if given is not None:
        return (
            "pass the run's prepared dataset with --dataset, or leave --dataset out to fetch it from the swarm "
            f"into {Path(data_dir) / DATASET_DIR}"
        )
    return f"it is left from another run: delete {Path(data_dir) / DATASET_DIR}, or pass another --data-dir"


def held_dataset(given: Path | None, data_dir: Path, manifest: Mapping[str, Any], role: str) -> PreparedDataset | None:
    """A head's or full replica's local copy of the run's dataset, when its folder has an index;
    ManifestMismatch in one line when that index is another corpus's. Stage peers read no data."""
    if role == "stage":
        if given is not None:
            log.info("--dataset %s is not used: a stage peer reads no data", given)
        return None
    folder = dataset_folder(given, data_dir)
    index = local_index(folder, RunDataset.of(manifest), mismatch_fix(given, data_dir))
    return None if index is None else PreparedDataset(folder, index)


def local_index(folder: Path, run: RunDataset, fix: str) -> DatasetIndex | None:
    """The index of `folder` when it has one (None otherwise); ManifestMismatch (one line, `fix`)
    when its fingerprints are not the run's, DataError when it is not a readable index."""
    path = folder / INDEX_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or one_line(exc)}") from None
    index = DatasetIndex.from_json(raw, str(path))
    check_dataset(run.manifest_fields(), index, str(folder), fix)
    return index


def fetch_tokenizer(
    cfg: RunConfig,
    manifest: dict[str, Any],
    data_dir: Path,
    timeout_s: float,
    fallback: Sequence[str] = (),
    outbound: Outbound | None = None,
    local: Path | None = None,
) -> RunConfig:
    """The run's tokenizer: `local` (the held dataset's) when its sha256 is the manifest's, else
    downloaded into <data-dir> from the bootstrap (else a live peer) and checked against the
    manifest; the data config then points at it. Stage peers need nothing else."""
    want = manifest["tokenizer_sha256"]
    if local is not None and local.is_file() and file_sha256(local) == want:
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=local))
    path = data_dir / TOKENIZER_FILE
    if not (path.exists() and file_sha256(path) == want):
        raw = b""
        for i, address in enumerate([manifest["bootstrap_address"], *fallback]):
            try:
                wait_s = timeout_s if i == 0 else min(timeout_s, 10.0)
                with PeerClient(address, timeout_s=wait_s, outbound=outbound) as client:
                    raw = client.get_artifact(ArtifactRequest("tokenizer"))
            except PeerError as exc:
                log.warning("tokenizer not available from %s: %s", address, exc)
                continue
            if hashlib.sha256(raw).hexdigest() == want:
                break
        if hashlib.sha256(raw).hexdigest() != want:
            raise ManifestMismatch(
                "no tokenizer matching the manifest's sha256 from the bootstrap or any live peer; retry later"
            )
        try:
            atomic_write_bytes(path, raw)
        except OSError as exc:
            raise DataError(
                f"could not write the tokenizer to {path}: {exc}; check that {data_dir} is writable"
            ) from None
    if not path.exists():
        raise DataError(f"tokenizer {path} missing after download")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=path))


class DatasetFetch:
    """Makes `folder` hold the run's dataset shards a replica needs (see the module docstring).

    `sources()`: data-plane addresses to ask, best first (the bootstrap, then live peers), read
    again for every shard; `client(address)`: an open PeerClient (the session's pool, with this
    peer's download cap); `call_s`: the deadline of a call before its bytes are counted in.
    """

    def __init__(
        self,
        folder: Path,
        run: RunDataset,
        sources: Callable[[], Sequence[str]],
        client: Callable[[str], PeerClient],
        call_s: float = 30.0,
        min_rate_bytes_s: float = MIN_RATE_BYTES_S,
        max_passes: int = MAX_PASSES,
    ) -> None:
        self.folder, self.run = Path(folder), run
        self.sources, self.client = sources, client
        self.call_s, self.min_rate_bytes_s, self.max_passes = call_s, min_rate_bytes_s, max_passes

    def ensure(
        self, tokenizer: Path, needed: Callable[[DatasetIndex], Sequence[ShardInfo]], fix: str = ""
    ) -> PreparedDataset:
        """The folder as a prepared dataset holding every shard `needed(index)` names; `tokenizer`
        is the run's verified tokenizer file; `fix` ends a mismatch's one line (what to do).
        DataError in one line when the folder cannot be written (read-only, full disk)."""
        try:
            return self._ensure(tokenizer, needed, fix)
        except OSError as exc:
            raise DataError(
                f"cannot write the run's dataset into {self.folder} ({exc.strerror or one_line(exc)}); "
                "free some space, or pass a writable --dataset DIR or --data-dir"
            ) from None

    def _ensure(
        self, tokenizer: Path, needed: Callable[[DatasetIndex], Sequence[ShardInfo]], fix: str
    ) -> PreparedDataset:
        self.folder.mkdir(parents=True, exist_ok=True)
        index = local_index(self.folder, self.run, fix)
        raw = None
        if index is None:
            index, raw = self.fetch_index()
        self._tokenizer(index, tokenizer)
        dataset = PreparedDataset(self.folder, index)
        wanted = list(needed(index))
        todo = dataset.missing(wanted)
        self._check_held(dataset, [s for s in wanted if s not in todo], fix)
        if todo:
            total = sum(dataset.nbytes(s) for s in todo)
            fp, n = index.fingerprint[:12], len(todo)
            log.info("fetching %d shard(s), %.1f MB, of dataset %s into %s", n, total / MB, fp, self.folder)
            t0 = time.monotonic()
            for shard in todo:
                self.fetch_shard(dataset, shard)
            dt = time.monotonic() - t0
            log.info("dataset fetched: %.1f MB in %.1f s (%.1f MB/s)", total / MB, dt, total / MB / max(dt, 1e-9))
        if raw is not None:  # last: the folder is a prepared dataset once its needed shards are in
            atomic_write_bytes(self.folder / INDEX_FILE, raw)
        return dataset

    def _check_held(self, dataset: PreparedDataset, held: Sequence[ShardInfo], fix: str) -> None:
        """Shards already in the folder are this run's byte for byte (sha256 against the checked
        index), else ManifestMismatch in one line: same-size shards of other text never train."""
        t0 = time.monotonic()
        for shard in held:
            got = file_sha256(dataset.path(shard))
            if got != shard.sha256:
                raise ManifestMismatch(
                    f"shard {shard.name} in {self.folder} is not the run's (sha256 {got[:12]}, the run's index "
                    f"says {shard.sha256[:12]}); " + (fix or "delete it to fetch it again")
                )
        if held:
            log.info("%d shard(s) already in %s verified in %.1f s", len(held), self.folder, time.monotonic() - t0)

    # ------------------------------------------------------------------ the index
    def fetch_index(self) -> tuple[DatasetIndex, bytes]:
        """The run's index (and its bytes) from the first source whose copy the manifest vouches for."""
        tried: list[str] = []
        for address in self.sources():
            try:
                raw = self.client(address).get_artifact(ArtifactRequest(INDEX_ARTIFACT), timeout_s=self.call_s)
                if hashlib.sha256(raw).hexdigest() != self.run.index_sha256:
                    raise DataError(f"its dataset index is not the manifest's (sha256 {self.run.index_sha256[:12]})")
                index = DatasetIndex.from_json(raw, f"the dataset index of {address}")
                check_dataset(self.run.manifest_fields(), index, address, "ask another peer")
            except PeerError as exc:
                log.info("dataset index not taken from %s: %s", address, exc)
                tried.append(f"{address}: {one_line(exc, 160)}")
                continue
            return index, raw
        last = f"; last: {tried[-1]}" if tried else ""
        raise NetworkError(
            f"no peer served the run's dataset index ({len(tried)} tried{last}); "
            "retry when the bootstrap or a head of the run is up"
        )

    def _tokenizer(self, index: DatasetIndex, tokenizer: Path) -> None:
        """Put the run's tokenizer into the folder when it has none; refuse one that differs."""
        path = self.folder / TOKENIZER_FILE
        if path.exists():
            if file_sha256(path) != index.tokenizer_sha256:
                raise DataError(
                    f"{path} is not the dataset's tokenizer (sha256 {index.tokenizer_sha256[:12]}); delete it and retry"
                )
            return
        raw = Path(tokenizer).read_bytes()
        if hashlib.sha256(raw).hexdigest() != index.tokenizer_sha256:
            raise ManifestMismatch(f"the run's tokenizer {tokenizer} is not the one its dataset was made with")
        atomic_write_bytes(path, raw)

    # ------------------------------------------------------------------ shards
    def fetch_shard(self, dataset: PreparedDataset, shard: ShardInfo) -> None:
        """Fetch one shard into the folder (resuming its .part), verified, from any source that has it."""
        size, part = dataset.nbytes(shard), self.folder / f"{shard.name}.part"
        t0, start = time.monotonic(), _size(part)
        last = "no peer to ask"
        for _ in range(self.max_passes):
            progressed = False
            for address in self.sources():
                before = _size(part)
                failure = self._attempt(address, shard, part, size)
                if failure is None:
                    self._install(part, dataset.path(shard))
                    dt, got = time.monotonic() - t0, size - start
                    resumed = f", resumed at {start / MB:.1f} MB" if start else ""
                    rate = got / MB / max(dt, 1e-9)
                    log.info(
                        "dataset shard %s: %.1f MB from %s in %.1f s (%.1f MB/s%s)",
                        *(shard.name, got / MB, address, dt, rate, resumed),
                    )
                    return
                last = f"{address}: {failure}"
                progressed |= _size(part) > before
            if not progressed:
                break
        kept = f"; the {_size(part)} bytes fetched are kept in {part}" if _size(part) else ""
        raise NetworkError(
            f"no peer served shard {shard.name} (sha256 {shard.sha256[:12]}) of the run's dataset (last: {last}); "
            f"retry `peer join` later{kept}"
        )

    def _attempt(self, address: str, shard: ShardInfo, part: Path, size: int) -> str | None:
        """Fetch the rest of the shard from `address` and check it: None once the .part is the
        shard, else why not (a .part whose hash is wrong is deleted)."""
        try:
            self._download(address, shard, part, size)
        except PeerError as exc:  # NOT_FOUND, unreachable, a deadline, a malformed stream
            level = logging.DEBUG if isinstance(exc, NotFoundError) else logging.WARNING
            log.log(level, "shard %s not fetched from %s: %s", shard.name, address, exc)
            return one_line(exc, 160)
        if file_sha256(part) != shard.sha256:
            part.unlink(missing_ok=True)
            log.warning("shard %s from %s does not hash to its sha256; deleted, asking another", shard.name, address)
            return "sent bytes that do not hash to the shard's sha256"
        return None

    def _download(self, address: str, shard: ShardInfo, part: Path, size: int) -> None:
        """Append the shard's bytes from the .part's size on (a .part longer than the shard is restarted)."""
        offset = _size(part)
        if offset > size:
            part.unlink()
            offset = 0
        if offset == size:
            return
        timeout = self.call_s + (size - offset) / self.min_rate_bytes_s
        with open(part, "ab") as sink:
            try:
                self.client(address).get_artifact_into(
                    ArtifactRequest(shard.sha256, offset), sink, size - offset, timeout_s=timeout
                )
            finally:
                sink.flush()
                os.fsync(sink.fileno())

    @staticmethod
    def _install(part: Path, final: Path) -> None:
        os.replace(part, final)
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
