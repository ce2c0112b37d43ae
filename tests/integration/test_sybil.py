"""Colluding contributors (issue 34): `peer.research.simulate.attacks.collude`,
`peer.research.bench.sybil.measure_round` and the recorded figures the open swarm's warning quotes
(`peer.research.bench.sybil_figures`).

The round here is synthetic (M = 10 contributions sharing a direction, each with its own noise,
through the real encoder) so it runs in a second; `peer bench sybil` measures a real run's round.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from peer.cli.render import bootstrap_banner, status_view
from peer.config import build_config
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.clip import payload_norm
from peer.core.sparseloco.codec.format import Payload
from peer.errors import ConfigError
from peer.net.addresses import order_maddrs
from peer.research.bench.sybil import colluder_counts, measure_round
from peer.research.bench.sybil_figures import (
    COMMAND,
    LOSS_COMMAND,
    RECORDED,
    RECORDED_LOSSES,
    loss_deltas,
    open_swarm_status,
    open_swarm_warning,
    worst_unscreened,
)
from peer.research.simulate.attacks import COLLUSIONS, Collusion, clip_target, collude

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {"w": (64, 128), "b": (4096,)}
M = 10


def _cfg(**overrides):
    return build_config(overrides={"preset": "tiny", **overrides}, environ={})


def _round(cfg, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[Payload]]:
    """θ_start and M honest payloads: a shared direction plus 3 × as much noise of each replica's own."""
    g = torch.Generator().manual_seed(seed)
    common = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    payloads = []
    for _ in range(M):
        delta = {n: 1e-3 * (common[n] + 3 * torch.randn(s, generator=g)) for n, s in SHAPES.items()}
        payload, _ = compress(delta, None, cfg.sparseloco)
        payloads.append(Payload.from_bytes(payload.to_bytes(), cfg=cfg.sparseloco))
    return {n: torch.zeros(s) for n, s in SHAPES.items()}, payloads


@pytest.fixture(scope="module")
def measured():
    cfg = _cfg()
    start, payloads = _round(cfg)
    rows = {}
    for k in colluder_counts(M):
        for s in COLLUSIONS:
            for r in measure_round(start, payloads, cfg, k, s):
                rows[k, s, r.screening] = r
    return cfg, payloads, rows


def test_colluders_stay_within_the_clip_bound(measured):
    cfg, payloads, _ = measured
    honest = payloads[: M - 3]
    bound = clip_target([payload_norm(p) for p in honest], 3, cfg.sparseloco.clip_median_factor)
    for s in COLLUSIONS:
        forged = collude(Collusion(3, s), honest, cfg.sparseloco)
        assert 0.9 * bound < payload_norm(forged) < 1.05 * bound, s  # at the bound: the clip scales, never refuses
    with pytest.raises(ConfigError, match="own the median|set the median"):
        clip_target([1.0] * 4, 6, 2.0)


def test_screening_drops_one_reversing_colluder_but_not_a_coalition(measured):
    _, _, rows = measured
    assert rows[1, "reversed", True].colluders_dropped == 1 and rows[1, "reversed", True].deviation == 0
    assert rows[1, "reversed", False].colluders_dropped == 0 and rows[1, "reversed", False].deviation > 0.1
    # three identical colluders already own the coordinate-wise median where they send and honest
    # payloads mostly do not: every score turns negative, there is no consensus, nothing is dropped
    for k in (3, 5):
        assert rows[k, "reversed", True].colluders_dropped == 0 and rows[k, "reversed", True].cosine < 0
    # half of the voters decide who is "against": an orthogonal coalition of 5 leaves a median cosine under
    # the floor (no consensus), so no honest contribution is dropped (3 were while any median above 0 counted)
    assert all(r.honest_dropped == 0 for r in rows.values())


def test_what_screening_keeps_moves_the_update_more_with_more_colluders(measured):
    _, _, rows = measured
    aligned = [rows[k, "aligned", True] for k in colluder_counts(M)]
    assert all(r.colluders_dropped == 0 and r.cosine > 0.9 for r in aligned)  # a bigger honest step, unseen
    assert aligned[0].deviation < aligned[1].deviation < aligned[2].deviation
    for k in (3, 5):  # the bisection finds as much reversal as screening keeps: at least the orthogonal's
        threshold, orthogonal = rows[k, "threshold", True], rows[k, "orthogonal", False]
        assert threshold.colluders_dropped == 0 and threshold.cosine <= orthogonal.cosine


def test_colluder_counts_and_strategies_are_checked():
    assert colluder_counts(10) == [1, 3, 5] and colluder_counts(12) == [1, 4, 6]
    with pytest.raises(ConfigError, match="at most M/2"):
        colluder_counts(10, (0.6,))
    with pytest.raises(ConfigError, match="unknown collusion"):
        Collusion(1, "loud")


def test_recorded_table_is_complete_and_the_docs_show_it():
    assert {(r.colluders, r.strategy, r.screening) for r in RECORDED} == {
        (k, s, on) for k in (1, 3, 5) for s in COLLUSIONS for on in (True, False)
    }
    docs = (ROOT / "docs" / "poisoning.md").read_text()
    assert COMMAND in docs
    shown = set()
    for line in docs.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 8 and re.fullmatch(r"\d+/\d+ \(\d+ %\)", cells[0]):
            k = int(cells[0].split("/")[0])
            dropped = int(cells[6].split("/")[0])
            values = (float(cells[3]), float(cells[4].replace("−", "-")), float(cells[5]), dropped)
            shown.add((k, cells[1], cells[2] == "on", values))
    recorded = {
        (
            r.colluders,
            r.strategy,
            r.screening,
            (round(r.deviation, 2), round(r.cosine, 2), round(r.norm, 2), r.colluders_dropped),
        )
        for r in RECORDED
    }
    assert shown == recorded


