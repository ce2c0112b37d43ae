"""Committing one stage's round a band of rows at a time: each rank its rows, the whole commit's bits.

A sharded replica's rank holds rows [a, b) — whole tile rows, `peer.core.sparseloco.codec.bands` — of
each tensor of two or more dimensions, of θ_start and of T⊥ (the embedding's rows). The portable commit
(`peer.core.sparseloco.commit`) splits into what needs the whole payloads and what does not:

    plan     = decide(whole payloads)                    each payload's clip scale, the screening's
                                                         kept lists: a few numbers, made once
    Δ̄[a:b]   = summed_by_plan(rows [a, b) of each payload) elementwise sums in commit order
    θ[a:b]   = θ_start[a:b] + fl32(−η·Δ̄[a:b])            elementwise
    T_S, T⊥  : Π(u)[a:b] = u[a:b]·U·Uᵀ                   row by row

so `commit_rows` gives exactly rows [a, b) of `commit_state`'s θ and T⊥, from rows [a, b) of θ_start,
T⊥ and every payload (`payload_rows`) — tests/unit/test_commit_rows.py checks it at 1–4 bands, with
clipping and an outlier screened out. A state's hash is over whole tensors: the bands are joined in
row order to hash it (the rank that speaks for the replica, one tensor at a time).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from torch import Tensor

from peer.core.sparseloco.codec.bands import entry_rows
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.commit import CommitPlan, summed_by_plan
from peer.core.sparseloco.portable import check_denormals
from peer.core.sparseloco.step import apply_update, decayed

__all__ = ["commit_rows", "payload_rows"]


def payload_rows(payload: Payload, rows: Mapping[str, tuple[int, int]], whole: Collection[str] = ()) -> Payload:
    """The entries of `payload` a band needs: rows [a, b) of each tensor named in `rows`
    (`entry_rows`), the tensors in `whole` as they are, nothing else."""
    entries = []
    for e in payload.entries:
        if e.name in rows:
            a, b = rows[e.name]
            entries.append(entry_rows(e, a, b, payload.chunk, payload.topk))
        elif e.name in whole:
            entries.append(e)
    return Payload(entries, payload.chunk, payload.topk, payload.quant_bits)


def commit_rows(
    start: Mapping[str, Tensor],
    perp: Tensor | None,
    payloads: Sequence[Payload],
    plan: CommitPlan,
    cfg: SparseLoCoConfig,
    U: Tensor | None,
    embed_update: Tensor | None = None,
    perp_factor: float = 1.0,
) -> tuple[dict[str, Tensor], Tensor | None, Tensor | None]:
    """(θ, T⊥, the embedding's committed change u) on a band's rows: `start` and `perp` are its rows of
    θ_start and T⊥ (and `embed_update` of stage 0's u, for a stage without the embedding), `payloads`
    the committed ones cut to the same rows (`payload_rows`), in commit order, and `plan` what
    `peer.core.sparseloco.commit.decide` made of the whole payloads. Nothing passed in is modified."""
    check_denormals()
    names = {e.name for p in payloads for e in p.entries if e.name in start}
    summed = summed_by_plan(payloads, plan, cfg, names) if payloads else {}
    return apply_update(start, decayed(perp, U, perp_factor, None), summed, cfg, U, embed_update)
