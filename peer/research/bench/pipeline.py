"""`peer bench pipeline`: the measured counterpart of the paper's Fig. 2 on this machine.

For every combination of boundary compression (k/d), link (unshaped, each `--rate`, with or
without `--rtt-ms`) and schedule (`--in-flight 1`, the sequential one, vs the pipelined one), it
starts the S stage peers as real processes (`peer.research.bench.pipeline_peers`), stage s pinned to core
s mod ncpu (`taskset`, one torch thread), optionally each in its own network namespace joined by
`tc tbf`-shaped links (`peer.research.bench.netns`, as root) with a userspace delay relay in front of every
stage (`peer.research.bench.delay_relay`) for the round trip. The head runs `warmup` + `steps` inner steps;
the whole model on one core with the same batches is the one-device baseline.

Reported per configuration (median over `repeats` of tokens/s): tokens/s, scaling efficiency =
pipeline tokens/s ÷ (S × one-device tokens/s), busy fraction per stage (compute seconds ÷ wall),
bubble fraction = 1 − mean busy fraction, data-plane bytes per token on each link, and tokens/s
relative to the same schedule and k/d unshaped.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.config import RunConfig, build_config
from peer.research.bench.netns import ShapedChain, netns_unavailable
from peer.research.bench.pipeline_peers import StageProcesses, _one_thread_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineBench:
    stages: int = 2
    preset: str = "small"
    split: str = "cost"  # model.stage_split: the head's matmul counted (peer.core.model.decoder.stage_layers)
    seq_len: int = 128
    batch_size: int = 16
    microbatches: int = 8
    k_ratios: tuple[str, ...] = ("1/8", "1")
    rates: tuple[str, ...] = ("", "100mbit", "10mbit")  # "" = unshaped
    rtt_ms: tuple[float, ...] = (0.0,)
    rtt_rate: str = "100mbit"  # the link the round trip is added to ("" = unshaped)
    in_flight: tuple[int, ...] = (1, 0)  # 0 = the default (auto)
    # the head's boundary mode (`peer join --compression`): "always" compressed at k/d, "never", or
    # "auto" (chosen by its measured links after the warm-up: peer.node.pipeline.mode)
    compression: tuple[str, ...] = ("always",)
    wire_dtype: str = "bf16"  # subspace.wire_dtype (its default): the boundary dtype on the wire
    warmup: int = 1
    steps: int = 3
    repeats: int = 1
    netns: bool = True  # namespaces (and shaping) when root; else loopback, shaping skipped
    workdir: Path | None = None
    overrides: dict[str, Any] = field(default_factory=dict)


def _config(b: PipelineBench, k_ratio: str, in_flight: int) -> RunConfig:
    return build_config(
        overrides={
            "preset": b.preset,
            "model.stage_split": b.split,
            "stages": b.stages,
            "subspace.k_ratio": k_ratio,
            "train.seq_len": b.seq_len,
            "train.batch_size": b.batch_size,
            "train.microbatches": b.microbatches,
            "train.inner_steps": b.warmup + b.steps + 1,
            "train.in_flight": in_flight,
            "swarm.rpc_timeout_s": 120,
            "subspace.wire_dtype": b.wire_dtype,
            **b.overrides,
        },
        environ={},
    )


def _taskset(core: int) -> list[str]:
    return ["taskset", "-c", str(core)] if sys.platform.startswith("linux") else []


def _core(s: int) -> int:
    return s % (os.cpu_count() or 1)


def _run_child(cmd: list[str], report: Path) -> dict[str, Any]:
    done = subprocess.run(cmd, env=_one_thread_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0 or not report.exists():
        raise RuntimeError(f"{' '.join(cmd[-6:])} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(report.read_text())
    return result


@contextlib.contextmanager
def _relays(addresses: dict[int, str], rtt_ms: float, prefix: Callable[[int], list[str]]) -> Iterator[dict[int, str]]:
    """A delay relay in front of every stage (in its namespace); yields the relayed addresses."""
    if rtt_ms <= 0:
        yield addresses
        return
    procs, relayed = [], {}
    try:
        for s, address in addresses.items():
            host, port = address.rsplit(":", 1)
            cmd = [*prefix(s), sys.executable, "-m", "peer.research.bench.delay_relay", "--listen", f"{host}:0"]
            cmd += ["--to", f"127.0.0.1:{port}", "--rtt-ms", str(rtt_ms)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            line = proc.stdout.readline() if proc.stdout is not None else ""
            if not line.startswith("READY "):
                raise RuntimeError(f"delay relay for stage {s} did not start: {line!r}")
            relayed[s] = f"{host}:{line.split()[1]}"
        yield relayed
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()


def measure(
    b: PipelineBench, k_ratio: str, rate: str, rtt_ms: float, in_flight: int, work: Path, compression: str = "always"
) -> dict[str, Any]:
    """One pipeline run; returns the head's result plus this configuration."""
    cfg = _config(b, k_ratio, in_flight)
    work.mkdir(parents=True, exist_ok=True)
    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    with contextlib.ExitStack() as stack:
        tag = uuid.uuid4().hex[:4]  # namespace names of this run only (another bench may run beside it)
        chain = stack.enter_context(ShapedChain(b.stages, rate or None, tag=tag)) if b.netns else None

        def prefix(s: int) -> list[str]:
            return [*(chain.exec_prefix(s) if chain else []), *_taskset(_core(s))]

        def hosts(s: int) -> tuple[str, str]:
            if chain is None:
                return "127.0.0.1", "127.0.0.1"
            return ("0.0.0.0" if rtt_ms > 0 else chain.address(s)), chain.address(s)

        procs = stack.enter_context(StageProcesses(cfg_path, b.stages, work, prefix, hosts))
        addresses = stack.enter_context(_relays(procs.start(), rtt_ms, prefix))
        report = work / "head.json"
        cmd = [*prefix(0), sys.executable, "-m", "peer.research.bench.pipeline_peers", "head", str(cfg_path)]
        cmd += ["--addresses", ",".join(addresses[s] for s in sorted(addresses)), "--report", str(report)]
        cmd += ["--warmup", str(b.warmup), "--steps", str(b.steps), "--compression", compression]
        result = _run_child(cmd, report)
    result.pop("losses", None)
    schedule = "sequential" if in_flight == 1 else "pipelined"
    link = {"rate": rate or "unshaped", "rtt_ms": rtt_ms}
    return {"k_ratio": k_ratio, **link, "schedule": schedule, "compression": compression, **result}


