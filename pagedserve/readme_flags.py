"""The README's flag tables, made from the command line's own parsers, so that the README and
``--help`` cannot disagree: ``python -m pagedserve.readme_flags`` rewrites the part of README.md
between ``BEGIN`` and ``END``; ``tests/test_readme_flags.py`` checks that doing so changes nothing.

Defaults are those of a clean environment: the parsers are built without the ``PAGEDSERVE_*``
variables (which would become the flags' defaults).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

BEGIN = "<!-- flag tables: made by `python -m pagedserve.readme_flags`; edit the flags' help, not these tables -->"
END = "<!-- end of flag tables -->"

COMMANDS = ("up", "complete", "health", "gateway", "scheduler", "worker", "worker-rank", "prepare-model")
"""The commands whose flags the README lists, in this order (``bench`` has its own page of flags:
``pagedserve bench --help``)."""

README = Path(__file__).resolve().parents[1] / "README.md"


def clean_parser() -> argparse.ArgumentParser:
    """``pagedserve``'s parser as built where no ``PAGEDSERVE_*`` variable is set."""
    from pagedserve.cli import build_parser

    saved = {k: v for k, v in os.environ.items() if k.startswith("PAGEDSERVE_")}
    for name in saved:
        del os.environ[name]
    try:
        return build_parser()
    finally:
        os.environ.update(saved)


def _flag(action: argparse.Action) -> str:
    """How ``--help`` names the flag and its value: ``--port PORT``, ``--chat``, ``--placement {a,b}``."""
    flag = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flag
    if action.metavar:
        return f"{flag} {action.metavar}"
    if action.choices:
        return f"{flag} {{{','.join(map(str, action.choices))}}}"
    return flag


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def command_table(parser: argparse.ArgumentParser) -> str:
    """One command's flags as a Markdown table (flag, and its ``--help`` text with the default)."""
    formatter = parser._get_formatter()
    rows = ["| flag | meaning (default; environment variable) |", "|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        rows.append(f"| `{_flag(action)}` | {_cell(formatter._expand_help(action) if action.help else '')} |")
    return "\n".join(rows)


def flag_tables(parser: argparse.ArgumentParser) -> str:
    """Every command of ``COMMANDS`` as a folded section holding its table."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    sections = []
    for name in COMMANDS:
        sub = commands[name]
        sections.append(f"<details><summary><code>pagedserve {name}</code>: {_cell(sub.description or '')}</summary>"
                        f"\n\n{command_table(sub)}\n\n</details>")
    return "\n\n".join(sections)


def rewrite(readme: str, tables: str) -> str:
    """``readme`` with the text between ``BEGIN`` and ``END`` replaced by ``tables``.

    Raises:
        ValueError: a marker is missing (put both on lines of their own where the tables go).
    """
    head, begin, rest = readme.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not (begin and end):
        raise ValueError(f"README.md needs the lines {BEGIN!r} and {END!r} around the flag tables")
    return f"{head}{BEGIN}\n{tables}\n{END}{tail}"


def main() -> int:
    """Rewrites README.md's flag tables; prints whether they changed."""
    text = README.read_text()
    new = rewrite(text, flag_tables(clean_parser()))
    if new != text:
        README.write_text(new)
    print(f"{README}: flag tables {'rewritten' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
