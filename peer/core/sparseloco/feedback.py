"""Error feedback across a round: what goes back into a sender's error buffer, and how.

    e ← e + r        r = Δ̂ (dropped or not committed), Δ̂ − fl(Δ̂·scale) (clipped), else nothing

A round never loses what a sender computed: a contribution that missed the commit or that outlier
screening dropped returns whole, one that median clipping scaled down returns what clipping
removed (`peer.core.sparseloco.codec.clip.clipped_mass`), and the next round sends it again. A holder that replaces
its commit of a round by another (a checked better claim) takes back what its own commit returned
(`sign` −1) and adds what the other returns. The simulator and every stage holder feed back through
these two functions, so both lose and keep the same mass.

Invariants: `add_to_errors` never writes its inputs (new float32 CPU tensors), and with `sign` 1 it
adds r as it is (e + r, bit for bit); a non-finite contribution is zeroed by clipping and never
fed back.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.codec.clip import ClipStats, clipped_mass
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.robust import Screen


def returned(
    contribution: Payload | Mapping[str, Tensor], index: int, clip: ClipStats, screened: Screen
) -> dict[str, Tensor] | None:
    """What a round returns to the sender of contribution `index` of its committed list: each tensor
    screening left out of the aggregate whole (`screened`, by sections: `Screen.dropped_names`), what
    median clipping removed from the others when its scale is set (`clip.scales`), else None. A
    payload is decoded only when something returns."""
    scale = clip.scales[index] if clip.scales else None
    if index not in screened.outliers and scale is None:
        return None
    decoded = decompress(contribution) if isinstance(contribution, Payload) else contribution
    left_out = screened.dropped_names(index, decoded)
    kept = {n: t for n, t in decoded.items() if n not in left_out}
    out = (clipped_mass(kept, scale) or {}) if kept else {}
    out.update({n: decoded[n] for n in left_out})
    return out or None


def add_to_errors(
    errors: Mapping[str, Tensor] | None, change: Mapping[str, Tensor] | None, sign: float = 1.0
) -> dict[str, Tensor] | None:
    """e + sign·r per tensor (float32, CPU; a tensor e lacks starts at sign·r); None + nothing stays None."""
    if change is None:
        return None if errors is None else dict(errors)
    out = {name: t.clone() for name, t in (errors or {}).items()}
    for name, r in change.items():
        r32 = r.to("cpu", torch.float32)
        if name in out:
            out[name] = out[name] + (r32 if sign == 1.0 else sign * r32)
        else:
            out[name] = r32.clone() if sign == 1.0 else sign * r32
    return out
