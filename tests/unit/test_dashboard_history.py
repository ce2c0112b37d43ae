"""The dashboard's history (peer/bootstrap/dashboard/history.py): bounded rings on disk that survive a
restart, and the contributions and claims it keeps, on a real SQLite file under tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.bootstrap.dashboard.history import History, Limits, Sighting
from peer.bootstrap.dashboard.run import Dashboard, DashboardOptions
from peer.errors import ConfigError


def test_a_series_is_a_ring_of_capacity_points_that_survives_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "h" / "run.sqlite"
    h = History(path, Limits(capacity=4))
    assert h.append("loss:a", [(t, 5.0 - t, 5.5 - t, 1.0) for t in range(10)], now=1.0, kind="pipeline") == 10
    assert [p[0] for p in h.points("loss:a")] == [6, 7, 8, 9]  # the newest replaced the oldest
    assert h.points("loss:a")[-1] == (9, -4.0, -3.5, 1.0)
    # a replica repeats its last rounds in every record: only a t above the last one is new
    assert h.append("loss:a", [(8, 0.0, 0.0, 0.0), (9, 0.0, 0.0, 0.0), (10, 1.0, None, 2.0)], now=2.0) == 1
    assert [p[0] for p in h.points("loss:a")] == [7, 8, 9, 10] and h.points("loss:a")[-1][2] is None
    h.close()
    again = History(path, Limits(capacity=4))
    assert [p[0] for p in again.points("loss:a")] == [7, 8, 9, 10]
    assert again.series("loss:") == {"loss:a": ""}  # kind is re-stated by each append ("" here)
    assert again.append("loss:a", [(11, 1.0, 1.0, 1.0)], now=3.0, kind="full") == 1
    assert again.series("loss:") == {"loss:a": "full"}
    again.close()


def test_the_number_of_series_is_bounded_least_recently_written_dropped(tmp_path: Path) -> None:
    h = History(tmp_path / "run.sqlite", Limits(max_series=3))
    for i in range(5):
        h.append(f"loss:{i}", [(1, 1.0, 1.0, 1.0)], now=float(i))
    assert sorted(h.series("loss:")) == ["loss:2", "loss:3", "loss:4"]
    assert h.points("loss:0") == []  # its points went with it


def test_claims_keep_the_last_outer_steps_and_a_bounded_number_of_holders(tmp_path: Path) -> None:
    h = History(tmp_path / "run.sqlite", Limits(claim_rounds=3, max_holders=2))
    for t in range(6):
        h.claim(1, [(t, "p", f"s{t}"), (t, "q", f"s{t}"), (t, "r", "odd")])  # r is one holder too many
    assert sorted(h.claims(1)) == [3, 4, 5]
    assert h.claims(1)[5] == {"p": "s5", "q": "s5"}
    assert h.claims(0) == {}


def test_contributions_count_outer_steps_tokens_and_time_seen(tmp_path: Path) -> None:
    h = History(tmp_path / "run.sqlite", Limits(max_peers=2))
    h.seen([Sighting("a", "head", 0, 3, 100.0)], now=10.0, gap_s=5.0)
    h.seen([Sighting("a", "head", 0, 5, 100.0)], now=12.0, gap_s=5.0)  # +2 outer steps, +200 tokens
    h.seen([Sighting("a", "head", 0, 6, 100.0)], now=30.0, gap_s=5.0)  # after a gap: no tokens credited
    (a,) = h.peers("a")
    assert (a["rounds"], a["tokens"], a["first_seen"], a["last_seen"]) == (3, 200.0, 10.0, 30.0)
    h.seen([Sighting("b", "trainer", 1, 6, None)], now=31.0, gap_s=5.0)
    h.seen([Sighting("c", "full", None, 6, 50.0)], now=32.0, gap_s=5.0)
    assert [p["peer_id"] for p in h.peers()] == ["c", "b"]  # at most max_peers: the least recently seen went


def test_an_unusable_history_folder_is_one_config_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ConfigError, match="a_file"):
        Dashboard.start(DashboardOptions(0, "127.0.0.1", tmp_path / "a_file"), {"run_id": "r"}, 1.0)
