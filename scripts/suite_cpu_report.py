"""Sums up a suite CPU log written through scripts/suite_cpu/sitecustomize.py: CPU seconds by kind of
process (pytest worker, each pagedserve subcommand, other), then by the test file that started them.

Usage: python scripts/suite_cpu_report.py LOG [--files N]
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def process_kind(argv: str, test: str) -> str:
    """``pytest worker``, ``pytest`` (the controller, or every test's own CPU with ``-n 0``), ``pagedserve
    SUBCOMMAND`` (``bench NAME`` for benches), or the name of the file argv starts with."""
    words = argv.split()
    if test == "-" and words[:1] == ["-c"]:
        return "pytest worker"
    if words and words[0].endswith("pytest/__main__.py"):
        return "pytest"
    if words and (words[0].endswith("pagedserve/__main__.py") or words[0].endswith("bin/pagedserve")) \
            and len(words) > 1:
        return "pagedserve " + " ".join(words[1:3] if words[1] == "bench" else words[1:2])
    if words[:1] == ["-c"]:
        return "python -c (rank processes, probes)"
    return Path(words[0]).name if words else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--files", type=int, default=25, help="test files to list (default 25)")
    args = parser.parse_args()
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_file: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = 0.0
    for line in args.log.read_text(errors="replace").splitlines():
        fields = line.split("\t", 3)
        if len(fields) != 4:  # a line cut short (a full disk, a process killed mid-write)
            continue
        _, cpu, test, argv = fields
        kind, seconds = process_kind(argv, test), float(cpu)
        total += seconds
        by_kind[kind][0] += seconds
        by_kind[kind][1] += 1
        if kind not in ("pytest worker", "pytest"):
            by_file[test.split("::")[0]][kind] += seconds
    print(f"{total:.0f} CPU-s logged\n\nCPU-s  processes  kind")
    for kind, (seconds, count) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
        print(f"{seconds:7.1f} {count:6d}  {kind}")
    print("\nCPU-s of the processes each test file started (a session stack counts for the file that started it)")
    for name, kinds in sorted(by_file.items(), key=lambda item: -sum(item[1].values()))[:args.files]:
        detail = ", ".join(f"{kind} {seconds:.0f}" for kind, seconds in kinds.most_common())
        print(f"{sum(kinds.values()):7.1f}  {name}: {detail}")


if __name__ == "__main__":
    main()
