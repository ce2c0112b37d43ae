"""The pure parts of a ranges round, row by row: the rule, the owners, the next step per range, the
records, the wire messages, the store and the claim's link (docs/protocol.md, RANGES)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from peer.config import build_config
from peer.core.sparseloco.ranges import merkle_check, merkle_root
from peer.net.range_records import Roster, RosterEntry, RosterRecord, ShardsRecord
from peer.net.records import Announcement
from peer.net.transport import codec
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.errors import TransportError
from peer.net.transport.messages import PayloadKind, PayloadRequest, RangeBlob, RangesReply
from peer.node.round.claims import Link
from peer.node.round.payloads import PayloadStore, sha256
from peer.node.round.ranges.ownership import (
    RangeStep,
    coordinator_order,
    owners,
    quiet_close,
    range_step,
    round_rule,
)

PEERS = [f"peer-{i:02d}" for i in range(8)]


@pytest.mark.parametrize(
    ("rule", "n_prev", "want"),
    [("auto", 0, "all"), ("auto", 8, "all"), ("auto", 13, "all"), ("auto", 14, "ranges"), ("all", 100, "all"),
     ("ranges", 0, "ranges")],
)  # fmt: skip
def test_round_rule(rule, n_prev, want):
    swarm = dataclasses.replace(build_config().swarm, round_rule=rule)
    assert round_rule(swarm, n_prev) == want


@pytest.mark.parametrize(("m", "n_ranges", "k"), [(8, 8, 2), (8, 16, 2), (5, 8, 2), (9, 8, 2), (3, 4, 3), (2, 8, 5)])
def test_owners_are_dealt_evenly_primary_first(m, n_ranges, k):
    peers = PEERS[:m] if m <= 8 else [f"peer-{i:02d}" for i in range(m)]
    counts = Counter(o for r in range(n_ranges) for o in owners(3, 1, r, peers, k))
    share = min(k, m) * n_ranges / m
    assert all(int(share) <= counts[p] <= int(share) + 1 for p in peers), counts
    order = coordinator_order(3, 1, peers)
    for r in range(n_ranges):
        got = owners(3, 1, r, peers, k)
        assert len(got) == len(set(got)) == min(k, m) and got[0] == order[r * min(k, m) % m]


def test_the_rendezvous_order_ranks_two_peers_alike_whatever_else_is_seen():
    full = coordinator_order(5, 0, PEERS)
    part = coordinator_order(5, 0, PEERS[2:6])
    assert part == [p for p in full if p in PEERS[2:6]]
    assert coordinator_order(6, 0, PEERS) != full  # the order rotates with the round


@pytest.mark.parametrize(
    ("claims", "past", "want"),
    [
        ({}, False, RangeStep.WAIT),
        ({"a": "h1"}, False, RangeStep.WAIT),  # the backup has not published yet
        ({"a": "h1", "b": "h1"}, False, RangeStep.TAKE),
        ({"a": "h1"}, True, RangeStep.TAKE),  # the other owner vanished
        ({"a": "h1", "b": "h2"}, False, RangeStep.CHECK),
        ({"a": "h1", "b": "h2"}, True, RangeStep.CHECK),
        ({}, True, RangeStep.COMPUTE),  # every owner gone
    ],
)
def test_range_step(claims, past, want):
    assert range_step(claims, 2, past) is want


@pytest.mark.parametrize(
    ("announced", "expected", "quiet_s", "want"),
    [
        (972, 1000, 3.0, True),  # 28 departed: their records would hold the roster until they expire
        (972, 1000, 2.9, False),  # one may still come
        (899, 1000, 60.0, False),  # below the quorum: wait (for the deadline, or the records to expire)
        (7, 8, 60.0, False),  # a small swarm waits for its eighth: 7/8 < 0.9
        (9, 10, 3.0, True),
        (0, 0, 60.0, False),  # nothing expected: the other rules decide
    ],
)
def test_quiet_close(announced, expected, quiet_s, want):
    assert quiet_close(announced, expected, quiet_s, 3.0, 0.9) is want
    assert quiet_close(announced, expected, quiet_s, 0.0, 0.9) is False  # roster_quiet_s 0: off


def test_roster_and_shards_records_round_trip_and_reject_malformed_values():
    entries = (RosterEntry("r1", "a" * 64, "b" * 32, "s1", "127.0.0.1:1"),)
    roster = Roster("c" * 32, 8, entries).record()
    assert roster.senders == ("s1",)
    assert RosterRecord.parse(roster.to_record()) == roster
    assert RosterRecord.parse({**roster.to_record(), "senders": [["s1"]]}) is None
    assert RosterRecord.parse({**roster.to_record(), "ranges": "8"}) is None
    shards = ShardsRecord("c" * 32, {0: "d" * 64, 7: "e" * 64})
    assert ShardsRecord.parse(shards.to_record()) == shards
    assert ShardsRecord.parse({"roster": "c", "shards": {"x": "d"}}) is None


def test_an_announcement_without_ranges_is_the_record_of_before():
    old = Announcement("a" * 64, 10, "127.0.0.1:1", "r1")
    assert "root" not in old.to_record() and Announcement.parse(old.to_record()) == old
    new = dataclasses.replace(old, root="b" * 32, ranges=8)
    assert Announcement.parse(new.to_record()) == new
    assert Announcement.parse({**new.to_record(), "ranges": "8"}) is None


def test_part_and_shard_requests_and_replies_cross_the_wire():
    request = PayloadRequest(4, 1, "peer", PayloadKind.PART, (2, 5))
    back = codec.from_bytes(pb.PayloadRequest, codec.to_bytes(request))
    assert (back.outer_step, back.stage, back.sender, back.kind, back.ranges) == (
        4,
        1,
        "peer",
        PayloadKind.PART,
        (2, 5),
    )
    plain = codec.from_bytes(pb.PayloadRequest, codec.to_bytes(PayloadRequest(4, 1, "peer")))
    assert plain.kind is PayloadKind.PAYLOAD and plain.ranges == ()
    reply = RangesReply((RangeBlob(2, b"part", (b"\x01" * 16, b"\x02" * 16)), RangeBlob(5, b"shard")))
    got = codec.from_bytes(pb.RangesReply, codec.to_bytes(reply))
    assert [(i.range, i.data, i.proof) for i in got.items] == [(i.range, i.data, i.proof) for i in reply.items]
    bad = pb.RangesReply(items=[pb.RangeBlob(range=0, data=b"x", proof=[b"short"])]).SerializeToString()
    with pytest.raises(TransportError):
        codec.from_bytes(pb.RangesReply, bad)


def test_the_store_serves_proven_parts_and_shards_by_hash_and_forgets_old_rounds():
    store = PayloadStore(keep=2)
    parts = [b"part-0", b"part-1", b"part-2"]
    store.put_parts(1, 0, parts)
    root = merkle_root(parts)
    for r, data, proof in store.parts(1, 0, None, [0, 2, 9]):
        assert merkle_check(root, r, 3, data, [h.hex() for h in proof])
    assert [r for r, _, _ in store.parts(1, 0, None, [0, 2, 9])] == [0, 2]
    store.put_shard(1, 0, 4, b"honest")
    store.put_shard(1, 0, 4, b"other")
    assert store.shards(1, 0, [4], sha256(b"honest")) == [(4, b"honest")]
    assert store.shards(1, 0, [4], "0" * 64) == []
    store.put_parts(3, 0, parts)  # round 1 is now older than `keep` rounds
    assert store.parts(1, 0, None, [0]) == [] and store.shards(1, 0, [4]) == []


def test_a_ranges_link_round_trips_and_a_malformed_one_is_no_link():
    link = Link(3, "prev", "state", (("r1", "a" * 32),), None, ranges=("c" * 32, "d" * 32))
    assert Link.from_record(link.to_record(), "state") == link
    assert Link.from_record({**link.to_record(), "ranges": ["c" * 32]}, "state") is None
    assert Link.from_record({k: v for k, v in link.to_record().items() if k != "ranges"}, "state").ranges is None
