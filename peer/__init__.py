"""peer: peer-to-peer pre-training of LLMs with subspace-compressed pipelines and SparseLoCo rounds.

`__version__` matches `version` in pyproject.toml; `peer --version` reports the installed
distribution's version (importlib.metadata) and falls back to this one in a bare source tree.
"""

__version__ = "0.1.0"


def package_version() -> str:
    """The installed distribution's version, or `__version__` when running from a source tree."""
    from importlib import metadata

    try:
        return metadata.version("peer")
    except metadata.PackageNotFoundError:
        return __version__
