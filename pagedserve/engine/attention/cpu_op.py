"""Builds and loads the C++ paged-attention op for CPU (``csrc/paged_attention_cpu.cpp``), and
(:func:`load_cpu_library`) any other C++ op library of pagedserve's (``models/csrc``).

The op is compiled once per machine with ``torch.utils.cpp_extension`` (the system C++ compiler,
``-O3 -march=native``) into a cache folder, then loaded into ``torch.ops.pagedserve_cpu``. The first
build takes about 10 s on two cores; later loads take milliseconds. ``scripts/setup.sh`` and the Dockerfile
build it ahead of time. When the build fails (no compiler, unsupported platform) :func:`load_cpu_attention_op`
warns once and returns ``None``, and callers use the torch backend instead.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.engine.cpu_features import cpu_flags, cpu_vendor, l2_prefetches_preferred
from pagedserve.model_files import default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
LANES = 16  # the op's vector width in floats: head_dim must be a multiple (kLanes in the source)

PagedAttentionOp = Callable[..., None]
_loaded: dict[tuple[Path, tuple[str, ...]], bool] = {}  # (source, defines) -> whether its library is loaded


def default_build_dir() -> Path:
    """``ops/`` in pagedserve's cache folder (``$PAGEDSERVE_CACHE_DIR``, else ``~/.cache/pagedserve``):
    one subfolder per source version and CPU."""
    return default_cache_dir() / "ops"


def _cpu_fingerprint() -> str:
    """A short hash of the CPU's instruction-set flags: a ``-march=native`` build is only valid on
    CPUs with the same ones."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def _source_digest(source: Path, defines: tuple[str, ...] = ()) -> str:
    """A short hash of the C++ file, the headers next to it (``vec16.h``) and the build's ``defines``: a
    change to any makes a new build folder, so the op is rebuilt."""
    h = hashlib.sha256(source.read_bytes() + " ".join(defines).encode())
    for header in sorted(source.parent.glob("*.h")):
        h.update(header.name.encode() + header.read_bytes())
    return h.hexdigest()[:10]


def kernel_defines() -> tuple[str, ...]:
    """The build choices of pagedserve's C++ kernels for this CPU (the decode attention op's, the few-row and
    panel GEMMs'): ``PAGEDSERVE_PREFETCH_TO_L2`` where
    :func:`~pagedserve.engine.cpu_features.l2_prefetches_preferred`."""
    return ("PAGEDSERVE_PREFETCH_TO_L2",) if l2_prefetches_preferred(cpu_flags(), cpu_vendor()) else ()


def load_cpu_attention_op(source: Path | None = None, build_dir: Path | None = None) -> PagedAttentionOp | None:
    """The compiled ``paged_attention`` op, built on first use; ``None`` if it cannot be built.

    The op: ``op(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
    alibi_slopes=None, alibi_bf16=False)`` writes ``out`` ``[T, H, D]``; ``alibi_slopes`` float32 ``[H]`` adds the ALiBi
    bias (a separate instantiation of the score loop); see the source file for the layouts.

    Args:
        source: the C++ file (default :data:`SOURCE`; tests pass a broken one to exercise the fallback).
        build_dir: where builds are cached (default :func:`default_build_dir`).

    Returns:
        ``torch.ops.pagedserve_cpu.paged_attention``, or ``None`` after logging a warning that says
        what failed and that the torch backend is used instead (also when the build folder cannot be
        created, e.g. on a read-only volume: nothing is raised).
    """
    if load_cpu_library(source or SOURCE, "pagedserve_cpu_attention", "the C++ paged-attention op for CPU",
                        "the torch attention backend", build_dir, kernel_defines()):
        return torch.ops.pagedserve_cpu.paged_attention
    return None


def load_cpu_library(source: Path, prefix: str, what: str, fallback: str, build_dir: Path | None = None,
                     defines: tuple[str, ...] = ()) -> bool:
    """Builds (on first use, once per source version, CPU and ``defines``) and loads the torch op library of
    ``source``.

    Args:
        source: the C++ file; every header next to it is part of the build's version.
        prefix: the build folder's and library's name before the version.
        what, fallback: the op and what runs instead, for the warning when it cannot be built.
        build_dir: where builds are cached (default :func:`default_build_dir`).
        defines: preprocessor macros the build defines (``-D``): choices the source makes per CPU.

    Returns:
        Whether the library is loaded; ``False`` after logging a warning that says what failed and
        that ``fallback`` is used instead (also when the build folder cannot be created, e.g. on a
        read-only volume: nothing is raised).
    """
    key = (source, defines)
    if key in _loaded:
        return _loaded[key]
    name = f"{prefix}_{_source_digest(source, defines)}_{_cpu_fingerprint()}"
    folder = (build_dir or default_build_dir()) / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a read-only or foreign cache folder must not stop a worker
        log.warning("%s has no build in %s and that folder cannot be created (%s); using %s instead. Build the "
                    "op ahead where the folder is writable (scripts/setup.sh; the Dockerfile builds it into the "
                    "image) or point PAGEDSERVE_CACHE_DIR at a writable folder.", what, folder, exc, fallback)
        _loaded[key] = False
        return False
    try:
        built = folder / f"{name}.so"
        if built.exists():  # built before: load it without taking the build lock
            torch.ops.load_library(str(built))
        else:
            _build(name, source, folder, defines)
        _loaded[key] = True
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: use the fallback
        log.warning("%s could not be built (%s: %s); using %s instead. Install a C++ compiler (g++) and ninja "
                    "to get it.", what, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "", fallback)
        _loaded[key] = False
    return _loaded[key]


STALE_LOCK_S = 300.0
"""A build lock older than this was left by a process killed while building: it is removed (a build
takes about 10 s on two cores), so that the next start does not wait for it forever."""


def _build(name: str, source: Path, folder: Path, defines: tuple[str, ...]) -> None:
    """Compiles and loads the op with ``torch.utils.cpp_extension`` (which holds ``folder/lock``
    while building). Raises whatever the build raises."""
    from torch.utils import cpp_extension

    lock = folder / "lock"
    try:
        if time.time() - lock.stat().st_mtime > STALE_LOCK_S:
            log.warning("removing a stale build lock %s (a build was killed)", lock)
            lock.unlink()
    except FileNotFoundError:
        pass
    cpp_extension.load(name=name, sources=[str(source)], build_directory=str(folder),
                       extra_cflags=["-O3", "-march=native", "-fopenmp", *(f"-D{d}" for d in defines)],
                       extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=False)

