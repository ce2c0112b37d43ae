"""The network: the hivemind DHT and the gRPC transport. Imports nothing from peer.core or peer.node."""
