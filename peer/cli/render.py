"""Rich renderables of every command's result: the tables and lines `peer …` prints.

The CLI parses flags and calls one function; what it then shows is built here, so the CLI stays
thin and the presentation of a result lives in one place per command. Nothing here prints: each
function returns rich renderables (`Table`, `Text`) and the CLI prints them.

Sizes are written with `rich.filesize.decimal` (powers of 1000: kB, MB, GB), the same unit as the
bandwidths in Mbit/s that `peer plan` takes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rich import filesize
from rich.progress import BarColumn, ProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from peer.demo.summary import DemoResult, DemoState
from peer.net.addresses import Reach, maddr_port, reach_of
from peer.research.bench.sybil_figures import open_swarm_status, open_swarm_warning

if TYPE_CHECKING:  # annotations only: the renderers never need these modules at run time
    from peer.bootstrap.node import BootstrapInfo
    from peer.config import RunConfig
    from peer.research.simulate.engine import ConfigResult


def human_bytes(n: float) -> str:
    """`n` bytes in decimal units, two decimals past 1 kB: "512 bytes", "1.50 MB"."""
    return filesize.decimal(int(n), precision=2)


def fmt(value: object, spec: str = "") -> str:
    """A table cell: "—" for a missing value, floats with `spec`."""
    if value is None:
        return "—"
    if isinstance(value, float) and spec:
        return format(value, spec)
    return str(value)


def short_id(peer_id: str) -> str:
    """A peer id short enough for a table column (first and last six characters)."""
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:6]}…{peer_id[-6:]}"


def fmt_params(n: int) -> str:
    """A parameter count: 1.10B, 178.3M, 512K."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def _table(title: str, columns: Sequence[str], left: Sequence[str] = ()) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right")
    return table


# --- research commands ---------------------------------------------------------------------------


def simulate_table(results: Sequence[ConfigResult], cfg: RunConfig, replicas: int) -> Table:
    """`peer simulate`: one row per configuration (the paper's Table 2 columns)."""
    columns = (
        "config",
        "k/d",
        "α",
        "train loss",
        "val loss",
        "val ppl",
        "Δ %",
        "PG bytes/replica",
        "act bytes/replica",
    )
    table = _table(
        f"peer simulate — {cfg.preset}, M={replicas}, S={cfg.stages}, H={cfg.train.inner_steps}, "
        f"T={cfg.train.outer_steps}, k/d={cfg.subspace.k_ratio}",
        (*columns, "wall s"),
        left=("config",),
    )
    for r in results:
        table.add_row(
            r.name,
            r.k_ratio or "—",
            "—" if r.het_fraction is None else f"{r.het_fraction:.2f}",
            f"{r.final_loss:.4f}",
            f"{r.final_val_loss:.4f}",
            f"{math.exp(r.final_val_loss):.2f}" if r.final_val_loss < 700 else "inf",
            f"{r.delta_pct:+.2f}",
            human_bytes(r.pg_bytes),
            human_bytes(r.act_bytes),
            f"{r.wall_s:.1f}",
        )
    return table


def metric_table(title: str, result: Mapping[str, Any]) -> Table:
    """`peer bench …`: one row per measured value."""
    table = _table(title, ("metric", "value"), left=("metric",))
    for k, v in result.items():
        table.add_row(k, f"{v:.6g}" if isinstance(v, float) else str(v))
    return table


# --- swarm commands ------------------------------------------------------------------------------


