"""The parts of a full replica over torchrun's ranks that need no process group: the flags it
refuses, the batches its ranks draw, and the record that announces its ranks."""

from __future__ import annotations

import threading

import pytest

from peer.errors import ConfigError
from peer.net.records import ReplicaRecord
from peer.node.replica.data_parallel import rank_batch_index
from peer.node.replica.group import launched_ranks
from peer.node.replica.ranks import run_join
from peer.node.session import SessionOptions


def test_a_stage_under_torchrun_with_several_processes_is_a_one_line_config_error(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--full-replica"):
        run_join(SessionOptions(initial_peers=("x",), data_dir=tmp_path), 1, threading.Event())


def test_sharded_without_torchrun_or_on_a_stage_is_a_one_line_config_error(monkeypatch, tmp_path):
    opts = SessionOptions(initial_peers=("x",), data_dir=tmp_path, sharded=True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match="--sharded"):
        run_join(opts, None, threading.Event())
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="--sharded"):
        run_join(opts, 1, threading.Event())


def test_launched_ranks_reads_torchruns_world_size():
    assert launched_ranks({}) == 1
    assert launched_ranks({"WORLD_SIZE": "4"}) == 4
    assert launched_ranks({"WORLD_SIZE": "junk"}) == 1


def test_the_ranks_read_the_shard_in_order_without_overlap():
    H, N = 3, 2
    seen = [rank_batch_index(t, h, H, N, r) for t in range(2) for h in range(H) for r in range(N)]
    assert seen == list(range(2 * H * N))
    assert [rank_batch_index(t, h, H, 1, 0) for t in range(2) for h in range(H)] == list(range(2 * H))  # one rank


def test_a_replica_record_announces_its_ranks_and_old_records_still_parse():
    rec = ReplicaRecord(address="a:1", kind="full", outer_step=3, shard=0, ranks=2, global_batch=16)
    raw = rec.to_record()
    assert (raw["ranks"], raw["global_batch"]) == (2, 16)
    parsed = ReplicaRecord.parse(raw)
    assert parsed is not None and (parsed.ranks, parsed.global_batch) == (2, 16)
    old = {k: v for k, v in raw.items() if k not in ("ranks", "global_batch")}
    assert "ranks" not in ReplicaRecord(address="a:1", kind="full").to_record()
    parsed_old = ReplicaRecord.parse(old)
    assert parsed_old is not None and parsed_old.ranks is None
    assert ReplicaRecord.parse({**raw, "ranks": "two"}) is None
