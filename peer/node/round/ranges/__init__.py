"""The range-sharded round (docs/protocol.md, RANGES): who owns what (`ownership`), one holder's
round (`exchange`), the parts and shards fetched (`fetch`) and resolved (`resolve`), and the
round driven for every stage (`rounds`)."""
