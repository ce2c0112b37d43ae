"""One peer: where the math meets the network.

- `session` composes a peer's parts; `trainer` runs a role's loop (head, stage peer, full
  replica); `service` answers the gRPC calls; `records`, `presence`, `discovery`, `connectivity`,
  `manifest`, `fit`, `metrics` the rest of a peer's life in the swarm;
- `stage/`: one stage as a holder keeps it (worker, committed state, portable commit, optimizer);
- `round/`: the outer round and the rules that decide what to trust (claims, refusals, bans, resync,
  replay), with `ranges/` for range-sharded rounds;
- `pipeline/`: a head's compressed pipeline; `replica/`: a full replica over torchrun ranks;
- `data/`: the run's dataset fetched and served; `checkpoints/`: saving and resuming.
"""
