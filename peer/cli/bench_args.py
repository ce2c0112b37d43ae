"""The flags of `peer bench …`, one dataclass per benchmark, one field per flag.

A field is a flag's one source (`peer.cli.options`): its name, its default and its help; `peer.cli.bench`
registers each benchmark from its dataclass and the benchmark gets one instance. A flag several
benchmarks share keeps its words in one constant here (`JSON_HELP`, `SEQ_LEN_HELP`, …), its default per
benchmark; `--microbatches` and `--wire-dtype` take their words from `peer plan`'s flag and the config
field. Invariants: nothing here parses, validates or runs anything; a field's name is the flag's
(hyphenated) unless it names others, and a bool flag names itself (`--keep`, not `--keep/--no-keep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from peer.cli import options as o
from peer.cli.args import PlanArgs

JSON_HELP = "Write the measurement as JSON."
PARAMS_HELP = "Approximate model size in parameters; a real model of that size is built."
TEMPLAR_HELP = "A templar checkout (holding tplr/compress.py or src/tplr/compress.py): time its real codec too."
PRESET_HELP = "Model preset."
SEQ_LEN_HELP = "Tokens per sequence."
BATCH_HELP = "Sequences per inner step."
MICROBATCHES_HELP = o.help_of(PlanArgs, "microbatches")
STAGES_HELP = "Pipeline stages of the model."
INNER_HELP = "H: inner steps per outer round."


@dataclass(frozen=True)
class PayloadArgs:
    """`peer bench payload`."""

    params: float = o.flag(178e6, PARAMS_HELP)
    seed: int = o.flag(0, None)
    repeats: int = o.flag(3, "Timed repetitions (rounds) of each codec; medians are reported.")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")
    templar_src: Path | None = o.flag(None, TEMPLAR_HELP)


@dataclass(frozen=True)
class PipelineArgs:
    """`peer bench pipeline` (the field names are `run_from_flags`'s keywords)."""

    stages: int = o.flag(2, "S: stages, each a process pinned to its own core.")
    preset: str = o.flag("small", PRESET_HELP)
    split: str = o.flag("cost", "Layers per stage (model.stage_split): even, or cost (the head's matmul counted).")
    seq_len: int = o.flag(128, SEQ_LEN_HELP)
    batch_size: int = o.flag(16, BATCH_HELP)
    microbatches: int = o.flag(8, MICROBATCHES_HELP)
    k_ratios: str = o.flag("1/8,1", "Comma-separated k/d to compare (1 = uncompressed).")
    rate: str = o.flag("", "Comma-separated tc tbf link rates besides unshaped, e.g. 100mbit,10mbit (root).")
    rtt_ms: str = o.flag("", "Comma-separated round trips (ms) added on a 100mbit link by a delay relay.")
    in_flight: str = o.flag("1,0", "Comma-separated schedules: 1 = sequential, 0 = auto, K = K in flight.")
    compression: str = o.flag(
        "always", "Comma-separated head boundary modes: always (k/d), never, auto (by the measured links)."
    )
    wire_dtype: str = o.flag("bf16", o.config_help("subspace.wire_dtype"))
    steps: int = o.flag(3, "Measured inner steps (after one warm-up step).")
    repeats: int = o.flag(1, "Runs per configuration (the median is reported).")
    no_netns: bool = o.flag(False, "Loopback only, even as root (no shaping).", "--no-netns")
    json_out: Path | None = o.flag(None, "Write every row as JSON (PNG next to it).", "--json")


@dataclass(frozen=True)
class ChaosArgs:
    """`peer bench chaos` (the field names are `config_from_flags`'s keys)."""

    faults: int = o.flag(20, "Faults to inject (one is a bootstrap kill).")
    seed: int = o.flag(0, "Seed of the fault schedule.")
    round_timeout_s: float = o.flag(20.0, "swarm.round_timeout_s.")
    inner_steps: int = o.flag(5, "H of the run.")
    microbatches: int = o.flag(4, "Pipeline micro-batches per inner step.")
    in_flight: int = o.flag(0, "Heads' micro-batches in flight: 0 = auto (1F1B), 1 = sequential.")
    long_stops: int = o.flag(2, "Faults that are a SIGSTOP longer than two round deadlines.")
    workdir: Path | None = o.flag(None, "Logs and data (default: runs/chaos-…).")
    json_out: Path | None = o.flag(None, "Write the table and every fault here.", "--json")
    verbose: bool = o.flag(False, None, "--verbose", "-v")


@dataclass(frozen=True)
class UtilisationArgs:
    """`peer bench utilisation` (the field names are `peer.research.bench.utilisation.config_from_flags`'s keys)."""

    preset: str = o.flag("small", PRESET_HELP)
    inner_steps: int = o.flag(80, INNER_HELP)
    outer_steps: int = o.flag(5, "T: outer steps of each run (1 .. T − 2 are measured).")
    batch_size: int = o.flag(4, BATCH_HELP)
    seq_len: int = o.flag(64, SEQ_LEN_HELP)
    seed: int = o.flag(0, "Seed of both runs.")
    rate: str = o.flag("400kbit", "tc tbf rate of the replicas' link, both ways (root; '' = unshaped).")
    overlaps: str = o.flag("0,1", "Comma-separated train.overlap values to run (0 = synchronous, 1 = overlapped).")
    no_netns: bool = o.flag(False, "Loopback only, even as root (no shaping).", "--no-netns")
    no_pin: bool = o.flag(False, "Leave the replicas unpinned (default: replica a on core 0, b on core 1).", "--no-pin")
    workdir: Path | None = o.flag(None, "Logs and metrics (default: runs/utilisation-…).")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class CommitArgs:
    """`peer bench commit`."""

    preset: str = o.flag("178M", "Model preset whose stage 0 is committed.")
    stages: int = o.flag(2, "Stages the model is split into (stage 0 is timed).")
    replicas: int = o.flag(4, "M: contributions in the round (3+: screening runs).")
    repeats: int = o.flag(3, "Timed commits of each kind; medians are reported.")
    threads: str = o.flag("", "Thread counts to commit with, comma-separated (e.g. 1,2,4); default: torch's.")
    device: str = o.flag("cpu", "Where the commit's elementwise steps run, comma-separated (cpu, cuda).")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class CapsArgs:
    """`peer bench caps`."""

    mbps: float = o.flag(20.0, "The upload and download cap to measure, Mbit/s.")
    window_s: float = o.flag(10.0, "Seconds each rate is measured over.")
    repeats: int = o.flag(1, "Runs; the median of each figure is reported.")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class ReplicaArgs:
    """`peer bench replica`."""

    ranks: int = o.flag(2, "N: ranks of the replica under torchrun, each on its own core.")
    preset: str = o.flag("small", PRESET_HELP)
    stages: int = o.flag(2, "Stages of the replica's chain (all local).")
    batch_size: int = o.flag(8, BATCH_HELP)
    seq_len: int = o.flag(128, SEQ_LEN_HELP)
    microbatches: int = o.flag(2, MICROBATCHES_HELP)
    warmup: int = o.flag(2, "Inner steps before the measured ones.")
    steps: int = o.flag(6, "Measured inner steps per run.")
    repeats: int = o.flag(3, "Runs of each (1 rank, N ranks), alternating; medians reported.")
    sharded: bool = o.flag(
        False, "The N ranks shard the replica (FSDP2, `peer join --sharded`) instead of DDP.", "--sharded"
    )
    gather_per_step: bool = o.flag(
        False,
        "With --sharded: gather and reduce once per inner step (`peer join --gather-per-step`).",
        "--gather-per-step",
    )
    memory: bool = o.flag(
        False,
        "Instead of tokens/s: each of N sharded ranks' peak memory (allocator, as `peer bench memory`) over two "
        "inner steps and a round on its bands, against one unsharded replica's.",
        "--memory",
    )
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class MemoryArgs:
    """`peer bench memory`."""

    rss: bool = o.flag(False, "Also peak RSS per case (a fresh process each).", "--rss")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class DataArgs:
    """`peer bench data` (the field names are `peer.research.bench.data.command`'s keys)."""

    sizes: str = o.flag("10M,1B", "Comma-separated synthetic corpus sizes in tokens (2 bytes each), e.g. 10M,1B.")
    batches: int = o.flag(2000, "Batches a head reads in each memory run.")
    batch_size: int = o.flag(8, BATCH_HELP)
    seq_len: int = o.flag(128, SEQ_LEN_HELP)
    n_shards: int = o.flag(4, "Data shards (claims) the corpus is split into.")
    steps: int = o.flag(3, "Inner steps of the tiny model after the batches (0: none).")
    workdir: Path | None = o.flag(None, "Where the corpora are written (default: a fresh temporary folder).")
    keep: bool = o.flag(False, "Keep the synthetic corpora afterwards.", "--keep")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class SwarmArgs:
    """`peer bench swarm` (the field names are `peer.research.bench.swarm.command`'s keys)."""

    peers: str = o.flag("8,16,32,64,128,256,512,1000", "Swarm sizes M to simulate, comma-separated.")
    rules: str = o.flag("all,ranges,voted", "Round rules to compare: all (today), ranges, voted.")
    rounds: int = o.flag(2, "Outer rounds simulated per M and rule.")
    seed: int = o.flag(0, "Seed of every draw (links, compute jitter, churn).")
    preset: str = o.flag("1B", "Model preset (shapes for payload and compute).")
    stages: int = o.flag(4, STAGES_HELP)
    stage: int = o.flag(0, "The stage whose round is simulated.")
    inner_steps: int = o.flag(50, INNER_HELP)
    flops: float = o.flag(400e12, "One device's sustained FLOP/s (the planner's).")
    home_up_mbps: float = o.flag(20.0, "Home link upload, Mbit/s.")
    home_down_mbps: float = o.flag(100.0, "Home link download, Mbit/s.")
    home_rtt_ms: str = o.flag("20,200", "Home RTT range MIN,MAX in ms (uniform).")
    dc_fraction: float = o.flag(0.0, "Share of datacenter peers, 0..1.")
    dc_up_mbps: float = o.flag(1000.0, "Datacenter upload, Mbit/s.")
    dc_down_mbps: float = o.flag(1000.0, "Datacenter download, Mbit/s.")
    dc_rtt_ms: str = o.flag("5,50", "Datacenter RTT range MIN,MAX in ms.")
    rate_spread: float = o.flag(0.0, "σ of a log-normal factor on each peer's rates (0: none).")
    rpc_ms: float = o.flag(1.0, "Server CPU per request, ms.")
    churn_per_h: float = o.flag(0.5, "Leaves (and joins) per peer per hour.")
    deadline_s: float = o.flag(120.0, "A round's deadline, s (swarm.round_timeout_s).")
    fetch_parallel: int = o.flag(64, "Requests in flight per peer (ranges; the swarm's MAX_FETCHERS).")
    range_backups: int = o.flag(1, "Owners per range beyond the primary.")
    shard_topk: int = o.flag(0, "Entries per tile a topk shard keeps (0: sparseloco.topk).")
    shard: str = o.flag("topk", "What a range owner publishes: topk (re-sparsified) or exact (swarm.shard).")
    support_topk: int = o.flag(64, "Positions per tile of the voted rule's agreed support (k′).")
    mean_bits: int = o.flag(8, "Bits of the voted rule's mean shards (swarm.mean_bits; 0: float32).")
    owner_grace_s: float = o.flag(3.0, "A range's co-owners are waited for this long after the first (0: records).")
    roster_quiet_s: float = o.flag(2.0, "Quiet close of the roster and the values, s (swarm.roster_quiet_s; 0: off).")
    calibrate: bool = o.flag(False, "Instead: a real loopback all-to-all vs the simulator.", "--calibrate")
    calibrate_peers: str = o.flag("4,8", "Replicas of the loopback swarms.")
    calibrate_rounds: int = o.flag(5, "Rounds of each loopback swarm.")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class SybilArgs:
    """`peer bench sybil` (the field names are `peer.research.bench.sybil.command`'s keys, `round_t` its "round")."""

    replicas: int = o.flag(10, "M: contributors of the round measured.")
    strategies: str = o.flag(
        "aligned,reversed,orthogonal,threshold",
        "Colluders' strategies: aligned, reversed, orthogonal, threshold (comma-separated).",
    )
    preset: str = o.flag("tiny", "Model preset of the honest run.")
    stages: int = o.flag(2, STAGES_HELP)
    stage: int = o.flag(0, "The stage whose round is measured.")
    round_t: int = o.flag(3, "Outer step of the round measured (rounds before it run honestly).", "--round")
    inner_steps: int = o.flag(5, INNER_HELP)
    batch_size: int = o.flag(4, BATCH_HELP)
    seq_len: int = o.flag(32, SEQ_LEN_HELP)
    seed: int = o.flag(0, "Seed of the run and of the colluders' target direction.")
    loss_outer_steps: int = o.flag(0, "Also simulate runs this long with K colluders in every round (0: no).")
    loss_strategy: str = o.flag("threshold", "The colluders' strategy in those runs.")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class CodecArgs:
    """`peer bench codec`."""

    params: float = o.flag(178e6, PARAMS_HELP)
    runs: int = o.flag(5, "Runs of the codec figures, each the median of 3 repetitions.")
    templar_src: Path | None = o.flag(None, TEMPLAR_HELP)


@dataclass(frozen=True)
class FetchArgs:
    """`peer bench fetch`."""

    tokens: int = o.flag(100_000_000, "Token ids in the synthetic dataset served.")
    shard_tokens: int = o.flag(1 << 24, "Token ids per shard.")
    max_download_mbps: float = o.flag(400.0, "The capped fetch's download cap, Mbit/s.")
    workdir: Path | None = o.flag(None, "Where the dataset and the fetches go (default: a temporary folder).")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class SimulateSpeedArgs:
    """`peer bench simulate`."""

    outer_steps: int = o.flag(4, "T: outer steps of every run.")
    inner_steps: int = o.flag(10, "H: inner steps per outer step.")
    replicas: int = o.flag(4, "M: replicas of every run.")
    workers: int | None = o.flag(None, "Worker processes of the new path (default: all cores, at most M).")
    repeats: int = o.flag(2, "Runs of the old and the new path, interleaved.")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")


@dataclass(frozen=True)
class DashboardBenchArgs:
    """`peer bench dashboard`."""

    holders: int = o.flag(1000, "Stage holders whose records the measured page shows.")
    stages: int = o.flag(4, "Stages they are spread over.")
    replicas: int = o.flag(8, "Replicas (half pipelines, half full) whose loss curves the page draws.")
    polls: int = o.flag(50, "Reads of those records before the page is opened (history behind the charts).")
    repeats: int = o.flag(5, "Page loads in fresh tabs; the median is reported.")
    rounds: int = o.flag(10_000, "Rounds of history the memory measurement ingests (0: skip it).")
    memory_holders: int = o.flag(100, "Stage holders per round in the memory measurement.")
    workdir: Path = o.flag(Path("runs") / "bench-dashboard", "Where the history files are written.")
    json_out: Path | None = o.flag(None, JSON_HELP, "--json")
