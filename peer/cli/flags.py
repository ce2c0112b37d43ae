"""Every flag of the `peer` command line: its name, its help (units in names), its type.

Each flag is a typed `Annotated` alias that `peer/cli/main.py` puts in a command's signature together
with its default (`stages: SimStages = None`), so a flag shared by several commands is written
once. Invariants: a flag's name and help are the ones `peer … --help` shows; nothing here parses,
validates or runs anything (the CLI and peer.config do).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# --- shared --------------------------------------------------------------------------------------

Config = Annotated[
    Path | None, typer.Option("--config", help="TOML run config (defaults < TOML < PEER_* env < flags).")
]
Verbose = Annotated[bool, typer.Option("--verbose", "-v")]
JsonOut = Annotated[Path | None, typer.Option("--json", help="Write results as JSON here.")]
Preset = Annotated[str | None, typer.Option(help="Model preset: tiny, small, 178M, 512M, 1B (default tiny).")]
KRatio = Annotated[
    str | None, typer.Option("--k-ratio", help="Subspace width k/d of compressed boundaries (default 1/8).")
]
BatchSize = Annotated[
    int | None, typer.Option("--batch-size", help="Sequences per inner step per replica (default 8).")
]
SeqLen = Annotated[int | None, typer.Option("--seq-len", help="Tokens per sequence (default 64).")]
Seed = Annotated[int | None, typer.Option(help="Run seed: init, U, data order (default 0).")]
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

# --- peer bootstrap ------------------------------------------------------------------------------

BootStages = Annotated[int | None, typer.Option(help="S: pipeline stages of compressed pipelines (default 2).")]
BootInnerSteps = Annotated[
    int | None, typer.Option("--inner-steps", help="H: inner steps per outer step (default 20).")
]
BootOuterSteps = Annotated[
    int | None, typer.Option("--outer-steps", help="T: outer steps (rounds) of the run (default 10).")
]
BootDataset = Annotated[
    str | None,
    typer.Option(
        help="The run's one corpus: a prepared folder (`peer data prepare`), or a local file/folder or hub "
        "dataset prepared into the cache (default: the embedded corpus). Heads and full replicas fetch it from here."
    ),
]
JoinDataset = Annotated[
    Path | None,
    typer.Option(
        "--dataset",
        help="A prepared folder holding the run's dataset (head, full replica); its fingerprints must be the "
        "manifest's. Default: <data-dir>/dataset, fetched from the swarm where shards are missing.",
    ),
]
MaxChars = Annotated[
    int | None, typer.Option("--max-chars", help="Cap on the corpus size in characters (default 4000000).")
]
Tokenizer = Annotated[Path | None, typer.Option(help="Use this sentencepiece .model instead of training one.")]
WireDtype = Annotated[str | None, typer.Option("--wire-dtype", help="Boundary dtype on the wire: fp32, bf16, fp16.")]
RunName = Annotated[str | None, typer.Option("--run-name", help="Human name of the run (part of the run id).")]
BootPaperSettings = Annotated[
    bool,
    typer.Option(
        "--paper-settings",
        help="Publish the paper's round rule (peer.config.PAPER_ALGORITHM: no quantization, median clip or "
        "outlier screening, 1-D tensors top-k, all-to-all rounds); prints each setting it changed. "
        "--config, PEER_* and flags still override it.",
    ),
]
BootHost = Annotated[
    str,
    typer.Option(help="Interface to listen on: 0.0.0.0, all (others can join); 127.0.0.1: this machine only."),
]
BootPort = Annotated[int, typer.Option(help="DHT (libp2p) TCP port; 0 picks a free one.")]
GrpcPort = Annotated[
    int, typer.Option("--grpc-port", help="gRPC TCP port serving the tokenizer and manifest; 0 picks a free one.")
]
BootAnnounceHost = Annotated[
    str | None,
    typer.Option(
        "--announce-host", help="Host name or IP other machines reach this one at (needs an explicit --port)."
    ),
]
BootIdentity = Annotated[
    Path | None,
    typer.Option(
        help="libp2p private key file, created if missing; keeps the peer id and multiaddr stable across restarts."
    ),
]
AddressFile = Annotated[
    Path | None,
    typer.Option(
        "--address-file", help="Once ready, write {initial_peers, grpc, run_id, peer_id} JSON here (removed on exit)."
    ),
]
BootAttest = Annotated[
    bool,
    typer.Option(
        "--attest/--no-attest",
        help="Follow every stage by replay and attest the states reached, so joiners past the history window "
        "can start (holds one copy of the model; docs/protocol.md, 'Joining by replay').",
    ),
]
BootAttestDir = Annotated[
    Path | None,
    typer.Option("--attest-dir", help="Where the attester keeps its states across restarts (default: the cache)."),
]
PrintPeerId = Annotated[
    bool,
    typer.Option("--print-peer-id", help="Print the peer id of --identity (creating the key if missing) and exit."),
]
Admission = Annotated[
    str | None,
    typer.Option(
        "--admission",
        help="Who may take part: open, secret (peers need --swarm-secret-file) or allowlist "
        "(only --allow-peer ids). Default: secret with --swarm-secret-file, allowlist with --allow-peer, else open.",
    ),
]
AllowPeer = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-peer",
        help="Peer id admitted in allowlist mode (repeatable; a peer prints its id with "
        "`peer bootstrap --identity KEY_FILE --print-peer-id`).",
    ),
]
BootSwarmSecret = Annotated[
    Path | None,
    typer.Option(
        "--swarm-secret-file",
        help="File holding the swarm secret (secret mode; default $PEER_SWARM_SECRET). "
        "Only a commitment to it is published.",
    ),
]

# --- peer status / join --------------------------------------------------------------------------

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
JoinPeers = Annotated[
    list[str] | None, typer.Option("--initial-peers", help="Multiaddr printed by `peer bootstrap` (repeatable).")
]
JoinStage = Annotated[
    int | None, typer.Option("--stage", help="Hold this pipeline stage (0 = a head that drives a pipeline).")
]
FullReplica = Annotated[bool, typer.Option("--full-replica", help="Hold every stage and train without compression.")]
Device = Annotated[str, typer.Option(help="auto, cpu or cuda.")]
Precision = Annotated[
    str,
    typer.Option(
        "--precision",
        envvar="PEER_PRECISION",
        help="Compute dtype of the inner steps: auto (bf16 on a GPU with native bf16, fp32 on CPU and older GPUs), "
        "bf16, fp16 (with loss scaling) or fp32. Weights, θ_start, the error buffer and every commit stay fp32. "
        "`PEER_PRECISION=bf16 peer demo` gives every join of the demo bf16.",
    ),
]
ActivationCheckpointing = Annotated[
    bool,
    typer.Option(
        "--activation-checkpointing",
        envvar="PEER_ACTIVATION_CHECKPOINTING",
        help="Recompute each layer's activations in backward instead of keeping them (less memory, ~1/3 more "
        "compute); also env PEER_ACTIVATION_CHECKPOINTING=1 (a demo's joins inherit it).",
    ),
]
MaxMemory = Annotated[
    str | None,
    typer.Option(
        "--max-memory",
        help="Memory this peer may use for its stages, e.g. 6GiB or 800MB (default: the device's free memory).",
    ),
]
JoinHost = Annotated[
    str,
    typer.Option(
        help="Interface for the gRPC data plane and the DHT: 0.0.0.0, all (others can dial it); "
        "127.0.0.1: this machine only."
    ),
]
JoinPort = Annotated[int, typer.Option(help="gRPC data-plane port (0 = any free port).")]
DhtPort = Annotated[int, typer.Option("--dht-port", help="DHT port (0 = any free port).")]
JoinAnnounceHost = Annotated[
    str | None, typer.Option("--announce-host", help="Host others reach this peer at (behind NAT / port forwarding).")
]
DataDir = Annotated[
    Path | None, typer.Option("--data-dir", help="Tokenizer, metrics.jsonl and state (default runs/<role>).")
]
JoinIdentity = Annotated[
    Path | None, typer.Option("--identity", help="Persistent peer key file (created on first run).")
]
ManifestTimeout = Annotated[
    float, typer.Option("--manifest-timeout-s", help="How long to wait for the bootstrap's manifest.")
]
Resume = Annotated[
    bool, typer.Option("--resume", help="Continue from the newest good checkpoint in <data-dir>/checkpoints.")
]
InitialPeersFile = Annotated[
    Path | None,
    typer.Option(
        "--initial-peers-file",
        help="JSON written by `peer bootstrap --address-file`: join through its multiaddrs, waiting for the "
        "file up to --manifest-timeout-s (e.g. on a volume shared with the bootstrap).",
    ),
]
MetricsPort = Annotated[
    int | None,
    typer.Option("--metrics-port", help="Serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port)."),
]

MaxUploadMbps = Annotated[
    float | None,
    typer.Option(
        "--max-upload-mbps", help="Cap on what this peer sends, Mbit/s (default: no cap; PEER_LINK__MAX_UPLOAD_MBPS)."
    ),
]
MaxDownloadMbps = Annotated[
    float | None,
    typer.Option(
        "--max-download-mbps",
        help="Cap on what this peer receives, Mbit/s (default: no cap; PEER_LINK__MAX_DOWNLOAD_MBPS).",
    ),
]
Relay = Annotated[
    bool | None,
    typer.Option(
        "--relay", help="Relay calls for peers that cannot be dialled (behind NAT); see docs/connectivity.md."
    ),
]
RelayMaxMbps = Annotated[
    float | None,
    typer.Option("--relay-max-mbps", help="Cap on the bytes relayed for others, Mbit/s (default: no cap)."),
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

# --- peer join --in-flight / peer bench pipeline ---------------------------------------------------

JoinInFlight = Annotated[
    int | None,
    typer.Option(
        "--in-flight", help="Head: micro-batches in the pipeline at once (1 = sequential; default auto from S and RTT)."
    ),
]
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
