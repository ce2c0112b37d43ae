"""`peer plan`'s outer step: the synchronous or the overlapped schedule, and the time of a holder's own
outer-step math (encode, commit, rebase) on the device that runs it.

Per outer step, a holder of a stage of P parameters (fp32, 4 bytes each) among M replicas:
- encode at the boundary (`peer.core.sparseloco.algorithm.compress`): Δ = θ_start − θ, e = β·e + Δ,
  top-k per tile, e −= Δ̂, and (overlapped) the copy θ_b the rebase needs: `ENCODE_PASSES` passes;
- the commit (`peer.core.sparseloco.commit.commit_state`, `load_committed`): the accumulator zeroed,
  θ = θ_start − η·Δ̄, the state's hash, θ loaded into the live weights: `COMMIT_PASSES` passes,
  plus the decode of every payload it gathered, `DECODE_BYTES_PER_ENTRY` bytes per sent entry
  (each scatters into the accumulator: one cache line or memory sector read and written);
- the rebase (overlap only, `peer.core.sparseloco.overlap.rebase`): θ ← θ_c + (θ − θ_b): `REBASE_PASSES`.
Every pass moves 4·P bytes at the device's bytes/s (`CommitDevice`): `gpu` at `GPU_BYTES_PER_S`, a
GPU's memory bandwidth; `cpu` at `CPU_BYTES_PER_S`, what this code achieves on a CPU (calibrated,
below), or either at `--commit-gbps`. The slowest stage's holder sets the outer step.

The outer step (H inner steps of `inner_s` in all, the round's transfer `round_s`):
- synchronous (today's node): H·inner + encode + round + commit;
- overlapped (issue 36: round t runs beside the inner steps of t + 1, each replica rebases onto the
  committed state when it lands): max(H·inner, round' + commit) + encode + rebase, where round' is
  when the round's transfer ends on a link the pipeline also uses: while the inner steps run, the
  boundary messages keep each direction busy a fraction b of the time (`link_busy`: a micro-batch's
  larger message over the time of a micro-batch), so the round gets the other 1 − b; once the inner
  steps are done it gets the whole link. round' = round / (1 − b) when that fits in H·inner, else
  H·inner + round − (1 − b)·H·inner. With inner steps bound by the link (b = 1) overlapping gains
  nothing. The node overlaps N = ⌈(round' + commit) / inner step⌉ inner steps, at most H
  (`overlap_steps`); when the round takes longer, the inner steps of t + 1 wait for it.

Calibration of `cpu` (2026-11-30, this 2-core AMD EPYC VM, AVX-512, 2 torch threads, nothing else
running): `peer bench commit --preset 178M --stages 2 --replicas 8 --threads 1,2,4 --repeats 7`
commits stage 0 of 178M (95,037,440 parameters; 8 payloads of 752,640 sent entries each,
`payload_entries`) in 1.31 s (median of 7; 2.43 s on one thread): 7 passes of 380 MB plus 6.02 M
entries of 64 bytes, 3.05 GB, in 1.31 s: 2.3 GB/s (0.69 GB/s on 2026-11-29, before the new state
came on recycled pages and the outer step ran on the kernel pool). It is
the portable commit's effective rate on 2 cores (fixed-order float64 sums, hashing, screening), not
the memory's bandwidth: give a server's own with `--commit-gbps`. `gpu`: 3.0 TB/s, about 90 % of an
H100 SXM's 3.35 TB/s of HBM3 (NVIDIA H100 Tensor Core GPU datasheet; an H200 has 4.8 TB/s). The
node commits on the CPU today; `gpu` is the hardware the planner's other defaults (400 TFLOP/s per
stage) describe.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from peer.core.sparseloco.codec.format import SPARSE, SparseLoCoConfig, entry_kind
from peer.core.sparseloco.codec.index import n_selected
from peer.errors import ConfigError
from peer.research.plan.round import HolderRound

ENCODE_PASSES = 11  # Δ: 3, error feedback: 3, top-k: 1, e −= Δ̂: 2, θ_b kept: 2
COMMIT_PASSES = 7  # accumulator: 1, θ_start − η·Δ̄: 3, hash: 1, load: 2
REBASE_PASSES = 4  # θ_c, θ, θ_b read; θ written
DECODE_BYTES_PER_ENTRY = 64  # one scattered entry: a cache line (or sector) read and written
CPU_BYTES_PER_S = 2.3e9  # calibrated on this machine (module docstring)
GPU_BYTES_PER_S = 3.0e12  # ~90 % of an H100 SXM's 3.35 TB/s (module docstring)
DEVICES = {"cpu": CPU_BYTES_PER_S, "gpu": GPU_BYTES_PER_S}


@dataclass(frozen=True)
class CommitDevice:
    """Where a holder's outer-step math runs: its name and the bytes per second it moves."""

    name: str
    bytes_per_s: float

    @classmethod
    def of(cls, name: str, gbps: float | None = None) -> CommitDevice:
        """`--commit-device` at its default rate, or at `--commit-gbps` GB/s; ConfigError naming the flag."""
        if name not in DEVICES:
            raise ConfigError(f"--commit-device must be one of {', '.join(DEVICES)}, got {name!r}")
        if gbps is not None and not (math.isfinite(gbps) and gbps > 0):
            raise ConfigError(f"--commit-gbps must be a positive rate in GB/s, e.g. 3000, got {gbps:g}")
        return cls(name, DEVICES[name] if gbps is None else gbps * 1e9)


