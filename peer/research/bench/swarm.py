"""`peer bench swarm`: today's all-to-all round against the range-sharded one, simulated for M peers.

Where this sits: `peer.cli.bench` parses the flags and calls `command`; the simulation is
`peer.research.swarm.sim` (engine, churn, the rows), `swarm_gather` (the two rules), `swarm_net` (links),
`swarm_sizes` (real byte counts and the planner's compute time); `--calibrate` runs
`peer.research.swarm.calib` (a real loopback swarm beside the simulator).

Per M and rule: per-peer bytes down and up per round (mean and max over the round's holders, in MB and
in payloads of the stage), the round's wall time (a holder's announce to its commit, mean and max), the
compute utilisation (H inner steps / (H inner steps + round), mean over holders), the contributions
counted, and the rounds lost (fewer than half the holders committed them by the deadline). Targets
(issue 24): at the largest M, "ranges" downloads at most 3 payloads per peer, and its round takes at most
twice today's rule's round at M = 8.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from peer.errors import ConfigError
from peer.research.swarm.net import LinkClass, LinkMix
from peer.research.swarm.run import simulate
from peer.research.swarm.sim import SimConfig, summarize

DEFAULT_PEERS = "8,16,32,64,128,256,512,1000"
TARGET_PAYLOADS = 3.0
TARGET_ROUND_RATIO = 2.0


def parse_ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers like 8,16,1000, got {text!r}") from None
    if not out or any(n < 2 for n in out):
        raise ConfigError(f"{flag}: every M must be 2 or more, got {text!r}")
    return out


def parse_range(text: str, flag: str) -> tuple[float, float]:
    """`20,200` (or one number) as (min, max)."""
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if len(vals) not in (1, 2) or any(v < 0 for v in vals) or vals[0] > vals[-1]:
        raise ConfigError(f"{flag}: expected MIN,MAX in ms like 20,200, got {text!r}")
    return vals[0], vals[-1]


def sim_config(args: Mapping[str, Any], peers: int, rule: str) -> SimConfig:
    """The `SimConfig` of one (M, rule) from the CLI's flags."""
    home = LinkClass(args["home_up_mbps"], args["home_down_mbps"], *parse_range(args["home_rtt_ms"], "--home-rtt-ms"))
    dc = LinkClass(args["dc_up_mbps"], args["dc_down_mbps"], *parse_range(args["dc_rtt_ms"], "--dc-rtt-ms"))
    if not 0 <= args["dc_fraction"] <= 1:
        raise ConfigError(f"--dc-fraction must be in [0, 1], got {args['dc_fraction']}")
    for name, low in (("rounds", 1), ("fetch_parallel", 1), ("range_backups", 0), ("shard_topk", 0)):
        if args[name] < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {args[name]}")
    if args["shard"] not in ("topk", "exact"):
        raise ConfigError(f"--shard must be topk or exact, got {args['shard']!r}")
    if args["churn_per_h"] < 0 or not args["deadline_s"] > 0 or not 0 <= args["stage"] < args["stages"]:
        raise ConfigError("--churn-per-h must be >= 0, --deadline-s > 0 and --stage in 0 … --stages − 1")
    mix = LinkMix(home, dc, args["dc_fraction"], args["rate_spread"], args["rpc_ms"] / 1e3)
    names: tuple[str, ...] = ("rounds", "seed", "preset", "stages", "stage", "inner_steps", "flops", "churn_per_h")
    names = (*names, "deadline_s", "fetch_parallel", "range_backups", "shard_topk", "shard")
    return SimConfig(peers=peers, rule=rule, mix=mix, **{n: args[n] for n in names})


def run_one(cfg: SimConfig) -> dict[str, Any]:
    """One (M, rule): its rounds' rows averaged (the maxima as maxima), rounds lost counted."""
    rows = summarize(simulate(cfg))
    if not rows:
        raise ConfigError(f"M={cfg.peers} {cfg.rule}: no round completed; raise --rounds or lower --churn-per-h")
    payload = rows[0]["payload_bytes"]
    out: dict[str, Any] = {"M": cfg.peers, "rule": rows[0]["rule"], "R": max(r["R"] for r in rows)}
    for key in ("down_mean", "up_mean", "round_s", "compute_s", "util", "counted", "holders"):
        out[key] = statistics.fmean(r[key] for r in rows)
    for key in ("down_max", "up_max", "round_max_s"):
        out[key] = max(r[key] for r in rows)
    out["payload_bytes"] = payload
    out["down_payloads"], out["down_max_payloads"] = out["down_mean"] / payload, out["down_max"] / payload
    out["up_payloads"], out["up_max_payloads"] = out["up_mean"] / payload, out["up_max"] / payload
    out["rounds"], out["lost"] = len(rows), sum(r["lost"] for r in rows)
    out["timeouts"] = sum(r["timeouts"] for r in rows)
    return out


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's two targets, checked on the rows (absent when the runs do not include them)."""
    out = []
    ranges = [r for r in rows if r["rule"] == "ranges"]
    base = [r for r in rows if r["rule"] == "all" and r["M"] == 8]
    if ranges:
        top = max(ranges, key=lambda r: r["M"])
        ok = top["down_payloads"] <= TARGET_PAYLOADS
        out.append(
            {"target": f"ranges at M={top['M']}: download <= {TARGET_PAYLOADS:g} payloads per peer",
             "value": f"{top['down_payloads']:.2f} (max {top['down_max_payloads']:.2f})", "met": ok}
        )  # fmt: skip
        if base:
            ratio = top["round_s"] / base[0]["round_s"]
            out.append(
                {"target": f"ranges round at M={top['M']} <= {TARGET_ROUND_RATIO:g}x all-to-all's at M=8",
                 "value": f"{top['round_s']:.1f} s / {base[0]['round_s']:.1f} s = {ratio:.2f}x",
                 "met": ratio <= TARGET_ROUND_RATIO}
            )  # fmt: skip
    return out
