"""θ_start of a stage's current outer step and the hashes of its committed state, computed once per state."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from peer.core.model.state import state_hash


class StartCache:
    """θ_start of the current outer step (CPU, float32) and the (θ_start, T⊥) hashes of the
    committed state, computed once per state: every change of θ_start or T⊥ goes through `set`,
    which bumps the version that keys the cache."""

    def __init__(self, start: Mapping[str, torch.Tensor]) -> None:
        self._version = 0
        self._key: tuple[int, int] | None = None
        self._value = ("", "")
        self.set(start)

    @property
    def start(self) -> Mapping[str, torch.Tensor]:
        return self._start

    def set(self, value: Mapping[str, torch.Tensor]) -> None:
        """A new θ_start (or T⊥): kept on the CPU in float32, whatever device trains."""
        self._start = {n: v.detach().to("cpu", torch.float32) for n, v in value.items()}
        self._version += 1

    def hashes(self, outer_step: int, perp: Callable[[], torch.Tensor]) -> tuple[str, str]:
        """(θ_start, T⊥) hashes of the state at `outer_step`, computed when the state changed."""
        key = (self._version, outer_step)
        if self._key != key:
            self._value = (state_hash(self._start), state_hash({"perp": perp()}))
            self._key = key
        return self._value

    def known(self, outer_step: int, hashes: tuple[str, str]) -> None:
        """The hashes of the current θ_start at `outer_step` are already known (a commit computed them)."""
        self._key, self._value = (self._version, outer_step), hashes
