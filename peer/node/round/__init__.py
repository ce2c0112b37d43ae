"""One stage's outer round over the swarm (DESIGN §3, docs/protocol.md).

- `rounds`    a peer's round entry points: gather, commit, check, record, catch up (`Rounds`);
- `gather`    one gather of round (t, s): announce, fetch, decide when to close, follow;
- `agreement` the pure rules: who counts, bindings, the deadline fence, the close decision;
- `follow`    taking another holder's committed set when it is ours to take;
- `verify`    checking a claimed set: its payloads found by content and proven genuine;
- `payloads`  what a peer serves and accepts (`PayloadStore`, the payload validator);
- `claims`, `refusals`, `bans`, `censors`, `recheck`: what a holder claims and how claims are checked,
  refused or banned; `resync` keeps a peer's stages on the committed state, `replay` brings a joiner
  there by recomputation;
- `ranges/`   the range-sharded round.
"""
