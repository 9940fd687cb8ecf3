"""The rendezvous of a worker's ranks (engine/parallel/group.py): rank 0 holds its port from the
start, and a failed join does not break the process's next group."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from pagedserve.engine.parallel.group import CollectiveError, GroupSpec, TensorParallelGroup, serve_rendezvous


def test_rank0_holds_its_rendezvous_port_until_the_group_is_done():
    spec, store = serve_rendezvous(GroupSpec("tcp://127.0.0.1:0", 2, timeout_s=5.0))
    port = int(spec.init_method.rsplit(":", 1)[1])
    assert port == store.port > 0
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("127.0.0.1", port))
    with pytest.raises(CollectiveError, match=f"rendezvous tcp://127.0.0.1:{port}: .*EADDRINUSE"):
        serve_rendezvous(spec)


def _rank_one(spec: GroupSpec) -> None:
    group = TensorParallelGroup(spec, 1)
    try:
        group.all_reduce(torch.tensor([2.0]))
    finally:
        group.close()


def test_a_failed_join_leaves_the_next_group_of_the_process_working():
    """torch names the default group after a count that a failed init leaves bumped: unless it is
    reset, this process's next group is named "1", a fresh rank's "0", and the two never meet."""
    spec, store = serve_rendezvous(GroupSpec("tcp://127.0.0.1:0", 2, timeout_s=1.0))
    with pytest.raises(CollectiveError, match="rank 0 could not join"):
        TensorParallelGroup(spec, 0, store)  # rank 1 never comes
    spec, store = serve_rendezvous(GroupSpec("tcp://127.0.0.1:0", 2, timeout_s=30.0))
    helper = mp.get_context("forkserver").Process(target=_rank_one, args=(spec,))
    helper.start()
    try:
        group = TensorParallelGroup(spec, 0, store)
        try:
            assert group.all_reduce(torch.tensor([1.0])).tolist() == [3.0]
        finally:
            group.close()
    finally:
        helper.join(30)
        helper.kill()
    assert helper.exitcode == 0
