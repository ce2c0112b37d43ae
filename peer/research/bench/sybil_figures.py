"""What colluding contributors can do, as measured: the recorded tables, and the open swarm's warning.

`RECORDED` holds the rows `peer bench sybil` measured (`COMMAND`) and `RECORDED_LOSSES` its loss
runs (`LOSS_COMMAND`); docs/poisoning.md "Sybils" shows the same tables (a test keeps them equal).
`open_swarm_warning` turns them into the lines `peer bootstrap` prints when the swarm admits anyone
(no `--swarm-secret-file`, no `--allow-peer`), and `open_swarm_status` is the one line `peer status`
adds. Nothing here measures or imports torch: the bootstrap pays nothing to say it.
"""

from __future__ import annotations

from dataclasses import dataclass

COMMAND = "peer bench sybil --replicas 10 --preset tiny --stages 2 --stage 0 --round 3 --seed 0"
LOSS_COMMAND = "peer bench sybil --loss-outer-steps 20 --loss-strategy threshold"


@dataclass(frozen=True)
class SybilRow:
    """One (K colluders, strategy, screening) commit against the honest-only commit (`peer.research.bench.sybil`)."""

    colluders: int  # K
    replicas: int  # M
    strategy: str
    screening: bool
    deviation: float  # ‖u − u_h‖ / ‖u_h‖: u the committed update, u_h the honest contributions' alone
    cosine: float  # cos(u, u_h)
    norm: float  # ‖u‖ / ‖u_h‖
    colluders_dropped: int  # of K, by screening
    honest_dropped: int  # of M − K, by screening
    clipped: int  # contributions the median clip scaled down

    @property
    def fraction(self) -> float:
        return self.colluders / self.replicas


RECORDED: tuple[
    SybilRow, ...
] = (  # K, M, strategy, screening, deviation, cosine, norm, dropped: colluders, honest; clipped
    SybilRow(1, 10, "aligned", True, 0.417, +0.963, 1.280, 0, 0, 1),
    SybilRow(1, 10, "aligned", False, 0.417, +0.963, 1.280, 0, 0, 1),
    SybilRow(1, 10, "reversed", True, 0.000, +1.000, 1.000, 1, 0, 1),
    SybilRow(1, 10, "reversed", False, 0.554, +0.853, 0.665, 0, 0, 1),
    SybilRow(1, 10, "orthogonal", True, 0.491, +0.882, 1.020, 0, 0, 1),
    SybilRow(1, 10, "orthogonal", False, 0.491, +0.882, 1.020, 0, 0, 1),
    SybilRow(1, 10, "threshold", True, 0.493, +0.880, 1.009, 0, 0, 1),
    SybilRow(1, 10, "threshold", False, 0.493, +0.880, 1.009, 0, 0, 1),
    SybilRow(3, 10, "aligned", True, 1.113, +0.872, 1.872, 0, 0, 3),
    SybilRow(3, 10, "aligned", False, 1.113, +0.872, 1.872, 0, 0, 3),
    SybilRow(3, 10, "reversed", True, 0.000, +1.000, 1.000, 3, 0, 3),
    SybilRow(3, 10, "reversed", False, 1.535, -0.247, 0.944, 0, 0, 3),
    SybilRow(3, 10, "orthogonal", True, 1.341, +0.472, 1.482, 0, 0, 0),
    SybilRow(3, 10, "orthogonal", False, 1.341, +0.472, 1.482, 0, 0, 0),
    SybilRow(3, 10, "threshold", True, 1.350, +0.450, 1.463, 0, 0, 3),
    SybilRow(3, 10, "threshold", False, 1.350, +0.450, 1.463, 0, 0, 3),
    SybilRow(5, 10, "aligned", True, 1.662, +0.798, 2.347, 0, 0, 5),
    SybilRow(5, 10, "aligned", False, 1.662, +0.798, 2.347, 0, 0, 5),
    SybilRow(5, 10, "reversed", True, 2.347, -0.526, 1.662, 0, 0, 5),
    SybilRow(5, 10, "reversed", False, 2.347, -0.526, 1.662, 0, 0, 5),
    SybilRow(5, 10, "orthogonal", True, 2.034, +0.245, 2.033, 0, 0, 5),
    SybilRow(5, 10, "orthogonal", False, 2.034, +0.245, 2.033, 0, 0, 5),
    SybilRow(5, 10, "threshold", True, 2.349, -0.532, 1.659, 0, 0, 5),
    SybilRow(5, 10, "threshold", False, 2.349, -0.532, 1.659, 0, 0, 5),
)


