"""`peer plan`: will my link keep up? (the paper's Fig. 2 and Fig. 3, for your numbers).

For a model shape, S stages, k/d, micro-batch shape, sustained FLOP/s and a range of inter-stage
bandwidths, estimate per bandwidth:
- compute time of one micro-batch on one stage: 6 · (params / S) · tokens / FLOP/s (fwd + bwd),
- communication time of one micro-batch over one boundary link: the larger of the forward message
  (activations + token ids, + targets into the last stage) and the backward message (activation
  gradient), each at the wire dtype, each direction of a full-duplex link carrying one of them
  (no link, no communication, when S = 1),
- an inner step of m micro-batches with communication overlapped: m · max(compute, comm)
  (1F1B steady state; the pipeline bubble is the same for both variants and left out),
- the pseudo-gradient round: each holder fetches the M − 1 other payloads of its stage and, in a
  compressed pipeline, a holder of stage s > 0 also all M stage-0 payloads (for T⊥), which stage 0's
  holders serve; the slowest holder's busier link direction sets the round's time
  (`peer.research.plan.round`, which says what the swarm's code fetches),
- the holders' own outer-step math (encode, commit, and with overlap the rebase) on the commit device
  (`--commit-device`, `--commit-gbps`: `peer.research.plan.schedule`),
- utilisation = compute time / wall time of one outer step: synchronous, H inner steps + encode +
  the round + the commit; overlapped (`--overlap 1`), max(H inner steps, the round beside them + the
  commit) + encode + rebase (`peer.research.plan.schedule.outer_step`); every row also has the
  synchronous figures (`util_sync_*`),
- with a token budget N (`--tokens`, Fig. 3): ⌈N / (M·H·m·b·L)⌉ outer steps of that wall time.
Several k/d (`--k-ratio 1/8,1/16,…`) give one row group each; the uncompressed pipeline does not
depend on k. The figures' curves: `peer.research.plan.figures`; the CLI (`peer.cli.plan`) draws the
tables and the plots.

`predict_pipeline` models the schedule that runs (`peer.node.pipeline.step`): the sequential one (every
hop through the head) or K micro-batches in flight streamed stage to stage, with the pipeline
bubble m/(m + S − 1), compute overlapped with full-duplex links and a round trip per link
(`scheduled_step_s`); `peer bench pipeline` measures the same configurations.

The byte counts are not a formula: boundary messages are built with the real transport messages
and measured with `peer.net.transport.codec.encoded_size`, and payload sizes come from
`peer.core.sparseloco.codec.format.payload_nbytes`, which walks the same layout `Payload.to_bytes` writes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from peer.config import WIRE_DTYPES
from peer.core.model.decoder import PRESETS, ModelConfig, split_layers, stage_shapes
from peer.core.sparseloco.codec.format import SparseLoCoConfig, payload_nbytes
from peer.core.subspace.compression import k_from_ratio
from peer.errors import ConfigError
from peer.net.transport.codec import encoded_size
from peer.net.transport.messages import BackwardRequest, ForwardRequest
from peer.research.plan.round import (
    HolderRound,
    outer_steps_for,
    parse_tokens,
    round_holders,
    round_seconds,
    stage0_fetch_nbytes,
    tokens_per_outer_step,
    wallclock_hours,
)
from peer.research.plan.schedule import (
    CommitDevice,
    HolderWork,
    holder_work,
    link_busy,
    outer_step,
    payload_entries,
)

# Shapes of larger models for planning only (never built): LLaMA-style, untied head, no GQA.
PLAN_PRESETS: dict[str, ModelConfig] = {
    **PRESETS,
    "7B": ModelConfig(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, head_dim=128, ffn_hidden=11008, max_seq_len=4096
    ),
    "13B": ModelConfig(
        vocab_size=32000, d_model=5120, n_layers=40, n_heads=40, head_dim=128, ffn_hidden=13824, max_seq_len=4096
    ),
    "70B": ModelConfig(
        vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, head_dim=128, ffn_hidden=28672, max_seq_len=4096
    ),
}
KINDS = ("compressed", "uncompressed")


@dataclass(frozen=True)
class PlanInputs:
    preset: str = "70B"
    params: float | None = None
    stages: int = 4
    k_ratio: str = "1/8"
    inner_steps: int = 50
    microbatch_size: int = 1
    microbatches: int = 8
    seq_len: int = 2048
    flops: float = 400e12
    replicas: int = 8
    wire_dtype: str = "bf16"
    tokens: float | None = None  # a token budget: the wall-clock to train it (Fig. 3)
    overlap: int = 0  # 1: overlapped outer steps (`peer.research.plan.schedule`); 0: synchronous
    commit_device: str = "gpu"  # where a holder encodes, commits and rebases: cpu or gpu
    commit_gbps: float | None = None  # its bytes/s in GB/s (None: the device's default)


def resolve_model(inputs: PlanInputs) -> tuple[str, ModelConfig]:
    """The preset's shape, or the known shape whose parameter count is nearest to `params`."""
    target = inputs.params
    if target is not None:
        if not target > 0:
            raise ConfigError(f"--params must be a positive parameter count, e.g. 7e9, got {target:g}")
        name = min(PLAN_PRESETS, key=lambda n: abs(PLAN_PRESETS[n].n_params - target))
        return name, PLAN_PRESETS[name]
    if inputs.preset not in PLAN_PRESETS:
        raise ConfigError(f"unknown preset {inputs.preset!r}; choose from {', '.join(PLAN_PRESETS)} or pass --params")
    return inputs.preset, PLAN_PRESETS[inputs.preset]


