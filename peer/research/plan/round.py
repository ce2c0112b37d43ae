"""`peer plan`'s pseudo-gradient round per holder, and the wall-clock of a token budget (Fig. 3).

The round (all-to-all: `swarm.round_rule` "all", what "auto" runs below `swarm.ranges_from` = 32
contributions; `peer.node.round.rounds`), per holder of stage s among M replicas and S stages, each
payload `payload_nbytes(stage_shapes(model, s, S))` bytes:
- every holder fetches the M − 1 other payloads of its own stage (`gather_round`) and serves its
  own to those M − 1 holders;
- in a compressed pipeline a holder of stage s > 0 also moves its T⊥ by stage 0's committed
  embedding change (`peer.core.sparseloco.commit.embedding_update`), which it computes from stage 0's
  payloads: it gathers round (t, 0) as an observer (`Rounds.stage_round` → `embed_job`), fetching
  all M stage-0 payloads at the same time as its own stage's round, over the same link — each as its
  embedding view (the embedding's entry and the payload's norm, all that u reads, the embedding being
  screened apart: `stage0_fetch_nbytes`, `peer.core.sparseloco.codec.sections`). A holder of stage 1
  fetches each view from its sender; a holder of stage s ≥ 2 from the holders of stage s − 1, which
  fetched them for their own T⊥ (relays: `peer.node.round.fetcher`). So a holder of stage 0 serves its
  payload to the M − 1 other heads and its view to the M holders of stage 1, and a holder of a middle
  stage serves M views on average (the relays are ranked by a hash per (holder, sender): about M·M
  requests over its stage's M holders); with whole payloads (views off) every later holder fetches
  from the sender. An uncompressed pipeline has no T⊥ and fetches none of them.
Links are full duplex at the planned bandwidth each way, so a holder's round takes
max(bytes fetched, bytes served) / bandwidth, and the round of the outer step takes the slowest
holder's. With ≥ 32 replicas the swarm switches to ranges (stage peers then fetch only the
embedding's shards), which this model does not cover (`peer bench swarm` does).

The token budget (Fig. 3): one outer step trains M·H·m·b·L tokens (M pipelines, H inner steps of
m micro-batches of b sequences of L tokens), so a budget of N tokens takes ⌈N / (M·H·m·b·L)⌉ outer
steps, each of the wall time of the schedule planned (`peer.research.plan.schedule.outer_step`:
synchronous, or the round overlapped with the next inner steps).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from peer.core.model.decoder import ModelConfig, stage_shapes
from peer.core.sparseloco.codec.format import SparseLoCoConfig, entry_kind, entry_nbytes
from peer.core.sparseloco.codec.sections import EMBED_ENTRY, view_nbytes
from peer.errors import ConfigError

SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


@dataclass(frozen=True)
class HolderRound:
    """One holder's share of an outer step's round (bytes over its link)."""

    stage: int
    payload_bytes: int  # this stage's payload
    own_fetched: int  # payloads of its own stage fetched
    stage0_fetched: int  # stage-0 payloads fetched for T⊥ (compressed pipelines, stages > 0), whole or as views
    fetched_bytes: int
    served_bytes: int

    @property
    def link_bytes(self) -> int:
        """The busier direction of a full-duplex link."""
        return max(self.fetched_bytes, self.served_bytes)


def stage0_fetch_nbytes(model: ModelConfig, stages: int, cfg: SparseLoCoConfig) -> int:
    """What a holder of a stage > 0 fetches of one stage-0 payload for T⊥: its embedding view."""
    shapes = stage_shapes(model, 0, stages)
    shape = tuple(shapes[EMBED_ENTRY])
    kind = entry_kind(shape, cfg)
    return view_nbytes(entry_nbytes(EMBED_ENTRY, kind, shape, cfg.chunk, cfg.topk, cfg.quant_bits))


def round_holders(
    payloads: Sequence[int], replicas: int, compressed: bool, stage0_fetch: int | None = None
) -> list[HolderRound]:
    """Each stage's holder's round for payload sizes `payloads` (one per stage) and M = `replicas`;
    `stage0_fetch`: a later stage's fetch of one stage-0 payload (`stage0_fetch_nbytes`; None: whole)."""
    M, S = replicas, len(payloads)
    view = payloads[0] if stage0_fetch is None else stage0_fetch
    relayed = compressed and stage0_fetch is not None  # views: stage s ≥ 2 asks stage s − 1's holders
    # views: the M holders of stage s + 1 fetch M each over the M holders of stage s; whole payloads all
    # come from their senders, stage 0's holders, for every holder of a later stage
    relays = [M if relayed and s + 1 < S else 0 for s in range(S)]
    relays[0] = M * (S - 1) if compressed and not relayed else relays[0]
    out = []
    for s, size in enumerate(payloads):
        stage0 = M if compressed and s > 0 else 0
        served = (M - 1) * size + relays[s] * view
        fetched = (M - 1) * size + stage0 * view
        out.append(HolderRound(s, size, M - 1, stage0, fetched, served))
    return out


def round_seconds(holders: Sequence[HolderRound], bandwidth_mbps: float) -> float:
    """The round's wall time: the slowest holder's busier link direction at `bandwidth_mbps`."""
    return max(h.link_bytes for h in holders) * 8 / (bandwidth_mbps * 1e6)


def parse_tokens(text: str | float | None) -> float | None:
    """`--tokens 3e9`, `3B`, `1.5T`, `500M`, `20k` as a token count (None: no budget)."""
    if text is None:
        return None
    raw = str(text).strip()
    match = re.fullmatch(r"([0-9.eE+\-_]+)\s*([kKmMbBgGtT]?)", raw)
    value = math.nan
    if match:
        try:
            value = float(match.group(1)) * SUFFIXES.get(match.group(2).lower(), 1.0)
        except ValueError:
            value = math.nan
    if not (math.isfinite(value) and value >= 1):
        raise ConfigError(f"--tokens: expected a token budget like 3e9, 3B or 1.5T, got {raw!r}")
    return value


def tokens_per_outer_step(
    replicas: int, inner_steps: int, microbatches: int, microbatch_size: int, seq_len: int
) -> int:
    """Tokens one outer step trains over all M pipelines: M·H·m·b·L."""
    return replicas * inner_steps * microbatches * microbatch_size * seq_len


def outer_steps_for(tokens: float, per_step: int) -> int:
    """Outer steps to train at least `tokens`: ⌈tokens / per_step⌉."""
    return math.ceil(tokens / per_step)


def wallclock_hours(outer_steps: int, outer_s: float) -> float:
    """Hours of `outer_steps` outer steps of `outer_s` seconds each."""
    return outer_steps * outer_s / 3600.0
