"""`peer` command line: parse flags, build the config, call one function, show the result.

The only module that prints (the tables and lines it prints are built in peer.cli.render; each
flag's name, default and help are one field of a dataclass in peer.cli.args).
Every `PeerError` becomes a one-line `error: …` and exit code 2. Every file a command writes goes
where its flags say (--json, --out, --plot, --png, --workdir, --data-dir, --save) or under runs/,
never into the current directory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from peer import package_version
from peer.cli import options as o
from peer.cli.args import (
    BootstrapArgs,
    DashboardArgs,
    DemoArgs,
    ExportArgs,
    JoinArgs,
    PlanArgs,
    PrepareArgs,
    SimulateArgs,
    StatusArgs,
)
from peer.cli.bench import bench_app
from peer.cli.bootstrap import bootstrap_config, dashboard_options, show_peer_id
from peer.core.files import atomic_write_bytes
from peer.core.memory import parse_bytes
from peer.demo.processes import stop_on_signals
from peer.errors import ConfigError, PeerError, ProcessGoneError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Peer-to-peer pre-training of LLMs.")
app.add_typer(bench_app, name="bench")
data_app = typer.Typer(no_args_is_help=True, help="Prepare a dataset: tokenized shards for a run.")
app.add_typer(data_app, name="data")
console = Console()
err_console = Console(stderr=True)

RUNS = Path("runs")  # where a command writes when no flag names a path


def _print_version(value: bool) -> None:
    if value:
        console.print(f"peer {package_version()}", highlight=False)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Peer-to-peer pre-training of LLMs."""


