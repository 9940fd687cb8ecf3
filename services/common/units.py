"""Parsing of human-written quantities on the command line."""

from __future__ import annotations

import re

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """Parses a byte count such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``"1048576"``.

    Raises:
        ValueError: not a number with a known unit (B, KB, MB, GB, KiB, MiB, GiB, TiB), or not positive.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(f"cannot read {text!r} as a size in bytes (examples: 2GiB, 512MiB, 1000000)")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value
