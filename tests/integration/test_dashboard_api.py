"""The dashboard's JSON API over real HTTP, fed by real DHT reads (peer/bootstrap/dashboard).

Three real hivemind DHT nodes on 127.0.0.1: the reader (as the bootstrap's node), an honest head
that publishes its stage-0 and replica records with committed rounds, and a hostile peer whose
records are well-typed but full of markup, or malformed. The collector polls the reader's DHT,
the server answers on 127.0.0.1:0, and the tests check what a browser would get: the data, strict
JSON with no '<' anywhere, the security headers, read-only routes, history kept across a restart.
"""

from __future__ import annotations

import json
import math
import os
import queue
import threading
import time
import urllib.error
import urllib.request

import pytest

from peer.bootstrap.dashboard.collect import Collector
from peer.bootstrap.dashboard.history import History
from peer.bootstrap.dashboard.server import serve_dashboard
from peer.net.dht import SwarmDHT
from tests.browser import CHROMIUM, NO_CHROMIUM, browse, element
from tests.conftest import assert_no_leftover_children, live_descendants

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

MANIFEST = {"run_id": "dash-run", "k": 8, "config": {"preset": "tiny", "stages": 2, "train": {"inner_steps": 4}}}
XSS = '<script>alert("x")</script><img src=x onerror=alert(1)>'


@pytest.fixture
def swarm():
    """(reader, head, hostile): three DHT nodes of run "dash-run"; all shut down after the test."""
    before = live_descendants(os.getpid())
    reader = SwarmDHT()
    nodes = [reader, SwarmDHT(initial_peers=reader.visible_maddrs()), SwarmDHT(initial_peers=reader.visible_maddrs())]
    try:
        for n in nodes:
            n.set_run("dash-run", n_stages=2)
        yield tuple(nodes)
    finally:
        for n in nodes:
            n.shutdown()
        assert_no_leftover_children(before)


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def publish(head: SwarmDHT, hostile: SwarmDHT, t: int) -> None:
    rounds = [[i, 5.0 - i / 4, 5.2 - i / 4, 1.5] for i in range(max(0, t - 8), t)]
    head.announce_stage(0, {"address": "127.0.0.1:5000", "role": "head", "state": "ready", "outer_step": t,
                            "state_id": f"s0-{t}", "tokens_per_s": 800.0}, ttl_s=60)  # fmt: skip
    head.announce_replica({"address": "127.0.0.1:5000", "kind": "pipeline", "outer_step": t, "loss": 4.0,
                           "tokens_per_s": 800.0, "joined_at": 0, "rounds": rounds}, ttl_s=60)  # fmt: skip
    # well-typed strings full of markup: shown as text, never as markup
    hostile.announce_stage(1, {"address": XSS, "role": XSS, "state": XSS, "outer_step": t, "state_id": XSS,
                               "tokens_per_s": float("inf"), "connectivity": XSS}, ttl_s=60)  # fmt: skip
    # a NaN loss parses (a diverged replica is still a replica); its kind is markup
    hostile.announce_replica({"address": "x", "kind": XSS, "outer_step": t, "joined_at": 0, "tokens_per_s": 1e308,
                              "rounds": [[t - 1, float("nan"), None, 2.0]]}, ttl_s=60)  # fmt: skip


