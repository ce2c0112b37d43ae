"""The flags of every `peer` command but `peer bench`, one dataclass per command, one field per flag.

A field is a flag's one source (`peer.cli.options`): its name, its default and its help, or, for a flag
that sets a field of the run's config (`o.setting("train.inner_steps")`), that field's help metadata and
the value it falls back to. A command's own flag takes its default from the object it configures where
that is cheap to import (`DemoConfig`, `Source`). `peer.cli.main` registers each command from its
dataclass; the command gets one instance (`peer bench`'s dataclasses are in `peer.cli.bench_args`).
Invariants: nothing here parses, validates or runs anything; a field's name is the flag's (hyphenated)
unless it names others.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from peer.cli import options as o
from peer.core.data.corpus import Source
from peer.core.data.prepare import SHARD_TOKENS
from peer.demo.run import DemoConfig
from peer.research.simulate.results import SIMULATE_DEFAULTS

CONFIG_HELP = "TOML run config (defaults < TOML < PEER_* env < flags)."
SECRET_HELP = "The swarm secret, for a secret-mode swarm (default $PEER_SWARM_SECRET)."
DASHBOARD_HOST = "127.0.0.1"  # the dashboard shows the whole run: this machine only unless told
DASHBOARD_HOST_HELP = "Interface the dashboard listens on: 127.0.0.1, this machine only; 0.0.0.0, every interface."
_sim = functools.partial(o.setting, defaults=SIMULATE_DEFAULTS)  # simulate's shorter runs in the help


@dataclass(frozen=True)
class BootstrapArgs:
    """`peer bootstrap`."""

    config: Path | None = o.flag(None, CONFIG_HELP, "--config")
    preset: str | None = o.setting("preset")
    stages: int | None = o.setting("stages")
    k_ratio: str | None = o.setting("subspace.k_ratio")
    inner_steps: int | None = o.setting("train.inner_steps")
    outer_steps: int | None = o.setting("train.outer_steps")
    overlap: int | None = o.setting("train.overlap")
    batch_size: int | None = o.setting("train.batch_size")
    seq_len: int | None = o.setting("train.seq_len")
    seed: int | None = o.setting("seed")
    dataset: str | None = o.setting("data.dataset")
    max_chars: int | None = o.setting("data.max_chars")
    tokenizer: Path | None = o.setting("data.tokenizer")
    wire_dtype: str | None = o.setting("subspace.wire_dtype")
    run_name: str | None = o.setting("run_name")
    paper_settings: bool = o.flag(
        False,
        "Publish the paper's round rule (peer.config.PAPER_ALGORITHM: no quantization, median clip or "
        "outlier screening, 1-D tensors top-k, all-to-all rounds); prints each setting it changed. "
        "--config, PEER_* and flags still override it.",
        "--paper-settings",
    )
    host: str = o.flag(
        "0.0.0.0", "Interface to listen on: 0.0.0.0, all (others can join); 127.0.0.1: this machine only."
    )
    port: int = o.flag(0, "DHT (libp2p) TCP port; 0 picks a free one.")
    grpc_port: int = o.flag(0, "gRPC TCP port serving the tokenizer and manifest; 0 picks a free one.")
    announce_host: str | None = o.flag(
        None, "Host name or IP other machines reach this one at (needs an explicit --port)."
    )
    identity: Path | None = o.flag(
        None, "libp2p private key file, created if missing; keeps the peer id and multiaddr stable across restarts."
    )
    address_file: Path | None = o.flag(
        None, "Once ready, write {initial_peers, grpc, run_id, peer_id} JSON here (removed on exit)."
    )
    print_peer_id: bool = o.flag(
        False, "Print the peer id of --identity (creating the key if missing) and exit.", "--print-peer-id"
    )
    admission: str | None = o.flag(
        None,
        "Who may take part: open, secret (peers need --swarm-secret-file) or allowlist "
        "(only --allow-peer ids). Default: secret with --swarm-secret-file, allowlist with --allow-peer, else open.",
    )
    allow_peer: list[str] | None = o.flag(
        None,
        "Peer id admitted in allowlist mode (repeatable; a peer prints its id with "
        "`peer bootstrap --identity KEY_FILE --print-peer-id`).",
    )
    swarm_secret_file: Path | None = o.flag(
        None,
        "File holding the swarm secret (secret mode; default $PEER_SWARM_SECRET). "
        "Only a commitment to it is published.",
    )
    relay: bool | None = o.setting("link.relay", "--relay")
    metrics_port: int | None = o.flag(None, "Serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port).")
    max_upload_mbps: float | None = o.setting("link.max_upload_mbps")
    attest: bool = o.flag(
        True,
        "Follow every stage by replay and attest the states reached, so joiners past the history window "
        "can start (holds one copy of the model; docs/protocol.md, 'Joining by replay').",
        "--attest/--no-attest",
    )
    attest_dir: Path | None = o.flag(None, "Where the attester keeps its states across restarts (default: the cache).")
    dashboard_port: int | None = o.flag(
        None, "Serve the run's live dashboard (web page and /api/ JSON) at http://HOST:PORT/ (0 = any free port)."
    )
    dashboard_host: str = o.flag(DASHBOARD_HOST, DASHBOARD_HOST_HELP)
    dashboard_history: Path | None = o.flag(
        None, "Folder of the dashboard's history file, kept across restarts (default: <cache>/dashboard)."
    )
    verbose: bool = o.flag(False, None, "--verbose", "-v")


@dataclass(frozen=True)
class JoinArgs:
    """`peer join`."""

    initial_peers: list[str] | None = o.flag(None, "Multiaddr printed by `peer bootstrap` (repeatable).")
    stage: int | None = o.flag(None, "Hold this pipeline stage (0 = a head that drives a pipeline).")
    full_replica: bool = o.flag(False, "Hold every stage and train without compression.", "--full-replica")
    sharded: bool = o.flag(
        False,
        "A full replica under torchrun: shard its parameters, gradients and AdamW state over the ranks "
        "(FSDP2) instead of a whole copy per rank (DDP); rank 0 still runs the round on the whole state.",
        "--sharded",
    )
    gather_per_step: bool = o.flag(
        False,
        "With --sharded: gather each unit's parameters and reduce its gradient once per inner step instead of "
        "per micro-batch (DDP's traffic and bits; the whole replica's parameters and gradients per rank "
        "during the step).",
        "--gather-per-step",
    )
    device: str = o.flag("auto", "auto, cpu or cuda.")
    precision: str = o.flag(
        "auto",
        "Compute dtype of the inner steps: auto (bf16 on a GPU with native bf16, fp32 on CPU and older GPUs), "
        "bf16, fp16 (with loss scaling) or fp32. Weights, θ_start, the error buffer and every commit stay fp32. "
        "`PEER_PRECISION=bf16 peer demo` gives every join of the demo bf16.",
        envvar="PEER_PRECISION",
    )
    activation_checkpointing: bool = o.flag(
        False,
        "Recompute each layer's activations in backward instead of keeping them (less memory, ~1/3 more "
        "compute); also env PEER_ACTIVATION_CHECKPOINTING=1 (a demo's joins inherit it).",
        "--activation-checkpointing",
        envvar="PEER_ACTIVATION_CHECKPOINTING",
    )
    max_memory: str | None = o.flag(
        None, "Memory this peer may use for its stages, e.g. 6GiB or 800MB (default: the device's free memory)."
    )
    host: str = o.flag(
        "0.0.0.0",
        "Interface for the gRPC data plane and the DHT: 0.0.0.0, all (others can dial it); "
        "127.0.0.1: this machine only.",
    )
    port: int = o.flag(0, "gRPC data-plane port (0 = any free port).")
    dht_port: int = o.flag(0, "DHT port (0 = any free port).")
    announce_host: str | None = o.flag(None, "Host others reach this peer at (behind NAT / port forwarding).")
    data_dir: Path | None = o.flag(None, "Tokenizer, metrics.jsonl and state (default runs/<role>).")
    dataset: Path | None = o.flag(
        None,
        "A prepared folder holding the run's dataset (head, full replica); its fingerprints must be the "
        "manifest's. Default: <data-dir>/dataset, fetched from the swarm where shards are missing.",
    )
    identity: Path | None = o.flag(None, "Persistent peer key file (created on first run).")
    manifest_timeout_s: float = o.flag(60.0, "How long to wait for the bootstrap's manifest.")
    swarm_secret_file: Path | None = o.flag(None, SECRET_HELP)
    resume: bool = o.flag(False, "Continue from the newest good checkpoint in <data-dir>/checkpoints.", "--resume")
    initial_peers_file: Path | None = o.flag(
        None,
        "JSON written by `peer bootstrap --address-file`: join through its multiaddrs, waiting for the "
        "file up to --manifest-timeout-s (e.g. on a volume shared with the bootstrap).",
    )
    metrics_port: int | None = o.flag(None, "Serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port).")
    wandb: str | None = o.flag(
        None,
        'Log the metrics.jsonl series to this Weights & Biases project (pip install "peer[wandb]"; '
        "WANDB_MODE=offline: no network, files in <data-dir>/wandb).",
    )
    tensorboard: Path | None = o.flag(
        None, 'Write the metrics.jsonl series as TensorBoard event files here (pip install "peer[tensorboard]").'
    )
    in_flight: int | None = o.setting("train.in_flight")  # this head's own K (SessionOptions.in_flight)
    compression: str = o.flag(
        "auto",
        "A head's stage boundaries: auto (uncompressed while its measured links keep the stages busy at "
        "the manifest's subspace.uncompressed_min_util, chosen each outer step), always or never compressed.",
    )
    max_upload_mbps: float | None = o.setting("link.max_upload_mbps")
    max_download_mbps: float | None = o.setting("link.max_download_mbps")
    relay: bool | None = o.setting("link.relay", "--relay")
    relay_max_mbps: float | None = o.setting("link.relay_max_mbps")
    verbose: bool = o.flag(False, None, "--verbose", "-v")


@dataclass(frozen=True)
class SimulateArgs:
    """`peer simulate` (the field names are also the keys a resumed sweep compares, peer.cli.simulate)."""

    preset: str | None = _sim("preset")
    replicas: int | None = o.flag(None, "M: replicas trained side by side (default 4).")
    stages: int | None = _sim("stages")
    k_ratio: str | None = o.flag(None, "Subspace widths k/d, comma-separated: a sweep (default 1/8).")
    het_fraction: float = o.flag(0.5, "α: fraction of uncompressed replicas in het-pp-compress.")
    links: str | None = o.flag(
        None,
        "het-bw-pp-compress: each replica's link in Mbit/s, or full (a full replica), e.g. full,full,1000,10; "
        "each outer step a pipeline runs uncompressed where the node's rule (subspace.uncompressed_min_util) says so.",
    )
    links_change: str | None = o.flag(
        None, "Links from outer step T on (a link degraded or restored), T:LINKS, several separated by ';'."
    )
    link_flops: float | None = o.flag(
        None, "One stage's sustained FLOP/s that --links plan a micro-batch's compute at (default 4e14, peer plan's)."
    )
    inner_steps: int | None = _sim("train.inner_steps")
    outer_steps: int | None = _sim("train.outer_steps")
    batch_size: int | None = _sim("train.batch_size")
    seq_len: int | None = _sim("train.seq_len")
    lr: float | None = _sim("train.lr")
    seed: int | None = _sim("seed")
    seeds: str | None = o.flag(None, "Seeds, comma-separated, e.g. 0,1,2 (default: --seed).")
    configs: str = o.flag("adamw,sparseloco,pp-compress,het-pp-compress", "Comma-separated configs to run.")
    val_tokens: int = o.flag(16384, "Held-out tokens of every evaluation.")
    quant_bits: int | None = _sim("sparseloco.quant_bits")
    clip_median: float | None = _sim("sparseloco.clip_median_factor")
    adamw_lr: float | None = o.flag(None, "Inner learning rate of the adamw* configs (default --lr).")
    te_adaptation: bool = o.flag(True, "Move the embedding's change outside Col(U) into T⊥.")
    weight_projection: bool = o.flag(False, "Keep W_o and W_2 outputs in Col(U) (Table 5).")
    grassmann: bool = o.flag(
        False,
        "Table 5c: train U on the Grassmann manifold, one Riemannian step of the compressed replicas' mean "
        "dL/dU per outer step (simulator only: the swarm keeps a fixed U).",
    )
    grassmann_lr: float | None = o.flag(None, "Table 5c: step size η_U of --grassmann (default 0.5).")
    modified_adamw: bool = o.flag(
        False,
        "Table 5d: compressed replicas step T_S with AdamW in subspace coordinates Z = T_S·U "
        "instead of AdamW then projection.",
    )
    paper_settings: bool = o.flag(
        False,
        "The paper's Table 9 / §3 settings for the preset (= --setting paper): M=8, S=4, H=50, batch 32, "
        "context 2048 (tiny/small: their max_seq_len), lr 1e-3, AdamW lr 3e-4, warmup 500 (≤ 10 % of the run), "
        "the paper's round rule, outer steps from the token budget; printed before the run; flags still win.",
    )
    setting: str | None = o.flag(
        None,
        "Named settings, comma-separated, later wins: paper (Table 9 / §3, as --paper-settings), "
        "adamw-tuned (the AdamW baseline's tuned lr 3e-4, Table 9 *), or a TOML file of dotted keys "
        "(train.lr = 6e-4, replicas = 8, adamw_lr, token_budget); printed before the run; flags still win.",
    )
    token_budget: float | None = o.flag(
        None, "Tokens per run, N: outer steps = ceil(N / (M·H·batch·seq_len)) (not with --outer-steps)."
    )
    extend: float | None = o.flag(
        None,
        "Table 3: F > 1; the baselines run at the budget N and F·N, the other configs at F·N; Δ % against "
        "the baseline at F·N and at its own budget N (N: --token-budget, a setting's, else the T outer steps').",
    )
    dataset: str | None = _sim("data.dataset")
    json_out: Path | None = o.flag(None, "Write results as JSON here.", "--json")
    plot: Path | None = o.flag(None, "Loss-curve PNG (default: next to --json, else runs/simulate.png).")
    save: Path | None = o.flag(None, "Write each config's final model checkpoint under DIR/<config>/.")
    attacks: str | None = o.flag(
        None,
        "Also run each SparseLoCo config with its last replica poisoning every round (random, flip, negate; "
        "comma-separated), with median clipping alone and with outlier screening, e.g. --replicas 8 --clip-median 2.",
    )
    round_rule: str = o.flag(
        "all",
        "Each stage's round: all (all-to-all, today's), ranges (range owners' shards re-sparsified to "
        "swarm.shard_topk per tile), exact (range owners' shards of the exact aggregate, swarm.shard = exact), "
        "aligned (one agreed support per tile from the last aggregate, values only), voted (the support by the "
        "senders' top-k votes), voted-residual (voted, 2-bit means with an agreed residual) or residual (shards of "
        "swarm.shard_topk per tile with an agreed, undecayed residual); see peer.research.simulate.round_designs.",
        "--round",
    )
    overlap: int = o.flag(
        0,
        "N: overlapped outer steps: the first N inner steps of outer step t + 1 run before round t lands, then "
        "each replica rebases onto the committed state keeping that progress (0: synchronous; at most H).",
    )
    workers: int | None = o.flag(
        None,
        "Worker processes that run the replicas' inner steps (default: all cores, at most M; "
        "1: in this process). The results are the same bits for any count.",
    )
    device: str = o.flag("cpu", "Where the replicas train: cpu or cuda (the commit math stays on the CPU).")
    resume: bool = o.flag(
        False,
        "Continue the interrupted sweep in --checkpoint-dir: finished runs are not rerun, the interrupted "
        "one continues from its last outer step (the same settings are required).",
    )
    checkpoint_dir: Path | None = o.flag(
        None, "Where every run's state after each outer step goes (default runs/simulate-ckpt)."
    )
    config: Path | None = o.flag(None, CONFIG_HELP, "--config")
    verbose: bool = o.flag(False, None, "--verbose", "-v")


@dataclass(frozen=True)
class PlanArgs:
    """`peer plan` (its defaults: the paper's Fig. 2; peer.research.plan is not imported here, it
    pulls in the transport, gRPC and protobuf, for every `peer` command)."""

    preset: str = o.flag("70B", "Model preset (tiny … 1B, or 70B for the paper's Fig. 2).")
    params: float | None = o.flag(None, "Parameter count instead of a preset (e.g. 7e9).")
    stages: int = o.flag(4, "Pipeline stages.")
    k_ratio: str = o.flag("1/8", "k/d of compressed boundaries, comma-separated (1/8,1/16,1/32,1/64): one curve each.")
    inner_steps: int = o.flag(50, o.config_help("train.inner_steps"))
    microbatch_size: int = o.flag(1, "Sequences per micro-batch.")
    microbatches: int = o.flag(8, "Micro-batches per inner step.")
    seq_len: int = o.flag(2048, o.config_help("train.seq_len"))
    flops: float = o.flag(400e12, "Sustained accelerator FLOP/s per stage (e.g. 4e14).")
    bandwidth_mbps: str = o.flag("10,30,100,300,1000", "Inter-stage bandwidths in Mbit/s.")
    replicas: int = o.flag(8, "Holders of each stage in the pseudo-gradient round.")
    wire_dtype: str = o.flag("bf16", o.config_help("subspace.wire_dtype"))
    tokens: str | None = o.flag(
        None,
        "Token budget (3e9, 3B, 1.5T): hours to train it per bandwidth and k/d (Fig. 3, a second plot "
        "<png>-wallclock.png).",
    )
    png: Path | None = o.flag(
        None, "Utilisation plot, Fig. 2 (default: next to --json, else runs/plan.png); Fig. 3 beside it."
    )
    json_out: Path | None = o.flag(None, "Write the table as JSON.", "--json")
    memory: bool = o.flag(False, "Peak memory per stage for every preset and stage count instead.", "--memory")
    ranks: int = o.flag(
        1,
        "With --memory: per-rank memory of a full replica over this many ranks (torchrun --nproc-per-node N); "
        "DDP, every rank the whole replica, unless --sharded.",
    )
    sharded: bool = o.flag(
        False,
        "With --memory: the ranks shard the replica (FSDP2, issue 40's per-rank round; `peer join --sharded` runs "
        "the first design, whose rank 0 still holds the whole replica).",
        "--sharded",
    )
    recommend: bool = o.flag(
        False,
        "Per bandwidth, the pipeline mode (uncompressed, or the least compression) that reaches --target-util, "
        "with the loss the paper's Table 2 expects of that k/d.",
        "--recommend",
    )
    target_util: float = o.flag(0.95, "The utilisation --recommend aims for.")
    overlap: int = o.flag(
        0,
        "1: overlapped outer steps (round t runs beside the inner steps of t + 1, each replica rebases when it "
        "lands): max(H·inner, round + commit) + encode + rebase per outer step; 0: synchronous, "
        "H·inner + encode + round + commit.",
    )
    commit_device: str = o.flag(
        "gpu",
        "Where a holder encodes, commits and rebases: gpu (3.0 TB/s, an H100's memory) or cpu (0.69 GB/s, "
        "the portable commit measured on a 2-core VM; the node commits on the CPU today).",
    )
    commit_gbps: float | None = o.flag(None, "The commit device's bytes/s in GB/s (default: the device's figure).")


@dataclass(frozen=True)
class DashboardArgs:
    """`peer dashboard`."""

    initial_peers: list[str] = o.flag(
        o.REQUIRED, "Multiaddr of a swarm peer, e.g. the bootstrap's /ip4/HOST/tcp/PORT/p2p/ID (repeatable)."
    )
    port: int = o.flag(8080, "Serve the dashboard at http://HOST:PORT/ (0 = any free port).")
    host: str = o.flag(DASHBOARD_HOST, DASHBOARD_HOST_HELP)
    history: Path = o.flag(Path("runs") / "dashboard", "Folder of the history file, kept across restarts.")
    poll_s: float = o.flag(2.0, "Seconds between two reads of the run's records.")
    timeout_s: float = o.flag(20.0, "Seconds to wait for the DHT and for the run's manifest.")
    swarm_secret_file: Path | None = o.flag(None, SECRET_HELP)
    verbose: bool = o.flag(False, None, "--verbose", "-v")


@dataclass(frozen=True)
class StatusArgs:
    """`peer status`."""

    initial_peers: list[str] = o.flag(
        o.REQUIRED, "Multiaddr of a swarm peer, e.g. the bootstrap's /ip4/HOST/tcp/PORT/p2p/ID (repeatable)."
    )
    json_out: bool = o.flag(False, "Print the status as JSON on stdout instead of tables.", "--json")
    timeout_s: float = o.flag(20.0, "Seconds to wait for the DHT and for the run's manifest.")
    swarm_secret_file: Path | None = o.flag(None, SECRET_HELP)
    verbose: bool = o.flag(False, None, "--verbose", "-v")


@dataclass(frozen=True)
class ExportArgs:
    """`peer export`."""

    out: Path = o.flag(o.REQUIRED, "Output folder for the Hugging Face LlamaForCausalLM files.")
    checkpoint: list[Path] | None = o.flag(
        None,
        "What to export: a full replica's data dir (or its checkpoints/ or one checkpoints/step-NNNNNN "
        "folder); one such folder per stage (`peer export s0/ s1/`); or a folder written by "
        "`peer simulate --save` (one configuration, or a folder holding exactly one). "
        "Leave out with --initial-peers.",
        argument=True,
        metavar="FOLDER",
        show_default=False,
    )
    initial_peers: list[str] | None = o.flag(
        None,
        "Export the live swarm instead: multiaddr of a swarm peer, e.g. the bootstrap's (repeatable). "
        "Each stage's state is downloaded from its holders and checked like a state sync.",
    )
    outer_step: int | None = o.flag(
        None,
        "Outer step (rounds committed) to export; default: the newest one every folder has a "
        "checkpoint of, or live the newest one a majority of every stage's holders claims. Live "
        "peers hold only their current state.",
    )
    timeout_s: float = o.flag(
        120.0, "Live: seconds to wait for the DHT, the manifest and the holders to agree on one state."
    )
    swarm_secret_file: Path | None = o.flag(None, SECRET_HELP)
    identity: Path | None = o.flag(
        None, "Live: this node's key file (created if missing); an allow-list swarm must admit it."
    )
    verbose: bool = o.flag(False, None, "--verbose", "-v")


_demo = DemoConfig()  # the demo's own defaults: the flags' defaults too


@dataclass(frozen=True)
class DemoArgs:
    """`peer demo` (its defaults are DemoConfig's)."""

    pipelines: int = o.flag(_demo.pipelines, "P: compressed pipelines, each S stage peers (stage 0 is the head).")
    stages: int = o.flag(_demo.stages, "S: pipeline stages.")
    full_replicas: int = o.flag(_demo.full_replicas, "F: uncompressed full replicas.")
    outer_steps: int = o.flag(_demo.outer_steps, "T: outer rounds to train.")
    inner_steps: int = o.flag(_demo.inner_steps, "H: inner steps per outer round.")
    preset: str = o.flag(_demo.preset, "Model preset (tiny trains on a CPU in minutes).")
    json_out: Path | None = o.flag(None, "Write the per-round summary as JSON here.", "--json")
    plot: Path | None = o.flag(None, "Loss-curve PNG (default: next to --json, else WORKDIR/demo.png).")
    workdir: Path | None = o.flag(None, "Logs and data dirs of every process (default: a fresh runs/demo-<timestamp>).")
    timeout_s: float = o.flag(_demo.timeout_s, "Seconds the whole demo may take before every process is stopped.")
    verbose: bool = o.flag(False, None, "--verbose", "-v")


@dataclass(frozen=True)
class PrepareArgs:
    """`peer data prepare` (its source's defaults are Source's)."""

    source: str = o.flag(
        o.REQUIRED,
        "builtin:stdlib, a local .txt/.jsonl/.json/.parquet file or folder, a dataset folder with a README.md "
        "card, or a hub dataset name (e.g. allenai/c4).",
        argument=True,
    )
    out: Path = o.flag(
        o.REQUIRED,
        "Folder for the shards, index.json and tokenizer.model (new or empty; a prepare stopped there resumes).",
    )
    config: str | None = o.flag(None, "Hub configuration / subset, e.g. en (C4) or sample-10BT (FineWeb).")
    split: str = o.flag(Source.split, "Split of a hub dataset.")
    text_field: str = o.flag(Source.text_field, "Column holding the text (json, parquet, hub).")
    vocab_size: int | None = o.flag(
        None,
        "Vocabulary of the tokenizer; match the model preset's (tiny 1024, small 4096, 178M and up 32000). "
        "Default: --tokenizer's, else 1024.",
    )
    tokenizer: Path | None = o.flag(
        None, "Use this sentencepiece .model instead of training one on the first 10M characters."
    )
    val_fraction: float = o.flag(0.05, "Share of the documents held out for validation.")
    seed: int = o.flag(0, "Seed of the train/validation document split.")
    shard_tokens: int = o.flag(SHARD_TOKENS, "Tokens per shard file.")
    workers: int | None = o.flag(None, "Tokenizing processes (default: every core).")
    max_chars: int | None = o.flag(None, "Cap on the characters read from the source (default: all of them).")
    restart: bool = o.flag(False, "Remove what an earlier prepare wrote in --out and start over.", "--restart")
    verbose: bool = o.flag(False, None, "--verbose", "-v")
