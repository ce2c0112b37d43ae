"""`peer` command line: parse flags, build the config, call one function, show the result.

The only module that prints. Every `PeerError` becomes a one-line `error: …` and exit code 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from peer.errors import PeerError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Peer-to-peer pre-training of LLMs.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that measure the design's budgets.")
app.add_typer(bench_app, name="bench")
console = Console()
err_console = Console(stderr=True)

CONFIG_OPT = typer.Option(None, "--config", help="TOML run config (defaults < TOML < PEER_* env < flags).")


def _setup_logging(verbose: bool) -> None:
    level = os.environ.get("PEER_LOG_LEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@contextlib.contextmanager
def _stop_on_signals(stop):
    """SIGINT/SIGTERM set `stop` (graceful leave) while the body runs.

    A process forked meanwhile (the hivemind DHT child) gets the previous handlers back, or it
    would ignore the SIGTERM with which shutdown reaps it.
    """
    import signal

    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore_in_child() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    os.register_at_fork(after_in_child=restore_in_child)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _write_json(path: Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


SIMULATE_DEFAULTS = {"train.inner_steps": 10, "train.outer_steps": 20}


@app.command()
def simulate(
    preset: str | None = typer.Option(None, help="Model preset: tiny, small, 178M, 512M, 1B (default tiny)."),
    replicas: int = typer.Option(4, help="M: replicas trained side by side."),
    stages: int | None = typer.Option(None, help="S: pipeline stages per replica (default 2)."),
    k_ratio: str | None = typer.Option(
        None, "--k-ratio", help="Subspace width k/d of compressed boundaries (default 1/8)."
    ),
    het_fraction: float = typer.Option(
        0.5, "--het-fraction", help="α: fraction of uncompressed replicas in het-pp-compress."
    ),
    inner_steps: int | None = typer.Option(None, "--inner-steps", help="H: inner steps per outer step (default 10)."),
    outer_steps: int | None = typer.Option(None, "--outer-steps", help="T: outer steps (default 20)."),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help="Sequences per inner step per replica (default 8)."
    ),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Tokens per sequence (default 64)."),
    lr: float | None = typer.Option(None, help="Peak inner learning rate."),
    seed: int | None = typer.Option(None, help="Run seed: init, U, data order (default 0)."),
    configs: str = typer.Option("adamw,sparseloco,pp-compress,het-pp-compress", help="Comma-separated configs to run."),
    dataset: str | None = typer.Option(None, help="Local path or hub name; default: the embedded corpus."),
    json_out: Path | None = typer.Option(None, "--json", help="Write results as JSON here."),
    plot: Path | None = typer.Option(None, help="Loss-curve PNG (default: next to --json, or simulate.png)."),
    save: Path | None = typer.Option(None, help="Write each config's final model checkpoint under DIR/<config>/."),
    config: Path | None = CONFIG_OPT,
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the paper's configurations (Table 2) in one process on the same data and steps."""
    _setup_logging(verbose)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from peer.config import build_config
    from peer.core.data import build_token_data
    from peer.errors import ConfigError
    from peer.tools.simulate import CONFIGS, plot_curves
    from peer.tools.simulate import simulate as run_simulation

    unknown = [c.strip() for c in configs.split(",") if c.strip() and c.strip() not in CONFIGS]
    if unknown:
        raise ConfigError(f"--configs: unknown config {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    overrides = {
        "preset": preset,
        "seed": seed,
        "stages": stages,
        "subspace.k_ratio": k_ratio,
        "train.inner_steps": inner_steps,
        "train.outer_steps": outer_steps,
        "train.batch_size": batch_size,
        "train.seq_len": seq_len,
        "train.lr": lr,
        "data.dataset": dataset,
    }
    cfg = build_config(config, overrides, defaults=SIMULATE_DEFAULTS)
    cfg = build_config(config, overrides)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    with console.status("preparing data and tokenizer…"):
        data = build_token_data(cfg.data)
    total = cfg.train.inner_steps * cfg.train.outer_steps
    columns = [
        TextColumn("{task.description:<16}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as bar:
        tasks = {n: bar.add_task(n, total=total, loss=float("nan")) for n in names}

        def progress(name: str, done: int, _total: int, loss: float) -> None:
            bar.update(tasks[name], completed=done, loss=loss)

        results = run_simulation(cfg, data, replicas, names, het_fraction, progress, save)

    table = Table(
        title=f"peer simulate — {cfg.preset}, M={replicas}, S={cfg.stages}, H={cfg.train.inner_steps}, "
        f"T={cfg.train.outer_steps}, k/d={cfg.subspace.k_ratio}"
    )
    for col in (
        "config",
        "k/d",
        "α",
        "train loss",
        "val loss",
        "Δ %",
        "PG bytes/replica",
        "act bytes/replica",
        "wall s",
    ):
        table.add_column(col, justify="right" if col != "config" else "left")
    for r in results:
        table.add_row(
            r.name,
            r.k_ratio or "—",
            "—" if r.het_fraction is None else f"{r.het_fraction:.2f}",
            f"{r.final_loss:.4f}",
            f"{r.final_val_loss:.4f}",
            f"{r.delta_pct:+.2f}",
            _human_bytes(r.pg_bytes),
            _human_bytes(r.act_bytes),
            f"{r.wall_s:.1f}",
        )
    console.print(table)
    plot_path = plot or (json_out.with_suffix(".png") if json_out else Path("simulate.png"))
    plot_curves(results, plot_path, title=f"peer simulate ({cfg.preset}, M={replicas}, S={cfg.stages})")
    console.print(f"loss curves: {plot_path}")
    if json_out:
        args = {
            "preset": cfg.preset,
            "replicas": replicas,
            "stages": cfg.stages,
            "k_ratio": cfg.subspace.k_ratio,
            "het_fraction": het_fraction,
            "inner_steps": cfg.train.inner_steps,
            "outer_steps": cfg.train.outer_steps,
            "batch_size": cfg.train.batch_size,
            "seq_len": cfg.train.seq_len,
            "seed": cfg.seed,
            "configs": names,
        }
        _write_json(json_out, {"configs": [r.summary() for r in results], "args": args})
        console.print(f"results: {json_out}")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


@app.command()
def plan(
    preset: str = typer.Option("70B", help="Model preset (tiny … 1B, or 70B for the paper's Fig. 2)."),
    params: float | None = typer.Option(None, help="Parameter count instead of a preset (e.g. 7e9)."),
    stages: int = typer.Option(4, help="Pipeline stages."),
    k_ratio: str = typer.Option("1/8", "--k-ratio", help="k/d of compressed boundaries."),
    inner_steps: int = typer.Option(50, "--inner-steps", help="H: inner steps per outer step."),
    microbatch_size: int = typer.Option(1, "--microbatch-size", help="Sequences per micro-batch."),
    microbatches: int = typer.Option(8, help="Micro-batches per inner step."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per sequence."),
    flops: float = typer.Option(400e12, help="Sustained accelerator FLOP/s per stage (e.g. 4e14)."),
    bandwidth_mbps: str = typer.Option(
        "10,30,100,300,1000", "--bandwidth-mbps", help="Inter-stage bandwidths in Mbit/s."
    ),
    replicas: int = typer.Option(8, help="Holders of each stage in the pseudo-gradient round."),
    wire_dtype: str = typer.Option("bf16", "--wire-dtype", help="Boundary dtype on the wire: fp32, bf16, fp16."),
    png: Path | None = typer.Option(Path("plan.png"), "--png", help="Utilisation plot."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the table as JSON."),
) -> None:
    """Will my link keep up? Compute utilisation of compressed vs uncompressed pipelines (paper Fig. 2/3)."""
    from peer.errors import ConfigError
    from peer.tools.plan import PlanInputs, plan_rows, plot_plan

    try:
        bws = [float(b) for b in bandwidth_mbps.split(",") if b.strip()]
    except ValueError:
        raise ConfigError(
            f"--bandwidth-mbps: expected comma-separated numbers like 10,100,1000, got {bandwidth_mbps!r}"
        ) from None
    inputs = PlanInputs(
        preset=preset,
        params=params,
        stages=stages,
        k_ratio=k_ratio,
        inner_steps=inner_steps,
        microbatch_size=microbatch_size,
        microbatches=microbatches,
        seq_len=seq_len,
        flops=flops,
        replicas=replicas,
        wire_dtype=wire_dtype,
    )
    rows = plan_rows(inputs, bws)
    table = Table(title=f"peer plan — {rows[0]['model']}, {stages} stages, H={inner_steps}, k/d={k_ratio}")
    for col in (
        "Mbit/s",
        "util compressed",
        "util uncompressed",
        "s/outer compressed",
        "s/outer uncompressed",
        "PG round s",
        "boundary bytes/µbatch (c / u)",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['bandwidth_mbps']:g}",
            f"{100 * r['util_compressed']:.1f} %",
            f"{100 * r['util_uncompressed']:.1f} %",
            f"{r['outer_s_compressed']:.1f}",
            f"{r['outer_s_uncompressed']:.1f}",
            f"{r['round_s']:.1f}",
            f"{_human_bytes(r['boundary_bytes_compressed'])} / {_human_bytes(r['boundary_bytes_uncompressed'])}",
        )
    console.print(table)
    if png:
        plot_plan(rows, png)
        console.print(f"plot: {png}")
    if json_out:
        _write_json(json_out, {"inputs": inputs.__dict__, "rows": rows})


@bench_app.command("payload")
def bench_payload_cmd(
    params: float = typer.Option(
        178e6, help="Approximate model size in parameters; a real model of that size is built."
    ),
    seed: int = typer.Option(0),
    json_out: Path | None = typer.Option(None, "--json", help="Write the measurement as JSON."),
) -> None:
    """Serialized SparseLoCo payload bytes per parameter on a real model's pseudo-gradient."""
    from peer.tools.bench import bench_payload

    with console.status(f"building a ~{params:.3g}-parameter model and measuring its payload…"):
        result = bench_payload(int(params), seed=seed)
    table = Table(title="SparseLoCo payload")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, f"{v:.6g}" if isinstance(v, float) else str(v))
    console.print(table)
    if json_out:
        _write_json(json_out, result)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder written by `peer simulate --save` or a peer."),
    out: Path = typer.Option(..., "--out", help="Output folder for the Hugging Face LlamaForCausalLM files."),
) -> None:
    """Write a checkpoint as a Hugging Face `LlamaForCausalLM` folder (config.json + safetensors + tokenizer)."""
    from peer.tools.export import export_hf

    path = export_hf(checkpoint, out)
    console.print(f"exported to {path} — load it with transformers.LlamaForCausalLM.from_pretrained('{path}')")


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _print_bootstrap(info, cfg) -> None:
    """The bootstrap's banner: run, model, split, k, H, and the exact lines other machines paste."""
    layers = " | ".join(f"{r.start}-{r.stop - 1}" for r in cfg.layer_ranges)
    maddr = info.initial_peers[0]
    console.print(f"[bold]peer bootstrap[/bold] — run [bold]{info.run_id}[/bold]", soft_wrap=True)
    console.print(
        f"model {cfg.preset} ({_fmt_params(cfg.model.n_params)} params, d={cfg.model.d_model}, "
        f"{cfg.model.n_layers} layers) · {cfg.stages} stages (layers {layers}) · "
        f"k={cfg.k} (k/d={cfg.subspace.k_ratio}) · H={cfg.train.inner_steps} · T={cfg.train.outer_steps} · "
        f"batch {cfg.train.batch_size}×{cfg.train.seq_len} tokens",
        soft_wrap=True,
        highlight=False,
    )
    console.print(
        f"tokenizer sha256 {info.tokenizer_sha256[:16]}… served at {info.grpc_address}; manifest refreshed "
        f"every {cfg.swarm.record_ttl_s / 3:.0f} s (ttl {cfg.swarm.record_ttl_s:.0f} s)",
        soft_wrap=True,
        highlight=False,
    )
    console.print("join this run (paste on another machine):", soft_wrap=True)
    extra = {"secret": " --swarm-secret-file SECRET_FILE", "allowlist": " --identity KEY_FILE"}.get(
        cfg.swarm.admission, ""
    )
    lines = [f"peer join --stage {s} --initial-peers {maddr}{extra}" for s in range(cfg.stages)]
    lines += [
        f"peer join --full-replica --initial-peers {maddr}{extra}",
        f"peer status --initial-peers {maddr}{extra if cfg.swarm.admission == 'secret' else ''}",
    ]
    if cfg.swarm.admission != "open":
        console.print(
            f"admission: {cfg.swarm.admission}"
            + (f" ({len(cfg.swarm.allowlist)} allowed peer ids)" if cfg.swarm.admission == "allowlist" else ""),
            soft_wrap=True,
            highlight=False,
        )
    for line in lines:
        console.print(f"  {line}", soft_wrap=True, highlight=False, markup=False)
    if len(info.initial_peers) > 1:
        console.print("other addresses of this node:", soft_wrap=True)
        for other in info.initial_peers[1:]:
            console.print(f"  {other}", soft_wrap=True, highlight=False, markup=False)
    console.print("running; Ctrl-C or SIGTERM stops it", soft_wrap=True)


@app.command()
def bootstrap(
    config: Path | None = CONFIG_OPT,
    preset: str | None = typer.Option(None, help="Model preset: tiny, small, 178M, 512M, 1B (default tiny)."),
    stages: int | None = typer.Option(None, help="S: pipeline stages of compressed pipelines (default 2)."),
    k_ratio: str | None = typer.Option(
        None, "--k-ratio", help="Subspace width k/d of compressed boundaries (default 1/8)."
    ),
    inner_steps: int | None = typer.Option(None, "--inner-steps", help="H: inner steps per outer step (default 20)."),
    outer_steps: int | None = typer.Option(
        None, "--outer-steps", help="T: outer steps (rounds) of the run (default 10)."
    ),
    batch_size: int | None = typer.Option(
        None, "--batch-size", help="Sequences per inner step per replica (default 8)."
    ),
    seq_len: int | None = typer.Option(None, "--seq-len", help="Tokens per sequence (default 64)."),
    seed: int | None = typer.Option(None, help="Run seed: init, U, data order (default 0)."),
    dataset: str | None = typer.Option(
        None, help="Local file/folder or hub dataset name (default: the embedded corpus)."
    ),
    max_chars: int | None = typer.Option(
        None, "--max-chars", help="Cap on the corpus size in characters (default 4000000)."
    ),
    tokenizer: Path | None = typer.Option(None, help="Use this sentencepiece .model instead of training one."),
    wire_dtype: str | None = typer.Option(None, "--wire-dtype", help="Boundary dtype on the wire: fp32, bf16, fp16."),
    run_name: str | None = typer.Option(None, "--run-name", help="Human name of the run (part of the run id)."),
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0: all interfaces)."),
    port: int = typer.Option(0, help="DHT (libp2p) TCP port; 0 picks a free one."),
    grpc_port: int = typer.Option(
        0, "--grpc-port", help="gRPC TCP port serving the tokenizer and manifest; 0 picks a free one."
    ),
    announce_host: str | None = typer.Option(
        None, "--announce-host", help="Host name or IP other machines reach this one at (needs an explicit --port)."
    ),
    identity: Path | None = typer.Option(
        None,
        help="libp2p private key file, created if missing; keeps the peer id and multiaddr stable across restarts.",
    ),
    address_file: Path | None = typer.Option(
        None,
        "--address-file",
        help="Once ready, write {initial_peers, grpc, run_id, peer_id} JSON here (removed on exit).",
    ),
    print_peer_id: bool = typer.Option(
        False, "--print-peer-id", help="Print the peer id of --identity (creating the key if missing) and exit."
    ),
    admission: str | None = typer.Option(
        None,
        "--admission",
        help="Who may take part: open, secret (peers need --swarm-secret-file) or allowlist "
        "(only --allow-peer ids). Default: secret with --swarm-secret-file, allowlist with --allow-peer, else open.",
    ),
    allow_peer: list[str] = typer.Option(
        [],
        "--allow-peer",
        help="Peer id admitted in allowlist mode (repeatable; a peer prints its id with "
        "`peer bootstrap --identity KEY_FILE --print-peer-id`).",
    ),
    swarm_secret_file: Path | None = typer.Option(
        None,
        "--swarm-secret-file",
        help="File holding the swarm secret (secret mode; default $PEER_SWARM_SECRET). "
        "Only a commitment to it is published.",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Start a swarm: publish the run's manifest and tokenizer on a DHT node and print the join lines."""
    _setup_logging(verbose)
    import threading

    from peer.errors import ConfigError

    if print_peer_id:
        if identity is None:
            raise ConfigError("--print-peer-id needs --identity PATH (the key file whose peer id to print)")
        from peer.net.dht import make_identity

        typer.echo(make_identity(identity))
        return
    from peer.config import build_config

    overrides = {
        "preset": preset,
        "stages": stages,
        "subspace.k_ratio": k_ratio,
        "train.inner_steps": inner_steps,
        "train.outer_steps": outer_steps,
        "train.batch_size": batch_size,
        "train.seq_len": seq_len,
        "seed": seed,
        "data.dataset": dataset,
        "data.max_chars": max_chars,
        "data.tokenizer": tokenizer,
        "subspace.wire_dtype": wire_dtype,
        "run_name": run_name,
        "swarm.admission": admission or ("secret" if swarm_secret_file else "allowlist" if allow_peer else None),
        "swarm.allowlist": tuple(allow_peer) or None,
    }
    cfg = build_config(config, overrides)
    from peer.net.dht import SECRET_ENV, load_swarm_secret

    secret = load_swarm_secret(swarm_secret_file)
    if cfg.swarm.admission == "secret":
        if secret is None:
            raise ConfigError(f"--admission secret needs --swarm-secret-file FILE (or {SECRET_ENV})")
        os.environ[SECRET_ENV] = secret.decode()  # run_bootstrap's SwarmDHT reads the secret from here
    elif swarm_secret_file is not None:
        raise ConfigError(
            f"--swarm-secret-file needs --admission secret (this run's admission is {cfg.swarm.admission})"
        )
    from bootstrap.node import run_bootstrap

    stop = threading.Event()
    with _stop_on_signals(stop):
        console.print("building the tokenizer and starting the DHT node…", soft_wrap=True)
        run_bootstrap(
            cfg,
            host=host,
            dht_port=port,
            grpc_port=grpc_port,
            announce_host=announce_host,
            identity_path=identity,
            address_file=address_file,
            on_ready=lambda info: _print_bootstrap(info, cfg),
            stop_event=stop,
        )
    console.print("bootstrap stopped", soft_wrap=True)


def _short_id(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:6]}…{peer_id[-6:]}"


def _fmt(value: object, spec: str = "") -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value)


