"""The range-sharded round (docs/protocol.md, RANGES): who owns what (`ownership`), one holder's
round (`exchange`), the parts and shards fetched (`fetch`) and resolved (`resolve`), each shard
taken as one record hashed once (`shard`), and the round driven for every stage (`rounds`)."""
