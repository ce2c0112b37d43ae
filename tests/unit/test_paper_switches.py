"""Issue 25 item 5: the swarm's robust rules are config switches the simulator shares, and
`--paper-settings` turns both to the paper's algorithm.

- `sparseloco.screening` decides every commit of the swarm (a stage holder's `apply_round`, the
  stage-0 change an observer computes) and the simulator's default; it is in the manifest and the
  fingerprint, so every holder of a run applies the same rule;
- `sparseloco.dense_1d = False` sends 1-D tensors top-k per chunk² tile like everything else: the
  codec round-trips them, the fused commit gives the dense commit's bits, a holder commits them,
  and the simulator's range shards keep every entry when asked to;
- `peer bootstrap --paper-settings` builds the paper's config, says what it changed, and flags
  still override it.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from peer.config import (
    PAPER_ALGORITHM,
    RunConfig,
    build_config,
    config_from_dict,
    paper_algorithm_config,
    setting,
    setting_changes,
)
from peer.core.model.state import stage_state
from peer.core.sparseloco import robust
from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.format import SPARSE, Payload, SparseLoCoConfig, n_selected
from peer.core.sparseloco.commit import commit_state, embedding_update, robust_aggregate, screening_rule
from peer.core.subspace.state import EMBED
from peer.node.manifest import build_manifest, verify_manifest
from peer.node.stage.worker import StageWorker
from peer.research.simulate.engine import _commit_stage
from peer.research.simulate.replica import LocalReplica
from peer.research.simulate.results import SIMULATE_DEFAULTS, SimOptions, new_result, robust_rule
from tests.unit.test_manifest import TOKENIZER_SHA, _index

SMALL = {"train.batch_size": 4, "train.microbatches": 2, "train.seq_len": 16, "stages": 2}


def _cfg(**overrides: object) -> RunConfig:
    return build_config(overrides=SMALL | overrides, environ={})


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a)


# ------------------------------------------------------------------ the switch on the swarm's side


def _holders(cfg: RunConfig, n: int) -> tuple[list[StageWorker], list[Payload]]:
    """n holders of stage 1 from one start, each trained to its own Δ (a shared direction plus its
    own noise); the last one sends −50 × the first's Δ: a clear outlier, but within the median clip's
    reach of no one (clipping is off, so only screening can stop it)."""
    workers = [StageWorker(cfg, 1, compressed=False) for _ in range(n)]
    g = torch.Generator().manual_seed(5)
    common = {name: torch.randn(p.shape, generator=g) * 1e-2 for name, p in workers[0].module.named_parameters()}
    with torch.no_grad():
        for i, w in enumerate(workers):
            for name, p in w.module.named_parameters():
                noise = torch.randn(p.shape, generator=g) * 5e-3
                p.add_(-50.0 * (common[name] + noise) if i == n - 1 else common[name] + noise)
    return workers, [w.contribute(f"r{i}") for i, w in enumerate(workers)]


@pytest.mark.parametrize("screening", [True, False])
def test_a_holders_commit_screens_exactly_when_the_run_says_so(screening):
    cfg = _cfg(**{"sparseloco.clip_median_factor": 0.0, "sparseloco.screening": screening})
    workers, payloads = _holders(cfg, 5)
    ids = [f"r{i}" for i in range(5)]
    done = workers[0].apply_round(payloads, None, ids)  # what every holder runs, FOLLOW/RECONCILE included
    assert done.dropped == ((4,) if screening else ())
    assert workers[0].ledger.last_dropped == (["r4"] if screening else [])
    # the same bits as the portable commit with the rule written out
    start = {n: t.clone() for n, t in workers[1].start.items()}
    want = commit_state(start, None, payloads, cfg.sparseloco, None, robust=robust.DEFAULT if screening else robust.OFF)
    assert _same(stage_state(workers[0].module), want.params)
    again = workers[1].apply_round(payloads, None, ids)
    assert again.dropped == done.dropped and _same(stage_state(workers[1].module), want.params)


def test_the_stage0_change_an_observer_computes_follows_the_switch():
    """`embedding_update` (ranges observers, RESYNC checks) drops the outlier only when screening."""
    on, off = SparseLoCoConfig(clip_median_factor=0.0), SparseLoCoConfig(clip_median_factor=0.0, screening=False)
    g = torch.Generator().manual_seed(2)
    common = torch.randn(96, 40, generator=g)
    deltas = [{EMBED: common + 0.5 * torch.randn(96, 40, generator=g)} for _ in range(4)] + [{EMBED: -100.0 * common}]
    payloads = [Payload.from_bytes(compress(d, None, on)[0].to_bytes()) for d in deltas]
    assert screening_rule(on) is robust.DEFAULT and screening_rule(off) is robust.OFF
    assert robust_aggregate(payloads, on)[2].dropped == (4,) and robust_aggregate(payloads, off)[2].dropped == ()
    with_screen, without = embedding_update(payloads, on), embedding_update(payloads, off)
    assert torch.equal(with_screen, embedding_update(payloads, off, robust.DEFAULT))  # an explicit rule wins
    assert torch.equal(without, embedding_update(payloads, on, robust.OFF))
    assert not torch.equal(with_screen, without)


def test_the_switch_is_in_the_manifest_and_the_fingerprint():
    on, off = _cfg(), _cfg(**{"sparseloco.screening": False})
    assert on.sparseloco.screening is True and off.sparseloco.screening is False
    assert on.fingerprint() != off.fingerprint()  # peers with different rules never share a run id
    manifest = json.loads(json.dumps(build_manifest(off, TOKENIZER_SHA, "127.0.0.1:5000", _index())))
    assert manifest["config"]["sparseloco"]["screening"] is False
    assert verify_manifest(manifest).sparseloco.screening is False
    older = copy.deepcopy(on.to_dict())
    del older["sparseloco"]["screening"]  # a config written before the switch: the rule it ran, screening
    assert config_from_dict(older).sparseloco.screening is True
    with pytest.raises(Exception, match="sparseloco.screening"):
        _cfg(**{"sparseloco.screening": "sometimes"})


# ------------------------------------------------------------------ the switch on the simulator's side


def test_the_simulator_screens_as_the_config_says_unless_an_arm_forces_it():
    swarm, sim = _cfg(), build_config(overrides=SMALL, environ={}, defaults=SIMULATE_DEFAULTS)
    assert sim.sparseloco.screening is False and sim.sparseloco.clip_median_factor == 0.0  # `peer simulate`'s numbers
    assert robust_rule(SimOptions(), swarm) is robust.DEFAULT and robust_rule(SimOptions(), sim) is robust.OFF
    assert robust_rule(SimOptions(robust=robust.DEFAULT), sim) is robust.DEFAULT  # the attack sweeps' arms
    assert robust_rule(SimOptions(robust=robust.OFF), swarm) is robust.OFF
    assert new_result(swarm, "sparseloco", SimOptions(), 4).screening is True
    assert new_result(sim, "sparseloco", SimOptions(), 4).screening is False


@pytest.mark.parametrize("screening", [True, False])
def test_a_simulated_round_drops_an_attacker_only_under_screening(screening):
    cfg = _cfg(**{"sparseloco.clip_median_factor": 0.0, "sparseloco.screening": screening})
    reps = [LocalReplica.build(cfg, compressed=False, U=None) for _ in range(5)]
    start = stage_state(reps[0].stages[1])
    for m, rep in enumerate(reps):
        with torch.no_grad():
            for p in rep.stages[1].parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(m)) * 0.01)
    errors = [[None, None] for _ in reps]
    done = _commit_stage(reps, 1, start, errors, [0] * 5, cfg, 1.0, None, SimOptions(attack="flip"))
    assert done.dropped == ((4,) if screening else ())


# ------------------------------------------------------------------ dense_1d = False


def test_1d_tensors_go_top_k_per_tile_and_round_trip():
    cfg = SparseLoCoConfig(topk=8, chunk=16, quant_bits=0, dense_1d=False)
    g = torch.Generator().manual_seed(0)
    delta = {"gain": torch.randn(600, generator=g), "w": torch.randn(40, 33, generator=g)}
    payload, err = compress(delta, None, cfg)
    entry = {e.name: e for e in payload.entries}["gain"]
    assert entry.kind == SPARSE
    n_tiles = math.ceil(600 / 16**2)  # 1-D: one row of chunk²-entry tiles
    assert n_selected((600,), 16, 8) == 8 * n_tiles == len(entry.indices)
    parsed = Payload.from_bytes(payload.to_bytes(), cfg=cfg)
    assert parsed.to_bytes() == payload.to_bytes()
    sent = decompress(parsed)["gain"]
    assert int((sent != 0).sum()) == 8 * n_tiles and torch.equal(sent + err["gain"], delta["gain"])
    for t0 in range(0, 600, 256):  # each tile sends its own 8 largest magnitudes
        tile, kept = delta["gain"][t0 : t0 + 256], sent[t0 : t0 + 256] != 0
        assert tile.abs()[kept].min() >= tile.abs()[~kept].max()


@pytest.mark.parametrize("quant_bits", [0, 2])
def test_fused_and_plain_commits_of_1d_top_k_are_the_same_bits(quant_bits):
    cfg = SparseLoCoConfig(quant_bits=quant_bits, dense_1d=False)
    g = torch.Generator().manual_seed(4)
    shapes = {EMBED: (96, 40), "gain": (5000,), "w": (130, 70)}
    start = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    deltas = [{n: torch.randn(s, generator=g) for n, s in shapes.items()} for _ in range(5)]
    payloads = [Payload.from_bytes(compress(d, None, cfg)[0].to_bytes(), cfg=cfg) for d in deltas]
    assert all(e.kind == SPARSE for p in payloads for e in p.entries)
    keys = [f"r{i}" for i in range(5)]
    fused = commit_state(start, None, payloads, cfg, None, keys=keys)
    plain = commit_state(start, None, [decompress(p) for p in payloads], cfg, None, keys=keys)
    assert _same(fused.params, plain.params) and fused.commit.screen == plain.commit.screen
    assert not torch.equal(fused.params["gain"], start["gain"])


def test_holders_commit_1d_top_k_payloads_alike():
    cfg = _cfg(**{"sparseloco.dense_1d": False})
    workers, payloads = _holders(cfg, 3)
    gains = [e for e in payloads[0].entries if len(e.shape) == 1]
    assert gains and all(e.kind == SPARSE for e in gains)
    ids = ["r0", "r1", "r2"]
    for w in workers:
        w.apply_round(payloads, None, ids)
    states = [stage_state(w.module) for w in workers]
    assert all(_same(states[0], s) for s in states[1:])


def test_range_shards_of_1d_top_k_keep_every_entry_when_asked():
    """swarm.shard_topk = chunk², exact values: the ranges round is the all-to-all round bit for bit,
    1-D tensors included."""
    cfg = _cfg(
        **{"sparseloco.dense_1d": False, "sparseloco.quant_bits": 0, "sparseloco.clip_median_factor": 0.0}
        | {"sparseloco.screening": False, "swarm.shard_topk": 64 * 64}
    )
    reps = [LocalReplica.build(cfg, compressed=False, U=None) for _ in range(3)]
    starts = [stage_state(st) for st in reps[0].stages]
    for m, rep in enumerate(reps):
        with torch.no_grad():
            for st in rep.stages:
                for p in st.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(m)) * 0.01 * (1 + m))
    twins = copy.deepcopy(reps)
    for s in (0, 1):
        errs_all, errs_ranges = [[None, None] for _ in reps], [[None, None] for _ in reps]
        a = _commit_stage(twins, s, starts[s], errs_all, [0] * 3, cfg, 1.0, None, SimOptions())
        r = _commit_stage(reps, s, starts[s], errs_ranges, [0] * 3, cfg, 1.0, None, SimOptions(round_rule="ranges"))
        assert r.mass is not None and r.mass.dropped_fraction == 0.0 and a.mass is None
        for rep, twin in zip(reps, twins, strict=True):
            assert _same(stage_state(rep.stages[s]), stage_state(twin.stages[s]))


# ------------------------------------------------------------------ --paper-settings


def test_paper_settings_set_the_papers_rule_say_what_changed_and_yield_to_flags():
    cfg, lines = paper_algorithm_config(None, {"preset": "178M", "train.seq_len": 2048}, environ={})
    assert {k: setting(cfg, k) for k in PAPER_ALGORITHM} == PAPER_ALGORITHM
    assert lines == [
        "sparseloco.quant_bits: 2 -> 0",
        "sparseloco.clip_median_factor: 2.0 -> 0.0",
        "sparseloco.screening: true -> false",
        "sparseloco.dense_1d: true -> false",
        'swarm.round_rule: "auto" -> "all"',
    ]
    assert cfg.train.seq_len == 2048  # the paper's context on its preset
    kept, lines = paper_algorithm_config(None, {"sparseloco.screening": True}, environ={})  # a flag overrides
    assert kept.sparseloco.screening is True and not any(ln.startswith("sparseloco.screening") for ln in lines)
    assert kept.sparseloco.dense_1d is False and len(lines) == len(PAPER_ALGORITHM) - 1
    manifest = build_manifest(cfg, TOKENIZER_SHA, "127.0.0.1:5000", _index())
    published = verify_manifest(json.loads(json.dumps(manifest))).sparseloco
    assert (published.quant_bits, published.clip_median_factor) == (0, 0.0)
    assert (published.screening, published.dense_1d) == (False, False)
    assert setting_changes(cfg, cfg, PAPER_ALGORITHM) == []
