"""Whether a pipeline's boundaries run compressed in an outer step: its head's choice from its links.

The paper compresses by interconnect bandwidth, not by role (arXiv 2601.02360 §2.3): a pipeline whose
links keep its stages busy with the full (b, L, d) boundary runs uncompressed — its math is the
paper's uncompressed replica (docs/architecture.md, "Compressed or not") — and one on slow links
compresses at the run's k/d. The rule is `peer plan --recommend`'s first one
(`peer.research.plan.recommend`): uncompressed when the uncompressed pipeline reaches the target
utilisation `subspace.uncompressed_min_util`, with the planner's utilisation of an inner step
(`peer.research.plan.command`): a stage computes a micro-batch in `compute_s` while each direction of
a full-duplex link carries the larger boundary message in t_msg = bytes / bandwidth, so the stage is
busy compute / max(compute, t_msg) of the time (1F1B; the bubble is left out, as the planner does).

The figures are the head's own measurements (`LinkEstimator.figures`): stage 0's compute per
micro-batch and the slowest bandwidth of the chain, the lower of the caps the head and its stage
peers state and of what its calls into stage 1 showed in the last outer step (the bytes of a hop over
the fastest call's network time less the round trip; a hop faster than `MIN_WIRE_S` bounds nothing).
A hop too fast to tell is no evidence of a fast link when its bytes are few: a compressed hop of
36 KiB takes 29 ms at 10 Mbit/s, within noise of `MIN_WIRE_S` (a CI run's head read one such outer step
as too fast to tell and ran the next uncompressed on the 10 Mbit/s link). So the last bandwidth a
hop of the same mode bounded is held through such readings (`held_bandwidth`) until one shows at
least `RECOVERED` times it, or for `HOLD_READINGS` outer steps; then the pipeline runs uncompressed
once more, whose larger hop measures the link again.
Links past stage 1 are known by their caps alone. Before any compute is measured (the head's first
outer step) `auto` runs compressed, the mode that is safe on any link, and measures. The choice is
made at an outer step's first inner step and holds through it (`PipelineDriver.inner_step`);
`peer join --stage 0 --compression always|never` forces it.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.config import WIRE_DTYPES, RunConfig
from peer.errors import ConfigError

POLICIES = ("auto", "always", "never")  # `peer join --stage 0 --compression`
# a hop's wire time (network less round trip) below this bounds no bandwidth: what a call costs beyond
# its bytes (gRPC streams, codec, threads waking on a busy core) reaches a few ms on a loaded loopback
# (charged to the bytes it made a 1.3 KiB hop look like a 3 Mbit/s link), and past 5 ms when the
# cores are shared with a swarm's other processes (CI: a 2.7 KiB hop read as a link that keeps the
# stages 35 % busy). 20 ms still measures a 36 KiB compressed hop at 10 Mbit/s (29 ms)
MIN_WIRE_S = 0.020
# a measured bandwidth is held through at most this many readings too fast to tell, then let go: the
# next outer step runs uncompressed and measures the link with its full boundary (a link that healed)
HOLD_READINGS = 3
# a reading too fast to tell shows at least hop_bytes / MIN_WIRE_S; at this multiple of the held
# bandwidth it is evidence the link got faster, and the held figure is let go at once
RECOVERED = 2.0


@dataclass(frozen=True)
class LinkFigures:
    """What a head measured of its pipeline when it chooses the mode."""

    compute_s: float | None  # stage 0's compute per micro-batch (None: not measured yet)
    bandwidth_bps: float | None  # bytes/s of the slowest link, measured or capped (None: none bounds it)
    rtt_s: float  # round trip to stage 1
    source: str  # where the bandwidth came from: "caps", "measured" or "none"

    def to_fields(self) -> dict[str, float | str | None]:
        """The figures as a metrics event's fields (ms and Mbit/s; None where not known)."""
        bw = None if self.bandwidth_bps is None else round(self.bandwidth_bps * 8 / 1e6, 3)
        compute = None if self.compute_s is None else round(self.compute_s * 1e3, 3)
        return {"compute_ms": compute, "bandwidth_mbps": bw, "bandwidth_source": self.source,
                "rtt_ms": round(self.rtt_s * 1e3, 3)}  # fmt: skip

    def describe(self) -> str:
        compute = "not measured" if self.compute_s is None else f"{self.compute_s * 1e3:.1f} ms"
        bw = "unbounded" if self.bandwidth_bps is None else f"{self.bandwidth_bps * 8 / 1e6:.1f} Mbit/s"
        rtt = f"{self.rtt_s * 1e3:.1f} ms"
        return f"compute {compute} per micro-batch, slowest link {bw} ({self.source}), round trip {rtt}"


