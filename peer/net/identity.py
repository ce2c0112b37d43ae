"""Persistent libp2p identities: RSA key files, the signing key they give, and peer ids.

Every DHT node runs on a file-backed libp2p RSA key: `--identity PATH` (created on first run, so
the peer id survives restarts) or a throw-away key in a temporary file. The same key signs this
peer's DHT records through hivemind's own `RSASignatureValidator`, so a peer id and the key that
signs for it are one thing: peer id = multihash(sha256(libp2p public key protobuf)).

Invariants: an existing key file is only ever read, never rewritten; a throw-away key's folder
is removed when `node_identity` exits; signatures are byte-compatible with hivemind's
`RSAPrivateKey` (RSA-PSS, MGF1-SHA256, maximal salt, base64).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import PrivateKey, RSAPublicKey

from peer.errors import ConfigError

logger = logging.getLogger(__name__)

_OWNER_RE = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX, re.DOTALL)
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.MAX_LENGTH)


def make_identity(path: str | os.PathLike[str]) -> str:
    """Create a persistent libp2p private key at `path` if it is missing; return its peer id.

    The key is written by hivemind's own generator (RSA, libp2p protobuf, mode 0400), the same file
    hivemind would write for `identity_path`; an existing file is only read.
    """
    path = Path(path).expanduser()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        P2P.generate_identity(str(path))
        logger.info("created peer identity %s", path)
    try:
        return str(PeerID.from_identity(path.read_bytes()).to_base58())
    except Exception as e:  # a truncated or foreign file
        raise ConfigError(f"identity file {path} is not a libp2p private key ({e}); delete it to make a new one") from e


class IdentityKey(PrivateKey):  # type: ignore[misc]  # hivemind ships no type information: PrivateKey is Any
    """A libp2p RSA identity as a hivemind signing key.

    Signs exactly like hivemind's `RSAPrivateKey` (RSA-PSS, MGF1-SHA256, maximal salt, base64), so
    hivemind's `RSASignatureValidator` and `RSAPublicKey.verify` accept its signatures.
    """

    def __init__(self, der: bytes) -> None:
        self._set_key(der)

    def _set_key(self, der: bytes) -> None:
        key = serialization.load_der_private_key(der, password=None)
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ValueError(f"expected an RSA key, got {type(key).__name__}")
        self._der = der
        self._key = key

    def sign(self, data: bytes) -> bytes:
        return base64.b64encode(self._key.sign(data, _PSS, hashes.SHA256()))

    def get_public_key(self) -> RSAPublicKey:
        return RSAPublicKey(self._key.public_key())

    def __getstate__(self) -> dict[str, bytes]:  # picklable for hivemind's child process
        return {"der": self._der}

    def __setstate__(self, state: dict[str, bytes]) -> None:
        self._set_key(state["der"])


def load_identity_key(path: Path) -> IdentityKey:
    """The signing key of a libp2p RSA key file; `ConfigError` if the file is anything else."""
    try:
        proto = crypto_pb2.PrivateKey.FromString(path.read_bytes())
        if proto.key_type != crypto_pb2.RSA:
            raise ValueError("not an RSA key")
        return IdentityKey(proto.data)
    except Exception as e:
        raise ConfigError(
            f"identity file {path} is not a libp2p RSA private key ({e}); delete it to make a new one"
        ) from e


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id of an RSA public key (multihash sha2-256 of the libp2p PublicKey protobuf)."""
    der = serialization.load_ssh_public_key(public_key.to_bytes()).public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return str(PeerID(b"\x12\x20" + hashlib.sha256(encoded).digest()).to_base58())  # 0x12 = sha2-256, 32 bytes


@functools.lru_cache(maxsize=4096)
def owner_peer_id(subkey: Any) -> str | None:
    """Peer id of the key in an owner subkey ``[owner:<ssh-rsa ...>]``; None for any other subkey."""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNER_RE.fullmatch(subkey)
    if match is None:
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(match.group(1)))
    except Exception:
        return None


@dataclass(frozen=True)
class NodeIdentity:
    """The key file a DHT node starts on, its signing key, and whether the file was made just now."""

    path: Path
    key: IdentityKey
    fresh: bool

    @property
    def peer_id(self) -> str:
        return peer_id_of(self.key.get_public_key())


@contextmanager
def node_identity(identity_path: str | os.PathLike[str] | None) -> Iterator[NodeIdentity]:
    """The identity a node starts on: `identity_path` (created if missing), or a throw-away key.

    A throw-away key lives in a temporary folder that is removed when the block exits, so start
    the node (p2pd reads the file) inside the block.
    """
    scratch = None
    try:
        if identity_path is None:
            scratch = tempfile.mkdtemp(prefix="peer-identity-")
            path = Path(scratch) / "identity.key"
            P2P.generate_identity(str(path))
            fresh = True
        else:
            path = Path(identity_path).expanduser()
            fresh = not path.exists()
            make_identity(path)
        yield NodeIdentity(path, load_identity_key(path), fresh)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def seal(key: IdentityKey, owner_subkey: bytes, text: str) -> dict[str, Any]:
    """`text` signed by `key` (whose owner subkey is `owner_subkey`), verifiable by anyone holding
    the seal alone: {"text", "owner", "sig"}. Lets any peer re-publish the bootstrap's manifest."""
    return {"text": text, "owner": owner_subkey, "sig": key.sign(text.encode())}


def unseal(item: Any) -> tuple[str, str] | None:
    """(signer's peer id, text) of a valid `seal`, or None if it is malformed or its signature fails."""
    if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not isinstance(item.get("sig"), bytes):
        return None
    owner = item.get("owner")
    match = _OWNER_RE.fullmatch(owner) if isinstance(owner, bytes) else None
    if match is None:
        return None
    try:
        public = RSAPublicKey.from_bytes(match.group(1))
        if not public.verify(item["text"].encode(), item["sig"]):
            return None
        return peer_id_of(public), item["text"]
    except Exception:  # noqa: BLE001 - any parse or verification failure means "not a valid seal"
        return None
