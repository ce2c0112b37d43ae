"""The bootstrap node of a `peer` swarm: a DHT entry point, the run's manifest and its artefacts.

`run_bootstrap(cfg, ...)` builds the tokenizer, starts a `peer.net.dht.SwarmDHT` node, serves the
tokenizer and manifest over `peer.net.transport`, and keeps the manifest published until stopped.
`peer bootstrap` is its command line. It reuses `peer.net.dht`; nothing here imports hivemind.
"""

from peer.bootstrap.artifacts import ArtifactHandler, manifest_bytes
from peer.bootstrap.node import BootstrapInfo, BootstrapNode, run_bootstrap, write_address_file

__all__ = ["ArtifactHandler", "BootstrapInfo", "BootstrapNode", "manifest_bytes", "run_bootstrap", "write_address_file"]
