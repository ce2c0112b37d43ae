"""`peer simulate`: the paper's method in one process (`engine.simulate`), with its replicas,
training loops, worker pool, checkpoints and results, the experiments, ablations and attacks, the
paper's settings and the templar baselines."""
