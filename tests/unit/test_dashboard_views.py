"""The dashboard's views (peer/bootstrap/dashboard/views.py) over the collector's real history (SQLite in
memory), fed typed records as the DHT hands them over: agreement, one row per peer, wall time per outer
step, the loss curves' limits."""

from __future__ import annotations

import json
import math

from peer.bootstrap.dashboard import views
from peer.bootstrap.dashboard.collect import Collector
from peer.bootstrap.dashboard.history import History
from peer.net.records import ReplicaRecord, StageRecord
from peer.net.round_points import RoundPoint

MANIFEST = {"run_id": "r", "k": 8, "config": {"preset": "tiny", "stages": 2, "train": {"inner_steps": 4}}}


def holder(t: int, state_id: str, role: str = "trainer", speed: float = 10.0) -> StageRecord:
    return StageRecord(role=role, state="ready", outer_step=t, state_id=state_id, tokens_per_s=speed)


def collector() -> Collector:
    return Collector(History(":memory:"), MANIFEST, poll_s=1.0)


def test_agreement_is_every_holder_claiming_one_state_id_and_a_tie_names_no_one():
    c = collector()
    c.ingest({0: {}, 1: {"a": holder(1, "x"), "b": holder(1, "x"), "c": holder(1, "x")}}, {}, now=100.0)
    c.ingest({0: {}, 1: {"a": holder(2, "y"), "b": holder(2, "y"), "c": holder(2, "z")}}, {}, now=101.0)
    s1 = views.stages_view(c)[1]
    assert [(r["t"], r["holders"], r["state_ids"], r["agree"]) for r in s1["rounds"]] == [
        (1, 3, 1, True),
        (2, 3, 2, False),
    ]
    assert s1["agreement"] is False
    assert {h["peer_id"]: h["agrees"] for h in s1["holders"]} == {"a": True, "b": True, "c": False}
    c.ingest({0: {}, 1: {"a": holder(3, "p"), "b": holder(3, "q")}}, {}, now=102.0)
    assert {h["peer_id"]: h["agrees"] for h in views.stages_view(c)[1]["holders"]} == {"a": None, "b": None}
    assert views.stages_view(c)[0] == {"stage": 0, "holders": [], "tokens_per_s": 0, "agreement": None, "rounds": []}


def test_a_full_replica_is_one_peer_and_the_outer_steps_wall_time_is_measured():
    c = collector()
    for t, now in ((1, 10.0), (1, 11.0), (3, 14.0)):  # outer step 1 first seen at 10 s, 3 at 14 s: 2 s per step
        full = {s: {"f": holder(t, f"s{s}-{t}", "full", 0.0)} for s in (0, 1)}
        points = tuple(RoundPoint(x, 4.0, 4.5, 1.0) for x in range(t))
        c.ingest(full, {"f": ReplicaRecord(kind="full", outer_step=t, tokens_per_s=50.0, rounds=points)}, now=now)
    (peer,) = views.peers_view(c, now=15.0)
    assert (peer["peer_id"], peer["role"], peer["stage"], peer["rounds"]) == ("f", "full", None, 2)
    assert peer["tokens"] == 200  # 50 tokens/s over 1 s, then 3 s (under the 3 polls + 1 s = 4 s gap)
    run = views.run_view(c, now=15.0)
    assert run["step_wall_s_series"] == [[3, 2.0]] and run["outer_step"] == 3 and run["tokens_per_s"] == 50.0
    assert [p[0] for p in views.loss_view(c)["replicas"][0]["points"]] == [0, 1, 2]


def test_numbers_that_are_not_finite_and_long_strings_are_cut():
    assert views.num(math.nan) is None and views.num(math.inf) is None and views.num(True) is None
    assert views.num(2.5) == 2.5 and views.text(None) is None and views.text("x" * 500) == "x" * views.MAX_TEXT


def test_the_loss_view_draws_the_most_recently_updated_replicas_only():
    c = collector()
    for i in range(views.MAX_CURVES + 3):
        rep = ReplicaRecord(kind="pipeline", outer_step=1, rounds=(RoundPoint(0, 1.0, float(i), 1.0),))
        c.ingest({0: {}, 1: {}}, {f"r{i:03d}": rep}, now=float(i))
    shown = [r["replica"] for r in views.loss_view(c)["replicas"]]
    assert shown == [f"r{i:03d}" for i in range(3, views.MAX_CURVES + 3)]


def test_junk_outer_steps_and_tokens_are_ignored_not_stored():
    """A record may carry any 64-bit outer step (SQLite's integers end at 2**63) and any tokens/s: the
    history takes what it can hold and the views stay strict JSON."""
    c = collector()
    huge = 2**64 - 1
    for now in (1.0, 2.0):
        stage = {"x": StageRecord(role="trainer", outer_step=huge, state_id="s", tokens_per_s=1e308)}
        rep = ReplicaRecord(kind="full", outer_step=huge, tokens_per_s=1e308, rounds=(RoundPoint(huge, 1.0, 1.0, 1.0),))
        c.ingest({0: {}, 1: stage}, {"x": rep}, now=now)
    (peer,) = views.peers_view(c, now=3.0)
    assert peer["outer_step"] is None and peer["rounds"] == 0 and math.isfinite(peer["tokens"])
    assert views.loss_view(c)["replicas"] == [] and views.stages_view(c)[1]["rounds"] == []
    assert views.run_view(c, now=3.0)["outer_step"] == 0
    json.dumps(views.dashboard(c, now=3.0), allow_nan=False)


def test_a_heads_holder_row_and_detail_name_its_boundary_mode():
    c = collector()
    heads = {"h": holder(1, "x", role="head"), "f": holder(1, "x", role="full")}
    replicas = {
        "h": ReplicaRecord(kind="pipeline", outer_step=1, mode="uncompressed"),
        "f": ReplicaRecord(kind="full", outer_step=1),
    }
    c.ingest({0: heads, 1: {}}, replicas, now=100.0)
    rows = {h["peer_id"]: h["mode"] for h in views.stages_view(c)[0]["holders"]}
    assert rows == {"h": "uncompressed", "f": None}  # a full replica has no mode: it never compresses
    detail = views.peer_view(c, "h", now=100.0)
    assert detail is not None and detail["replica"]["mode"] == "uncompressed"


def test_a_head_or_full_replica_is_credited_with_its_replica_records_tokens_per_s():
    # their stage records carry no throughput (0): a stage's tokens/s must still count the tokens they train
    c = collector()
    stage0 = {"h": holder(1, "x", role="head", speed=0.0), "f": holder(1, "x", role="full", speed=0.0)}
    stage1 = {"p": holder(1, "y", speed=30.0), "f": holder(1, "y", role="full", speed=0.0)}
    replicas = {
        "h": ReplicaRecord(kind="pipeline", outer_step=1, tokens_per_s=30.0),
        "f": ReplicaRecord(kind="full", outer_step=1, tokens_per_s=50.0),
    }
    c.ingest({0: stage0, 1: stage1}, replicas, now=100.0)
    s0, s1 = views.stages_view(c)
    assert {h["peer_id"]: h["tokens_per_s"] for h in s0["holders"]} == {"h": 30.0, "f": 50.0}
    assert {h["peer_id"]: h["tokens_per_s"] for h in s1["holders"]} == {"p": 30.0, "f": 50.0}  # its own figure first
    assert s0["tokens_per_s"] == s1["tokens_per_s"] == 80.0