def test_the_api_serves_the_swarm_as_data_never_markup(swarm, tmp_path):
    reader, head, hostile = swarm
    history_file = tmp_path / "dash-run.sqlite"
    collector = Collector(History(history_file), MANIFEST, poll_s=0.5)
    server = serve_dashboard(collector, 0)
    try:
        for t in (1, 2, 3):
            publish(head, hostile, t)
            collector.poll(reader)
        status, headers, body = get(server.url + "api/dashboard")
        assert status == 200 and headers["Content-Type"] == "application/json"
        assert "script-src 'self'" in headers["Content-Security-Policy"]
        assert "default-src 'none'" in headers["Content-Security-Policy"]
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert b"<" not in body and b">" not in body  # escaped as \u003c, \u003e: never markup, even as JSON
        data = json.loads(body)  # strict JSON: NaN and inf became null
        run, loss, stages, peers = data["run"], data["loss"], data["stages"], data["peers"]
        assert run["run_id"] == "dash-run" and run["stages"] == 2 and run["inner_steps"] == 4
        assert run["outer_step"] == 3 and run["tokens_per_s"] == 800.0 + 1e308  # the sum of claims: a liar shows
        assert len(run["tokens_per_s_series"]) == 3 and [s[0] for s in run["step_wall_s_series"]] == [2, 3]

        by_kind = {r["kind"]: r for r in loss["replicas"]}
        assert set(by_kind) == {"pipeline", XSS}  # the string itself, unharmed, for textContent
        assert [p[0] for p in by_kind["pipeline"]["points"]] == [0, 1, 2]  # one point per committed round
        assert by_kind["pipeline"]["points"][2] == [2, 4.5, 4.7]
        assert by_kind[XSS]["points"] == [[t, None, None] for t in (0, 1, 2)]  # NaN → null
        assert loss["mean_val"] == [[0, 5.2], [1, 4.95], [2, 4.7]]

        (s0,), s1 = stages[0]["holders"], stages[1]["holders"]
        assert s0["peer_id"] == head.peer_id and s0["state_id"] == "s0-3" and stages[0]["agreement"] is True
        assert [r["t"] for r in stages[0]["rounds"]] == [1, 2, 3]
        assert s1[0]["role"] == XSS and s1[0]["tokens_per_s"] is None  # inf → null
        assert {p["peer_id"] for p in peers} == {head.peer_id, hostile.peer_id}
        assert {p["peer_id"]: p["rounds"] for p in peers}[head.peer_id] == 2  # outer steps 1 → 3
        assert math.isfinite({p["peer_id"]: p["tokens"] for p in peers}[hostile.peer_id])  # it claimed 1e308/s

        status, _, body = get(server.url + f"api/peers/{head.peer_id}")
        mine = json.loads(body)
        assert status == 200 and mine["role"] == "pipeline" and mine["replica"]["kind"] == "pipeline"
        assert [p[0] for p in mine["loss"]] == [0, 1, 2] and mine["stages"][0]["stage"] == 0
        for path in ("api/peers/nobody", "api/peers/%3Cscript%3E", "api/nothing", "static/..%2Fserver.py",
                     "static/server.py", "static/", "etc/passwd"):  # fmt: skip
            status, headers, body = get(server.url + path)
            assert status == 404 and b"<" not in body and "Content-Security-Policy" in headers, path
        page_status, page_headers, page = get(server.url + f"peers/{head.peer_id}")
        assert page_status == 200 and page_headers["Content-Type"].startswith("text/html")
        assert b'<script src="/static/dashboard.js"' in page and b"innerHTML" not in page
        script = get(server.url + "static/dashboard.js")[2]
        assert b"textContent" in script
        assert not [w for w in (b".innerHTML", b".outerHTML", b"insertAdjacentHTML", b"document.write") if w in script]
        assert get(server.url + "static/chart.min.js")[2].startswith(b"/*!\n * Chart.js v3.9.1")
        request = urllib.request.Request(server.url + "api/dashboard", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 405
    finally:
        server.stop()
        collector.history.close()

    # a restarted dashboard of the same run shows the history it had
    again = Collector(History(history_file), MANIFEST, poll_s=0.5)
    server = serve_dashboard(again, 0)
    try:
        loss = json.loads(get(server.url + "api/loss")[2])
        assert [p[0] for r in loss["replicas"] if r["kind"] == "pipeline" for p in r["points"]] == [0, 1, 2]
        assert math.isclose(loss["mean_val"][0][1], 5.2)
    finally:
        server.stop()
        again.history.close()


def test_malformed_and_forged_records_never_reach_the_api(swarm, tmp_path):
    reader, head, hostile = swarm
    collector = Collector(History(tmp_path / "h.sqlite"), MANIFEST, poll_s=0.5)
    publish(head, hostile, 2)
    hostile.announce_replica({"kind": "full", "joined_at": 0, "rounds": [[1, 2.0, 2.0, 1.0]] * 9}, ttl_s=60)  # too many
    hostile.announce_stage(1, {"role": "trainer", "outer_step": "99", "state_id": "s"}, ttl_s=60)  # wrong type
    collector.poll(reader)
    server = serve_dashboard(collector, 0)
    try:
        data = json.loads(get(server.url + "api/dashboard")[2])
        assert [r["replica"] for r in data["loss"]["replicas"]] == [head.peer_id]
        assert data["stages"][1]["holders"] == [] and data["run"]["outer_step"] == 2
        assert {p["peer_id"] for p in data["peers"]} == {head.peer_id}
        assert reader.dropped_records["malformed"] >= 2
    finally:
        server.stop()
        collector.history.close()


def test_a_browser_shows_hostile_strings_as_text(swarm, tmp_path):
    """In headless Chromium the hostile peer's markup is text in its cells: no element it names exists."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    reader, head, hostile = swarm
    collector = Collector(History(tmp_path / "h.sqlite"), MANIFEST, poll_s=0.5)
    for t in (1, 2):
        publish(head, hostile, t)
        collector.poll(reader)
    server = serve_dashboard(collector, 0)
    try:
        for url in (server.url, server.url + f"peers/{hostile.peer_id}"):
            dom = browse(url)
            assert 'data-ready="1"' in dom, dom[-2000:]
            assert (
                "<script>alert" not in dom and "<img" not in dom and "onerror" not in dom.replace("onerror=alert", "")
            )
            assert "&lt;script&gt;alert" in dom  # the string itself, shown as text
        overview = browse(server.url)
        stage1 = element(overview, "section", "stage-1")
        assert hostile.peer_id[:16] in stage1 and "&lt;img src=x onerror=alert(1)&gt;" in stage1
    finally:
        server.stop()
        collector.history.close()


def test_peer_dashboard_serves_a_swarm_it_joins_as_a_client(tmp_path):
    """`peer dashboard`'s loop (`run_dashboard`): a DHT client that finds the run's manifest through the
    initial peers, reads the records itself every poll and keeps its history in <history>/<run id>.sqlite."""
    from peer.bootstrap.dashboard.run import Dashboard, DashboardOptions, run_dashboard

    before = live_descendants(os.getpid())
    boot = SwarmDHT()
    stop, ready = threading.Event(), queue.Queue()
    worker = None
    try:
        boot.publish_manifest(MANIFEST, ttl_s=60)
        boot.set_run("dash-run", n_stages=2)
        rounds = [[0, 5.0, 5.1, 1.0], [1, 4.5, 4.6, 1.0]]
        boot.announce_replica({"kind": "full", "outer_step": 2, "joined_at": 0, "rounds": rounds}, ttl_s=60)
        opts = DashboardOptions(0, "127.0.0.1", tmp_path / "history")

        def serve() -> None:
            run_dashboard(boot.visible_maddrs(), opts, stop, ready.put, timeout_s=30, poll_s=0.5)

        worker = threading.Thread(target=serve, daemon=True)
        worker.start()
        board: Dashboard = ready.get(timeout=60)
        deadline = time.monotonic() + 30
        while True:
            loss = json.loads(get(board.url + "api/loss")[2])
            if loss["replicas"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert loss["replicas"] == [{"replica": boot.peer_id, "kind": "full", "points": [[0, 5.0, 5.1], [1, 4.5, 4.6]]}]
        assert json.loads(get(board.url + "api/run")[2])["run_id"] == "dash-run"
        assert (tmp_path / "history" / "dash-run.sqlite").exists()
    finally:
        stop.set()
        if worker is not None:
            worker.join(timeout=30)
        boot.shutdown()
    assert worker is not None and not worker.is_alive()
    assert_no_leftover_children(before)
