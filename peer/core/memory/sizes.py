"""Sizes as users type them (`--max-memory 6GiB`) and as tables show them.

`parse_bytes("6GiB")` and `format_bytes` are the one spelling of sizes on the command line and in
tables: binary units (KiB, MiB, GiB, TiB) and decimal ones (KB, MB, GB, TB), or plain bytes.
"""

from __future__ import annotations

import re

from peer.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, what: str = "size") -> int:
    """'6GiB', '800MB', '1.5 GB', '123456' -> bytes; a one-line ConfigError naming `what` otherwise."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{what} must be a size such as 6GiB, 800MB or 123456 (bytes), got {text!r}")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ConfigError(f"{what} must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """Bytes in binary units with three significant digits: 1.5 GiB, 812 MiB, 4 KiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"
