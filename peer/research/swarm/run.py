"""Running the swarm simulator: the engine (`peer.research.swarm.sim`) wired to the three rules' gathers
(`peer.research.swarm.gather`: "all", "ranges"; `peer.research.swarm.voted`), which read the engine's
state. Kept apart so neither imports the other both ways: `peer bench swarm` and its calibration call
`simulate` from here."""

from __future__ import annotations

from peer.research.swarm.gather import check_range, gather_all, gather_ranges, run_peer
from peer.research.swarm.sim import Protocol, RuleHooks, Sim, SimConfig
from peer.research.swarm.voted import gather_voted

GATHERS = {"all": gather_all, "ranges": gather_ranges, "voted": gather_voted}


def simulate(cfg: SimConfig, protocol: Protocol | None = None) -> Sim:
    """Run `cfg.rounds` rounds (and let every peer finish its last); the finished `Sim`."""
    sim = Sim(cfg, protocol, RuleHooks(run_peer=run_peer, check_range=check_range, gathers=GATHERS))
    for _ in range(cfg.peers):
        sim.add_peer(0)
    if cfg.churn_per_h > 0:
        sim.env.process(sim.churn())
    sim.env.run()
    return sim
