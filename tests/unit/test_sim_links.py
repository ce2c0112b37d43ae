"""The simulator's links (`peer.research.simulate.links`, issue 39): parsing, the checks, and each replica's
mode per outer step chosen by the node's own rule (`peer.node.pipeline.mode.choose_mode`)."""

from __future__ import annotations

import dataclasses

import pytest

from peer.errors import ConfigError
from peer.node.pipeline.mode import message_bytes, utilisation
from peer.research.plan.command import microbatch_compute_s
from peer.research.simulate.links import (
    LinkSchedule,
    check_links,
    fixed_modes,
    link_mode,
    link_modes,
    mode_summary,
    parse_links,
    parse_schedule,
)
from peer.research.simulate.results import uncompressed_share
from tests.configs import tiny_run

FLOPS = 1e11  # tiny's micro-batch keeps pace with 1000 Mbit/s at this rate, not with 10 (see the first test)


def test_the_mode_is_the_nodes_rule_on_the_planners_compute():
    cfg = tiny_run(**{"train.outer_steps": 4})
    b = cfg.train.batch_size // cfg.train.microbatches
    compute = microbatch_compute_s(cfg.model, cfg.stages, b, cfg.train.seq_len, FLOPS)
    msg = message_bytes(cfg, cfg.model.d_model)
    for mbps in (10.0, 100.0, 1000.0, 10_000.0):
        util = utilisation(compute, msg, mbps * 1e6 / 8)
        want = "U" if util >= cfg.subspace.uncompressed_min_util else "C"
        assert link_mode(cfg, mbps, FLOPS) == want, (mbps, util)
    assert [link_mode(cfg, m, FLOPS) for m in (None, 10.0, 1000.0)] == ["F", "C", "U"]
    assert link_mode(cfg, 1000.0, 4e14) == "C"  # a fast device outruns the same link: compressed
    strict = dataclasses.replace(cfg, subspace=dataclasses.replace(cfg.subspace, uncompressed_min_util=1.0))
    assert link_mode(cfg, 105.0, FLOPS) == "U"  # 96 % busy ≥ the 95 % target ...
    assert link_mode(strict, 105.0, FLOPS) == "C" and link_mode(strict, 1000.0, FLOPS) == "U"  # ... < 100 %
    one = tiny_run(stages=1)
    assert link_mode(one, 10.0, FLOPS) == "U"  # one stage: no boundary to compress


def test_a_schedule_gives_each_outer_steps_modes():
    cfg = tiny_run(**{"train.outer_steps": 5})
    schedule = parse_schedule("full,1000,10", "2:full,10,10;4:full,1000,1000", FLOPS)
    assert schedule is not None and schedule.phases[1] == (2, (None, 10.0, 10.0))
    assert link_modes(cfg, schedule) == ["FUC", "FUC", "FCC", "FCC", "FUU"]
    assert mode_summary(link_modes(cfg, schedule)) == "FUC × 2, FCC × 2, FUU × 1"
    assert schedule.to_json() == {
        "phases": [
            {"from_step": 0, "mbps": [None, 1000.0, 10.0]},
            {"from_step": 2, "mbps": [None, 10.0, 10.0]},
            {"from_step": 4, "mbps": [None, 1000.0, 1000.0]},
        ],
        "flops": FLOPS,
    }
    assert fixed_modes(3, 4, 1) == ["FCCC"] * 3
    assert uncompressed_share(["FUC", "FCC"]) == 0.5


@pytest.mark.parametrize(
    ("links", "change", "match"),
    [
        ("full,abc", None, "--links"),
        ("full,0", None, "Mbit/s > 0"),
        ("full,-5", None, "Mbit/s > 0"),
        ("full,inf", None, "Mbit/s > 0"),
        ("full,10", "0:full,10", "increasing from 1"),
        ("full,10", "3:full,10;2:full,10", "increasing from 1"),
        ("full,10", "x:full,10", "T:LINKS"),
        ("full,10", "3", "T:LINKS"),
        ("full,10", "3:full,10,10", "names 3 replicas"),
        ("full,10", "3:10,10", "full replica"),
        (None, "3:full,10", "needs --links"),
    ],
)
def test_bad_links_are_refused_naming_the_flag(links, change, match):
    with pytest.raises(ConfigError, match=match):
        parse_schedule(links, change, FLOPS)


def test_links_and_het_bw_go_together():
    schedule = parse_schedule("full,10", None, FLOPS)
    bw = ["het-bw-pp-compress"]
    with pytest.raises(ConfigError, match="needs --links"):
        check_links(bw, None, 2, "", 0)
    with pytest.raises(ConfigError, match="add it to --configs"):
        check_links(["het-pp-compress"], schedule, 2, "", 0)
    with pytest.raises(ConfigError, match="the run has 4"):
        check_links(bw, schedule, 4, "", 0)
    with pytest.raises(ConfigError, match="--grassmann"):
        check_links(bw, schedule, 2, "--grassmann", 0)
    changing = parse_schedule("full,10", "1:full,1000", FLOPS)
    with pytest.raises(ConfigError, match="--overlap"):
        check_links(bw, changing, 2, "", 1)
    check_links(bw, schedule, 2, "", 1)  # static links: no switch to overlap
    check_links(["sparseloco", "het-pp-compress"], None, 2, "", 0)
    with pytest.raises(ConfigError, match="--link-flops"):
        check_links(bw, LinkSchedule(((0, (None, 10.0)),), 0.0), 2, "", 0)


def test_parse_links_reads_full_and_numbers():
    assert parse_links("full, FULL ,1000,2.5") == (None, None, 1000.0, 2.5)
    assert parse_schedule(None, None) is None
    assert parse_schedule("10", "").phases == ((0, (10.0,)),)  # type: ignore[union-attr]


def test_the_cli_line_summarises_each_het_bw_runs_modes():
    from peer.research.simulate.experiments import mode_lines
    from peer.research.simulate.results import ConfigResult

    bw = ConfigResult("het-bw-pp-compress", "1/8", 0.5, 0.0, 0.0, seed=2, config="het-bw-pp-compress")
    bw.modes = ["FUC", "FUC", "FCC"]
    role = ConfigResult("het-pp-compress", "1/8", 0.5, 0.0, 0.0, config="het-pp-compress", modes=["FFC"])
    (line,) = mode_lines([role, bw])
    assert line.startswith("het-bw-pp-compress s2:") and line.endswith("FUC × 2, FCC × 1")
