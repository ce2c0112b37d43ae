"""The dashboard as a person sees it: a real swarm, its bootstrap's dashboard, headless Chromium.

A bootstrap with `--dashboard-port 0`, a compressed 2-stage pipeline (head, stage-1 peer) and a
full replica train as processes on loopback. Once a few rounds have committed, Chromium renders
the page (`--dump-dom` after the page's scripts ran) and the test reads what is on it: every peer
under the stage it holds, the agreement column, a loss chart with one point per committed round
(no gap, each a round the head's metrics.jsonl says it committed) and a peer's page; a `peer dashboard`
process joined through the bootstrap serves the same holders. Screenshots are kept as artefacts:
<tmp>/dashboard.png (1280×2000) and <tmp>/dashboard-narrow.png (420×900). Skips only when no
Chromium binary is installed.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest

from tests.browser import CHROMIUM, NO_CHROMIUM, browse, cells, element
from tests.e2e.cli_swarm import DEADLINES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_person_sees_the_swarm_on_the_dashboard(swarm_factory, tmp_path: Path):
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    flags = ("--dashboard-port", "0", "--dashboard-history", str(tmp_path / "history"))
    sw = swarm_factory(
        outer_steps=1000, deadlines={**DEADLINES, "PEER_SWARM__RECORD_TTL_S": "20"}, bootstrap_flags=flags
    )
    url = sw.address["dashboard"]
    sw.join("s1", "--stage", "1")
    sw.join("full", "--full-replica")
    sw.join("head", "--stage", "0")
    ids = {}
    sw.wait_for(lambda: all(sw.events(n, "start") for n in ("s1", "full", "head")), timeout_s=120)
    for name in ("s1", "full", "head"):
        ids[name] = sw.events(name, "start")[0]["peer_id"]

    def api_rounds() -> set[int]:
        with urllib.request.urlopen(url + "api/loss", timeout=5) as answer:
            loss = json.load(answer)
        return {p[0] for r in loss["replicas"] if r["replica"] == ids["head"] for p in r["points"]}

    sw.wait_for(lambda: len(api_rounds()) >= 3, timeout_s=150, poll_s=0.5)

    dom = browse(url)
    assert 'data-ready="1"' in dom, dom[-3000:]
    # every peer under the stage it holds (the full replica holds both), with the agreement column
    for stage, holders in ((0, ("head", "full")), (1, ("s1", "full"))):
        section = element(dom, "section", f"stage-{stage}")
        for name in holders:
            assert ids[name][:16] in section, (stage, name, section[:2000])
        assert "agrees" in cells(section) and f"Agreement of stage {stage}" in section
    assert ids["s1"][:16] not in element(dom, "section", "stage-0")
    # the loss chart: one point per committed round, the same rounds as its table
    chart = re.search(r'<canvas id="loss-chart"[^>]*>', dom).group(0)
    drawn = int(re.search(r'data-rounds="(\d+)"', chart).group(1))
    assert 'data-drawn="yes"' in chart
    rows = re.findall(r"<tr>(.*?)</tr>", element(dom, "table", "loss-table").split("<tbody>")[1], re.S)
    shown = [int(cells(r)[0]) for r in rows]
    committed = set(sw.rounds("head"))
    assert len(shown) == drawn >= 3 and shown == list(range(shown[0], shown[0] + len(shown))), shown
    assert set(shown) <= committed | set(sw.rounds("full")), (shown, committed)
    # the peers' table links to a page per peer
    assert f'href="/peers/{ids["head"]}"' in element(dom, "table", "peers-table")

    peer_dom = browse(url + f"peers/{ids['head']}")
    assert f"Peer {ids['head']}" in peer_dom and 'data-ready="1"' in peer_dom
    assert re.search(r'<div id="overview" hidden', peer_dom)
    peer_chart = re.search(r'<canvas id="peer-loss-chart"[^>]*>', peer_dom).group(0)
    assert int(re.search(r'data-rounds="(\d+)"', peer_chart).group(1)) >= 3

    # `peer dashboard` on "another machine": a DHT client through the bootstrap, its own reads and history
    sw.start("dashboard", ["dashboard", "--initial-peers", sw.maddr, "--port", "0", "--poll-s", "0.5",
                           "--history", str(tmp_path / "elsewhere")])  # fmt: skip
    sw.wait_for(lambda: "dashboard of " in sw.log("dashboard"), timeout_s=60)
    other = re.search(r"at (http://\S+/)", sw.log("dashboard")).group(1)

    def other_stages() -> list[dict]:
        with urllib.request.urlopen(other + "api/stages", timeout=5) as answer:
            return json.load(answer)

    sw.wait_for(lambda: {h["peer_id"] for h in other_stages()[1]["holders"]} == {ids["s1"], ids["full"]}, timeout_s=60)

    for shot, size in ((tmp_path / "dashboard.png", "1280,2000"), (tmp_path / "dashboard-narrow.png", "420,900")):
        browse(url, f"--screenshot={shot}", f"--window-size={size}")  # a desktop and a phone-wide window
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
        print(f"\ndashboard screenshot: {shot}")