def bootstrap_banner(info: BootstrapInfo, cfg: RunConfig) -> list[Text]:
    """`peer bootstrap`: run, model, split, k, H, and the exact lines other machines paste."""
    layers = " | ".join(f"{r.start}-{r.stop - 1}" for r in cfg.layer_ranges)
    maddr = info.initial_peers[0]  # the widest-reaching address (peer.net.addresses.order_maddrs)
    out = [
        Text.from_markup(f"[bold]peer bootstrap[/bold] — run [bold]{info.run_id}[/bold]"),
        Text(
            f"model {cfg.preset} ({fmt_params(cfg.model.n_params)} params, d={cfg.model.d_model}, "
            f"{cfg.model.n_layers} layers) · {cfg.stages} stages (layers {layers}) · "
            f"k={cfg.k} (k/d={cfg.subspace.k_ratio}) · H={cfg.train.inner_steps} · T={cfg.train.outer_steps} · "
            f"batch {cfg.train.batch_size}×{cfg.train.seq_len} tokens"
        ),
        Text(
            f"tokenizer sha256 {info.tokenizer_sha256[:16]}… served at {info.grpc_address}; manifest refreshed "
            f"every {cfg.swarm.record_ttl_s / 3:.0f} s (ttl {cfg.swarm.record_ttl_s:.0f} s)"
        ),
        *_dataset_line(info.manifest),
        *who_can_join(info),
    ]
    admission = cfg.swarm.admission
    extra = {"secret": " --swarm-secret-file SECRET_FILE", "allowlist": " --identity KEY_FILE"}.get(admission, "")
    lines = [f"peer join --stage {s} --initial-peers {maddr}{extra}" for s in range(cfg.stages)]
    lines += [
        f"peer join --full-replica --initial-peers {maddr}{extra}",
        f"peer status --initial-peers {maddr}{extra if admission == 'secret' else ''}",
    ]
    if admission != "open":
        allowed = f" ({len(cfg.swarm.allowlist)} allowed peer ids)" if admission == "allowlist" else ""
        out.append(Text(f"admission: {admission}{allowed}"))
    else:  # what an open swarm admits and risks (peer bench sybil's recorded figures)
        out += [Text(line, style="yellow") for line in open_swarm_warning()]
    out += [Text(f"  {line}") for line in lines]
    if len(info.initial_peers) > 1:
        out.append(Text("other addresses of this node:"))
        out += [Text(f"  {other}") for other in info.initial_peers[1:]]
    window = cfg.swarm.history_rounds
    if info.attest_dir:
        out.append(
            Text(
                f"attester: follows every stage by replay; a joiner more than {window} rounds late starts "
                f"from its states (kept in {info.attest_dir})"
            )
        )
    else:
        out.append(
            Text(
                f"attester: off (--no-attest); a joiner more than {window} rounds late waits for one the run "
                "names (swarm.attesters)",
                style="yellow",
            )
        )
    if info.metrics_url:
        out.append(Text(f"prometheus metrics of the swarm at {info.metrics_url}"))
    if info.dashboard_url:
        out.append(Text(f"live dashboard of the run at {info.dashboard_url}"))
    out.append(Text("running; Ctrl-C or SIGTERM stops it"))
    return out


def _dataset_line(manifest: dict[str, Any]) -> list[Text]:
    """The run's one corpus, as the manifest names it (heads and full replicas fetch what they lack)."""
    if "dataset_fingerprint" not in manifest:
        return []
    tokens = manifest.get("dataset_tokens", {})
    return [
        Text(
            f"dataset {manifest['dataset_fingerprint'][:12]} (validation {manifest['dataset_val_fingerprint'][:12]}): "
            f"{fmt_params(tokens.get('train', 0))} train / {fmt_params(tokens.get('val', 0))} val tokens, "
            "served to heads and full replicas that lack it"
        )
    ]


def who_can_join(info: BootstrapInfo) -> list[Text]:
    """The heading of the join lines: who can use them and, if not everyone, which flags open the run."""
    reach = reach_of(info.initial_peers)
    ports = f"--port {maddr_port(info.initial_peers[0])} --grpc-port {info.grpc_address.rpartition(':')[2]}"
    if reach is Reach.THIS_MACHINE:
        only_here = (
            "only this machine can join: this bootstrap listens on loopback only (--host 127.0.0.1, or this machine "
            "has no other address). To let other machines join, restart it with --host 0.0.0.0 (all interfaces); "
            f"behind a forwarded port or NAT add --announce-host PUBLIC_IP {ports}"
        )
        return [Text(only_here, style="yellow"), Text("join this run (on this machine only):")]
    heading = Text("join this run (paste on another machine):")
    if reach is Reach.ANYONE:
        return [heading]
    private = (
        "these addresses are private: machines on this network can join; from outside it, forward these TCP ports "
        f"to this machine and restart with --announce-host PUBLIC_IP {ports}"
    )
    return [Text(private), heading]


def link_cell(p: Mapping[str, Any]) -> str:
    """How others reach a peer, its caps and refused calls: "relayed ↑10 ↓50 Mbit/s, 3 refused"."""
    caps = [f"{arrow}{p[k]:g}" for arrow, k in (("↑", "max_upload_mbps"), ("↓", "max_download_mbps")) if p.get(k)]
    cell = str(p.get("connectivity") or "?") + (" relay" if p.get("relay") else "")
    cell += f" {' '.join(caps)} Mbit/s" if caps else ""
    return cell + (f", {p['auth_failures']} refused" if p.get("auth_failures") else "")


