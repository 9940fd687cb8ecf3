"""The building thread's OpenMP team is given back (engine/openmp_threads.py): the runtime found in the
process's maps, the team's threads ended by the release, and build_model_runner releasing its own."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from pagedserve.engine.openmp_threads import loaded_openmp_runtimes, release_openmp_team
from pagedserve.engine.runner_factory import build_model_runner

pytestmark = pytest.mark.skipif(not loaded_openmp_runtimes(), reason="needs torch with an OpenMP runtime (Linux)")


def _settled_threads(quiet_s: float = 0.3, limit_s: float = 5.0) -> set[str]:
    """This process's thread ids once the set has not changed for ``quiet_s`` (threads that other code
    starts or ends in passing, e.g. a build's helper, or a team's threads leaving, are done by then)."""
    deadline = time.monotonic() + limit_s
    last, since = set(os.listdir("/proc/self/task")), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = set(os.listdir("/proc/self/task"))
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


@pytest.fixture
def two_threads():
    """torch on two intra-op threads (the suite may run it on one), restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _parallel_region() -> None:
    x = torch.randn(512, 512)
    x @ x  # a GEMM large enough to run on every intra-op thread


def test_the_openmp_runtimes_are_read_from_the_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("\n".join([
        "7f00-7f01 r-xp 00000000 08:01 12 /venv/torch/lib/libgomp.so.1",
        "7f01-7f02 r--p 00001000 08:01 12 /venv/torch/lib/libgomp.so.1",  # another segment of the same file
        "7f02-7f03 r-xp 00000000 08:01 13 /usr/lib/libc.so.6",
        "7f03-7f04 r-xp 00000000 08:01 14 /opt/intel/libiomp5.so",
        "7f04-7f05 rw-p 00000000 00:00 0 ",
        "7f05-7f06 r-xp 00000000 00:00 0 [vdso]",
    ]))
    assert loaded_openmp_runtimes(maps) == ["/venv/torch/lib/libgomp.so.1", "/opt/intel/libiomp5.so"]
    assert loaded_openmp_runtimes(tmp_path / "absent") == []


def test_releasing_ends_the_teams_threads_and_a_later_region_starts_them_again(two_threads):
    _parallel_region()
    with_team = _settled_threads()
    assert release_openmp_team()
    without_team = _settled_threads()
    assert len(with_team - without_team) == 1 and without_team < with_team  # the one helper of a two-thread team
    _parallel_region()
    assert len(_settled_threads()) == len(with_team)


def test_building_a_runner_leaves_the_building_thread_without_a_team(two_threads, small_model: Path):
    _parallel_region()  # the building thread has a team before the build, as after loading weights
    runner = build_model_runner(small_model, kv_cache_memory_bytes=1 << 22)
    assert runner.num_blocks > 0
    after_build = _settled_threads()
    release_openmp_team()
    assert after_build - _settled_threads() == set()  # nothing left to end: the build gave its team back
