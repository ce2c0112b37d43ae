"""`--metrics-port`: Prometheus metrics fed by a peer's metrics.jsonl events, scraped over real HTTP.

A real `MetricsWriter` logs the events a training peer logs; the registered sink maps them onto
the registry and the exporter serves it on 127.0.0.1 (a free port). The data-plane helpers
(`observe_rpc`, `count_bytes`, `set_connectivity`) and the ClientPool collector show up in the
same scrape. A live peer is scraped in tests/e2e/test_compose_processes.py.
"""

from __future__ import annotations

import urllib.request

import pytest

from peer.net import prometheus as prom
from peer.node.metrics import MetricsWriter, add_sink, read_events, remove_sink


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in the scrape:\n{text}")


class _Pool:
    def bytes_sent(self) -> dict[str, int]:
        return {"forward": 1000, "get_payload": 20}

    def bytes_received(self) -> dict[str, int]:
        return {"forward": 500, "get_payload": 4096}


@pytest.fixture
def exporter():
    exp = prom.Exporter(0, "127.0.0.1")
    sink = exp.sink()
    add_sink(sink)
    yield exp
    remove_sink(sink)
    exp.stop()


def test_events_reach_the_scrape(tmp_path, exporter):
    metrics = MetricsWriter(tmp_path, "head")
    before = {
        name: prom.REGISTRY.get_sample_value(name) or 0.0
        for name in ("peer_tokens_total", "peer_rounds_total", "peer_inner_steps_total")
    }
    dropped_before = prom.REGISTRY.get_sample_value("peer_contributions_dropped_total", {"stage": "0"}) or 0.0
    metrics.log("start", stage=0, peer_id="12D3KooWTest", address="127.0.0.1:1")
    assert exporter.port > 0  # started by the first event
    metrics.log("step", t=3, h=0, loss=4.25, tokens=512)
    metrics.log("step", t=3, h=1, loss=4.0, tokens=512)
    stages = {"0": {"clipped": 1, "max_norm_ratio": 3.0, "dropped": ["replica-x"]}, "1": {"clipped": 0}}
    act = {"activations": 2048, "activations_uncompressed_equiv": 16384, "pseudo_gradients": 9000}
    metrics.log("round", t=3, stages=stages, train_loss=4.0, val_loss=4.5, round_wall_s=1.5, bytes=act)
    metrics.log("connectivity", mode="relayed")
    metrics.close()
    assert [e["event"] for e in read_events(tmp_path / "metrics.jsonl")] == [
        "start",
        "step",
        "step",
        "round",
        "connectivity",
    ]
    prom.observe_rpc("forward", 0.02)
    prom.observe_rpc("forward", 3.0, ok=False)
    prom.count_bytes("activations", "12D3KooWPeerB", sent=4096, received=128)
    prom.watch_pool(_Pool())

    text = _scrape(exporter.port)
    assert _value(text, "peer_tokens_total") == before["peer_tokens_total"] + 1024
    assert _value(text, "peer_inner_steps_total") == before["peer_inner_steps_total"] + 2
    assert _value(text, "peer_loss") == 4.0
    assert _value(text, "peer_outer_step") == 4  # round 3 committed: the peer is at outer step 4
    assert _value(text, "peer_val_loss") == 4.5
    assert _value(text, "peer_rounds_total") == before["peer_rounds_total"] + 1
    assert _value(text, "peer_tokens_per_second") > 0
    assert _value(text, 'peer_contributions_dropped_total{stage="0"}') == dropped_before + 1
    assert _value(text, 'peer_contributions_clipped_total{stage="0"}') >= 1
    assert _value(text, 'peer_connectivity{mode="relayed"}') == 1.0
    assert _value(text, 'peer_connectivity{mode="direct"}') == 0.0
    assert _value(text, 'peer_bytes_sent_total{kind="activations",peer="12D3KooWPeerB"}') >= 4096
    assert _value(text, 'peer_bytes_received_total{kind="pseudo_gradients",peer="all"}') >= 9000
    assert _value(text, 'peer_rpc_failures_total{method="forward"}') >= 1
    assert _value(text, 'peer_rpc_seconds_bucket{le="0.025",method="forward"}') >= 1
    assert _value(text, 'peer_client_bytes_received_total{method="get_payload",peer="all"}') == 4096
    assert _value(text, "peer_round_seconds_count") >= 1
    assert 'peer_info{peer_id="12D3KooWTest",role="head",stage="0"} 1.0' in text


def test_a_failing_event_never_reaches_the_writer(tmp_path):
    """A sink that raises is logged; the event is still written and the peer goes on."""
    calls = []

    def broken(record):
        calls.append(record["event"])
        raise RuntimeError("boom")

    add_sink(broken)
    try:
        metrics = MetricsWriter(tmp_path, "stage")
        metrics.log("step", t=0, h=0, loss=1.0, tokens=1)
        metrics.close()
    finally:
        remove_sink(broken)
    assert calls == ["step"] and read_events(tmp_path / "metrics.jsonl", "step")
    sink = prom.EventSink()
    sink({"event": "step", "tokens": "not-a-number"})  # logged, not raised


def test_cumulative_totals_become_increments():
    totals = prom._Totals()
    assert totals.delta(("x",), 10) == 10
    assert totals.delta(("x",), 25) == 15
    assert totals.delta(("x",), 5) == 5  # restarted: counts from zero again


def test_a_real_grpc_call_is_timed_and_counted_by_the_client():
    """A PeerClient call (here to a port nobody listens on: real gRPC, UNAVAILABLE) lands in the
    RPC latency histogram and the failure counter without any wiring by the caller."""
    import socket

    from peer.errors import NetworkError
    from peer.net.transport.client import PeerClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    def sample(name: str, **labels: str) -> float:
        value = prom.REGISTRY.get_sample_value(name, labels)
        return 0.0 if value is None else value

    calls, failures = sample("peer_rpc_seconds_count", method="info"), sample("peer_rpc_failures_total", method="info")
    with PeerClient(f"127.0.0.1:{port}", timeout_s=2.0, retries=0) as client, pytest.raises(NetworkError):
        client.info()
    assert sample("peer_rpc_seconds_count", method="info") == calls + 1
    assert sample("peer_rpc_failures_total", method="info") == failures + 1
