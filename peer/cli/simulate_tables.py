"""What `peer simulate` prints besides its per-run table: the Table-2 summary, the poisoning tables,
the eq. 5 bias table and the settings a named setting set.

The simulator's research code (`peer.research.simulate`) computes the rows; these functions only
lay them out as rich tables for the CLI to print.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.table import Table

from peer.research.simulate.paper_settings import Resolved
from peer.research.simulate.results import ConfigResult

__all__ = ["bias_table", "poison_tables", "settings_table", "summary_table"]


def _pm(stat: dict[str, Any], fmt: str) -> str:
    """mean ± std in `fmt` (the std without its sign)."""
    std = stat["std"]
    return f"{stat['mean']:{fmt}}" + ("" if math.isnan(std) else f" ± {std:{fmt[1:] if fmt[0] == '+' else fmt}}")


def summary_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    """The Table-2 shape: rows k/d; SparseLoCo loss, each config's Δ %, the paired het − uniform."""
    names = list(dict.fromkeys(n for r in rows for n in r["delta_pct"]))
    pairs = list(dict.fromkeys(f"{p['a']} − {p['b']}" for r in rows for p in r["pairs"]))
    table = Table(title=title)
    columns = ("k/d", "k", "SparseLoCo val", "SparseLoCo ppl", *(f"{n} Δ %" for n in names))
    for col in (*columns, *(f"{p} (nats, 95 % CI)" for p in pairs)):
        table.add_column(col, justify="left" if col == "k/d" else "right")
    own = list(dict.fromkeys(n for r in rows for n in r.get("delta_pct_own_budget", {})))  # Table 3
    for col in [] if not own else ["SparseLoCo val, own budget", *(f"{n} Δ % vs own budget" for n in own)]:
        table.add_column(col, justify="right")
    for r in rows:
        cells = [r["k_ratio"], str(r["k"])]
        cells.append(_pm(r["sparseloco_val_loss"], ".4f") if "sparseloco_val_loss" in r else "—")
        cells.append(_pm(r["sparseloco_val_perplexity"], ".2f") if "sparseloco_val_perplexity" in r else "—")
        cells += [_pm(r["delta_pct"][n], "+.2f") if n in r["delta_pct"] else "—" for n in names]
        for label in pairs:
            p = next((p for p in r["pairs"] if f"{p['a']} − {p['b']}" == label), None)
            if p is None:
                cells.append("—")
            else:
                lo, hi = p["ci95"]
                cells.append(f"{p['diff_mean']:+.4f} [{lo:+.4f}, {hi:+.4f}] ahead {p['a_ahead']}/{p['n']}")
        if own:  # Table 3: the loss at the budget N, each config's Δ % against it
            short, by = r.get("sparseloco_val_loss_own_budget"), r.get("delta_pct_own_budget", {})
            cells += [_pm(short, ".4f") if short else "—", *(_pm(by[n], "+.2f") if n in by else "—" for n in own)]
        table.add_row(*cells)
    return table


def poison_tables(results: Sequence[ConfigResult]) -> list[Table]:
    """One table per screened honest run that has attacked runs: final replica-mean val loss and
    its Δ % against that honest run, contributions clipped, the attacker's contributions dropped
    and honest ones dropped (false drops, out of the honest contributions of the run)."""
    tables = []
    for base in (r for r in results if r.attack is None and r.screening):
        same = (base.config, base.k, base.seed)
        rows = [r for r in results if r.attack is not None and (r.config, r.k, r.seed) == same]
        if not rows:
            continue
        k = "" if base.k_ratio is None else f" {base.k_ratio}"
        table = Table(
            title=f"poisoning — {base.name}{k}, M={base.replicas}, seed {base.seed}: the last replica attacks"
        )
        for col in ("run", "screening", "val loss", "Δ % vs honest", "clipped", "attacker dropped", "honest dropped"):
            table.add_column(col, justify="left" if col == "run" else "right")
        for r in (base, *rows):
            attacker = sum(1 for _, _, m in r.dropped if r.attack is not None and m == r.replicas - 1)
            honest_sent = r.rounds * (r.replicas - (r.attack is not None))
            table.add_row(
                "honest" if r.attack is None else r.attack,
                "on" if r.screening else "off (clip only)",
                f"{r.final_val_loss:.4f}",
                "—" if r is base else f"{r.delta_pct:+.2f}",
                str(r.clipped),
                "—" if r.attack is None else f"{attacker}/{r.rounds}",
                f"{len(r.dropped) - attacker}/{honest_sent}",
            )
        tables.append(table)
    return tables


def _pm3(stat: dict[str, float]) -> str:
    """mean ± std to three places (— when there is no mean): the eq. 5 ratios."""
    if math.isnan(stat["mean"]):
        return "—"
    return f"{stat['mean']:.3f}" + ("" if math.isnan(stat["std"]) else f" ± {stat['std']:.3f}")


def bias_table(rows: Sequence[dict[str, Any]], seeds: Sequence[int]) -> Table:
    """Eq. 5: rows k/d, per config the per-replica and aggregate ‖B‖ / ‖Δ*‖ (mean over rounds; ± over seeds)."""
    names = list(dict.fromkeys(n for r in rows for n in r["configs"]))
    table = Table(
        title=f"eq. 5 bias ‖Δ* − Π(Δ*)‖ / ‖Δ*‖ of the embedding, mean over rounds, seeds {','.join(map(str, seeds))}"
    )
    columns = ["k/d", "k", "√(1 − k/d)"]
    for n in names:
        columns += [f"{n} per replica", f"{n} aggregate"]
    for col in columns:
        table.add_column(col, justify="left" if col == "k/d" else "right")
    for r in rows:
        cells = [r["k_ratio"], str(r["k"]), f"{r['random']:.3f}"]
        for n in names:
            c = r["configs"].get(n)
            cells += [_pm3(c["replica"]), _pm3(c["aggregate"])] if c else ["—", "—"]
        table.add_row(*cells)
    return table


def settings_table(res: Resolved, names: Sequence[str]) -> Table:
    """What `--paper-settings` / `--setting` set: setting, value, where from (printed before the run)."""
    table = Table(title=f"settings — {', '.join(names)} ({res.cfg.preset})")
    for col in ("setting", "value", "where from"):
        table.add_column(col, justify="right" if col == "value" else "left")
    for row in res.table:
        value = f"{row.value:,}" if isinstance(row.value, int) and not isinstance(row.value, bool) else str(row.value)
        table.add_row(row.key, value, row.source)
    return table