def whole(b: PipelineBench, work: Path) -> dict[str, Any]:
    """The whole model in one process on one core (the one-device baseline)."""
    cfg = _config(b, "1/8", 1)
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg.to_dict()))
    report = work / "whole.json"
    cmd = [*_taskset(0), sys.executable, "-m", "peer.research.bench.pipeline_peers", "whole", str(work / "config.json")]
    cmd += ["--report", str(report), "--warmup", str(b.warmup), "--steps", str(b.steps)]
    return _run_child(cmd, report)


def links(b: PipelineBench) -> list[tuple[str, float]]:
    """(rate, rtt ms) of every link setting measured."""
    out = [(r, 0.0) for r in b.rates]
    out += [(b.rtt_rate, ms) for ms in b.rtt_ms if ms > 0]
    return out


def run_bench(b: PipelineBench, progress: Callable[[str], None] = log.info) -> dict[str, Any]:
    """Every configuration of `b`, `repeats` times each; medians by tokens/s."""
    why = netns_unavailable() if b.netns else None
    shaped = any(r for r, _ in links(b))
    if why is not None:
        progress(f"no network namespaces ({why}); stages talk over loopback, shaped links skipped")
        b = PipelineBench(**{**b.__dict__, "netns": False})
    root = Path(b.workdir or tempfile.mkdtemp(prefix="peer-bench-pipeline-"))
    wholes = sorted((whole(b, root / f"whole{i}") for i in range(b.repeats)), key=lambda r: r["tokens_per_s"])
    median = wholes[len(wholes) // 2]
    one = median["tokens_per_s"]
    progress(f"one device (whole model, one core): {one:.0f} tokens/s")
    rows = []
    for k_ratio, (rate, rtt), k in itertools.product(b.k_ratios, links(b), b.in_flight):
        if rate and not b.netns:
            continue
        name = f"{k_ratio.replace('/', '-')}-{rate or 'none'}-{rtt:g}-{k}"
        # the modes' repeats interleaved: a slow spell of a shared machine falls on every mode alike
        runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in b.compression}
        for i in range(b.repeats):
            for mode in b.compression:
                runs[mode].append(measure(b, k_ratio, rate, rtt, k, root / f"{name}-{mode}-{i}", mode))
        for mode in b.compression:
            row = sorted(runs[mode], key=lambda r: r["tokens_per_s"])[len(runs[mode]) // 2]
            row["efficiency"] = row["tokens_per_s"] / (b.stages * one)
            row["bubble"] = 1.0 - sum(row["busy"]) / len(row["busy"])
            row["runs_tokens_per_s"] = [r["tokens_per_s"] for r in runs[mode]]
            row["plan_tokens_per_s"] = planned(b, row, median)
            if "always" in runs:  # each repeat against the forced-compressed run next to it
                pairs = zip(runs[mode], runs["always"], strict=True)
                ratios = sorted(r["tokens_per_s"] / a["tokens_per_s"] for r, a in pairs)
                row["paired_vs_compressed"] = ratios[len(ratios) // 2]
            rows.append(row)
            progress(_line(row))
    for row in rows:
        base = next(
            (r for r in rows if r["k_ratio"] == row["k_ratio"] and r["schedule"] == row["schedule"] and
             r["compression"] == row["compression"] and r["rate"] == "unshaped" and r["rtt_ms"] == 0),
            None,
        )  # fmt: skip
        row["vs_unshaped"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        forced = next(
            (r for r in rows if r["k_ratio"] == row["k_ratio"] and r["schedule"] == row["schedule"] and
             r["compression"] == "always" and r["rate"] == row["rate"] and r["rtt_ms"] == row["rtt_ms"]),
            None,
        )  # fmt: skip
        row["vs_compressed"] = row["tokens_per_s"] / forced["tokens_per_s"] if forced else None
    return {
        "bench": {k: (str(v) if isinstance(v, Path) else v) for k, v in b.__dict__.items()},
        "one_device_tokens_per_s": one,
        "one_device_step_s": median.get("step_s"),
        "rows": rows,
        "shaping": "skipped: " + why if why and shaped else "tc tbf" if shaped else "none",
    }


def rate_mbps(rate: str) -> float | None:
    """A tc rate ("100mbit", "1gbit", "500kbit") in Mbit/s; "" or "unshaped": None."""
    rate = rate.strip().lower()
    if rate in ("", "unshaped"):
        return None
    for unit, scale in (("gbit", 1e3), ("mbit", 1.0), ("kbit", 1e-3)):
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"cannot read the rate {rate!r} (use e.g. 100mbit)")


def planned(b: PipelineBench, row: dict[str, Any], one_device: dict[str, Any]) -> float:
    """`peer plan`'s tokens/s for this row, calibrated by the measured one-device run: its FLOP/s
    without the optimizer step, and the step's seconds per parameter; `RPC_OVERHEAD_S` per call end."""
    from peer.core.model.decoder import get_preset
    from peer.research.plan.command import RPC_OVERHEAD_S, flops_from_tokens_per_s, predict_pipeline

    cfg = get_preset(b.preset, stage_split=b.split)
    k_ratio = row["k_ratio"] if row.get("mode", "compressed") == "compressed" else "1"  # (b, L, d) on the wire
    tokens, wall = one_device["tokens"], one_device["wall_s"]
    step_s = one_device.get("step_s", 0.0) * b.steps
    flops = flops_from_tokens_per_s(cfg, b.seq_len, tokens / max(1e-9, wall - step_s))
    return predict_pipeline(
        cfg, b.stages, b.microbatches, b.batch_size, b.seq_len, k_ratio, flops, row["in_flight"],
        rate_mbps(row["rate"]), row["rtt_ms"], wire_dtype=b.wire_dtype, rpc_overhead_s=RPC_OVERHEAD_S,
        opt_s_per_param=one_device.get("opt_s_per_param", 0.0),
    )["tokens_per_s"]  # fmt: skip


def _line(row: dict[str, Any]) -> str:
    link = row["rate"] + (f" +{row['rtt_ms']:g}ms" if row["rtt_ms"] else "")
    mode = f" {row['compression']}→{row['mode']}" if row.get("compression", "always") != "always" else ""
    return (
        f"k/d={row['k_ratio']:<4}{mode} {link:<16} in_flight={row['in_flight']}: {row['tokens_per_s']:7.0f} tok/s, "
        f"efficiency {row['efficiency']:.2f}, busy {'/'.join(f'{x:.2f}' for x in row['busy'])}"
    )


def parse_list(text: str, cast: Callable[[str], Any], what: str) -> tuple[Any, ...]:
    """Comma-separated values of a flag ("" items allowed for rates: unshaped)."""
    try:
        return tuple(cast(x.strip()) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{what}: cannot read {text!r}") from None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_from_flags(
    progress: Callable[[str], None],
    *,
    stages: int,
    preset: str,
    split: str,
    seq_len: int,
    batch_size: int,
    microbatches: int,
    k_ratios: str,
    rate: str,
    rtt_ms: str,
    in_flight: str,
    compression: str,
    wire_dtype: str,
    steps: int,
    repeats: int,
    no_netns: bool,
) -> dict[str, Any]:
    """`peer bench pipeline`: check the CLI's flags, run every configuration (progress lines to `progress`)
    and return the result; the CLI renders it (`peer.cli.bench_render`)."""
    from peer.errors import ConfigError

    try:
        bench = PipelineBench(
            stages=stages,
            preset=preset,
            split=split,
            seq_len=seq_len,
            batch_size=batch_size,
            microbatches=microbatches,
            k_ratios=parse_list(k_ratios, str, "--k-ratios"),
            rates=("", *(r for r in parse_list(rate, str, "--rate") if r)),
            rtt_ms=tuple(x for x in parse_list(rtt_ms, float, "--rtt-ms") if x > 0) if rtt_ms.strip() else (),
            in_flight=parse_list(in_flight, int, "--in-flight"),
            compression=parse_list(compression, str, "--compression"),
            wire_dtype=wire_dtype,
            steps=steps,
            repeats=repeats,
            netns=not no_netns,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for k_ratio in bench.k_ratios:  # the run config's own checks (wire dtype, k/d, preset, stages), before any run
        _config(bench, k_ratio, 0)
    bad = [c for c in bench.compression if c not in ("always", "never", "auto")]
    if bad:
        raise ConfigError(f"--compression: {', '.join(bad)} is not always, never or auto")
    if stages < 2 or microbatches < 1 or batch_size % microbatches:
        raise ConfigError("--stages must be >= 2 and --batch-size a multiple of --microbatches")
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # cleanups (namespaces, children) still run
    try:
        return run_bench(bench, progress)
    finally:
        signal.signal(signal.SIGTERM, previous)