@dataclass(frozen=True)
class ModeDecision:
    """A head's mode for one outer step and why."""

    compressed: bool
    util_uncompressed: float | None  # the planner's utilisation of the uncompressed pipeline (None: not known)
    reason: str

    @property
    def mode(self) -> str:
        return "compressed" if self.compressed else "uncompressed"


def check_policy(policy: str) -> str:
    """`--compression`'s value, or a ConfigError naming the flag."""
    if policy not in POLICIES:
        raise ConfigError(f"--compression must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def message_bytes(cfg: RunConfig, width: int) -> int:
    """The larger boundary message of one micro-batch over one link at `width` channels: the
    forward one, (b, L, width) at the wire dtype with its int32 tokens and targets (framing left out)."""
    b, L = cfg.train.batch_size // cfg.train.microbatches, cfg.train.seq_len
    return b * L * width * WIRE_DTYPES[cfg.subspace.wire_dtype].itemsize + 2 * b * L * 4


def utilisation(compute_s: float, msg_bytes: int, bandwidth_bps: float | None) -> float:
    """The planner's busy fraction of a stage: compute / max(compute, message time); 1 unbounded."""
    if bandwidth_bps is None or compute_s <= 0:
        return 1.0
    return compute_s / max(compute_s, msg_bytes / bandwidth_bps)


def choose_mode(policy: str, figures: LinkFigures | None, msg_bytes: int, target: float) -> ModeDecision:
    """The mode of the next outer step: `policy` "always" compresses, "never" does not, "auto"
    runs uncompressed when the uncompressed pipeline's utilisation with `figures` reaches `target`
    (`figures` None: the pipeline has no boundary, nothing to compress)."""
    if policy == "always":
        return ModeDecision(True, None, "--compression always")
    if policy == "never":
        return ModeDecision(False, None, "--compression never")
    if figures is None:
        return ModeDecision(False, 1.0, "one stage: no boundary")
    if figures.compute_s is None:
        return ModeDecision(True, None, "no compute measured yet: compressed until the links are measured")
    util = utilisation(figures.compute_s, msg_bytes, figures.bandwidth_bps)
    if util >= target:
        why = f"uncompressed keeps the stages {100 * util:.1f} % busy ≥ {100 * target:.0f} %"
        return ModeDecision(False, util, why)
    return ModeDecision(True, util, f"uncompressed keeps the stages {100 * util:.1f} % busy < {100 * target:.0f} %")


def measured_bandwidth(hop_bytes: int, network_s: float | None, rtt_s: float) -> float | None:
    """Bytes/s a hop's measured network time shows: both messages of a hop (`hop_bytes`) over its
    network time less the round trip; None when not measured, or too fast to tell (`MIN_WIRE_S`)."""
    if network_s is None:
        return None
    wire_s = network_s - rtt_s
    return hop_bytes / wire_s if wire_s >= MIN_WIRE_S else None


@dataclass(frozen=True)
class HeldBandwidth:
    """A bandwidth a hop bounded, and how many readings too fast to tell it has been held through."""

    bps: float
    held: int = 0


def held_bandwidth(
    reading_bps: float | None, floor_bps: float | None, last: HeldBandwidth | None
) -> HeldBandwidth | None:
    """The measured bandwidth of the chain after one outer step's reading: the reading where it bounds
    one; else the last one, held while the reading's floor (`floor_bps`: the least bandwidth a hop too
    fast to tell shows; None: no call measured) stays under `RECOVERED` times it and for at most
    `HOLD_READINGS` readings; None once let go or when nothing was ever bounded."""
    if reading_bps is not None:
        return HeldBandwidth(reading_bps)
    if last is None:
        return None
    if floor_bps is None:  # no call in the outer step: nothing read, nothing learned
        return last
    if floor_bps >= RECOVERED * last.bps or last.held >= HOLD_READINGS:
        return None
    return HeldBandwidth(last.bps, last.held + 1)
