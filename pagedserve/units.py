"""Parsing of human-written quantities on the command line."""

from __future__ import annotations

import argparse
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


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """Parses a CPU list such as ``"0-3,6"`` (the format of ``taskset -c``) into sorted core ids;
    ``""`` is no cores (how an empty list is written back to flags).

    Raises:
        ValueError: not a list of non-negative integers and ranges.
    """
    if not text.strip():
        return ()
    cores: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+))?\s*", part)
        if match is None:
            raise ValueError(f"cannot read {text!r} as a CPU list (examples: 0-3, 0,2,4)")
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            raise ValueError(f"empty CPU range {part!r} in {text!r}")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def parse_bytes_or_zero(text: str) -> int:
    """Like :func:`parse_bytes`, and ``"0"`` (or ``""``) is 0: for sizes that may be none."""
    return 0 if text.strip() in ("", "0") else parse_bytes(text)


def format_bytes(size: int) -> str:
    """``size`` bytes as :func:`parse_bytes` reads it back: in the largest binary unit that divides
    it (``1073741824`` -> ``"1GiB"``), else in bytes."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size and size % _BYTE_UNITS[unit.lower()] == 0:
            return f"{size // _BYTE_UNITS[unit.lower()]}{unit}"
    return str(size)


def positive(kind: type):
    """An argparse ``type`` reading a ``kind`` (``int`` or ``float``) that must be above 0.

    Raises (the returned parser):
        argparse.ArgumentTypeError: the value is 0 or less.
    """
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse
