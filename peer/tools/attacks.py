"""Poisoned contributions for the simulator and `peer bench poison`: what an attacker sends.

Each attack maps the attacker's honest decoded Δ̂ of round (t, stage s) to what every receiver
decodes instead. All of them are well-formed: they pass every wire check a peer makes, so only
the round's robust aggregation (median clipping, `peer.core.codec.clip`; outlier screening,
`peer.core.robust`) stands between them and the model.

- `random`: a valid payload of a huge random tensor (1e3 · N(0, 1), compressed as any payload);
- `flip`:   the attacker's own Δ̂ × −1e4 (a wrong-sign flood);
- `negate`: the attacker's own Δ̂ × −1 (wrong sign at an honest norm: clipping never sees it).

Deterministic: the same (attack, t, s) gives the same contribution.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from peer.core.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco import compress, decompress
from peer.errors import ConfigError

ATTACKS = ("random", "flip", "negate")


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