def payload_entries(shapes: Mapping[str, Sequence[int]], cfg: SparseLoCoConfig) -> int:
    """Values one payload of tensors of these shapes carries (`compress`: top-k of every tile, or dense)."""
    total = 0
    for shape in shapes.values():
        dims = tuple(shape)
        total += n_selected(dims, cfg.chunk, cfg.topk) if entry_kind(dims, cfg) == SPARSE else math.prod(dims)
    return total


@dataclass(frozen=True)
class HolderWork:
    """A stage holder's own outer-step math, in seconds."""

    stage: int
    encode_s: float
    commit_s: float
    rebase_s: float


def holder_work(
    params: Sequence[int], entries: Sequence[int], holders: Sequence[HolderRound], device: CommitDevice
) -> list[HolderWork]:
    """Each stage's holder's encode, commit and rebase for its P (`params`), the entries of one payload
    of each stage (`entries`) and what it gathers in the round (`holders`: its own stage's M payloads,
    and stage 0's it fetches for T⊥; `peer.research.plan.round.round_holders` says which)."""
    out = []
    for s, (p, h) in enumerate(zip(params, holders, strict=True)):
        decoded = (h.own_fetched + 1) * entries[s] + h.stage0_fetched * entries[0]
        pass_s = 4 * p / device.bytes_per_s
        commit = COMMIT_PASSES * pass_s + decoded * DECODE_BYTES_PER_ENTRY / device.bytes_per_s
        out.append(HolderWork(s, ENCODE_PASSES * pass_s, commit, REBASE_PASSES * pass_s))
    return out


@dataclass(frozen=True)
class OuterStep:
    """One outer step on a schedule: its wall time and the parts that set it."""

    outer_s: float
    landed_s: float  # when the round's transfer ends, from the boundary (overlapped: beside the inner steps)
    encode_s: float  # the slowest holder's
    commit_s: float
    rebase_s: float  # 0 when synchronous
    overlap_steps: int  # N: inner steps of t + 1 run before round t lands (0: synchronous)


def link_busy(message_s: float, microbatch_s: float) -> float:
    """The share of each link direction the pipeline's boundary messages take during the inner steps."""
    return 0.0 if microbatch_s <= 0 else min(1.0, message_s / microbatch_s)


def outer_step(
    inner_s: float, inner_steps: int, round_s: float, work: Sequence[HolderWork], overlap: bool, busy: float = 0.0
) -> OuterStep:
    """The outer step's wall time: synchronous H·inner + encode + round + commit, or overlapped
    max(H·inner, round' + commit) + encode + rebase with the round beside inner steps that keep the
    link `busy` (module docstring); `inner_s` is all H inner steps."""
    encode = max(w.encode_s for w in work)
    commit = max(w.commit_s for w in work)
    if not overlap:
        return OuterStep(inner_s + encode + round_s + commit, round_s, encode, commit, 0.0, 0)
    rebase = max(w.rebase_s for w in work)
    free = (1.0 - busy) * inner_s  # link time the round gets while the inner steps run
    landed = round_s / (1.0 - busy) if round_s < free else inner_s + round_s - free
    busy_s = landed + commit
    steps = inner_steps if busy_s >= inner_s else min(inner_steps, math.ceil(busy_s * inner_steps / inner_s))
    return OuterStep(max(inner_s, busy_s) + encode + rebase, landed, encode, commit, rebase, steps)
