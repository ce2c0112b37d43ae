"""`peer bench swarm`: today's all-to-all round against the range-sharded and the voted ones, simulated for M peers.

Where this sits: `peer.cli.bench` parses the flags and calls `command`; the simulation is
`peer.research.swarm.sim` (engine, churn, the rows), `swarm.gather` ("all", "ranges"), `swarm.voted`
("voted"), `swarm.net` (links), `swarm.sizes` (real byte counts and the planner's compute time);
`--calibrate` runs `peer.research.swarm.calib` (a real loopback swarm beside the simulator).

Per M and rule: per-peer bytes down and up per round (mean and max over the round's holders, in MB and
in payloads of the stage), the round's wall time (a holder's announce to its commit, mean and max), the
compute utilisation (H inner steps / (H inner steps + round), mean over holders), the contributions
counted, and the rounds lost (fewer than half the holders committed them by the deadline). Targets
(issue 24): at the largest M, "ranges" downloads at most 3 payloads per peer, and its round takes at most
twice today's rule's round at M = 8. Issue 37's for "voted", at the largest M: the download stays under
the rule's constant (`voted_bound`: every range's support and mean, plus an owner's (1 + backups) shares
of every member's vote and values; no term grows with M), every live contribution is counted, and the
round takes at most twice all-to-all's at M = 8.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from peer.core.sparseloco.codec.format import QUANT_BITS
from peer.errors import ConfigError
from peer.research.swarm.net import LinkClass, LinkMix
from peer.research.swarm.run import simulate
from peer.research.swarm.sim import SimConfig, summarize
from peer.research.swarm.sizes import voted_sizes

DEFAULT_PEERS = "8,16,32,64,128,256,512,1000"
TARGET_PAYLOADS = 3.0
TARGET_ROUND_RATIO = 2.0
RULES = ("all", "ranges", "voted")


def parse_rules(text: str) -> list[str]:
    rules = [r.strip() for r in text.split(",") if r.strip()]
    if not rules or any(r not in RULES for r in rules):
        raise ConfigError(f"--rules: expected some of {', '.join(RULES)} (comma-separated), got {text!r}")
    return rules


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
    for name, low in (
        ("rounds", 1),
        ("fetch_parallel", 1),
        ("range_backups", 0),
        ("shard_topk", 0),
        ("support_topk", 1),
    ):
        if args[name] < low:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {args[name]}")
    if args["owner_grace_s"] < 0 or args["roster_quiet_s"] < 0:
        raise ConfigError("--owner-grace-s and --roster-quiet-s must be >= 0 (0: off)")
    if args["mean_bits"] not in QUANT_BITS:
        raise ConfigError(f"--mean-bits must be 0, 2, 4 or 8, got {args['mean_bits']}")
    if args["shard"] not in ("topk", "exact"):
        raise ConfigError(f"--shard must be topk or exact, got {args['shard']!r}")
    if args["churn_per_h"] < 0 or not args["deadline_s"] > 0 or not 0 <= args["stage"] < args["stages"]:
        raise ConfigError("--churn-per-h must be >= 0, --deadline-s > 0 and --stage in 0 … --stages − 1")
    mix = LinkMix(home, dc, args["dc_fraction"], args["rate_spread"], args["rpc_ms"] / 1e3)
    names: tuple[str, ...] = ("rounds", "seed", "preset", "stages", "stage", "inner_steps", "flops", "churn_per_h")
    names = (*names, "deadline_s", "fetch_parallel", "range_backups", "shard_topk", "shard", "support_topk")
    names = (*names, "mean_bits", "owner_grace_s", "roster_quiet_s")
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


def voted_bound(cfg: SimConfig, peers: int) -> float:
    """Bytes per holder per round that bound the voted rule's mean download at M = `peers`, whatever M:
    every range's support and mean (with a shard's header), and (1 + range_backups) owner shares of every
    member's vote and values (each with a part's proof): an owner holds (1 + b)·R/M ranges of 1/R each
    and fetches them from M − 1 members, (1 + b)·(M − 1)/M of a whole vote and values; R and the
    proofs' log2 R are the only inputs that move with M."""
    v = voted_sizes(cfg.preset, cfg.stages, cfg.stage, peers, cfg.support_topk, cfg.mean_bits)
    shards = sum(v.supports) + sum(v.means) + 2 * v.n * v.head
    parts = sum(v.votes) + sum(v.values) + 2 * v.n * v.proof
    return shards + (1 + cfg.range_backups) * parts


def targets(rows: list[dict[str, Any]], cfg: SimConfig | None = None) -> list[dict[str, Any]]:
    """The issues' targets, checked on the rows (absent when the runs do not include them); `cfg`: the
    runs' settings (for the voted rule's bound)."""
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
    out += _voted_targets(rows, base[0] if base else None, cfg or SimConfig())
    return out


def _voted_targets(rows: list[dict[str, Any]], base: dict[str, Any] | None, cfg: SimConfig) -> list[dict[str, Any]]:
    """Issue 37's targets for the voted rule at its largest M (module docstring)."""
    voted = [r for r in rows if r["rule"] == "voted"]
    if not voted:
        return []
    top = max(voted, key=lambda r: r["M"])
    bound = voted_bound(cfg, top["M"]) / top["payload_bytes"]
    out = [
        {"target": f"voted at M={top['M']}: download <= its constant, {bound:.2f} payloads per peer",
         "value": f"{top['down_payloads']:.2f} (max {top['down_max_payloads']:.2f})",
         "met": top["down_payloads"] <= bound},
        {"target": f"voted at M={top['M']}: every live contribution counted",
         "value": f"{top['counted']:.0f} of {top['holders']:.0f} holders, {top['timeouts']} late",
         "met": top["counted"] >= top["holders"] and not top["lost"]},
    ]  # fmt: skip
    if base:
        ratio = top["round_s"] / base["round_s"]
        out.append(
            {"target": f"voted round at M={top['M']} <= {TARGET_ROUND_RATIO:g}x all-to-all's at M=8",
             "value": f"{top['round_s']:.1f} s / {base['round_s']:.1f} s = {ratio:.2f}x",
             "met": ratio <= TARGET_ROUND_RATIO}
        )  # fmt: skip
    return out
