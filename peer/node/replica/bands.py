"""A sharded replica's outer state in bands: each rank's θ_start and error buffer, the payload they
encode together and the commit each rank makes of its rows (`peer join --full-replica --sharded`).

Each rank holds, of every parameter of two or more dimensions, the rows of one band
(`peer.core.sparseloco.codec.bands.band_rows`: whole 64-row tile rows, so about 1/N of each; which band
turns from tensor to tensor) of θ_start and of the SparseLoCo error buffer; the speaking rank (0) holds
the small rest (biases, norms) whole.

`BandedStage.encode` is a collective of every rank: each takes its rows of the current parameters
(one parameter all-gathered at a time, so a rank never holds more than one whole tensor besides its
shards), forms Δ = θ_start − θ on them and selects each tile's top-k (`bands.select`); the ranks then
exchange what a payload carries of their bands (sent values and index ranks, `BandWire`: a payload's
size, not the model's), each computes the codebooks alike and settles its error rows, and rank 0
joins the entries into the payload. The payload is byte for byte what an unsharded replica with the
same θ_start, θ and error buffer sends, and the error rows are its error buffer's rows.

`BandedStage.commit` is one too: rank 0 plans the commit from the whole committed payloads
(`peer.core.sparseloco.commit.decide`: clip scales, screening) and broadcasts plan and payloads; every
rank commits its rows of θ_start and T⊥ (`peer.core.sparseloco.commit_rows`), and the ranks put the
new rows together one tensor at a time (an all-gather of equal, padded bands) into their FSDP2 shards.
The committed bits are an unsharded replica's (tests/unit/test_commit_rows.py;
tests/integration/test_sharded_replica.py at 2 and 4 gloo ranks).

A rank whose rows are not finite raises `PayloadError` on every rank (the exchange carries the
message), so no rank waits in a collective the others left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, distribute_tensor

from peer.config import RunConfig
from peer.core.model.decoder import Decoder
from peer.core.model.state import StateHasher, state_hash
from peer.core.sparseloco.codec.bands import Band, BandWire, band_rows, banded, join, select, sent_parts, settle
from peer.core.sparseloco.codec.encode import encode_tensor
from peer.core.sparseloco.codec.format import Payload, PayloadError, TensorEntry
from peer.core.sparseloco.commit import decide, embedding_update, perp_decay, screening_rule
from peer.core.sparseloco.commit_rows import commit_rows, payload_rows
from peer.core.subspace.state import EMBED, perp_of, set_perp


def _placed(full: Tensor, like: Tensor) -> Tensor:
    """`full` laid out as `like` (this rank's FSDP2 shard of it: every rank holds `full`, no traffic)."""
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def _whole(p: Tensor) -> Tensor:
    """The whole tensor of a (possibly FSDP-sharded) parameter as float32 on CPU (a collective for a DTensor)."""
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().to("cpu", torch.float32)


class BandedStage:
    """One stage's θ_start and error buffer as this rank's bands (module docstring); built and
    restarted (`mark_start`) by every rank at once."""

    def __init__(
        self, module: Decoder, cfg: RunConfig, U: Tensor | None = None, group: dist.ProcessGroup | None = None
    ) -> None:
        """`module`: the stage as the ranks train it (FSDP2 shards or whole); `U`: the run's basis (None:
        no subspace, no T⊥)."""
        self.module, self.run, self.cfg, self.U, self.group = module, cfg, cfg.sparseloco, U, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.shapes = {n: tuple(p.shape) for n, p in module.named_parameters()}
        # the j-th banded tensor's band b (row order) is held by rank (b − j) mod N: a tensor of fewer
        # tile rows than ranks leaves a different rank empty each time, so the ranks hold alike
        self.turn = {n: j for j, n in enumerate(n for n, s in self.shapes.items() if banded(s))}
        chunk = self.cfg.chunk
        self.rows = {n: band_rows(self.shapes[n], chunk, self.world)[self._band(n, self.rank)] for n in self.turn}
        # T⊥'s rows: the embedding's, where the stage holds it (T_S and T⊥ split row by row together)
        self.perp_band = self._band(EMBED, self.rank) if EMBED in self.turn else self.rank
        self.perp_rows = (
            band_rows(tuple(perp_of(module).shape), chunk, self.world)[self.perp_band] if U is not None else (0, 0)
        )
        self.start: dict[str, Tensor] = {}  # our rows of θ_start; rank 0 also the unbanded tensors whole
        self.errors: dict[str, Tensor] = {}  # the same rows of the error buffer (empty before the first round)
        self.mark_start()

    def _band(self, name: str, rank: int) -> int:
        """The band (in row order) of tensor `name` that `rank` holds ("perp": T⊥'s)."""
        if name == "perp":
            return self._band(EMBED, rank) if EMBED in self.turn else rank
        return (rank + self.turn[name]) % self.world

    def _in_row_order(self, name: str, per_rank: Sequence[Any]) -> list[Any]:
        """`per_rank` (one item per rank) reordered by the band each rank holds of `name`."""
        out: list[Any] = [None] * self.world
        for rank, item in enumerate(per_rank):
            out[self._band(name, rank)] = item
        return out

    def _mine(self) -> dict[str, Tensor]:
        """Our rows of every banded parameter and, on rank 0, the rest whole (a collective)."""
        out = {}
        for name, p in self.module.named_parameters():
            whole = _whole(p)
            if name in self.rows:
                a, b = self.rows[name]
                out[name] = whole[a:b].clone()
            elif self.rank == 0:
                out[name] = whole.clone()
            del whole
        return out

    def mark_start(self) -> None:
        """θ_start ← the current parameters (after a commit was loaded into the shards, or at join)."""
        self.start = self._mine()

    def held_bytes(self) -> int:
        """Bytes of θ_start and the error buffer this rank holds."""
        return sum(t.nbytes for t in (*self.start.values(), *self.errors.values()))

    def encode(self) -> Payload | None:
        """This round's payload of Δ = θ_start − θ (rank 0; None on the others); every rank's error
        rows become e − Δ̂ (module docstring). A collective of every rank."""
        now = self._mine()
        bands: dict[str, Band] = {}
        whole: dict[str, TensorEntry] = {}
        failure = ""
        try:
            for name, start in self.start.items():
                d = (start - now.pop(name)).contiguous()
                prev = self.errors.get(name)
                if name in self.rows:
                    bands[name] = select(name, d, prev, self.cfg, in_place=prev is not None)
                else:  # rank 0's unbanded tensors, as an unsharded replica encodes them
                    whole[name], self.errors[name] = encode_tensor(name, d, prev, self.cfg, in_place=prev is not None)
        except PayloadError as exc:
            failure = str(exc)
        wires: list[Any] = [None] * self.world
        mine = {"failure": failure, "bands": {n: b.wire() for n, b in bands.items()} if not failure else {}}
        dist.all_gather_object(wires, mine, group=self.group)
        failures = [w["failure"] for w in wires if w["failure"]]
        if failures:
            raise PayloadError(failures[0])
        entries: list[TensorEntry] = []
        for name in self.shapes:
            if name not in self.rows:
                if self.rank == 0:
                    entries.append(whole[name])
                continue
            parts: Sequence[BandWire] = self._in_row_order(name, [w["bands"][name] for w in wires])
            entry, sent = join(name, self.shapes[name], parts, self.cfg)
            self.errors[name] = settle(bands[name], sent_parts(parts, sent)[self._band(name, self.rank)], self.cfg)
            entries.append(entry)
        if self.rank != 0:
            return None
        return Payload(entries, self.cfg.chunk, self.cfg.topk, self.cfg.quant_bits)

    def commit(
        self, payloads: Sequence[Payload] | None, t: int, embed_update: Tensor | None = None
    ) -> dict[str, Any] | None:
        """Commit round t from rank 0's committed `payloads` (commit order; None on the other ranks) and,
        for a stage without the embedding, stage 0's committed change `embed_update` (rank 0's): rank 0
        plans the commit from the whole payloads (`decide`: clip scales, screening), every rank commits
        its rows (`commit_rows`) into θ_start and, one tensor at a time, the stage's shards and T⊥. Rank 0
        returns {"param_hash", "perp_hash", "embed_update": u (the stage holding the embedding)}; a
        collective of every rank."""
        box: list[Any] = [None]
        if self.rank == 0:
            assert payloads is not None
            box = [(decide(payloads, self.cfg, screening_rule(self.cfg), None), list(payloads), embed_update)]
        dist.broadcast_object_list(box, src=0, group=self.group)
        plan, committed, update = box[0]
        whole = [n for n in self.shapes if n not in self.rows] if self.rank == 0 else []
        cut = [payload_rows(p, self.rows, whole) for p in committed]
        a, b = self.perp_rows
        perp = perp_of(self.module).detach().to("cpu", torch.float32)[a:b] if self.U is not None else None
        rows_u = None if update is None else update[a:b]
        factor = perp_decay(self.run.train, t)
        params, perp, own = commit_rows(self.start, perp, cut, plan, self.cfg, self.U, rows_u, factor)
        self.start = params
        hashes = StateHasher(self.shapes, background=False)
        for name, p in self.module.named_parameters():
            full = self._joined(name, params.get(name))
            with torch.no_grad():
                p.copy_(_placed(full.to(p.device, p.dtype), p))
            if self.rank == 0:
                hashes.add(name, full)
        out: dict[str, Any] = {"param_hash": hashes.digest()} if self.rank == 0 else {}
        if self.U is not None and perp is not None:
            full_perp = self._joined("perp", perp)
            set_perp(self.module, full_perp)
            if self.rank == 0:
                out["perp_hash"] = state_hash({"perp": full_perp})
        if EMBED in self.rows and own is not None:  # every rank alike: the same payloads named the embedding
            out["embed_update"] = self._joined(EMBED, own)
        return out if self.rank == 0 else None

    def _joined(self, name: str, rows: Tensor | None) -> Tensor:
        """The whole float32 tensor from every rank's rows of it (rank 0's alone for an unbanded one), on
        every rank: one all-gather of the bands padded to the longest, or one broadcast (a collective)."""
        device = self._wire_device()
        if name not in self.rows and name != "perp":
            shape = self.shapes[name]
            out = rows.to(device, torch.float32) if self.rank == 0 and rows is not None else None
            buf = out if out is not None else torch.empty(shape, dtype=torch.float32, device=device)
            dist.broadcast(buf, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
            return buf.cpu()
        shape = tuple(perp_of(self.module).shape) if name == "perp" else self.shapes[name]
        bands = band_rows(shape, self.cfg.chunk, self.world)  # in row order
        longest = max(b - a for a, b in bands)
        mine = torch.zeros((longest, *shape[1:]), dtype=torch.float32, device=device)
        if rows is not None and rows.shape[0]:
            mine[: rows.shape[0]] = rows.to(device, torch.float32)
        got = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(got, mine, group=self.group)
        parts: list[Tensor] = [mine] * self.world
        for rank, t in enumerate(got):
            band = self._band(name, rank)
            a, b = bands[band]
            parts[band] = t[: b - a]
        return torch.cat(parts).cpu()

    def _wire_device(self) -> torch.device:
        """Where the collectives' tensors live: the current CUDA device on NCCL, else the CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def whole_errors(self) -> dict[str, Tensor] | None:
        """The whole error buffer on rank 0 (None on the others): every rank's rows gathered (a
        collective; for checks and checkpoints of an unsharded form)."""
        got: list[Any] = [None] * self.world
        dist.all_gather_object(got, {n: e for n, e in self.errors.items() if n in self.rows}, group=self.group)
        if self.rank != 0:
            return None
        out = {}
        for name in self.shapes:
            if name in self.rows:
                out[name] = torch.cat(self._in_row_order(name, [g[name] for g in got])).view(self.shapes[name])
            elif name in self.errors:
                out[name] = self.errors[name]
        return out


def round_alone(bands: Sequence[BandedStage], t: int) -> dict[str, str] | None:
    """Round t of a replica alone, on every rank's bands (a collective): each stage's payload encoded
    from the bands and committed by itself, stage 0's embedding update passed on to the others; rank
    0's {stage: committed param hash}, None on the other ranks."""
    payloads = [b.encode() for b in bands]
    lead = payloads[0] is not None
    cfg = bands[0].cfg
    embed = embedding_update([payloads[0]], cfg) if payloads[0] is not None else None  # fused: no dense Δ̂
    out = {}
    for s, (b, p) in enumerate(zip(bands, payloads, strict=True)):
        done = b.commit([p] if p is not None else None, t, None if s == 0 else embed)
        if done is not None:
            out[str(s)] = done["param_hash"]
    return out if lead else None
