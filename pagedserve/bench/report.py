"""Shared output helpers for the bench commands: aligned text tables and result JSON files."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Renders rows as a plain-text table: text left-aligned, numbers right-aligned.

    Floats print with 2 decimals (3 significant digits below 0.01), ``None`` as ``-``.
    """
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    rule = "-" * (sum(widths) + 2 * (len(widths) - 1))
    out = [title.center(len(rule), "=")] if title else []
    out += [line(headers), rule, *(line(r) for r in cells)]
    return "\n".join(out)


def format_key_values(title: str, sections: Sequence[tuple[str | None, Sequence[tuple[str, Any]]]],
                      width: int = 50) -> str:
    """Renders labelled figures in one column under section headings, framed by ``=`` rules.

    Args:
        title: the banner on the first line.
        sections: ``(heading or None, [(label, value), ...])`` in print order.
        width: characters per line.
    """
    out = [f" {title} ".center(width, "=")]
    for heading, items in sections:
        if heading:
            out.append(f" {heading} ".center(width, "-"))
        for label, value in items:
            text = _cell(value)
            out.append(f"{label + ':':<{width - max(len(text), 10)}}{text:>{max(len(text), 10)}}")
    out.append("=" * width)
    return "\n".join(out)


def to_jsonable(value: Any) -> Any:
    """Dataclasses to dicts, tuples to lists, Paths to strings, non-finite floats to strings (``"inf"``)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def write_json(path: Path, payload: Any) -> None:
    """Writes ``payload`` (after ``to_jsonable``) as indented JSON, creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or value is None


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.3g}" if 0 < abs(value) < 0.01 else f"{value:.2f}"
    return str(value)
