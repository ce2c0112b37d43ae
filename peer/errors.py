"""User-facing errors of `peer`.

Every error a user can cause (a bad flag, a missing dataset, a corrupt checkpoint, a peer that
disagrees with the manifest) is a `PeerError`. The CLI prints its one-line message and exits with
code 2 instead of showing a traceback, so each message must say what to do next.
"""

from __future__ import annotations


class PeerError(Exception):
    """Base of all errors whose message is meant for the person running `peer`."""


class ConfigError(PeerError):
    """A configuration value, preset or combination of settings is invalid."""


class DataError(PeerError):
    """A dataset, corpus or tokenizer cannot be found or read."""


class CheckpointError(PeerError):
    """A checkpoint is missing, corrupt or does not match the model."""


class ManifestMismatch(PeerError):
    """This peer's local build disagrees with the run's manifest."""


class NetworkError(PeerError):
    """A peer, the DHT or a gRPC call could not be reached within its deadline."""


class ProcessGoneError(NetworkError):
    """The background process that answers this peer's requests (the hivemind DHT) has exited."""


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line, at most `limit` characters, for quoting inside a PeerError."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
