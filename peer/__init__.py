"""peer: peer-to-peer pre-training of LLMs with subspace-compressed pipelines and SparseLoCo rounds.

`__version__` matches `version` in pyproject.toml; `peer --version` reports the installed
distribution's version (importlib.metadata) and falls back to this one in a bare source tree.
Importing the package switches gRPC's fork handlers off (see below; a user's setting wins).
"""

import os

__version__ = "0.1.0"

# gRPC's fork handlers (on by default in grpcio >= 1.78) run in every fork; when another thread is
# inside gRPC at that moment, a forked child inherits half-held gRPC locks and aborts or segfaults
# on its own next fork. The DHT process is forked only where no gRPC runs (else a clean forkserver
# forks it: peer.net.dht_child), and what we fork never calls gRPC, so the handlers are switched
# off before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def package_version() -> str:
    """The installed distribution's version, or `__version__` when running from a source tree."""
    from importlib import metadata

    try:
        return metadata.version("peer")
    except metadata.PackageNotFoundError:
        return __version__