@app.command()
def status(
    initial_peers: list[str] = typer.Option(
        ...,
        "--initial-peers",
        help="Multiaddr of a swarm peer, e.g. the bootstrap's /ip4/HOST/tcp/PORT/p2p/ID (repeatable).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the status as JSON on stdout instead of tables."),
    timeout_s: float = typer.Option(
        20.0, "--timeout-s", help="Seconds to wait for the DHT and for the run's manifest."
    ),
    swarm_secret_file: Path | None = typer.Option(
        None, "--swarm-secret-file", help="The swarm secret, for a secret-mode swarm (default $PEER_SWARM_SECRET)."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Show the swarm: stages and the peers holding them, full replicas, outer step, loss, tokens/s."""
    _setup_logging(verbose)
    from peer.net.dht import SwarmDHT, load_swarm_secret
    from peer.tools.status import collect_status

    secret = load_swarm_secret(swarm_secret_file)
    with SwarmDHT(initial_peers=initial_peers, client_mode=True, start_timeout_s=timeout_s, swarm_secret=secret) as dht:
        result = collect_status(dht, timeout_s=timeout_s, where=", ".join(initial_peers))
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        sys.stdout.flush()
        return
    console.print(
        f"[bold]run {result['run_id']}[/bold] — preset {result['preset']}, {len(result['stages'])} stages, "
        f"outer step {result['outer_step']}",
        soft_wrap=True,
    )
    table = Table(title="stage peers")
    for col in ("stage", "peer", "role", "state", "outer step", "tokens/s", "address"):
        table.add_column(col, justify="right" if col in ("stage", "outer step", "tokens/s") else "left")
    for stage, peers in result["stages"].items():
        if not peers:
            table.add_row(stage, "—", "", "[yellow]no peer[/yellow]", "", "", f"start one: peer join --stage {stage} …")
        for p in peers:
            table.add_row(
                stage,
                _short_id(p["peer_id"]),
                _fmt(p["role"]),
                _fmt(p["state"]),
                _fmt(p["outer_step"]),
                _fmt(p["tokens_per_s"], ".0f"),
                _fmt(p["address"]),
            )
    console.print(table)
    if not result["full_replicas"]:
        console.print("no full replica (start one: peer join --full-replica …)", soft_wrap=True)
        return
    replicas = Table(title="full replicas")
    for col in ("peer", "outer step", "loss", "tokens/s"):
        replicas.add_column(col, justify="left" if col == "peer" else "right")
    for r in result["full_replicas"]:
        replicas.add_row(
            _short_id(r["peer_id"]), _fmt(r["outer_step"]), _fmt(r["loss"], ".4f"), _fmt(r["tokens_per_s"], ".0f")
        )
    console.print(replicas)


@app.command()
def join(
    initial_peers: list[str] = typer.Option(
        [], "--initial-peers", help="Multiaddr printed by `peer bootstrap` (repeatable)."
    ),
    stage: int | None = typer.Option(
        None, "--stage", help="Hold this pipeline stage (0 = a head that drives a pipeline)."
    ),
    full_replica: bool = typer.Option(False, "--full-replica", help="Hold every stage and train without compression."),
    device: str = typer.Option("auto", help="auto, cpu or cuda."),
    host: str = typer.Option("127.0.0.1", help="Interface for the gRPC data plane and the DHT."),
    port: int = typer.Option(0, help="gRPC data-plane port (0 = any free port)."),
    dht_port: int = typer.Option(0, "--dht-port", help="DHT port (0 = any free port)."),
    announce_host: str | None = typer.Option(
        None, "--announce-host", help="Host others reach this peer at (behind NAT / port forwarding)."
    ),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Tokenizer, metrics.jsonl and state (default runs/<role>)."
    ),
    identity: Path | None = typer.Option(None, "--identity", help="Persistent peer key file (created on first run)."),
    manifest_timeout_s: float = typer.Option(
        60.0, "--manifest-timeout-s", help="How long to wait for the bootstrap's manifest."
    ),
    swarm_secret_file: Path | None = typer.Option(
        None, "--swarm-secret-file", help="The swarm secret, for a secret-mode swarm (default $PEER_SWARM_SECRET)."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the newest good checkpoint in <data-dir>/checkpoints."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Join a swarm: hold one stage (`--stage N`) or a whole replica (`--full-replica`)."""
    import threading

    from peer.errors import ConfigError

    os.environ.setdefault("PEER_LOG_LEVEL", "INFO")
    _setup_logging(verbose)
    if (stage is None) == (not full_replica):
        raise ConfigError("pass exactly one of --stage N or --full-replica")
    if device == "auto":
        device = "cpu"  # decided after the DHT has started (hivemind forks before CUDA is touched)
        auto = True
    else:
        auto = False
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {device!r}")
    from peer.net.dht import load_swarm_secret
    from peer.node.session import SwarmOptions
    from peer.node.trainer import data_dir_default, run_full_replica, run_head, run_stage_peer

    role = "full" if full_replica else ("head" if stage == 0 else "stage")
    opts = SwarmOptions(
        initial_peers=tuple(initial_peers),
        host=host,
        port=port,
        dht_port=dht_port,
        announce_host=announce_host,
        data_dir=data_dir or data_dir_default(role, stage),
        identity=str(identity) if identity else None,
        device=device,
        manifest_timeout_s=manifest_timeout_s,
        resume=resume,
        swarm_secret=load_swarm_secret(swarm_secret_file),
    )
    if auto:
        opts = dataclasses.replace(opts, device="auto")
    stop = threading.Event()
    err_console.print(f"peer join: {role}{'' if stage is None else f' (stage {stage})'}; data in {opts.data_dir}")
    with _stop_on_signals(stop):
        try:
            if full_replica:
                code = run_full_replica(opts, stop)
            elif stage == 0:
                code = run_head(opts, stop)
            else:
                code = run_stage_peer(opts, stage, stop)
        except PeerError:
            if not stop.is_set():
                raise
            code = 0  # asked to leave (SIGINT/SIGTERM) while waiting: records withdrawn, a clean exit
    raise typer.Exit(code)


def _demo_view(state) -> Table:
    """The live table of `peer demo`: one row per join process, totals in the title."""
    b = state.bytes
    loss = "—" if state.train_loss is None else f"{state.train_loss:.3f}"
    table = Table(
        title=(
            f"peer demo — {state.phase} · round {state.round}/{state.outer_steps} · train loss {loss} · "
            f"{state.tokens_per_s:,.0f} tokens/s · activations {_human_bytes(b['activations'])} "
            f"(uncompressed {_human_bytes(b['activations_uncompressed_equiv'])}) · "
            f"pseudo-gradients {_human_bytes(b['pseudo_gradients'])} · {state.elapsed_s:.0f} s"
        ),
        title_justify="left",
    )
    for col in ("process", "role", "stage", "t", "h", "loss", "tokens/s", "rounds", "act sent", "PG sent", "state"):
        table.add_column(col, justify="left" if col in ("process", "role", "state") else "right")
    for p in state.processes:
        status = ("starting" if not p.started else "running") if p.exit_code is None else f"exited {p.exit_code}"
        table.add_row(
            p.name,
            p.role,
            _fmt(p.stage),
            _fmt(p.outer_step),
            _fmt(p.inner_step),
            _fmt(p.loss, ".3f"),
            f"{p.tokens_per_s:,.0f}",
            str(p.rounds_done),
            _human_bytes(p.bytes["activations"]),
            _human_bytes(p.bytes["pseudo_gradients"]),
            status,
        )
    return table


@app.command()
def demo(
    pipelines: int = typer.Option(1, help="P: compressed pipelines, each S stage peers (stage 0 is the head)."),
    stages: int = typer.Option(2, help="S: pipeline stages."),
    full_replicas: int = typer.Option(1, "--full-replicas", help="F: uncompressed full replicas."),
    outer_steps: int = typer.Option(4, "--outer-steps", help="T: outer rounds to train."),
    inner_steps: int = typer.Option(10, "--inner-steps", help="H: inner steps per outer round."),
    preset: str = typer.Option("tiny", help="Model preset (tiny trains on a CPU in minutes)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the per-round summary as JSON here."),
    plot: Path | None = typer.Option(
        None, "--plot", help="Loss-curve PNG (default: next to --json, else WORKDIR/demo.png)."
    ),
    workdir: Path | None = typer.Option(
        None, "--workdir", help="Logs and data dirs of every process (default: a fresh runs/demo-<timestamp>)."
    ),
    timeout_s: float = typer.Option(
        900.0, "--timeout-s", help="Seconds the whole demo may take before every process is stopped."
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """A whole swarm on this machine: a bootstrap, P compressed pipelines and F full replicas as processes on loopback."""
    _setup_logging(verbose)
    from rich.live import Live

    from peer.tools.demo import DemoConfig, default_workdir, plot_demo, run_demo

    cfg = DemoConfig(
        pipelines=pipelines,
        stages=stages,
        full_replicas=full_replicas,
        outer_steps=outer_steps,
        inner_steps=inner_steps,
        preset=preset,
        workdir=workdir,
        timeout_s=timeout_s,
    )
    workdir = workdir or default_workdir()
    cfg = dataclasses.replace(cfg, workdir=workdir)
    console.print(
        f"peer demo: {pipelines} pipeline(s) × {stages} stages + {full_replicas} full replica(s), "
        f"T={outer_steps}, H={inner_steps}; logs in {workdir}",
        soft_wrap=True,
        highlight=False,
    )
    try:
        with Live(console=console, auto_refresh=False) as live:
            result = run_demo(cfg, lambda state: live.update(_demo_view(state), refresh=True))
    except KeyboardInterrupt:
        err_console.print(f"interrupted — every process the demo started was stopped; logs in {workdir}")
        raise typer.Exit(130)
    summary = result.summary
    table = Table(
        title=f"peer demo — {preset}, {pipelines}×{stages} compressed + {full_replicas} full, "
        f"H={inner_steps}, {summary['wall_s']:.0f} s"
    )
    for col in ("round", "train loss", "val loss", "participants", "param hash"):
        table.add_column(col, justify="right" if col != "param hash" else "left")
    for r in summary["rounds"]:
        table.add_row(
            str(r["t"]),
            _fmt(r["train_loss"], ".4f"),
            _fmt(r["val_loss"], ".4f"),
            " ".join(f"{s}:{n}" for s, n in r["participants"].items()),
            " ".join(f"{s}:{h[:8]}" for s, h in r["param_hash"].items()),
        )
    console.print(table)
    b = summary["bytes"]
    ratio = b["activations_uncompressed_equiv"] / b["activations"] if b["activations"] else float("nan")
    console.print(
        f"bytes sent: activations {_human_bytes(b['activations'])} ({ratio:.1f}× less than the "
        f"{_human_bytes(b['activations_uncompressed_equiv'])} uncompressed), pseudo-gradients "
        f"{_human_bytes(b['pseudo_gradients'])}",
        soft_wrap=True,
        highlight=False,
    )
    if summary["params_consistent"]:
        console.print("parameters: every holder of each stage reported the same hash after every round", soft_wrap=True)
    else:
        console.print(
            "[red]parameters diverged: two holders of a stage reported different hashes[/red]", soft_wrap=True
        )
    plot_path = plot or (json_out.with_suffix(".png") if json_out else result.workdir / "demo.png")
    plot_demo(
        result, plot_path, inner_steps, title=f"peer demo ({preset}, {pipelines}×{stages} + {full_replicas} full)"
    )
    console.print(f"loss curves: {plot_path}", soft_wrap=True)
    if json_out:
        args = {
            "pipelines": pipelines,
            "stages": stages,
            "full_replicas": full_replicas,
            "outer_steps": outer_steps,
            "inner_steps": inner_steps,
            "preset": preset,
        }
        _write_json(json_out, {**summary, "workdir": str(result.workdir), "args": args})
        console.print(f"results: {json_out}", soft_wrap=True)


def main() -> None:
    try:
        app()
    except PeerError as exc:
        from rich.markup import escape

        err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)
