"""The range-sharded round (docs/protocol.md, RANGES): who owns what (`ownership`), one holder's
round (`exchange`), the parts and shards fetched (`fetch`) and resolved (`resolve`), each shard
taken as one record hashed once (`shard`), the voted round's phases on top of them (`voted`,
docs/protocol.md VOTED), and the round driven for every stage (`rounds`)."""
