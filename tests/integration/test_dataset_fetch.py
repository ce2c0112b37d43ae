"""Fetching the run's prepared dataset between real peers on loopback (peer.node.data.fetch).

Servers are real `PeerServer`s with the bootstrap's `ArtifactHandler` serving a prepared folder
(`peer.node.data.serve`) behind a `Gate` with the peer's link (its upload cap); the fetcher uses
real `PeerClient`s whose `Outbound` link carries the download cap. Prepared folders are made with
the real tokenizer and shard writer (tests/prepared.py). Covered: a fetch into an empty folder (and
serving it onwards), resuming a half-written .part, resuming after a call ran out of time, a
corrupted shard refused by its hash, NOT_FOUND from one peer falling back to another, an index that
is not the manifest's, and the upload and download caps holding. Last, the whole path in-process:
a bootstrap's manifest on a real DHT, a head's `ShardData.fetch` (`session.data`), a foreign `--dataset` refused.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from peer.bootstrap.artifacts import ArtifactHandler
from peer.bootstrap.node import BootstrapNode
from peer.config import build_config
from peer.core.data.loader import needed_shards
from peer.core.data.shards import INDEX_FILE, TOKENIZER_FILE, PreparedDataset
from peer.errors import DataError, ManifestMismatch, NetworkError
from peer.net.pool import ClientPool
from peer.net.ratelimit import MBIT, Link, LinkCaps
from peer.net.transport import CHUNK_BYTES, ArtifactRequest, NotFoundError, PeerServer
from peer.net.transport.dialer import Outbound
from peer.net.transport.gate import Gate
from peer.node.data.fetch import DatasetFetch, RunDataset, local_index
from peer.node.data.serve import INDEX_ARTIFACT, DatasetServer
from peer.node.manifest import dataset_index_sha256
from peer.node.session import Session, SessionOptions
from tests.prepared import corpus, make_prepared, synthetic_prepared, tokenizer_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

SHARD_TOKENS = 600_000  # 1.2 MB shards: each streams as two 1 MiB-bounded chunks


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("prepared")
    text = make_prepared(root / "text", corpus(0))
    other = make_prepared(root / "other", corpus(1))
    tok = tokenizer_for(corpus(0), root / "tok.model")
    big = synthetic_prepared(root / "big", 2 * SHARD_TOKENS, tok, shard_tokens=SHARD_TOKENS)
    return {"text": text, "other": other, "big": big}


def run_of(dataset: PreparedDataset) -> RunDataset:
    index = dataset.index
    return RunDataset(index.fingerprint, index.val_fingerprint, dataset_index_sha256(index))


class Server:
    """A real data-plane server holding `dataset` (or none) behind a Gate with an upload cap."""

    def __init__(self, dataset: PreparedDataset | None, upload_mbps: float | None = None) -> None:
        tokenizer = {"tokenizer": dataset.tokenizer_path.read_bytes()} if dataset is not None else {}
        self.handler = ArtifactHandler(tokenizer, {"run_id": "test"}, DatasetServer(dataset))
        self.link = Link(LinkCaps(upload_mbps=upload_mbps))
        self.gate = Gate("server", link=self.link)
        self.server = PeerServer(self.handler, host="127.0.0.1", interceptors=[self.gate])
        self.address = f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        self.server.stop(grace_s=0.5)


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    made: list[Server] = []
    yield made
    for s in made:
        s.close()


@pytest.fixture
def pool() -> Iterator[ClientPool]:
    p = ClientPool(10.0)
    yield p
    p.close()


def serve(servers: list[Server], dataset: PreparedDataset | None, upload_mbps: float | None = None) -> str:
    servers.append(Server(dataset, upload_mbps))
    return servers[-1].address


def fetcher(folder: Path, run: PreparedDataset, sources: list[str], pool: ClientPool, **kw) -> DatasetFetch:
    return DatasetFetch(folder, run_of(run), lambda: sources, pool.get, call_s=10.0, **kw)


def everything(index):
    return [*index.train, *index.val]


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_fetch_into_an_empty_folder_then_serve_it_onwards(made, servers, pool, tmp_path, caplog):
    text = made["text"]
    first = tmp_path / "first"
    with caplog.at_level(logging.INFO, logger="peer.node.data.fetch"):
        got = fetcher(first, text, [serve(servers, text)], pool).ensure(text.tokenizer_path, everything)
    _same_files(first, text.root)  # index.json, tokenizer.model and every shard, byte for byte
    PreparedDataset.open(first).verify()
    assert got.index == text.index and not list(first.glob("*.part"))
    assert sum("dataset shard train-00000.bin" in r.getMessage() and "MB/s" in r.getMessage() for r in caplog.records)
    # a peer that fetched it serves it onwards (a head's PeerService holds it after `session.data.fetch`)
    second = tmp_path / "second"
    onwards = serve(servers, PreparedDataset.open(first))
    fetcher(second, text, [onwards], pool).ensure(first / TOKENIZER_FILE, everything)
    _same_files(second, text.root)


def test_only_the_needed_shards_are_fetched_and_the_index_comes_last(made, servers, pool, tmp_path):
    text = made["text"]
    folder = tmp_path / "head"
    wanted = [text.index.train[1], *text.index.val]
    fetcher(folder, text, [serve(servers, text)], pool).ensure(text.tokenizer_path, lambda index: wanted)
    assert sorted(p.name for p in folder.iterdir()) == sorted([INDEX_FILE, TOKENIZER_FILE, *(s.name for s in wanted)])
    assert PreparedDataset.open(folder).missing(wanted) == []


def test_a_held_shard_of_other_bytes_is_refused_in_one_line(made, tmp_path, pool):
    """A folder whose index is the run's but one of whose shards is other text of the same size (a
    corrupted or foreign --dataset) is refused before anything trains on it; no source is asked."""
    text = made["text"]
    folder = tmp_path / "held"
    shutil.copytree(text.root, folder)
    victim = text.index.train[0]
    raw = bytearray((folder / victim.name).read_bytes())
    raw[3] ^= 0x01  # same size, other bytes
    (folder / victim.name).write_bytes(bytes(raw))
    fetch = fetcher(folder, text, [], pool)
    with pytest.raises(ManifestMismatch) as info:
        fetch.ensure(text.tokenizer_path, everything, "pass the run's dataset with --dataset")
    message = str(info.value)
    assert "\n" not in message and victim.name in message and victim.sha256[:12] in message
    assert message.endswith("pass the run's dataset with --dataset")
    (folder / victim.name).write_bytes(text.path(victim).read_bytes())  # the run's bytes again: accepted
    assert fetch.ensure(text.tokenizer_path, everything).missing() == []


def test_a_half_written_part_is_resumed_not_fetched_again(made, servers, pool, tmp_path, caplog):
    big = made["big"]
    shard = big.index.train[0]
    size = big.nbytes(shard)
    folder = tmp_path / "resumed"
    folder.mkdir()
    (folder / f"{shard.name}.part").write_bytes(big.path(shard).read_bytes()[: size // 2])
    address = serve(servers, big)
    with caplog.at_level(logging.INFO, logger="peer.node.data.fetch"):
        fetcher(folder, big, [address], pool).ensure(big.tokenizer_path, everything)
    _same_files(folder, big.root)
    total = sum(big.nbytes(s) for s in big.index.shards)
    served = servers[0].link.up.total  # every byte the server sent, framing and index included
    assert total - size // 2 < served < total - size // 2 + 64 * 1024, (served, total)
    assert any("resumed at 0.6 MB" in r.getMessage() for r in caplog.records)


def test_a_call_that_runs_out_of_time_is_resumed_on_the_next_pass(made, servers, pool, tmp_path):
    """A server capped at 1 MB/s sends a 1.2 MB shard's first 1 MiB chunk at once and its second
    0.8 s later; with a 0.6 s deadline per call the first call ends early and the next one continues
    from the .part, until the shard is whole and verified."""
    big = made["big"]
    address = serve(servers, big, upload_mbps=8)
    fetch = DatasetFetch(tmp_path / "slow", run_of(big), lambda: [address], pool.get, 0.6, 1e12)
    fetch.ensure(big.tokenizer_path, lambda index: [index.train[0]])
    PreparedDataset.open(tmp_path / "slow").verify([big.index.train[0]])
    calls = pool.get(address).stats()["calls"]["get_artifact"]
    assert calls >= 3, calls  # the index, then at least two calls for one 1.2 MB shard


def test_a_corrupted_shard_is_refused_by_its_hash_and_taken_from_another_peer(made, servers, pool, tmp_path):
    text = made["text"]
    bad = tmp_path / "bad"
    shutil.copytree(text.root, bad)
    victim = text.index.train[1]
    raw = bytearray((bad / victim.name).read_bytes())
    raw[10] ^= 0xFF  # same size, other bytes
    (bad / victim.name).write_bytes(bytes(raw))
    bad_address = serve(servers, PreparedDataset.open(bad))
    folder = tmp_path / "fetched"
    fetcher(folder, text, [bad_address, serve(servers, text)], pool).ensure(text.tokenizer_path, everything)
    _same_files(folder, text.root)
    alone = tmp_path / "alone"
    with pytest.raises(NetworkError) as info:
        fetcher(alone, text, [bad_address], pool).ensure(text.tokenizer_path, everything)
    message = str(info.value)
    assert "\n" not in message and victim.name in message and "do not hash" in message
    assert not (alone / victim.name).exists() and not (alone / f"{victim.name}.part").exists()
    assert not (alone / INDEX_FILE).exists()  # the folder is not a prepared dataset until it holds its shards


def test_not_found_from_one_peer_falls_back_to_the_next(made, servers, pool, tmp_path):
    text = made["text"]
    nothing = serve(servers, None)  # e.g. a stage peer: holds no dataset
    partial_dir = tmp_path / "partial"
    shutil.copytree(text.root, partial_dir)
    (partial_dir / text.index.train[2].name).unlink()  # a head holding only its own shards
    partial = serve(servers, PreparedDataset.open(partial_dir))
    with pytest.raises(NotFoundError):
        pool.get(nothing).get_artifact(ArtifactRequest(INDEX_ARTIFACT))
    with pytest.raises(NotFoundError, match="does not hold shard"):
        pool.get(partial).get_artifact(ArtifactRequest(text.index.train[2].sha256))
    folder = tmp_path / "fetched"
    fetcher(folder, text, [nothing, partial, serve(servers, text)], pool).ensure(text.tokenizer_path, everything)
    _same_files(folder, text.root)
    assert servers[2].handler.dataset.info()["served"]["shards"] == 1  # only the shard the partial peer lacked


def test_an_index_that_is_not_the_manifests_is_refused(made, servers, pool, tmp_path):
    text, other = made["text"], made["other"]
    folder = tmp_path / "fetched"
    fetcher(folder, text, [serve(servers, other), serve(servers, text)], pool).ensure(text.tokenizer_path, everything)
    _same_files(folder, text.root)
    with pytest.raises(NetworkError, match="no peer served the run's dataset index"):
        fetcher(tmp_path / "none", text, [servers[0].address], pool).ensure(text.tokenizer_path, everything)
    with pytest.raises(ManifestMismatch) as info:  # a local folder of another corpus: one line, both fingerprints
        local_index(other.root, run_of(text), "pass the run's prepared dataset with --dataset")
    message = str(info.value)
    assert "\n" not in message and other.index.fingerprint[:12] in message and text.index.fingerprint[:12] in message


@pytest.mark.parametrize("side", ["upload", "download"])
def test_the_link_caps_hold(made, servers, tmp_path, side):
    big = made["big"]
    mbps = 16.0
    address = serve(servers, big, upload_mbps=mbps if side == "upload" else None)
    link = Link(LinkCaps(download_mbps=mbps if side == "download" else None))
    with contextlib.closing(ClientPool(10.0, outbound=Outbound(link=link))) as capped:
        t0 = time.monotonic()
        fetcher(tmp_path / side, big, [address], capped).ensure(big.tokenizer_path, everything)
        elapsed = time.monotonic() - t0
    sent = servers[0].link.up.total
    rate = mbps * MBIT
    # a bucket starts full (its burst) and hands a message out whenever it is out of debt, so the
    # last message (at most a chunk) is never waited for (peer.net.ratelimit); uncapped: ~0.05 s
    burst = 0.25 * rate
    assert elapsed >= (sent - burst - CHUNK_BYTES) / rate, (elapsed, sent)
    assert sent > sum(big.nbytes(s) for s in big.index.shards)


@pytest.mark.timeout(120)
def test_a_head_fetches_the_bootstraps_dataset_and_a_foreign_one_is_refused(made, tmp_path, reap_children):
    """The whole path in-process: a bootstrap publishing a prepared folder, a head's session that
    reads the manifest from the DHT, refuses `--dataset` of another corpus in one line, and else
    fetches into <data-dir>/dataset (`ShardData.fetch`), then serves it onwards."""
    text, other = made["text"], made["other"]
    cfg = build_config(overrides={"data.dataset": str(text.root)}, environ={})  # the manifest outlives the test
    with BootstrapNode(cfg) as boot:
        peers = tuple(boot.info.initial_peers)
        foreign = SessionOptions(initial_peers=peers, data_dir=tmp_path / "foreign", dataset=other.root)
        with pytest.raises(ManifestMismatch) as info:
            Session.connect(foreign, role="head", stage=0)
        message = str(info.value)
        assert "\n" not in message and other.index.fingerprint[:12] in message and "--dataset" in message
        assert text.index.fingerprint[:12] in message
        opts = SessionOptions(initial_peers=peers, data_dir=tmp_path / "head", manifest_timeout_s=30)
        session = Session.connect(opts, role="head", stage=0)
        try:
            cfg = session.data.fetch(session.cfg, shard=0)
            folder = tmp_path / "head" / "dataset"
            assert cfg.data.dataset == str(folder) and cfg.data.tokenizer == folder / TOKENIZER_FILE
            needed = needed_shards(text.index, cfg.train.seq_len, 0, cfg.swarm.n_shards)
            assert len(needed) < len(text.index.shards)  # shard 0 of n reads a part of the train files
            held = sorted(p.name for p in folder.iterdir())
            assert held == sorted(["index.json", TOKENIZER_FILE, *(s.name for s in needed)])
            for name in held:
                assert (folder / name).read_bytes() == (text.root / name).read_bytes(), name
            assert session.datasets.info()["shards_held"] == len(needed)
        finally:
            session.close()


def test_a_folder_that_cannot_be_written_is_one_line(made, pool):
    text = made["text"]
    fetch = fetcher(Path("/proc/peer-no-such-dataset"), text, [], pool)  # not writable even for root
    with pytest.raises(DataError) as info:
        fetch.ensure(text.tokenizer_path, everything)
    assert "\n" not in str(info.value) and "writable --dataset" in str(info.value)
