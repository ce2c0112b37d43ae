"""A stage holder's ranges round without a network: parts, the commit of shards, the error feedback.

Three holders of stage 1 (tiny preset) train apart, contribute parts for one plan, and commit the
same shards (aggregated here by `aggregate_range`, as the owners would): they hold the same state
id afterwards, their claims pin the roster and the shards, and each error buffer got back exactly
what `returned_to` says (a holder absent from the roster: its whole parts). A stage peer's view of
stage 0's round (the embedding's ranges alone) gives it the bits of u that stage 0's holders commit.
"""

from __future__ import annotations

import hashlib

import torch

from peer.config import build_config
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.ranges.owner import aggregate_range, roster_digest
from peer.core.subspace.state import EMBED
from peer.node.round.claims import SHA_CHARS
from peer.node.round.ranges.ownership import round_rule
from peer.node.round.ranges.shard import made
from peer.node.stage.embed import embed_change, embed_ranges
from peer.node.stage.ranges import parts_delta, range_plan, returned, shards_digest
from peer.node.stage.state import StageState


def _trained(cfg, seed: int, stage: int = 1) -> StageState:
    holder = StageState(cfg, stage)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in holder.module.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)
    return holder


def test_holders_that_commit_the_same_shards_hold_the_same_state_and_get_their_share_back():
    cfg = build_config()
    holders = [_trained(cfg, i) for i in range(3)]
    plan = range_plan(cfg.sparseloco, {n: v.shape for n, v in holders[0].start.items()}, n_prev=8)
    assert plan.n == 8
    parts = [h.contribute_parts(f"replica-{i}", plan) for i, h in enumerate(holders)]
    # the roster holds the first two contributions: the third missed it (its whole parts come back)
    roster = [(f"replica-{i}", hashlib.sha256(b"".join(p.to_bytes() for p in parts[i])).hexdigest()) for i in range(2)]
    digest = roster_digest(roster)
    shards = {}
    for r in range(plan.n):
        shard, _ = aggregate_range(0, 1, r, plan, [parts[0][r], parts[1][r]], digest, cfg.sparseloco)
        shards[r] = made(shard)
    before = [{n: e.clone() for n, e in (h.optim.errors or {}).items()} for h in holders]

    for i, h in enumerate(holders):
        h.apply_ranges(plan, roster, digest, shards, i if i < 2 else None, None)

    assert len({h.state_id() for h in holders}) == 1
    link = holders[0].ledger.link
    pinned = hashlib.sha256(b"".join(hashlib.sha256(shards[r].data).digest() for r in sorted(shards)))
    assert link is not None and link.ranges == (digest, pinned.hexdigest()[:SHA_CHARS])
    assert shards_digest(shards) == link.ranges[1]
    assert holders[0].n_prev() == 2 and holders[0].outer_step == 1
    assert round_rule(cfg.swarm, holders[0].n_prev()) == "all"  # auto: ranges from 32 contributions on
    parsed = {r: s.shard for r, s in shards.items()}
    for i, h in enumerate(holders):
        back = returned(plan, h.start, parts[i], i if i < 2 else None, parsed)
        if i == 2:
            whole = parts_delta(plan, parts[i], h.start)
            assert all(torch.equal(back[n], whole[n]) for n in back)
        for name, e in (h.optim.errors or {}).items():
            assert torch.allclose(e, before[i][name] + back[name], atol=1e-7), name


def test_a_stage_peer_gets_stage_0s_embedding_change_bit_for_bit_from_the_embedding_ranges_alone():
    """What a stage peer observes of a stage-0 ranges round (the shards of the ranges that hold
    embed.weight's bands, planned from the meta-built stage-0 shapes) gives the very bits of u that a
    stage-0 holder's commit of all the shards gives; a state adopted without its link does not know
    its n_prev (the rule then asks the stage's claims)."""
    cfg = build_config()
    holders = [_trained(cfg, i, stage=0) for i in range(2)]
    plan = range_plan(cfg.sparseloco, {n: v.shape for n, v in holders[0].start.items()}, n_prev=8)
    observed = range_plan(cfg.sparseloco, stage_shapes(cfg.model, 0, cfg.stages), n_prev=8)
    assert observed == plan
    wanted = embed_ranges(plan)
    assert 0 < len(wanted) < plan.n
    parts = [h.contribute_parts(f"replica-{i}", plan) for i, h in enumerate(holders)]
    roster = [(f"replica-{i}", hashlib.sha256(b"".join(p.to_bytes() for p in parts[i])).hexdigest()) for i in range(2)]
    digest = roster_digest(roster)
    shards = {}
    for r in range(plan.n):
        shard, _ = aggregate_range(0, 0, r, plan, [parts[0][r], parts[1][r]], digest, cfg.sparseloco)
        shards[r] = made(shard)
    commit = holders[0].apply_ranges(plan, roster, digest, shards, 0, None)
    assert commit.embed_update is not None
    u = embed_change(cfg.sparseloco, plan, {r: shards[r].shard for r in wanted}, holders[0].start[EMBED].shape)
    assert u.dtype == torch.float32 and torch.equal(u.view(torch.int32), commit.embed_update.view(torch.int32))

    fresh = StageState(cfg, 0)
    state = holders[0].state_dict()
    fresh.load_state_dict({**state, "link": None})
    assert fresh.n_prev() is None and holders[0].n_prev() == 2
    assert StageState(cfg, 0).n_prev() == 0  # the first round: known to every holder