def test_recorded_losses_are_the_docs_table():
    docs = (ROOT / "docs" / "poisoning.md").read_text()
    assert LOSS_COMMAND in docs
    shown = set()
    for line in docs.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d+(/\d+ \(\d+ %\))?", cells[0]):
            shown.add((int(cells[0].split("/")[0]), cells[1].replace("—", "-"), float(cells[2])))
    assert shown == {(r.colluders, r.strategy, round(r.val_loss, 4)) for r in RECORDED_LOSSES}
    assert [k for k, _ in loss_deltas(RECORDED_LOSSES, "threshold")] == [1, 3, 5]


def test_open_swarm_warning_names_the_flags_and_the_recorded_figures():
    text = " ".join(open_swarm_warning())
    assert "--swarm-secret-file" in text and "--allow-peer" in text and "any peer id" in text
    assert "poisoned-yet-valid" in text and "many identities" in text
    for k in (1, 3, 5):
        worst = worst_unscreened(RECORDED, k)
        assert worst.colluders_dropped == 0 and worst.screening
        assert f"{worst.fraction:.0%}" in text and f"{worst.deviation:.0%}" in text and f"{worst.cosine:+.2f}" in text
    assert all(f"{d:+.1f}%" in text for _, d in loss_deltas(RECORDED_LOSSES, "threshold"))
    line = open_swarm_status()
    assert "--swarm-secret-file" in line and "--allow-peer" in line
    assert f"{worst_unscreened(RECORDED, 5).deviation:.0%}" in line


def test_the_banner_warns_only_an_open_swarm_and_status_says_it(tmp_path):
    from peer.bootstrap.node import BootstrapInfo

    peer_id = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN"
    info = BootstrapInfo(
        "run", peer_id, order_maddrs([f"/ip4/127.0.0.1/tcp/1/p2p/{peer_id}"]), "127.0.0.1:2", "0" * 64, {}
    )
    open_lines = [t.plain for t in bootstrap_banner(info, _cfg())]
    assert all(line in open_lines for line in open_swarm_warning())
    listed = _cfg(**{"swarm.admission": "allowlist", "swarm.allowlist": (peer_id,)})
    assert not any("admission: open" in t.plain for t in bootstrap_banner(info, listed))
    result = {"run_id": "r", "preset": "tiny", "outer_step": 0, "stages": {}, "full_replicas": []}
    said = [getattr(x, "plain", "") for x in status_view({**result, "admission": "open"})]
    assert open_swarm_status() in said
    assert open_swarm_status() not in [getattr(x, "plain", "") for x in status_view({**result, "admission": "secret"})]


def test_bench_sybil_measures_a_real_round_of_a_small_run(tmp_path):
    """The bench's whole path on a tiny run (M = 4, one honest round first): real payloads, every row."""
    from peer.cli.bench_results import rows_table
    from peer.research.bench.sybil import bench_config, bench_sybil
    from tests.corpora import pattern_corpus

    cfg = bench_config("tiny", 2, 1, 2, 16, 0)
    result = bench_sybil(cfg, pattern_corpus(tmp_path, cfg.model.vocab_size, tokens=20_000), 4, t=1, stage=1)
    assert (result.replicas, result.t, result.stage) == (4, 1, 1)
    assert [(r.colluders, r.strategy, r.screening) for r in result.rows] == [
        (k, s, on) for k in (1, 1, 2) for s in COLLUSIONS for on in (True, False)
    ]
    assert all(r.deviation >= 0 and -1 <= r.cosine <= 1 for r in result.rows)
    assert rows_table(result).row_count == len(result.rows)


def test_the_simulator_runs_colluders_in_every_round(tmp_path):
    """`SimOptions.collusion`: the last K replicas send the forged payload in every stage round; a
    reversing one is screened out, and an attacker and colluders together are refused."""
    from dataclasses import replace

    from peer.cli.bench_results import losses_table
    from peer.research.bench.sybil import bench_config, losses
    from peer.research.simulate.loops import run_diloco
    from peer.research.simulate.results import SimOptions
    from tests.corpora import pattern_corpus

    cfg = bench_config("tiny", 2, 1, 2, 16, 0)
    cfg = replace(cfg, train=replace(cfg.train, outer_steps=2))
    data = pattern_corpus(tmp_path, cfg.model.vocab_size, tokens=20_000)
    honest, reversed_one = losses(cfg, data, 4, "reversed", [0, 1], val_tokens=256)
    assert (honest.colluders, honest.strategy, honest.colluders_dropped) == (0, "-", 0)
    assert reversed_one.rounds == 4 and 1 <= reversed_one.colluders_dropped <= 4  # of 4 stage rounds
    assert losses_table([honest, reversed_one]).row_count == 2
    both = SimOptions(replicas=4, attack="negate", collusion=Collusion(1, "aligned"))
    with pytest.raises(ConfigError, match="one attack"):
        run_diloco(cfg, data, "sparseloco", both, None)
