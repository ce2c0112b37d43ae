"""Crash-safe files: atomic writes of one file or a whole directory, and file digests.

A reader never sees a half-written file: data goes to a temporary sibling first, is fsynced and
then renamed into place with `os.replace` (atomic on POSIX). Used by trained tokenizers, prepared
shards, checkpoints, exports and every peer's downloaded artefacts. No networking here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

__all__ = ["atomic_directory", "atomic_write_bytes", "file_sha256"]


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in blocks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def atomic_write_bytes(path: Path, raw: bytes) -> None:
    """Write `raw` to `path` so that readers see the old file or the whole new one, never a part.

    Raises OSError (the caller turns it into its own one-line error).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory next to `final`; on success it replaces `final`.

    An existing `final` is moved aside, the new directory renamed into place with os.replace,
    and only then the old one deleted. On an exception the temporary directory is removed and
    `final` is left untouched.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        old = None
        if final.exists():
            old = final.parent / f".{final.name}.old-{tmp.name.rsplit('-', 1)[-1]}"
            os.replace(final, old)
        os.replace(tmp, final)
        _fsync_tree(final.parent, files=False)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(path: Path, files: bool = True) -> None:
    """fsync the files directly inside `path` (if `files`) and the directory entry itself."""
    if files:
        for child in path.iterdir():
            if child.is_file():
                with open(child, "rb") as f:
                    os.fsync(f.fileno())
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
