"""The flags of the smaller `peer` commands (status, export, demo, data, bench): name, help, type.

Each flag is a typed `Annotated` alias that `peer/cli/main.py` puts in a command's signature together
with its default (`out: ExportOut`), so a flag shared by several commands is written once; the flags
of bootstrap, join and simulate are dataclass fields instead (peer.cli.args). Invariants: a flag's
name and help are the ones `peer … --help` shows; nothing here parses, validates or runs anything
(the CLI and peer.config do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# --- shared --------------------------------------------------------------------------------------

Verbose = Annotated[bool, typer.Option("--verbose", "-v")]
SwarmSecret = Annotated[
    Path | None,
    typer.Option("--swarm-secret-file", help="The swarm secret, for a secret-mode swarm (default $PEER_SWARM_SECRET)."),
]

# --- peer bench / export -------------------------------------------------------------------------

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
Checkpoint = Annotated[
    list[Path] | None,
    typer.Argument(
        help="What to export: a full replica's data dir (or its checkpoints/ or one checkpoints/step-NNNNNN "
        "folder); one such folder per stage (`peer export s0/ s1/`); or a folder written by "
        "`peer simulate --save` (one configuration, or a folder holding exactly one). "
        "Leave out with --initial-peers.",
        metavar="FOLDER",
        show_default=False,
    ),
]
ExportOut = Annotated[Path, typer.Option("--out", help="Output folder for the Hugging Face LlamaForCausalLM files.")]
ExportPeers = Annotated[
    list[str] | None,
    typer.Option(
        "--initial-peers",
        help="Export the live swarm instead: multiaddr of a swarm peer, e.g. the bootstrap's (repeatable). "
        "Each stage's state is downloaded from its holders and checked like a state sync.",
    ),
]
ExportOuterStep = Annotated[
    int | None,
    typer.Option(
        "--outer-step",
        help="Outer step (rounds committed) to export; default: the newest one every folder has a "
        "checkpoint of, or live the newest one a majority of every stage's holders claims. Live "
        "peers hold only their current state.",
    ),
]
ExportIdentity = Annotated[
    Path | None,
    typer.Option(
        "--identity", help="Live: this node's key file (created if missing); an allow-list swarm must admit it."
    ),
]
ExportTimeout = Annotated[
    float,
    typer.Option(
        "--timeout-s", help="Live: seconds to wait for the DHT, the manifest and the holders to agree on one state."
    ),
]

# --- peer status / bench caps --------------------------------------------------------------------

StatusPeers = Annotated[
    list[str],
    typer.Option(
        "--initial-peers",
        help="Multiaddr of a swarm peer, e.g. the bootstrap's /ip4/HOST/tcp/PORT/p2p/ID (repeatable).",
    ),
]
StatusJson = Annotated[bool, typer.Option("--json", help="Print the status as JSON on stdout instead of tables.")]
StatusTimeout = Annotated[
    float, typer.Option("--timeout-s", help="Seconds to wait for the DHT and for the run's manifest.")
]
CapsMbps = Annotated[float, typer.Option("--mbps", help="The upload and download cap to measure, Mbit/s.")]
CapsWindow = Annotated[float, typer.Option("--window-s", help="Seconds each rate is measured over.")]
CapsRepeats = Annotated[int, typer.Option("--repeats", help="Runs; the median of each figure is reported.")]

# --- peer data prepare ---------------------------------------------------------------------------

PrepSource = Annotated[
    str,
    typer.Argument(
        help="builtin:stdlib, a local .txt/.jsonl/.json/.parquet file or folder, a dataset folder with a README.md "
        "card, or a hub dataset name (e.g. allenai/c4)."
    ),
]
PrepOut = Annotated[
    Path,
    typer.Option(
        "--out",
        help="Folder for the shards, index.json and tokenizer.model (new or empty; a prepare stopped there resumes).",
    ),
]
PrepConfig = Annotated[
    str | None, typer.Option("--config", help="Hub configuration / subset, e.g. en (C4) or sample-10BT (FineWeb).")
]
PrepSplit = Annotated[str, typer.Option("--split", help="Split of a hub dataset.")]
TextField = Annotated[str, typer.Option("--text-field", help="Column holding the text (json, parquet, hub).")]
PrepVocabSize = Annotated[
    int | None,
    typer.Option(
        "--vocab-size",
        help="Vocabulary of the tokenizer; match the model preset's (tiny 1024, small 4096, 178M and up 32000). "
        "Default: --tokenizer's, else 1024.",
    ),
]
PrepTokenizer = Annotated[
    Path | None,
    typer.Option(
        "--tokenizer", help="Use this sentencepiece .model instead of training one on the first 10M characters."
    ),
]
ValFraction = Annotated[float, typer.Option("--val-fraction", help="Share of the documents held out for validation.")]
PrepSeed = Annotated[int, typer.Option("--seed", help="Seed of the train/validation document split.")]
ShardTokens = Annotated[int, typer.Option("--shard-tokens", help="Tokens per shard file.")]
PrepWorkers = Annotated[int | None, typer.Option("--workers", help="Tokenizing processes (default: every core).")]
PrepMaxChars = Annotated[
    int | None, typer.Option("--max-chars", help="Cap on the characters read from the source (default: all of them).")
]
Restart = Annotated[
    bool, typer.Option("--restart", help="Remove what an earlier prepare wrote in --out and start over.")
]

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

# --- peer demo -----------------------------------------------------------------------------------

Pipelines = Annotated[int, typer.Option(help="P: compressed pipelines, each S stage peers (stage 0 is the head).")]
DemoStages = Annotated[int, typer.Option(help="S: pipeline stages.")]
FullReplicas = Annotated[int, typer.Option("--full-replicas", help="F: uncompressed full replicas.")]
DemoOuterSteps = Annotated[int, typer.Option("--outer-steps", help="T: outer rounds to train.")]
DemoInnerSteps = Annotated[int, typer.Option("--inner-steps", help="H: inner steps per outer round.")]
DemoPreset = Annotated[str, typer.Option(help="Model preset (tiny trains on a CPU in minutes).")]
DemoJson = Annotated[Path | None, typer.Option("--json", help="Write the per-round summary as JSON here.")]
DemoPlot = Annotated[
    Path | None, typer.Option("--plot", help="Loss-curve PNG (default: next to --json, else WORKDIR/demo.png).")
]
Workdir = Annotated[
    Path | None,
    typer.Option("--workdir", help="Logs and data dirs of every process (default: a fresh runs/demo-<timestamp>)."),
]
DemoTimeout = Annotated[
    float, typer.Option("--timeout-s", help="Seconds the whole demo may take before every process is stopped.")
]

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