def status_view(result: Mapping[str, Any]) -> list[Text | Table]:
    """`peer status`: a header line, the stage peers, the full replicas (or how to start one)."""
    out: list[Text | Table] = [
        Text.from_markup(
            f"[bold]run {result['run_id']}[/bold] — preset {result['preset']}, {len(result['stages'])} stages, "
            f"outer step {result['outer_step']}"
        )
    ]
    columns = ("stage", "peer", "role", "state", "outer step", "tokens/s", "in flight", "address", "link")
    table = _table("stage peers", columns, left=("peer", "role", "state", "address", "link"))
    for stage, peers in result["stages"].items():
        if not peers:
            table.add_row(
                stage, "—", "", "[yellow]no peer[/yellow]", "", "", "", f"start one: peer join --stage {stage} …", ""
            )
        for p in peers:
            table.add_row(
                stage,
                short_id(p["peer_id"]),
                fmt(p["role"]) + (f" ({p['mode']})" if p.get("mode") else ""),  # a head's boundary mode
                fmt(p["state"]),
                fmt(p["outer_step"]),
                fmt(p["tokens_per_s"], ".0f"),
                fmt(p.get("in_flight")),
                fmt(p["address"]),
                link_cell(p),
            )
    out.append(table)
    if result.get("admission") == "open":
        out.append(Text(open_swarm_status(), style="yellow"))
    if not result["full_replicas"]:
        out.append(Text("no full replica (start one: peer join --full-replica …)"))
        return out
    heads = ("peer", "outer step", "loss", "tokens/s", "ranks × batch", "link")
    replicas = _table("full replicas", heads, left=("peer", "link"))
    for r in result["full_replicas"]:
        ranks, batch = r.get("ranks"), r.get("global_batch")
        replicas.add_row(
            short_id(r["peer_id"]),
            fmt(r["outer_step"]),
            fmt(r["loss"], ".4f"),
            fmt(r["tokens_per_s"], ".0f"),
            "–" if ranks is None else f"{ranks} × {(batch or 0) // max(1, ranks)}",
            link_cell(r),
        )
    out.append(replicas)
    return out


# --- peer demo -----------------------------------------------------------------------------------


def demo_live(state: DemoState) -> Table:
    """The live table of `peer demo`: one row per join process, totals in the title."""
    b = state.bytes
    loss = "—" if state.train_loss is None else f"{state.train_loss:.3f}"
    table = Table(
        title=(
            f"peer demo — {state.phase} · round {state.round}/{state.outer_steps} · train loss {loss} · "
            f"{state.tokens_per_s:,.0f} tokens/s · activations {human_bytes(b['activations'])} "
            f"(uncompressed {human_bytes(b['activations_uncompressed_equiv'])}) · "
            f"pseudo-gradients {human_bytes(b['pseudo_gradients'])} · {state.elapsed_s:.0f} s"
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
            fmt(p.stage),
            fmt(p.outer_step),
            fmt(p.inner_step),
            fmt(p.loss, ".3f"),
            f"{p.tokens_per_s:,.0f}",
            str(p.rounds_done),
            human_bytes(p.bytes["activations"]),
            human_bytes(p.bytes["pseudo_gradients"]),
            status,
        )
    return table


def demo_summary(result: DemoResult, title: str) -> list[Text | Table]:
    """`peer demo` at the end: per-round losses and hashes, bytes per link kind, parameter agreement."""
    summary = result.summary
    table = _table(
        f"{title}, {summary['wall_s']:.0f} s",
        ("round", "train loss", "val loss", "participants", "param hash"),
        left=("param hash",),
    )
    for r in summary["rounds"]:
        table.add_row(
            str(r["t"]),
            fmt(r["train_loss"], ".4f"),
            fmt(r["val_loss"], ".4f"),
            " ".join(f"{s}:{n}" for s, n in r["participants"].items()),
            " ".join(f"{s}:{h[:8]}" for s, h in r["param_hash"].items()),
        )
    b = summary["bytes"]
    ratio = b["activations_uncompressed_equiv"] / b["activations"] if b["activations"] else float("nan")
    sent = Text(
        f"bytes sent: activations {human_bytes(b['activations'])} ({ratio:.1f}× less than the "
        f"{human_bytes(b['activations_uncompressed_equiv'])} uncompressed), pseudo-gradients "
        f"{human_bytes(b['pseudo_gradients'])}"
    )
    if summary["params_consistent"]:
        agree = Text("parameters: every holder of each stage reported the same hash after every round")
    else:
        agree = Text("parameters diverged: two holders of a stage reported different hashes", style="red")
    return [table, sent, agree]


def loss_progress_columns() -> list[ProgressColumn]:
    """Columns of a per-config progress bar: name, bar, steps, last loss, elapsed, remaining."""
    return [
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    ]
