"""A merkle tree over a contribution's parts: one root announced, each part checked on its own.

A contributor announces `merkle_root(parts)`; an owner fetches part r with `merkle_proof(parts, r)`
and checks it with `merkle_check` against the announced root, without the other parts.

    leaf  = H(0x00 ‖ part bytes)
    node  = H(0x01 ‖ left ‖ right)          a level's last node without a sibling moves up as it is
    root  = H(0x02 ‖ u32 n ‖ top node)      the root commits to the number of leaves too
    H(x)  = sha256(x)[:16]

Invariants: leaves, inner nodes and the root are domain-separated (a part's bytes can never pass
as an inner node), a lone node is promoted rather than paired with itself (no two leaf lists share
a root by duplication), and a proof is checked for its exact length, so a proof that verifies names
exactly one (i, n, leaf).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = ["merkle_check", "merkle_proof", "merkle_root"]

NODE_BYTES = 16
_LEAF, _INNER, _ROOT = b"\x00", b"\x01", b"\x02"


def _h(*chunks: bytes) -> bytes:
    return hashlib.sha256(b"".join(chunks)).digest()[:NODE_BYTES]


def _levels(leaves: Sequence[bytes]) -> list[list[bytes]]:
    """Every level of the tree, leaves' hashes first, the top node last."""
    if not leaves:
        raise ValueError("a merkle tree needs at least one leaf")
    level = [_h(_LEAF, bytes(leaf)) for leaf in leaves]
    levels = [level]
    while len(level) > 1:
        nxt = [_h(_INNER, level[j], level[j + 1]) for j in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])  # a lone node moves up as it is
        level = nxt
        levels.append(level)
    return levels


def _root(top: bytes, n: int) -> str:
    return _h(_ROOT, n.to_bytes(4, "little"), top).hex()


def merkle_root(leaves: Sequence[bytes]) -> str:
    """Hex root (32 characters) of the parts `leaves`, in range order."""
    return _root(_levels(leaves)[-1][0], len(leaves))


def merkle_proof(leaves: Sequence[bytes], i: int) -> list[str]:
    """The siblings (hex, bottom up) that take leaf i to the root; levels where it has none are skipped."""
    if not 0 <= i < len(leaves):
        raise IndexError(f"leaf {i} of {len(leaves)}")
    proof = []
    for level in _levels(leaves)[:-1]:
        sib = i ^ 1
        if sib < len(level):
            proof.append(level[sib].hex())
        i //= 2
    return proof


def merkle_check(root: str, i: int, n: int, leaf: bytes, proof: Sequence[str]) -> bool:
    """Whether `leaf` is leaf i of n under `root` with this proof (False on any malformed input)."""
    if not (0 <= i < n < 2**32) or not isinstance(root, str):
        return False
    try:
        sibs = [bytes.fromhex(p) for p in proof]
    except (ValueError, TypeError):
        return False
    if any(len(s) != NODE_BYTES for s in sibs):
        return False
    node, width, used = _h(_LEAF, bytes(leaf)), n, 0
    while width > 1:
        if i ^ 1 < width:
            if used == len(sibs):
                return False
            sib = sibs[used]
            used += 1
            node = _h(_INNER, sib, node) if i % 2 else _h(_INNER, node, sib)
        i, width = i // 2, (width + 1) // 2
    return used == len(sibs) and _root(node, n) == root
