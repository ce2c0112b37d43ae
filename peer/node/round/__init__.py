"""One stage's outer round over the swarm (DESIGN §3, docs/protocol.md).

- `rounds`    a peer's round entry points: gather, commit, check, record, catch up (`Rounds`);
- `gather`    one gather of round (t, s): announce, fetch, decide when to close, follow;
- `agreement` the pure rules: who counts, bindings, the deadline fence, the close decision;
- `follow`    taking another holder's committed set when it is ours to take;
- `verify`    checking a claimed set: its payloads found by content and proven genuine;
- `payloads`  what a peer serves and accepts (`PayloadStore`, the payload validator).
"""
