"""One OpenMP thread team per process: the thread that builds a model gives its team back before
another thread runs the model.

torch's CPU kernels run their parallel regions on the OpenMP team of the thread that calls them, and
each calling thread gets a team of its own. A model is built (weights loaded, GEMM weights packed) on
one thread and run on another (``LocalExecutor``'s thread per worker, the worker service's model
thread), so the process keeps two teams: 2 x 2 threads on a 2-core machine. GNU libgomp stops
spinning between parallel regions when it manages more threads than there are CPUs (GOMP_SPINCOUNT's
"throttled" count, libgomp manual), so every region of the running team waited for its sleeping
threads to wake: about 70 us more a region on the 2-core Xeon VM, for a decode step's ~300 regions
(a 64-row SiLU: 22 us with one team, 92-129 us with two). Giving the builder's team back
(OpenMP 5.0's ``omp_pause_resource_all``, soft pause: the threads end, a later region starts new ones)
made the default model's decode steps 1.2x faster at 64 sequences and 1.5x at one (docs/benchmarks.md,
"Fused row-wise ops, and one OpenMP team").
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger("pagedserve.worker")

OMP_PAUSE_SOFT = 1
"""``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``."""
RUNTIME_NAMES = ("libgomp", "libiomp5", "libomp")
"""File-name starts of the OpenMP runtimes torch builds link (GNU, Intel, LLVM)."""


def loaded_openmp_runtimes(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Paths of the OpenMP runtime libraries mapped into this process, in map order (empty where
    ``/proc`` is absent)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    paths = [line.split()[-1] for line in lines if line.split() and line.split()[-1].startswith("/")]
    return list(dict.fromkeys(p for p in paths if Path(p).name.startswith(RUNTIME_NAMES)))


def release_openmp_team() -> bool:
    """Ends the calling thread's OpenMP worker threads (``omp_pause_resource_all(omp_pause_soft)``).

    Call it on the thread that built a model, once the model runs elsewhere; a later parallel region
    on this thread starts a new team (one region's cost, ~0.1 ms). Where it cannot (no OpenMP runtime
    mapped, one without OpenMP 5.0's pause, or a call inside a parallel region) nothing changes.

    Returns:
        Whether a runtime released the team.
    """
    for path in loaded_openmp_runtimes():
        pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        if pause is not None:
            released = pause(OMP_PAUSE_SOFT) == 0
            log.debug("OpenMP team of the building thread %s (%s)", "released" if released else "kept", path)
            return released
    return False
