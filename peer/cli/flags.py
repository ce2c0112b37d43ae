"""The flags of `peer bench …`: name, help, type.

Each flag is a typed `Annotated` alias that `peer/cli/bench.py` puts in a command's signature together
with its default (`json_out: BenchJson = None`), so a flag shared by several benchmarks is written once;
the flags of every other command are dataclass fields instead (peer.cli.args). Invariants: a flag's
name and help are the ones `peer bench … --help` shows; nothing here parses, validates or runs
anything (the CLI and peer.config do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# --- every benchmark -----------------------------------------------------------------------------

Verbose = Annotated[bool, typer.Option("--verbose", "-v")]

# --- peer bench payload (and the --json of several) ----------------------------------------------

BenchParams = Annotated[
    float, typer.Option(help="Approximate model size in parameters; a real model of that size is built.")
]
BenchSeed = Annotated[int, typer.Option()]
BenchRepeats = Annotated[int, typer.Option(help="Timed repetitions (rounds) of each codec; medians are reported.")]
BenchJson = Annotated[Path | None, typer.Option("--json", help="Write the measurement as JSON.")]
BenchTemplarSrc = Annotated[
    Path | None,
    typer.Option(
        "--templar-src",
        help="A templar checkout (holding tplr/compress.py or src/tplr/compress.py): time its real codec too.",
    ),
]

# --- peer bench caps ----------------------------------------------------------------------------

CapsMbps = Annotated[float, typer.Option("--mbps", help="The upload and download cap to measure, Mbit/s.")]
CapsWindow = Annotated[float, typer.Option("--window-s", help="Seconds each rate is measured over.")]
CapsRepeats = Annotated[int, typer.Option("--repeats", help="Runs; the median of each figure is reported.")]

# --- peer bench chaos ----------------------------------------------------------------------------

ChaosFaults = Annotated[int, typer.Option("--faults", help="Faults to inject (one is a bootstrap kill).")]
ChaosSeed = Annotated[int, typer.Option("--seed", help="Seed of the fault schedule.")]
ChaosRoundTimeout = Annotated[float, typer.Option("--round-timeout-s", help="swarm.round_timeout_s.")]
ChaosInnerSteps = Annotated[int, typer.Option("--inner-steps", help="H of the run.")]
ChaosMicrobatches = Annotated[int, typer.Option("--microbatches", help="Pipeline micro-batches per inner step.")]
ChaosInFlight = Annotated[
    int, typer.Option("--in-flight", help="Heads' micro-batches in flight: 0 = auto (1F1B), 1 = sequential.")
]
ChaosWorkdir = Annotated[Path | None, typer.Option("--workdir", help="Logs and data (default: runs/chaos-…).")]
ChaosJson = Annotated[Path | None, typer.Option("--json", help="Write the table and every fault here.")]
ChaosLongStops = Annotated[
    int, typer.Option("--long-stops", help="Faults that are a SIGSTOP longer than two round deadlines.")
]

# --- peer bench commit ---------------------------------------------------------------------------

CommitPreset = Annotated[str, typer.Option("--preset", help="Model preset whose stage 0 is committed.")]
CommitStages = Annotated[int, typer.Option("--stages", help="Stages the model is split into (stage 0 is timed).")]
CommitReplicas = Annotated[int, typer.Option("--replicas", help="M: contributions in the round (3+: screening runs).")]
CommitRepeats = Annotated[int, typer.Option("--repeats", help="Timed commits of each kind; medians are reported.")]


# --- peer bench pipeline / replica ---------------------------------------------------------------

PipeStages = Annotated[int, typer.Option(help="S: stages, each a process pinned to its own core.")]
PipePreset = Annotated[str, typer.Option(help="Model preset.")]
PipeSplit = Annotated[
    str, typer.Option(help="Layers per stage (model.stage_split): even, or cost (the head's matmul counted).")
]
PipeSeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")]
PipeBatch = Annotated[int, typer.Option("--batch-size", help="Sequences per inner step.")]
PipeKRatios = Annotated[str, typer.Option("--k-ratios", help="Comma-separated k/d to compare (1 = uncompressed).")]
PipeRate = Annotated[
    str, typer.Option("--rate", help="Comma-separated tc tbf link rates besides unshaped, e.g. 100mbit,10mbit (root).")
]
PipeRtt = Annotated[
    str, typer.Option("--rtt-ms", help="Comma-separated round trips (ms) added on a 100mbit link by a delay relay.")
]
PipeInFlight = Annotated[
    str, typer.Option("--in-flight", help="Comma-separated schedules: 1 = sequential, 0 = auto, K = K in flight.")
]
PipeSteps = Annotated[int, typer.Option(help="Measured inner steps (after one warm-up step).")]
PipeRepeats = Annotated[int, typer.Option(help="Runs per configuration (the median is reported).")]
PipeNoNetns = Annotated[bool, typer.Option("--no-netns", help="Loopback only, even as root (no shaping).")]
PipeJson = Annotated[Path | None, typer.Option("--json", help="Write every row as JSON (PNG next to it).")]
ReplicaRanks = Annotated[int, typer.Option(help="N: ranks of the replica under torchrun, each on its own core.")]
ReplicaStages = Annotated[int, typer.Option(help="Stages of the replica's chain (all local).")]
ReplicaWarmup = Annotated[int, typer.Option(help="Inner steps before the measured ones.")]
ReplicaSteps = Annotated[int, typer.Option(help="Measured inner steps per run.")]
ReplicaRepeats = Annotated[int, typer.Option(help="Runs of each (1 rank, N ranks), alternating; medians reported.")]

# --- peer bench data -----------------------------------------------------------------------------

DataSizes = Annotated[
    str, typer.Option("--sizes", help="Comma-separated synthetic corpus sizes in tokens (2 bytes each), e.g. 10M,1B.")
]
DataBatches = Annotated[int, typer.Option("--batches", help="Batches a head reads in each memory run.")]
DataShards = Annotated[int, typer.Option("--n-shards", help="Data shards (claims) the corpus is split into.")]
DataSteps = Annotated[int, typer.Option("--steps", help="Inner steps of the tiny model after the batches (0: none).")]
DataWorkdir = Annotated[
    Path | None, typer.Option("--workdir", help="Where the corpora are written (default: a fresh temporary folder).")
]
DataKeep = Annotated[bool, typer.Option("--keep", help="Keep the synthetic corpora afterwards.")]