def _setup_logging(verbose: bool) -> None:
    level = os.environ.get("PEER_LOG_LEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(Path(path), (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


def _png_path(flag: Path | None, json_out: Path | None, default: Path) -> Path:
    """A plot goes where --plot/--png says, else next to --json, else to `default` (under runs/)."""
    return flag or (json_out.with_suffix(".png") if json_out else default)


@o.command(app)
def simulate(a: SimulateArgs) -> None:
    """Run the paper's configurations (Tables 2, 4, 5) on the same data and steps (replicas in parallel)."""
    _setup_logging(a.verbose)
    from peer.cli.simulate import command

    args = dataclasses.asdict(a) | {"checkpoint_dir": a.checkpoint_dir or RUNS / "simulate-ckpt"}
    command(console, args, _png_path(a.plot, a.json_out, RUNS / "simulate.png"), _write_json)


@o.command(data_app, "prepare")
def data_prepare(a: PrepareArgs) -> None:
    """Tokenize a corpus into token shards with an index and fingerprints (streams; every core; resumes)."""
    os.environ.setdefault("PEER_LOG_LEVEL", "INFO")  # say what it does before the bar starts (the tokenizer)
    _setup_logging(a.verbose)
    from peer.cli.data_prepare import command

    command(console, err_console, a)


@o.command(app)
def plan(a: PlanArgs) -> None:
    """Will my link keep up? Utilisation of compressed (per k/d) vs uncompressed pipelines (paper Fig. 2),
    and the wall-clock of a token budget (--tokens, Fig. 3)."""
    from peer.cli.plan import plan_command

    args = dataclasses.asdict(a)
    if (a.ranks != 1 or a.sharded) and not a.memory:
        raise ConfigError("--ranks and --sharded size a full replica's memory per rank: pass them with --memory")
    if a.memory:  # the memory table (peer.research.plan.memory) for the same micro-batch flags
        from peer.cli.plan import plan_memory_command

        plan_memory_command(console.print, args, a.json_out, _write_json)
        return
    if a.recommend:  # the mode and k/d per link (peer.research.plan.recommend)
        from peer.cli.plan import plan_recommend_command

        plan_recommend_command(console.print, args, a.json_out, _write_json)
        return
    plan_command(console.print, args, _png_path(a.png, a.json_out, RUNS / "plan.png"), a.json_out, _write_json)


@o.command(app)
def export(a: ExportArgs) -> None:
    """Write the model as a Hugging Face `LlamaForCausalLM` folder (config.json, model.safetensors, tokenizer):
    from a full replica's checkpoints, one checkpoint folder per stage, the live swarm, or `peer simulate --save`."""
    _setup_logging(a.verbose)
    if bool(a.checkpoint) == bool(a.initial_peers):
        raise ConfigError("give checkpoint folders or --initial-peers ADDR (a live swarm), not both and not neither")

    def say(line: str) -> None:  # progress on stdout: stderr holds warnings and the one `error:` line
        console.print(line, soft_wrap=True, highlight=False)

    if a.initial_peers:
        from peer.export.live import export_live
        from peer.net.dht import load_swarm_secret

        secret = load_swarm_secret(a.swarm_secret_file)
        result = export_live(a.initial_peers, a.out, a.outer_step, a.timeout_s, secret, say, a.identity)
    else:
        from peer.export.checkpoints import export_folders

        assert a.checkpoint is not None
        result = export_folders(a.checkpoint, a.out, a.outer_step, say)
    step = "" if result.outer_step is None else f" at outer step {result.outer_step}"
    console.print(
        f"exported {result.source}{step} to {result.out} (model.safetensors sha256 {result.model_sha256[:16]}, "
        f"tokenizer: {'yes' if result.tokenizer else 'no'}) — load it with "
        f"transformers.LlamaForCausalLM.from_pretrained('{result.out}')",
        soft_wrap=True,
        highlight=False,
    )


@o.command(app)
def bootstrap(a: BootstrapArgs) -> None:
    """Start a swarm: publish the run's manifest, tokenizer and dataset on a DHT node and print the join lines."""
    _setup_logging(a.verbose)
    if a.print_peer_id:
        return show_peer_id(a.identity)
    from peer.bootstrap.node import ATTESTER_THREAD, BootstrapInfo, export_swarm_secret, run_bootstrap
    from peer.cli.render import bootstrap_banner
    from peer.net.dht_child import start_shared_memory_manager
    from peer.node.link_config import build_link_config

    cfg = bootstrap_config(a, console)
    export_swarm_secret(cfg, a.swarm_secret_file)

    def on_ready(info: BootstrapInfo) -> None:
        for line in bootstrap_banner(info, cfg):
            console.print(line, soft_wrap=True)

    stop = threading.Event()
    start_shared_memory_manager()  # before the handler: see its docstring
    with stop_on_signals(stop):
        console.print("opening the dataset and starting the DHT node…", soft_wrap=True)
        run_bootstrap(
            cfg,
            host=a.host,
            dht_port=a.port,
            grpc_port=a.grpc_port,
            announce_host=a.announce_host,
            identity_path=a.identity,
            address_file=a.address_file,
            on_ready=on_ready,
            stop_event=stop,
            relay=bool(a.relay),
            metrics_port=a.metrics_port,
            max_upload_mbps=build_link_config(None, max_upload_mbps=a.max_upload_mbps).max_upload_mbps,
            attest_dir=(a.attest_dir or cfg.data.cache_dir / "attest") if a.attest else None,
            dashboard=dashboard_options(a, cfg),
        )
    console.print("bootstrap stopped", soft_wrap=True)
    if any(t.name == ATTESTER_THREAD and t.is_alive() for t in threading.enumerate()):
        # stopped while the attester was still being built (torch's first imports, the initial states:
        # longer than the stop waits on a loaded machine): the interpreter's teardown under that thread
        # aborts the process (SIGABRT, "terminate called without an active exception"), so leave now
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


@o.command(app)
def dashboard(a: DashboardArgs) -> None:
    """Serve a live dashboard of a swarm (web page and /api/ JSON) from its DHT records, on any machine."""
    _setup_logging(a.verbose)
    from peer.bootstrap.dashboard.run import Dashboard, DashboardOptions, run_dashboard
    from peer.net.dht import load_swarm_secret
    from peer.net.dht_child import start_shared_memory_manager

    def on_ready(board: Dashboard) -> None:
        console.print(f"dashboard of {board.collector.run['run_id']} at {board.url}", soft_wrap=True, highlight=False)

    stop = threading.Event()
    opts = DashboardOptions(a.port, a.host, a.history)
    start_shared_memory_manager()  # before the handler: see its docstring
    with stop_on_signals(stop):
        secret = load_swarm_secret(a.swarm_secret_file)
        run_dashboard(a.initial_peers, opts, stop, on_ready, a.timeout_s, a.poll_s, secret)


@o.command(app)
def status(a: StatusArgs) -> None:
    """Show the swarm: stages and the peers holding them, full replicas, outer step, loss, tokens/s."""
    _setup_logging(a.verbose)
    from peer.cli.render import status_view
    from peer.cli.status import collect_status
    from peer.net.dht import SwarmDHT, load_swarm_secret

    secret = load_swarm_secret(a.swarm_secret_file)
    peers = a.initial_peers
    with SwarmDHT(initial_peers=peers, client_mode=True, start_timeout_s=a.timeout_s, swarm_secret=secret) as dht:
        result = collect_status(dht, timeout_s=a.timeout_s, where=", ".join(peers))
    if a.json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
        sys.stdout.flush()
        return
    for part in status_view(result):
        console.print(part, soft_wrap=True)


@o.command(app)
def join(a: JoinArgs) -> None:
    """Join a swarm: hold one stage (`--stage N`) or a whole replica (`--full-replica`)."""
    os.environ.setdefault("PEER_LOG_LEVEL", "INFO")
    _setup_logging(a.verbose)
    from peer.cli.join_setup import join_role, prepare_join, start_loggers
    from peer.net.dht import load_swarm_secret
    from peer.net.dht_child import start_shared_memory_manager
    from peer.node.link_config import build_link_config
    from peer.node.replica.ranks import run_join  # torchrun: one full replica over its processes
    from peer.node.session import SessionOptions, dht_exited, usable_data_dir
    from peer.node.trainer import data_dir_default

    role = join_role(a.stage, a.full_replica, a.device, a.precision, a.compression)
    opts = SessionOptions(
        initial_peers=prepare_join(a.initial_peers, a.initial_peers_file, a.manifest_timeout_s, a.metrics_port, a.host),
        host=a.host,
        port=a.port,
        dht_port=a.dht_port,
        announce_host=a.announce_host,
        data_dir=usable_data_dir(a.data_dir or data_dir_default(role, a.stage)),
        dataset=a.dataset.expanduser() if a.dataset else None,
        identity=str(a.identity) if a.identity else None,
        precision=a.precision,
        activation_checkpointing=a.activation_checkpointing,
        max_memory=None if a.max_memory is None else parse_bytes(a.max_memory, "--max-memory"),
        device=a.device,  # "auto" is decided after the DHT has started
        manifest_timeout_s=a.manifest_timeout_s,
        resume=a.resume,
        link=build_link_config(None, **o.overrides(a, "link")),
        swarm_secret=load_swarm_secret(a.swarm_secret_file),
        in_flight=a.in_flight,  # a head's own window K (peer.node.pipeline.schedule.with_in_flight)
        compression=a.compression,  # a head's boundary mode (peer.node.pipeline.mode)
        sharded=a.sharded,  # torchrun's ranks of a full replica: FSDP2 shards (peer.node.replica.sharded)
        gather_per_step=a.gather_per_step,
    )
    start_loggers(a.wandb, a.tensorboard, opts.data_dir)
    stop = threading.Event()
    start_shared_memory_manager()  # before the handler: see its docstring
    where = "" if a.stage is None else f" (stage {a.stage})"
    err_console.print(f"peer join: {role}{where}; data in {opts.data_dir}")
    with stop_on_signals(stop):
        try:
            code = run_join(opts, a.stage, stop)
        except PeerError as exc:
            if not stop.is_set():
                if isinstance(exc, ProcessGoneError):  # the same line whichever DHT wait noticed first
                    raise dht_exited(opts.data_dir) from None
                raise
            code = 0  # asked to leave (SIGINT/SIGTERM) while waiting: records withdrawn, a clean exit
    raise typer.Exit(code)


@o.command(app)
def demo(a: DemoArgs) -> None:
    """A whole swarm on this machine: a bootstrap, P compressed pipelines and F full replicas as processes
    on loopback."""
    _setup_logging(a.verbose)
    from rich.live import Live

    from peer.cli.plots import plot_demo
    from peer.cli.render import demo_live, demo_summary
    from peer.demo.run import DemoConfig, default_workdir, run_demo

    shape_keys = ("pipelines", "stages", "full_replicas", "outer_steps", "inner_steps", "preset")
    args: dict[str, Any] = {k: getattr(a, k) for k in shape_keys}
    cfg = DemoConfig(**args, timeout_s=a.timeout_s)  # checked before a work directory is made
    cfg = dataclasses.replace(cfg, workdir=a.workdir or default_workdir(RUNS))
    workdir = cfg.workdir
    shape = f"{a.pipelines}×{a.stages}"
    console.print(
        f"peer demo: {a.pipelines} pipeline(s) × {a.stages} stages + {a.full_replicas} full replica(s), "
        f"T={a.outer_steps}, H={a.inner_steps}; logs in {workdir}",
        soft_wrap=True,
        highlight=False,
    )
    try:
        with Live(console=console, auto_refresh=False) as live:
            result = run_demo(cfg, lambda s: live.update(demo_live(s), refresh=True))
    except KeyboardInterrupt:
        err_console.print(f"interrupted — every process the demo started was stopped; logs in {workdir}")
        raise typer.Exit(130) from None
    title = f"peer demo — {a.preset}, {shape} compressed + {a.full_replicas} full, H={a.inner_steps}"
    for part in demo_summary(result, title):
        console.print(part, soft_wrap=True)
    plot_path = _png_path(a.plot, a.json_out, result.workdir / "demo.png")
    plot_demo(result, plot_path, a.inner_steps, title=f"peer demo ({a.preset}, {shape} + {a.full_replicas} full)")
    console.print(f"loss curves: {plot_path}", soft_wrap=True)
    if a.json_out:
        _write_json(a.json_out, {**result.summary, "workdir": str(result.workdir), "args": args})
        console.print(f"results: {a.json_out}", soft_wrap=True)


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
