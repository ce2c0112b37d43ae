"""The network: imports nothing from peer.core, peer.node or any room above them.

- `dht`: `SwarmDHT`, one hivemind DHT node and the swarm's records (manifest, stages, replicas, rounds);
- `identity`: persistent RSA identity keys and peer ids; `admission`: swarm secret, HMAC proofs,
  commitments, allow-list; `records`: which DHT records a reader believes;
- `processes`: the DHT daemon's child-process tree (psutil);
- `transport/`: the gRPC data plane (codec, framing, client, server); `pool`: one client per peer.
"""
