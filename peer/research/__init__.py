"""Research tools behind `peer simulate`, `peer plan` and `peer bench`: they may import core, net
and node, never the CLI.

- `simulate/`: the in-process simulator of the paper's method (`engine`), its replicas, loops,
  pool, checkpoints and results, the experiments and ablations, the paper's settings, attacks and
  the templar baselines;
- `plan/`: the utilisation and memory planner (`command`, `round`, `memory`, `figures`);
- `swarm/`: the swarm-scale round model (`sim`, `run`, `gather`, `net`, `sizes`, `calib`);
- `bench/`: every `peer bench` measurement (`common` holds what they share), the chaos harness,
  network namespaces and the delay relay.
"""
