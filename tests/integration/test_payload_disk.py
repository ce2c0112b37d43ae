"""A peer restarted with --resume serves its window's payloads again (`peer.node.round.payload_disk`).

Real payloads of the tiny preset, a real PeerServer(PeerService) on 127.0.0.1 and a real gRPC client:
what one process kept (its own payload, one it fetched from another sender) is served, byte for byte,
by the next process of the same peer reading the same folder; a fresh start serves nothing of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from peer.config import build_config
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.format import Payload
from peer.net.pool import ClientPool
from peer.net.transport import PayloadRequest
from peer.net.transport.errors import NotFoundError
from peer.net.transport.server import PeerServer
from peer.node.round.contribution import whole
from peer.node.round.payload_disk import PayloadDisk
from peer.node.round.payloads import PayloadStore
from peer.node.service import PeerService

pytestmark = pytest.mark.timeout(60)

CFG = build_config(environ={})
HISTORY = 4


def _payload(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    delta = {"layers.2.attn.wq.weight": torch.randn(64, 64, generator=gen) * 1e-2}
    return compress(delta, None, CFG.sparseloco)[0].to_bytes()


@contextlib.contextmanager
def _serving(store: PayloadStore) -> Iterator[ClientPool]:
    server = PeerServer(PeerService(CFG, {}, store, "me", "full"), host="127.0.0.1", port=0)
    clients = ClientPool(timeout_s=5.0)
    try:
        yield clients.get(server.address)  # type: ignore[misc]
    finally:
        clients.close()
        server.stop(grace_s=0.5)


def _kept(folder, resume: bool) -> PayloadStore:
    store = PayloadStore(history=HISTORY, disk=PayloadDisk(folder, resume=resume))
    store.restore()
    return store


def test_a_resumed_peer_serves_its_own_and_fetched_payloads_again(tmp_path):
    folder = tmp_path / "payloads"
    first = _kept(folder, resume=False)
    ours, theirs = _payload(1), _payload(2)
    first.put(7, 1, whole("me", ours, Payload.from_bytes(ours)))
    first.put_fetched(7, 1, "alice", whole("alice-replica", theirs, Payload.from_bytes(theirs)))
    del first  # the process is gone; its files are not
    with _serving(_kept(folder, resume=True)) as client:
        assert client.get_payload(PayloadRequest(7, 1, "")) == ours
        assert client.get_payload(PayloadRequest(7, 1, "alice")) == theirs
    resumed = _kept(folder, resume=True)
    assert resumed.fetched(7, 1, "alice").replica == "alice-replica"  # a second source names its replica
    with _serving(_kept(folder, resume=False)) as client, pytest.raises(NotFoundError):
        client.get_payload(PayloadRequest(7, 1, ""))  # a fresh start: nothing of the earlier run
    assert list(folder.iterdir()) == []


def test_rounds_leaving_the_window_leave_the_disk_and_a_torn_file_is_never_served(tmp_path):
    folder = tmp_path / "payloads"
    store = _kept(folder, resume=False)
    for t in range(10):
        data = _payload(t)
        store.put(t, 0, whole("me", data, Payload.from_bytes(data)))
    assert sorted(int(p.name.split(".")[0]) for p in folder.iterdir()) == list(range(10 - HISTORY, 10))
    newest = folder / "9.0.own.me"
    newest.write_bytes(newest.read_bytes()[:40])  # torn by hand (a write is renamed whole: a kill cannot)
    (folder / ".9.0.own.me.tmp").write_bytes(b"half")  # a write a kill interrupted
    resumed = _kept(folder, resume=True)
    assert resumed.get(9, 0) is None and resumed.get(8, 0) == _payload(8)
    assert sorted(p.name for p in folder.iterdir()) == [f"{t}.0.own.me" for t in range(10 - HISTORY, 9)]
