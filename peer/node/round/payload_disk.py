"""A payload store's whole payloads on disk, so a peer restarted with `--resume` serves its window again.

A holder keeps its own payload of every round and the payloads it fetched for `swarm.history_rounds`
rounds: a joiner replays those rounds from them (docs/protocol.md, "Joining by replay"). Kept in
memory only, they died with the process: a holder killed and resumed no longer served them, and when
every holder of a round had restarted, its payloads were nowhere while its links were still
published, so a joiner needing that round could only wait for an attester's state. `PayloadDisk`
writes each whole payload once, as it enters the store (`<data dir>/payloads/<run id>/`, one file per payload,
written to a temporary name and renamed: a kill never leaves half a file under the real name),
deletes the files of rounds that leave the window, and reads the window back on `--resume`. A fresh
start (no `--resume`) begins with an empty folder. Embedding views and a ranges round's parts and
shards stay in memory only (the stage-0 holders serve the whole payloads; a ranges round is not
replayed).

File names: `<t>.<stage>.<sender>.<replica>` (our own payload: sender "own"); peer ids are base58,
so a name splits on "." alone. Every file read back must parse as a payload (one that does not is
deleted, never served); whoever fetches it checks its id against the announcement, as from any source.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from peer.core.sparseloco.codec.format import Payload, PayloadError

log = logging.getLogger(__name__)

OWN = "own"  # the sender part of our own payload's file name


@dataclass(frozen=True)
class Stored:
    """One payload read back from disk: (t, stage), the sender (None: our own), the replica, bytes, parsed."""

    t: int
    stage: int
    sender: str | None
    replica: str
    data: bytes
    payload: Payload


class PayloadDisk:
    """The files of one peer's whole payloads (module docstring)."""

    def __init__(self, folder: Path, resume: bool) -> None:
        """`resume` keeps what an earlier run of this peer wrote; without it the folder starts empty."""
        self.folder, self.oldest = folder, 0  # `oldest`: no file of an earlier round is left
        folder.mkdir(parents=True, exist_ok=True)
        for path in folder.iterdir():
            if not resume or path.name.endswith(".tmp"):  # a fresh start, or a write a kill interrupted
                path.unlink(missing_ok=True)

    def write(self, t: int, stage: int, sender: str | None, replica: str, data: bytes) -> None:
        """Keep one payload (an OSError, a full disk, is logged: the payload stays served from memory)."""
        name = f"{t}.{stage}.{sender or OWN}.{replica or OWN}"
        tmp = self.folder / f".{name}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, self.folder / name)
        except OSError as exc:
            log.warning("could not keep the payload of round %d stage %d on disk: %s", t, stage, exc)
            tmp.unlink(missing_ok=True)

    def expire(self, oldest: int) -> None:
        """Delete the files of rounds before `oldest` (the folder is read only when `oldest` moves on)."""
        if oldest <= self.oldest:
            return
        self.oldest = oldest
        for path, t in self._files():
            if t < oldest:
                path.unlink(missing_ok=True)

    def read(self) -> Iterator[Stored]:
        """Every payload kept, oldest round first; a file whose bytes do not parse is deleted."""
        for path, t in sorted(self._files(), key=lambda item: item[1]):
            _, stage, sender, replica = path.name.split(".")
            try:
                data = path.read_bytes()
                payload = Payload.from_bytes(data)
            except (OSError, PayloadError) as exc:
                log.warning("dropping the kept payload %s: %s", path.name, exc)
                path.unlink(missing_ok=True)
                continue
            who = None if sender == OWN else sender
            yield Stored(t, int(stage), who, "" if replica == OWN else replica, data, payload)

    def _files(self) -> list[tuple[Path, int]]:
        """(path, round) of every payload file; a write in progress (a temporary name) is not one."""
        out = []
        for path in self.folder.iterdir():
            parts = path.name.split(".")
            if len(parts) == 4 and parts[0].isdigit() and parts[1].isdigit():
                out.append((path, int(parts[0])))
        return out