@dataclass(frozen=True)
class LossRow:
    """A simulated run with K colluders in every round of every stage (K = 0: the honest run)."""

    colluders: int
    strategy: str
    val_loss: float  # held-out loss after the last outer step (replica mean)
    colluders_dropped: int  # colluder contributions screening dropped, over the run
    rounds: int  # stage rounds committed


# `LOSS_COMMAND` (and --loss-strategy aligned; orthogonal at K = 3 by `bench_sybil.losses`): 20 outer steps
RECORDED_LOSSES: tuple[LossRow, ...] = (
    LossRow(0, "-", 6.055907846719492, 0, 40),
    LossRow(1, "threshold", 6.12986648036167, 3, 40),
    LossRow(3, "threshold", 6.309900947671849, 0, 40),
    LossRow(5, "threshold", 7.555955474846996, 0, 40),
    LossRow(3, "orthogonal", 6.232434130390175, 0, 40),
    LossRow(1, "aligned", 5.889132638141746, 0, 40),
    LossRow(3, "aligned", 5.704222765416489, 0, 40),
    LossRow(5, "aligned", 5.652433818919235, 0, 40),
)


def loss_deltas(losses: tuple[LossRow, ...], strategy: str) -> list[tuple[int, float]]:
    """(K, Δ % of the held-out loss against the honest run) of one strategy's runs, by K."""
    honest = next(r.val_loss for r in losses if r.colluders == 0)
    return sorted((r.colluders, 100 * (r.val_loss / honest - 1)) for r in losses if r.strategy == strategy)


def worst_unscreened(rows: tuple[SybilRow, ...], colluders: int) -> SybilRow:
    """The row of K colluders, screening on, none of them dropped, that moves the update most."""
    kept = [r for r in rows if r.colluders == colluders and r.screening and r.colluders_dropped == 0]
    return max(kept, key=lambda r: r.deviation)


def open_swarm_warning(
    rows: tuple[SybilRow, ...] = RECORDED, losses: tuple[LossRow, ...] = RECORDED_LOSSES
) -> list[str]:
    """The lines `peer bootstrap` prints for a swarm without admission: what it admits, what that
    risks (the worst strategy screening keeps, per fraction of a round's contributors), how to restrict it."""
    counts = sorted({r.colluders for r in rows})
    worst = [worst_unscreened(rows, k) for k in counts]
    m = rows[0].replicas
    shares = " / ".join(f"{r.fraction:.0%}" for r in worst)
    moves = " / ".join(f"{r.deviation:.0%}" for r in worst)
    cosines = " / ".join(f"{r.cosine:+.2f}" for r in worst)
    hurt = " / ".join(f"{d:+.1f}%" for _, d in loss_deltas(losses, "threshold"))
    return [
        "admission: open — this swarm admits any peer id, and one operator can run as many identities as it likes.",
        f"  what that risks (peer bench sybil, M = {m}, docs/poisoning.md): colluders at {shares} of a round's "
        f"contributors, sending one payload within the median clip that screening keeps, move the committed update "
        f"by {moves} of its honest norm (cosine to the honest update {cosines}); in a 20-round run colluding "
        f"every round that costs {hurt} held-out loss.",
        "  verified state stops forged states, not poisoned-yet-valid contributions: every holder commits them alike.",
        "  restrict it: restart with --swarm-secret-file FILE (peers that know the secret) or --allow-peer PEER_ID "
        "(listed peers only; repeat the flag).",
    ]


def open_swarm_status(rows: tuple[SybilRow, ...] = RECORDED) -> str:
    """The one line `peer status` gives an open swarm."""
    k = max(r.colluders for r in rows)
    worst = worst_unscreened(rows, k)
    return (
        f"admission open: any peer id counts; colluders at {worst.fraction:.0%} of a round's contributors can move "
        f"its update by {worst.deviation:.0%} of its honest norm (cosine {worst.cosine:+.2f}) unseen — restrict with "
        "--swarm-secret-file or --allow-peer at the bootstrap"
    )