def boundary_bytes(b: int, L: int, width: int, wire_dtype: str) -> tuple[int, int]:
    """Serialized (forward, backward) message sizes for one micro-batch over one boundary.

    The forward message is the largest one: into the last stage, carrying tokens, the boundary
    activation and the targets. Both are encoded at `wire_dtype`, as the sender does.
    """
    dtype = WIRE_DTYPES[wire_dtype]
    tokens = torch.zeros(b, L, dtype=torch.int32)  # (b, L)
    hidden = torch.zeros(b, L, width, dtype=dtype)  # (b, L, k) or (b, L, d)
    fwd = ForwardRequest(
        pipeline_id="p", microbatch=0, outer_step=0, inner_step=0, stage=1, tokens=tokens, hidden=hidden, targets=tokens
    )
    bwd = BackwardRequest(pipeline_id="p", microbatch=0, outer_step=0, inner_step=0, stage=0, grad=hidden)
    return encoded_size(fwd, wire_dtype), encoded_size(bwd, wire_dtype)


def parse_bandwidths(text: str) -> list[float]:
    """`--bandwidth-mbps 10,100,1000` as numbers (ConfigError otherwise)."""
    try:
        return [float(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(
            f"--bandwidth-mbps: expected comma-separated numbers like 10,100,1000, got {text!r}"
        ) from None


def parse_k_ratios(text: str, d_model: int) -> list[tuple[str, int]]:
    """`--k-ratio 1/8,1/16` as [(ratio, k)], in the order given; ConfigError naming the flag for a
    bad value, an empty list or the same k/d twice (1/8 and 0.125 are the same)."""
    items = [x.strip() for x in str(text).split(",")]
    if not items or any(not x for x in items):
        raise ConfigError(f"--k-ratio: expected comma-separated ratios like 1/8,1/16, got {text!r}")
    out: list[tuple[str, int]] = []
    seen: dict[Fraction, str] = {}
    for ratio in items:
        try:
            k = k_from_ratio(d_model, ratio)
            value = Fraction(ratio)
        except (ConfigError, ValueError, ZeroDivisionError) as exc:
            raise ConfigError(f"--k-ratio: {exc}") from None
        if value in seen:
            raise ConfigError(f"--k-ratio: {ratio} is given twice (as {seen[value]} and {ratio})")
        seen[value] = ratio
        out.append((ratio, k))
    return out


def _check_inputs(inputs: PlanInputs, bandwidths_mbps: list[float]) -> None:
    if not bandwidths_mbps or any(not b > 0 for b in bandwidths_mbps):
        raise ConfigError("--bandwidth-mbps needs positive numbers, e.g. 10,100,1000")
    if inputs.wire_dtype not in WIRE_DTYPES:
        raise ConfigError(f"--wire-dtype must be one of {', '.join(WIRE_DTYPES)}, got {inputs.wire_dtype!r}")
    for name in ("stages", "inner_steps", "microbatch_size", "microbatches", "seq_len", "replicas"):
        if getattr(inputs, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(inputs, name)}")
    if not inputs.flops > 0:
        raise ConfigError(f"--flops must be a positive FLOP/s rate, e.g. 4e14, got {inputs.flops:g}")
    if inputs.tokens is not None and not (math.isfinite(inputs.tokens) and inputs.tokens >= 1):
        raise ConfigError(f"--tokens must be a positive token budget, e.g. 3e9, got {inputs.tokens:g}")
    if inputs.overlap not in (0, 1):
        raise ConfigError(f"--overlap must be 0 (synchronous) or 1 (overlapped outer steps), got {inputs.overlap}")
    CommitDevice.of(inputs.commit_device, inputs.commit_gbps)


def microbatch_compute_s(cfg: ModelConfig, stages: int, microbatch_size: int, seq_len: int, flops: float) -> float:
    """The planner's compute of one micro-batch on one stage (forward + backward): 6 · (params / S) ·
    tokens / FLOP/s (module docstring); the simulator's links use it too (`peer.research.simulate.links`)."""
    return 6.0 * (cfg.n_params / stages) * microbatch_size * seq_len / flops


def stage_payloads(cfg: ModelConfig, stages: int) -> list[int]:
    """Each stage's payload bytes at the codec's defaults (`payload_nbytes` over the real shapes)."""
    slc = SparseLoCoConfig()
    return [payload_nbytes(stage_shapes(cfg, s, stages), slc) for s in range(stages)]


def plan_rows(inputs: PlanInputs, bandwidths_mbps: list[float]) -> list[dict[str, Any]]:
    """One row per (k/d, bandwidth), k/d in `--k-ratio`'s order: byte counts, times, utilisation and
    (with `tokens`) the budget's wall-clock of compressed vs uncompressed pipelines. The uncompressed
    columns repeat in every k/d's rows; the round's bytes per holder: `peer.research.plan.round`."""
    _check_inputs(inputs, bandwidths_mbps)
    name, cfg = resolve_model(inputs)
    S, b, L = inputs.stages, inputs.microbatch_size, inputs.seq_len
    split_layers(cfg.n_layers, S)  # ConfigError when S > n_layers
    ratios = parse_k_ratios(inputs.k_ratio, cfg.d_model)
    payloads = stage_payloads(cfg, S)
    holders = {c: round_holders(payloads, inputs.replicas, c, stage0_fetch(inputs, cfg)) for c in (True, False)}
    work = _holder_work(inputs, cfg, holders)
    t_comp = microbatch_compute_s(cfg, S, b, L, inputs.flops)
    per_step = tokens_per_outer_step(inputs.replicas, inputs.inner_steps, inputs.microbatches, b, L)
    uncompressed = (0, 0) if S == 1 else boundary_bytes(b, L, cfg.d_model, inputs.wire_dtype)
    rows: list[dict[str, Any]] = []
    for ratio, k in ratios:
        compressed = (0, 0) if S == 1 else boundary_bytes(b, L, k, inputs.wire_dtype)  # no boundary at S = 1
        for bw in bandwidths_mbps:
            row: dict[str, Any] = {
                "model": name,
                "n_params": cfg.n_params,
                "k_ratio": ratio,
                "k": k,
                "bandwidth_mbps": bw,
                "compute_s_per_microbatch": t_comp,
                "boundary_bytes_compressed": sum(compressed),
                "boundary_bytes_uncompressed": sum(uncompressed),
                "payload_bytes_per_stage": max(payloads),
                "tokens_per_outer_step": per_step,
            }
            for kind, msgs in (("compressed", compressed), ("uncompressed", uncompressed)):
                c = kind == "compressed"
                row.update(_timing(inputs, kind, msgs, (holders[c], work[c]), t_comp, bw, per_step))
            rows.append(row)
    return rows


def _holder_work(
    inputs: PlanInputs, cfg: ModelConfig, holders: Mapping[bool, Sequence[HolderRound]]
) -> dict[bool, list[HolderWork]]:
    """Each stage holder's encode, commit and rebase on the commit device, per pipeline (compressed or not)."""
    device = CommitDevice.of(inputs.commit_device, inputs.commit_gbps)
    shapes = [stage_shapes(cfg, s, inputs.stages) for s in range(inputs.stages)]
    params = [_n_params(sh) for sh in shapes]
    entries = [payload_entries(sh, SparseLoCoConfig()) for sh in shapes]
    return {c: holder_work(params, entries, holders[c], device) for c in holders}


def _timing(
    inputs: PlanInputs,
    kind: str,
    msgs: tuple[int, int],
    stage_rounds: tuple[Sequence[HolderRound], Sequence[HolderWork]],
    t_comp: float,
    bw: float,
    per_step: int,
) -> dict[str, Any]:
    """One pipeline's (`kind`) columns at `bw` Mbit/s: round bytes and time, the holders' own math,
    the outer step on the synchronous schedule and on the one asked (`inputs.overlap`), utilisation
    and, with a token budget, the outer steps and hours it takes."""
    holders, work = stage_rounds
    bytes_per_s = bw * 1e6 / 8
    m, H = inputs.microbatches, inputs.inner_steps
    busiest = max(holders, key=lambda h: h.link_bytes)
    t_msg = max(msgs) / bytes_per_s
    inner_s = H * m * max(t_comp, t_msg)
    round_s = round_seconds(holders, bw)
    busy = link_busy(t_msg, max(t_comp, t_msg))
    sync = outer_step(inner_s, H, round_s, work, overlap=False)
    step = outer_step(inner_s, H, round_s, work, overlap=bool(inputs.overlap), busy=busy)
    out: dict[str, Any] = {
        f"round_bytes_{kind}": busiest.link_bytes,
        f"round_busiest_stage_{kind}": busiest.stage,
        f"stage0_payloads_fetched_{kind}": max(h.stage0_fetched for h in holders),
        f"round_s_{kind}": round_s,
        f"inner_s_{kind}": inner_s,
        f"link_busy_{kind}": busy,
        f"round_landed_s_{kind}": step.landed_s,
        f"encode_s_{kind}": step.encode_s,
        f"commit_s_{kind}": step.commit_s,
        f"rebase_s_{kind}": step.rebase_s,
        f"overlap_steps_{kind}": step.overlap_steps,
        f"outer_s_sync_{kind}": sync.outer_s,
        f"util_sync_{kind}": H * m * t_comp / sync.outer_s,
        f"outer_s_{kind}": step.outer_s,
        f"util_{kind}": H * m * t_comp / step.outer_s,
    }
    if inputs.tokens is not None:
        steps = outer_steps_for(inputs.tokens, per_step)
        out[f"outer_steps_{kind}"] = steps
        out[f"wallclock_h_{kind}"] = wallclock_hours(steps, step.outer_s)
    return out


@dataclass(frozen=True)
class PlanResult:
    """What `peer plan` computed: the inputs, one row per k/d and bandwidth (`plan_rows`) and the round's
    bytes per stage holder (`holders[compressed]`); `peer.cli.plan` renders it."""

    inputs: PlanInputs
    rows: list[dict[str, Any]]
    holders: dict[bool, list[HolderRound]]

    def to_json(self) -> dict[str, Any]:
        """The `--json` file: inputs, k/d values, rows, the round per holder and the plotted curves."""
        from peer.research.plan.figures import figure_curves

        return {
            "inputs": dataclasses.asdict(self.inputs),
            "k_ratios": list(dict.fromkeys(r["k_ratio"] for r in self.rows)),
            "rows": self.rows,
            "round": {kind: [dataclasses.asdict(h) for h in self.holders[kind == "compressed"]] for kind in KINDS},
            **figure_curves(self.rows),
        }


def plan(args: Mapping[str, Any]) -> PlanResult:
    """`peer plan` for the CLI's flags (`args`): the rows per k/d and bandwidth and the round per holder."""
    bws = parse_bandwidths(args["bandwidth_mbps"])
    fields = {f.name: args[f.name] for f in dataclasses.fields(PlanInputs) if f.name in args and f.name != "tokens"}
    inputs = PlanInputs(**fields, tokens=parse_tokens(args.get("tokens")))
    rows = plan_rows(inputs, bws)
    _, cfg = resolve_model(inputs)
    payloads, fetch = stage_payloads(cfg, inputs.stages), stage0_fetch(inputs, cfg)
    holders = {c: round_holders(payloads, inputs.replicas, c, fetch) for c in (True, False)}
    return PlanResult(inputs, rows, holders)


def stage0_fetch(inputs: PlanInputs, cfg: ModelConfig) -> int:
    """A later stage's fetch of one stage-0 payload: its embedding view."""
    return stage0_fetch_nbytes(cfg, inputs.stages, SparseLoCoConfig())


# ---------------------------------------------------------------------------- the schedule that runs


def compute_params(cfg: ModelConfig, stage: int, stages: int, seq_len: int) -> float:
    """Parameters of a stage that cost 6 FLOPs per token (fwd + bwd): its matrices except the
    embedding table (a lookup), plus L·d per layer for causal attention scores and mixing."""
    shapes = stage_shapes(cfg, stage, stages)
    mats = sum(math.prod(v) for n, v in shapes.items() if len(v) == 2 and not n.startswith("embed"))
    layers = sum(1 for n in shapes if n.endswith("attn.wq.weight"))
    return float(mats + layers * seq_len * cfg.d_model)


RPC_OVERHEAD_S = 1.5e-3  # CPU one end of a pipeline call costs (gRPC stream, codec, checks; measured: docs/pipeline.md)


def scheduled_step_s(
    t_stages: Sequence[float],
    t_msg: float,
    rtt_s: float,
    m: int,
    in_flight: int,
    t_rpc: float = 0.0,
    t_opt: Sequence[float] = (),
) -> float:
    """Wall time of one inner step of m micro-batches, as `peer.node.pipeline.step` runs it.

    t_stages: compute (fwd + bwd) of one micro-batch on each stage; t_msg: one boundary message
    on one link (bytes / bandwidth); rtt_s: round trip per link; t_rpc: the CPU each end of a call
    spends on it (on the core that computes); t_opt: each stage's optimizer step (the head steps
    after the later stages, which step in parallel).
    - in_flight 1 (sequential, every hop through the head, 2S − 3 calls per micro-batch):
      m · (Σ t_s + (4S − 6)·t_msg + (2S − 3)·(rtt + 2·t_rpc)).
    - in_flight K > 1 (1F1B, streamed stage to stage, each link full duplex): stage s spends
      t_s' = t_s + t_rpc per call it makes or serves per micro-batch (1 on the first and last stage,
      2 between); one micro-batch takes the chain latency C = Σ t_s' + (S − 1)(2·t_msg + rtt);
      then one finishes every 1/r with r = min(1 / max(t_s', t_msg), K / C). Step = C + (m − 1)/r;
      with K ≥ S and fast links this is (m + S − 1)·t: the bubble m / (m + S − 1).
    Plus the optimizer step. Sequential: max of the later stages' t_opt, a round trip, then the
    head's. In flight: every stage steps at once, the head not waiting for the others' answers
    (their next micro-batches wait for their step instead), so max(t_opt) and no round trip (the
    outer step's last inner step still waits; that one round trip per H steps is left out).
    """
    S = len(t_stages)
    if not t_opt:
        opt = 0.0
    elif in_flight > 1 and S > 1:
        opt = max(t_opt)
    else:
        opt = max(t_opt[1:], default=0.0) + t_opt[0] + (rtt_s + 2 * t_rpc if S > 1 else 0.0)
    if S == 1:
        return m * t_stages[0] + opt
    if in_flight <= 1:
        return m * (sum(t_stages) + (4 * S - 6) * t_msg + (2 * S - 3) * (rtt_s + 2 * t_rpc)) + opt
    busy = [t + (1 if s in (0, S - 1) else 2) * t_rpc for s, t in enumerate(t_stages)]
    chain = sum(busy) + (S - 1) * (2 * t_msg + rtt_s)
    rate = min(1.0 / max(*busy, t_msg), in_flight / chain)
    return chain + (m - 1) / rate + opt


def predict_pipeline(
    cfg: ModelConfig,
    stages: int,
    microbatches: int,
    batch_size: int,
    seq_len: int,
    k_ratio: str,
    flops: float,
    in_flight: int,
    bandwidth_mbps: float | None = None,
    rtt_ms: float = 0.0,
    wire_dtype: str = "fp32",
    rpc_overhead_s: float = 0.0,
    opt_s_per_param: float = 0.0,
) -> dict[str, float]:
    """Predicted tokens/s of a pipeline on this schedule; `flops` is one device's sustained FLOP/s
    for forward and backward (e.g. `flops_from_tokens_per_s` of a measured one-device run).
    bandwidth None: unshaped. `rpc_overhead_s`: CPU per end of a call (`RPC_OVERHEAD_S` on this
    machine); `opt_s_per_param`: optimizer step seconds per parameter (both 0: compute only)."""
    b = batch_size // microbatches
    width = k_from_ratio(cfg.d_model, k_ratio)
    fwd, bwd = boundary_bytes(b, seq_len, width, wire_dtype)
    t_msg = 0.0 if bandwidth_mbps is None else max(fwd, bwd) * 8 / (bandwidth_mbps * 1e6)
    t_stages = [6 * compute_params(cfg, s, stages, seq_len) * b * seq_len / flops for s in range(stages)]
    t_opt = [opt_s_per_param * _n_params(stage_shapes(cfg, s, stages)) for s in range(stages)]
    step = scheduled_step_s(t_stages, t_msg, rtt_ms / 1e3, microbatches, in_flight, rpc_overhead_s, t_opt)
    one = microbatches * 6 * compute_params(cfg, 0, 1, seq_len) * b * seq_len / flops + opt_s_per_param * cfg.n_params
    return {
        "tokens_per_s": batch_size * seq_len / step,
        "one_device_tokens_per_s": batch_size * seq_len / one,
        "efficiency": one / (stages * step),
        "bubble": 1 - sum(t_stages) * microbatches / (stages * step),
    }


def _n_params(shapes: Mapping[str, tuple[int, ...]]) -> int:
    return sum(math.prod(v) for v in shapes.values())


def flops_from_tokens_per_s(cfg: ModelConfig, seq_len: int, tokens_per_s: float) -> float:
    """The sustained FLOP/s a whole-model run at `tokens_per_s` implies."""
    return 6 * compute_params(cfg, 0, 1, seq_len) * tokens_per_s


def with_inputs(inputs: PlanInputs, **changes: Any) -> PlanInputs:
    """A copy of `inputs` with `changes` applied."""
    return dataclasses.replace(inputs, **changes)
