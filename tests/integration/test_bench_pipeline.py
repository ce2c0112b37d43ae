"""`peer bench pipeline` in a tiny configuration: real stage processes, real sockets, a real relay.

The namespace / `tc tbf` part needs root; without it that part is skipped with the reason. No
speed is asserted beyond generous bounds of the planner's prediction (speed targets are the
benchmark's, run by hand: docs/pipeline.md).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from peer.cli.bench_render import pipeline_rows, pipeline_summary
from peer.research.bench.netns import netns_unavailable
from peer.research.bench.pipeline import PipelineBench, rate_mbps, run_bench

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

TINY = dict(stages=2, preset="tiny", seq_len=32, batch_size=8, microbatches=4, k_ratios=("1/8",), steps=2)


def _check(result: dict, schedules: set[str]) -> None:
    rows = result["rows"]
    assert {r["schedule"] for r in rows} == schedules
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["efficiency"] > 0 and len(r["busy"]) == 2
        assert all(0 <= x <= 1.05 for x in r["busy"]) and 0 <= r["bubble"] <= 1
        assert r["bytes_per_token"][0] > 0
        # the planner models the schedule that runs. Very generous bounds: the tiny model is dominated
        # by per-message overhead the planner leaves out, and CI machines are shared (the one-device
        # calibration and the run may see different loads); the `small` comparison is the benchmark's
        assert 0.1 < r["tokens_per_s"] / r["plan_tokens_per_s"] < 10.0, r
    assert len(pipeline_rows(result)) == len(rows) + 1


def test_loopback_old_and_new_schedule(tmp_path):
    bench = PipelineBench(**TINY, rates=("",), in_flight=(1, 0), netns=False, workdir=tmp_path)
    result = run_bench(bench, lambda line: None)
    _check(result, {"sequential", "pipelined"})
    seq, pipe = (next(r for r in result["rows"] if r["schedule"] == s) for s in ("sequential", "pipelined"))
    assert seq["in_flight"] == 1 and pipe["in_flight"] >= 2
    assert pipe["bytes_per_token"][0] == pytest.approx(seq["bytes_per_token"][0], rel=0.05)  # S = 2: same messages


def test_a_head_choosing_by_its_links_runs_uncompressed_on_loopback(tmp_path):
    # issue 39: the same pipeline forced compressed and choosing by its measured links (`--compression auto`)
    bench = PipelineBench(
        **TINY, rates=("",), in_flight=(0,), compression=("always", "auto"), netns=False, workdir=tmp_path
    )
    result = run_bench(bench, lambda line: None)
    _check(result, {"pipelined"})
    forced, auto = (next(r for r in result["rows"] if r["compression"] == c) for c in ("always", "auto"))
    assert forced["mode"] == "compressed" and forced["vs_compressed"] == forced["paired_vs_compressed"] == 1.0
    assert auto["mode"] == "uncompressed", auto["mode_reason"]
    assert "busy" in auto["mode_reason"] and auto["vs_compressed"] is not None
    # the full (b, L, d) boundary on the wire: d/k = 8 times the compressed one's bytes, give or take headers
    assert 5 < auto["bytes_per_token"][0] / forced["bytes_per_token"][0] < 9
    assert any("forced compressed" in line for line in pipeline_summary(result))


def test_shaped_namespaces_and_a_round_trip(tmp_path):
    why = netns_unavailable()
    if why is not None:
        pytest.skip(why)
    # unshaped links are the loopback test's; here one tbf-shaped link and one with a relay's round trip
    bench = PipelineBench(**TINY, rates=("10mbit",), rtt_ms=(20.0,), rtt_rate="", in_flight=(0,), workdir=tmp_path)
    result = run_bench(bench, lambda line: None)
    assert result["shaping"] == "tc tbf"
    _check(result, {"pipelined"})
    links = {(r["rate"], r["rtt_ms"]) for r in result["rows"]}
    assert links == {("10mbit", 0.0), ("unshaped", 20.0)}


def test_delay_relay_adds_the_round_trip():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    cmd = [
        sys.executable,
        "-m",
        "peer.research.bench.delay_relay",
        "--listen",
        "127.0.0.1:0",
        "--to",
        f"127.0.0.1:{port}",
    ]
    relay = subprocess.Popen([*cmd, "--rtt-ms", "100"], stdout=subprocess.PIPE, text=True)
    try:
        relayed = int(relay.stdout.readline().split()[1])
        with socket.create_connection(("127.0.0.1", relayed)) as sock:
            started = time.monotonic()
            sock.sendall(b"ping")
            assert sock.recv(16) == b"ping"
            assert time.monotonic() - started >= 0.1  # a lower bound only: the relay never delivers early
    finally:
        relay.terminate()
        relay.wait(timeout=10)
        relay.stdout.close()
        server.close()


def test_rates_read_like_tc():
    assert rate_mbps("100mbit") == 100 and rate_mbps("1gbit") == 1000 and rate_mbps("") is None
    with pytest.raises(ValueError):
        rate_mbps("fast")


def test_cli_wiring_checks_its_flags_before_starting_anything():
    from typer.testing import CliRunner

    from peer.cli.main import app
    from peer.errors import ConfigError

    result = CliRunner().invoke(app, ["bench", "pipeline", "--stages", "1", "--no-netns"])
    assert isinstance(result.exception, ConfigError) and "--stages" in str(result.exception)
    result = CliRunner().invoke(app, ["bench", "pipeline", "--rtt-ms", "fast"])
    assert isinstance(result.exception, ConfigError) and "--rtt-ms" in str(result.exception)
