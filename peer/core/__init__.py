"""The math: pure torch/numpy. Imports only peer.core, peer.config and peer.errors (no grpc, hivemind, asyncio)."""
