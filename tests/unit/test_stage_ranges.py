"""A stage holder's ranges round without a network: parts, the commit of shards, the error feedback.

Three holders of stage 1 (tiny preset) train apart, contribute parts for one plan, and commit the
same shards (aggregated here by `aggregate_range`, as the owners would): they hold the same state
id afterwards, their claims pin the roster and the shards, and each error buffer got back exactly
what `returned_to` says (a holder absent from the roster: its whole parts).
"""

from __future__ import annotations

import hashlib

import torch

from peer.config import build_config
from peer.core.ranges.owner import aggregate_range, roster_digest
from peer.node.round.ownership import round_rule
from peer.node.stage_ranges import parts_delta, range_plan, returned, shards_digest
from peer.node.stage_state import StageState


def _trained(cfg, seed: int) -> StageState:
    holder = StageState(cfg, 1)
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
        shards[r] = (shard.to_bytes(), shard)
    before = [{n: e.clone() for n, e in (h.optim.errors or {}).items()} for h in holders]

    for i, h in enumerate(holders):
        h.apply_ranges(plan, roster, digest, shards, i if i < 2 else None, None)

    assert len({h.state_id() for h in holders}) == 1
    link = holders[0].ledger.link
    assert link is not None and link.ranges == (digest, shards_digest({r: b for r, (b, _) in shards.items()}))
    assert holders[0].n_prev() == 2 and holders[0].outer_step == 1
    assert round_rule(cfg.swarm, holders[0].n_prev()) == "all"  # auto: ranges from 8 contributions on
    parsed = {r: s for r, (_, s) in shards.items()}
    for i, h in enumerate(holders):
        back = returned(plan, h.start, parts[i], i if i < 2 else None, parsed)
        if i == 2:
            whole = parts_delta(plan, parts[i], h.start)
            assert all(torch.equal(back[n], whole[n]) for n in back)
        for name, e in (h.optim.errors or {}).items():
            assert torch.allclose(e, before[i][name] + back[name], atol=1e-7), name
