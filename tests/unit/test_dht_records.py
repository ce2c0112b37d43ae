"""DHT records are parsed once into typed records (`peer.net.records`), row by row.

- What an owner publishes is `to_record()`: exactly the dict the protocol names (keys, order, values),
  and `parse` gives the same record back from it once signed.
- A record with a field of the wrong type parses to None and the reader drops it as "malformed"
  (never a crash, never a half-read record); a missing field takes the default its readers assume.
- The node's writer (`peer.node.records.Records`) publishes every field of docs/protocol.md.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from peer.config import build_config
from peer.net.identity import owner_peer_id
from peer.net.records import Announcement, NetFields, RecordReader, ReplicaRecord, StageRecord
from peer.net.round_points import MAX_ROUNDS
from peer.node.presence import Presence
from peer.node.records import Records
from peer.node.round.refusals import Refusals
from peer.node.stage.worker import StageWorker

NET = {
    "connectivity": "reverse",
    "via": ["1.2.3.4:5"],
    "relay": False,
    "auth_failures": 2,
    "max_upload_mbps": 20.0,
    "max_download_mbps": None,
}
STAGE = {
    "address": "10.0.0.1:4000",
    "role": "trainer",
    "state": "ready",
    "outer_step": 7,
    "param_hash": "ab" * 8,
    "perp_hash": "cd" * 8,
    "inc": "0123456789ab",
    "pipeline": None,
    "committed": ["A" * 16, "B" * 16],
    "bans": {"X" * 16: [3, 6, 16]},
    "state_id": "ef" * 8,
    "link": {"t": 6, "prev": "p" * 16, "set": [["A" * 16, "a" * 32]], "state": "ef" * 8},
    "refused": ["Y" * 16],
    "tokens_per_s": 812.5,
    "in_flight": 4,
    **NET,
}
REPLICA = {
    "address": "10.0.0.2:4000",
    "kind": "pipeline",
    "outer_step": 7,
    "shard": 1,
    "loss": 3.25,
    "tokens_per_s": 900.0,
    "joined_at": 2,
    "inc": "ba9876543210",
    "done": False,
    **NET,
    "pipeline_peers": {"1": "peer-p", "2": "peer-q"},
    "rounds": [[5, 3.5, None, 1.25], [6, 3.25, 3.375, 1.5]],
}
ANNOUNCEMENT = {
    "sha256": "f" * 64,
    "size": 1234,
    "address": "10.0.0.2:4000",
    "replica": "head-a",
    "inc": "ba9876543210",
    "closes": 1700000000.125,
    "peers": {"1": "peer-p"},
}
SIGNED = {"time": 1699999999.5, "peer_id": "signer"}
TYPES = [(StageRecord, STAGE), (ReplicaRecord, REPLICA), (Announcement, ANNOUNCEMENT)]


@pytest.mark.parametrize(("kind", "raw"), TYPES, ids=["stage", "replica", "announcement"])
def test_a_published_record_is_the_exact_dict_and_parses_back(kind: Any, raw: dict) -> None:
    rec = kind.parse({**raw, **SIGNED})
    assert rec is not None and (rec.peer_id, rec.time) == ("signer", SIGNED["time"])
    assert rec.to_record() == raw
    assert list(rec.to_record()) == list(raw)  # the same keys in the same order
    assert kind.parse(rec.to_record()) == kind.parse(raw)


def test_optional_parts_are_left_out_as_the_owner_leaves_them_out() -> None:
    no_via = {k: v for k, v in STAGE.items() if k != "via"}  # before the reachability check ran
    rec = StageRecord.parse(no_via)
    assert rec is not None and rec.net.via is None and rec.to_record() == no_via
    full = {k: v for k, v in REPLICA.items() if k != "pipeline_peers"}  # a full replica binds nobody
    rec2 = ReplicaRecord.parse(full)
    assert rec2 is not None and rec2.pipeline_peers is None and rec2.to_record() == full
    own = {k: v for k, v in ANNOUNCEMENT.items() if k != "peers"}
    rec3 = Announcement.parse(own)
    assert rec3 is not None and rec3.peers is None and rec3.to_record() == own


@pytest.mark.parametrize(
    ("kind", "raw", "field", "bad"),
    [
        (StageRecord, STAGE, "address", 4000),
        (StageRecord, STAGE, "state", None),
        (StageRecord, STAGE, "outer_step", "7"),
        (StageRecord, STAGE, "outer_step", True),
        (StageRecord, STAGE, "outer_step", 7.0),
        (StageRecord, STAGE, "committed", "A" * 16),
        (StageRecord, STAGE, "committed", [1, 2]),
        (StageRecord, STAGE, "bans", [["X", 3, 6, 16]]),
        (StageRecord, STAGE, "bans", {1: [3, 6, 16]}),
        (StageRecord, STAGE, "link", "everything"),
        (StageRecord, STAGE, "state_id", 5),
        (StageRecord, STAGE, "tokens_per_s", "fast"),
        (StageRecord, STAGE, "in_flight", 2.5),
        (StageRecord, STAGE, "connectivity", 1),
        (StageRecord, STAGE, "via", "1.2.3.4:5"),
        (StageRecord, STAGE, "relay", "yes"),
        (StageRecord, STAGE, "auth_failures", False),
        (StageRecord, STAGE, "max_upload_mbps", "20"),
        (StageRecord, STAGE, "time", "now"),
        (StageRecord, STAGE, "peer_id", b"signer"),
        (ReplicaRecord, REPLICA, "kind", ["full"]),
        (ReplicaRecord, REPLICA, "outer_step", -1.5),
        (ReplicaRecord, REPLICA, "shard", "1"),
        (ReplicaRecord, REPLICA, "loss", "nan"),
        (ReplicaRecord, REPLICA, "joined_at", None),
        (ReplicaRecord, REPLICA, "joined_at", True),
        (ReplicaRecord, REPLICA, "done", 0),
        (ReplicaRecord, REPLICA, "pipeline_peers", ["peer-p"]),
        (ReplicaRecord, REPLICA, "pipeline_peers", {"1": 5}),
        (ReplicaRecord, REPLICA, "state", 3),
        (ReplicaRecord, REPLICA, "rounds", [[1, 2.0, 2.0, 1.0]] * 9),  # more than MAX_ROUNDS
        (ReplicaRecord, REPLICA, "rounds", [[1, 2.0, 2.0]]),
        (ReplicaRecord, REPLICA, "rounds", [[-1, 2.0, 2.0, 1.0]]),
        (ReplicaRecord, REPLICA, "rounds", [[True, 2.0, 2.0, 1.0]]),
        (ReplicaRecord, REPLICA, "rounds", [[1, "<b>2</b>", 2.0, 1.0]]),
        (ReplicaRecord, REPLICA, "rounds", {"1": [2.0, 2.0, 1.0]}),
        (ReplicaRecord, REPLICA, "rounds", None),
        (Announcement, ANNOUNCEMENT, "sha256", None),
        (Announcement, ANNOUNCEMENT, "size", "1234"),
        (Announcement, ANNOUNCEMENT, "replica", ["head-a"]),
        (Announcement, ANNOUNCEMENT, "replica", ""),
        (Announcement, ANNOUNCEMENT, "replica", None),
        (Announcement, ANNOUNCEMENT, "closes", "soon"),
        (Announcement, ANNOUNCEMENT, "peers", None),
        (Announcement, ANNOUNCEMENT, "peers", {"1": ["peer-p"]}),
        (Announcement, ANNOUNCEMENT, "inc", 12),
    ],
)
def test_a_field_of_the_wrong_type_makes_the_record_malformed(kind: Any, raw: dict, field: str, bad: Any) -> None:
    assert kind.parse({**raw, field: bad}) is None


@pytest.mark.parametrize("kind", [StageRecord, ReplicaRecord, Announcement])
@pytest.mark.parametrize("raw", [None, "record", 7, ["outer_step", 3], b"\x00"])
def test_a_record_that_is_not_a_dict_is_malformed(kind: Any, raw: Any) -> None:
    assert kind.parse(raw) is None


def test_missing_fields_take_the_defaults_readers_assume() -> None:
    left = StageRecord.parse({"state": "left", **SIGNED})
    assert left is not None and left.left and left.outer_step is None and left.address == ""
    rep = ReplicaRecord.parse({"state": "left"})
    assert rep is not None and rep.left and rep.joined_at == 0 and rep.done is None and rep.rounds == ()
    ann = Announcement.parse({"sha256": "f" * 64})
    assert ann is not None and ann.replica_of("sender") == "sender" and ann.closes is None
    assert StageRecord.parse({"unknown": object()}) == StageRecord()  # fields nobody reads are not kept


def _subkey_and_id() -> tuple[bytes, str]:
    subkey = RSASignatureValidator(RSAPrivateKey()).local_public_key
    signer = owner_peer_id(subkey)
    assert signer is not None
    return subkey, signer


def test_the_reader_drops_a_malformed_record_and_counts_it() -> None:
    (good_key, good), (bad_key, bad) = _subkey_and_id(), _subkey_and_id()
    reader = RecordReader("me", None)
    value = {
        good_key: SimpleNamespace(value={**STAGE, "peer_id": good, "time": 10.0}),
        bad_key: SimpleNamespace(value={**STAGE, "outer_step": "7", "peer_id": bad, "time": 10.0}),
    }
    out = reader.records(value, now=11.0, max_age_s=None, parse=StageRecord.parse)
    assert set(out) == {good} and out[good].outer_step == 7 and out[good].peer_id == good
    assert reader.dropped["malformed"] == 1


def test_the_reader_drops_records_older_than_max_age_and_keeps_the_rest() -> None:
    (old_key, old), (new_key, new) = _subkey_and_id(), _subkey_and_id()
    reader = RecordReader("me", None)
    value = {
        old_key: SimpleNamespace(value={**STAGE, "peer_id": old, "time": 10.0}),
        new_key: SimpleNamespace(value={**STAGE, "peer_id": new, "time": 12.0}),
    }
    assert set(reader.records(value, now=13.0, max_age_s=2.0, parse=StageRecord.parse)) == {new}
    assert set(reader.records(value, now=13.0, max_age_s=3.0, parse=StageRecord.parse)) == {old, new}  # age == max
    assert set(reader.records(value, now=13.0, max_age_s=None, parse=StageRecord.parse)) == {old, new}
    assert reader.records(value, now=13.0, max_age_s=0.5, parse=StageRecord.parse) == {}


def test_the_writer_publishes_every_field_of_the_protocol() -> None:
    cfg = build_config(environ={})
    me = Presence("me", "full", address="127.0.0.1:4000")
    net = NetFields("direct", None, False, 0, None, None)
    records = Records(None, cfg.swarm, me, Refusals(), lambda: net, lambda: None)  # type: ignore[arg-type]
    worker = StageWorker(cfg, 0)
    stage = records.stage(worker, role="trainer")
    assert stage.stage == 0
    published = stage.record.to_record()
    assert list(published) == [k for k in STAGE if k != "via"]
    assert published["state"] == "syncing" and published["address"] == "127.0.0.1:4000"
    assert published["state_id"] == worker.state_id() and published["inc"] == me.incarnation
    assert "rounds" not in records.replica("pipeline", 3, 1, 2.5, 10.0).record.to_record()  # none committed yet
    for t in range(10):  # the record keeps the last MAX_ROUNDS, newest last
        records.committed(t, 3.0 - t / 10, None if t % 2 else 2.9, 1.5)
    replica = records.replica("pipeline", 3, 1, 2.5, 10.0, pipeline_peers={"1": "peer-p"})
    assert replica.stage is None
    assert list(replica.record.to_record()) == [k for k in REPLICA if k != "via"]
    assert [p[0] for p in replica.record.to_record()["rounds"]] == list(range(10 - MAX_ROUNDS, 10))
    assert ReplicaRecord.parse(replica.record.to_record()) == replica.record
    assert StageRecord.parse(published) == stage.record
