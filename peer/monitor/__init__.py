"""What a person watches a run with, beside `metrics.jsonl`: the experiment loggers people already use
(`peer.monitor.loggers`: Weights & Biases and TensorBoard, `peer join --wandb / --tensorboard`).

Everything here is fed by the peer's own metrics events (`peer.node.metrics.add_sink`), so a logger
sees exactly what `metrics.jsonl` holds and can never stop training: a failing sink is logged.
"""
