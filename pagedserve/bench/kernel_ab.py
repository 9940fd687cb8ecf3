"""A C++ kernel library built as it was at a git revision, under another library name, so that it loads
beside the working tree's in one process: the base side of the same-process A/B scripts
(``scripts/attention_op_ab.py``, ``panel_gemm_ab.py``, ``few_rows_ab.py``; this VM's memory speed drifts
30-45 GB/s within minutes, so only such an A/B resolves a 10% change).
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

import torch

from pagedserve.engine.attention.cpu_op import kernel_defines, load_cpu_library

ROOT = Path(__file__).resolve().parents[2]

OLD_DEFINE_NAMES = {"PAGEDSERVE_PREFETCH_TO_L2": "PAGEDSERVE_KEYS_TO_L2"}
"""Defines by their name before a rename (d87aad1): a revision from before it reads the old one."""


def files_at(revision: str, folder: Path) -> dict[str, str]:
    """Every file in ``folder`` (a kernel's source folder in the working tree) as it was at ``revision``: the
    kernel's source and the headers it includes. Raises SystemExit when git cannot read them."""
    where = folder.resolve().relative_to(ROOT)
    listing = _git("ls-tree", "--name-only", f"{revision}:{where}")
    return {name: _git("show", f"{revision}:{where}/{name}") for name in listing.split()}


def files_in_tree(folder: Path) -> dict[str, str]:
    """Every file in ``folder`` as the working tree has it (see ``files_at``)."""
    return {path.name: path.read_text() for path in sorted(folder.iterdir()) if path.is_file()}


def renamed_library(files: dict[str, str], source: Path, library: str, name: str, what: str, prefix: str = ""):
    """``torch.ops.<library>_<name>``: the library of ``files[source.name]`` built under that name.

    Args:
        files: file name -> text (``files_at`` or ``files_in_tree``), written to a temporary folder.
        source: the kernel's C++ file (its ``TORCH_LIBRARY`` and ``TORCH_LIBRARY_IMPL`` lines name ``library``).
        library: the library's name in those lines.
        name: what the copy's library name ends with.
        what: the kernel, for messages (e.g. "the GEMM at HEAD").
        prefix: text put before the source (e.g. an ``#undef`` that builds another instruction set's code).

    Raises:
        SystemExit: ``files`` lack the source, its library lines are not ``library``'s, or it does not build.
    """
    if source.name not in files:
        raise SystemExit(f"{what}: there is no {source.name}")
    text = files[source.name]
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL"):
        text = text.replace(f"{macro}({library},", f"{macro}({library}_{name},")
    if text.count(f"({library}_{name},") != 2:
        raise SystemExit(f"{what}: its TORCH_LIBRARY lines are not {library}'s")
    defines = kernel_defines()
    defines += tuple(OLD_DEFINE_NAMES[d] for d in defines if d in OLD_DEFINE_NAMES)
    with tempfile.TemporaryDirectory() as folder:
        for file_name, file_text in files.items():
            (Path(folder) / file_name).write_text(file_text)
        (Path(folder) / source.name).write_text(prefix + text)
        if not load_cpu_library(Path(folder) / source.name, f"{library}_{name}_ab", what, "nothing", defines=defines):
            raise SystemExit(f"{what} could not be built (see the warning above)")
    return getattr(torch.ops, f"{library}_{name}")


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout
