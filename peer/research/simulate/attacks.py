"""Poisoned contributions for the simulator and the benches: what an attacker sends.

Each attack maps the attacker's honest decoded Δ̂ of round (t, stage s) to what every receiver
decodes instead. All of them are well-formed: they pass every wire check a peer makes, so only
the round's robust aggregation (median clipping, `peer.core.sparseloco.codec.clip`; outlier screening,
`peer.core.sparseloco.robust`) stands between them and the model.

One attacker (`SimOptions.attack`, the last replica):
- `random`: a valid payload of a huge random tensor (1e3 · N(0, 1), compressed as any payload);
- `flip`:   the attacker's own Δ̂ × −1e4 (a wrong-sign flood);
- `negate`: the attacker's own Δ̂ × −1 (wrong sign at an honest norm: clipping never sees it).

Colluders (`Collusion`: K identities of one operator, all sending the same payload, `collude`).
They are given the round's honest payloads (a worst case: in an all-to-all round a colluder may
wait for them before it sends, speed wins nothing) and send a unit direction d scaled to the clip
bound c·med, where med is the lower median the round will compute with them in it (K ≤ M/2
colluders of a norm above every honest one move it up, never past the largest honest norm):
- `aligned`:    d = ĥ, the honest aggregate's direction (the honest step, inflated);
- `reversed`:   d = −ĥ (the honest step, undone);
- `orthogonal`: d = a seeded random direction with its ĥ component removed (a step the honest
                replicas do not take, e.g. a backdoor's);
- `threshold`:  d = cos φ·ô − sin φ·ĥ with the largest φ ∈ [0, π/2] that the default screening
                (`peer.core.sparseloco.robust.DEFAULT`) keeps, by bisection on the real screening of the
                round: as much reversal as passes unseen.
Each d goes through the real encoder (`compress`, top-k and quantization, then the wire bytes).

Deterministic: the same (attack, honest payloads, t, s) gives the same contribution.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.clip import payload_norm
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.commit import robust_aggregate
from peer.core.sparseloco.robust import DEFAULT, OFF
from peer.errors import ConfigError

ATTACKS = ("random", "flip", "negate")
COLLUSIONS = ("aligned", "reversed", "orthogonal", "threshold")
BISECTIONS = 12  # steps of the `threshold` search: φ to within π/2 / 4096


def check_attack(kind: str | None) -> None:
    if kind is not None and kind not in ATTACKS:
        raise ConfigError(f"unknown attack {kind!r}; choose from {', '.join(ATTACKS)}")


def poison(
    kind: str, honest: Mapping[str, torch.Tensor], t: int, s: int, cfg: SparseLoCoConfig
) -> dict[str, torch.Tensor]:
    """What an attacker of kind `kind` sends in round (t, s) instead of its honest Δ̂ (decoded)."""
    check_attack(kind)
    if kind == "flip":
        return {k: v * -1e4 for k, v in honest.items()}
    if kind == "negate":
        return {k: -v for k, v in honest.items()}
    g = torch.Generator().manual_seed(100 * t + s)
    payload, _ = compress({k: 1e3 * torch.randn(v.shape, generator=g) for k, v in honest.items()}, None, cfg)
    return decompress(Payload.from_bytes(payload.to_bytes(), cfg=cfg))


@dataclass(frozen=True)
class Collusion:
    """K colluding contributors of every round, all sending one `strategy` payload (`collude`)."""

    colluders: int
    strategy: str
    seed: int = 0  # of the `orthogonal` / `threshold` target direction

    def __post_init__(self) -> None:
        if self.strategy not in COLLUSIONS:
            raise ConfigError(f"unknown collusion {self.strategy!r}; choose from {', '.join(COLLUSIONS)}")
        if self.colluders < 1:
            raise ConfigError(f"a collusion needs 1 or more colluders, got {self.colluders}")


def _dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> float:
    return math.fsum(float((a[k].double() * b[k].double()).sum()) for k in a if k in b)


def _unit(d: Mapping[str, Tensor]) -> dict[str, Tensor]:
    n = math.sqrt(_dot(d, d))
    if n == 0:
        raise ValueError("the colluders' direction is zero (the honest aggregate is empty)")
    return {k: v / n for k, v in d.items()}


def _encode(direction: Mapping[str, Tensor], norm: float, cfg: SparseLoCoConfig) -> Payload:
    """The payload of `direction` scaled so that its decoded norm is `norm` (one correction for
    what top-k drops), through the wire bytes."""

    def once(scale: float) -> Payload:
        payload, _ = compress({k: v * scale for k, v in direction.items()}, None, cfg)
        return Payload.from_bytes(payload.to_bytes(), cfg=cfg)

    first = once(norm)
    return once(norm * norm / payload_norm(first))


def clip_target(honest_norms: Sequence[float], colluders: int, factor: float) -> float:
    """The clip bound c·med of a round of these honest norms plus `colluders` norms above all of them
    (c = 2 when clipping is off): the largest norm a colluder keeps whole."""
    voters = sorted([n for n in honest_norms if math.isfinite(n) and n > 0] + [math.inf] * colluders)
    median = voters[(len(voters) - 1) // 2]
    if not math.isfinite(median):
        raise ConfigError(f"{colluders} colluders of {len(voters)} set the median themselves: no bound to measure")
    return (factor or 2.0) * median


def collude(c: Collusion, honest: Sequence[Payload], cfg: SparseLoCoConfig, t: int = 0, s: int = 0) -> Payload:
    """The one payload every colluder sends in round (t, s) whose honest payloads are `honest`."""
    h, _, _ = robust_aggregate(list(honest), cfg, OFF)  # the honest aggregate (clipped, unscreened)
    h_hat = _unit(h)
    norm = clip_target([payload_norm(p) for p in honest], c.colluders, cfg.clip_median_factor)
    if c.strategy in ("aligned", "reversed"):
        sign = 1.0 if c.strategy == "aligned" else -1.0
        return _encode({k: sign * v for k, v in h_hat.items()}, norm, cfg)
    g = torch.Generator().manual_seed(1_000_003 * c.seed + 100 * t + s)
    r = {k: torch.randn(v.shape, generator=g) for k, v in h_hat.items()}
    along = _dot(r, h_hat)
    o_hat = _unit({k: r[k] - along * h_hat[k] for k in r})

    def at(phi: float) -> Payload:
        return _encode({k: math.cos(phi) * o_hat[k] - math.sin(phi) * h_hat[k] for k in o_hat}, norm, cfg)

    if c.strategy == "orthogonal":
        return at(0.0)
    keys = [f"h{i:04d}" for i in range(len(honest))] + [f"x{i:04d}" for i in range(c.colluders)]
    lo, hi, best = 0.0, math.pi / 2, at(0.0)
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        forged = at(mid)
        _, _, screened = robust_aggregate([*honest, *[forged] * c.colluders], cfg, DEFAULT, keys)
        if any(i >= len(honest) for i in screened.dropped):
            hi = mid
        else:
            lo, best = mid, forged
    return best
