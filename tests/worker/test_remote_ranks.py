"""Ranks on several machines, one machine standing in for two: rank 1 of a TP=2 worker is a
separate ``pagedserve worker-rank`` process dialing rank 0 over 127.0.0.1 (``parallel/rank_link.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.engine.parallel.group import CollectiveError
from pagedserve.engine.parallel.rank_link import RankPlacement
from pagedserve.llm import LLM
from tests.e2e.ports import free_port
from tests.worker.tp_helpers import (BLOCK, BLOCK_BYTES_ONE_RANK, NUM_BLOCKS, assert_a_dead_or_stuck_rank_fails_the_step,
                                     generated_tokens, tiny_model_and_prompts)

TOKEN = "remote-rank-test-secret-0123456789"
REPO = Path(__file__).resolve().parents[2]


def rank_address() -> str:
    """``127.0.0.1:P`` with P and P + 1 free (``--rank-address`` P; its gloo rendezvous is on P + 1)."""
    return f"127.0.0.1:{free_port(span=2)}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_and_prompts(tmp_path_factory.mktemp("remote"), (1, 4, 7, 13, 20))


@pytest.fixture(scope="module")
def reference(tiny):
    """One rank's greedy tokens of the prompts."""
    folder, prompts = tiny
    return generated_tokens(LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK), prompts)


@pytest.fixture
def remote():
    """``(address, process)``: rank 1 as a ``pagedserve worker-rank`` process dialing a free loopback port."""
    address = rank_address()
    process = start_rank(1, address, TOKEN)
    yield address, process
    process.kill()
    process.wait()


def start_rank(rank: int, address: str, token: str) -> subprocess.Popen:
    """``pagedserve worker-rank --rank RANK --rank-address ADDRESS`` with ``token`` in the environment."""
    env = {**os.environ, "PAGEDSERVE_CLUSTER_TOKEN": token, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "pagedserve", "worker-rank", "--rank", str(rank),
                             "--rank-address", address, "--num-threads", "1", "--connect-timeout", "180"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def placement(address: str, timeout_s: float = 120.0) -> RankPlacement:
    return RankPlacement(address, local_ranks=1, authkey=TOKEN.encode(), join_timeout_s=timeout_s)


def test_tp2_with_a_remote_rank_equals_one_rank_and_a_killed_rank_fails_the_step(tiny, reference, remote):
    folder, prompts = tiny
    address, process = remote
    llm = LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK // 2, block_size=BLOCK,
              tensor_parallel_size=2, rank_placement=placement(address))
    try:
        assert generated_tokens(llm, prompts) == reference
        runner = llm._runners["worker-0"]
        assert runner.helpers[0][0].name.startswith("rank-1 (at 127.0.0.1:")
        assert_a_dead_or_stuck_rank_fails_the_step(llm, runner, process.pid, "killed", prompts[:2])
    finally:
        llm.close()


def test_a_rank_with_a_wrong_secret_is_refused_and_missing_ranks_are_named(tiny):
    folder, _ = tiny
    address = rank_address()
    intruder = start_rank(1, address, "not-the-cluster-token-at-all")
    started = time.monotonic()
    try:
        with pytest.raises(CollectiveError, match=r"ranks \[1\] did not join .*pagedserve worker-rank --rank 1"):
            LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK,
                tensor_parallel_size=2, rank_placement=placement(address, timeout_s=15.0))
        out, _ = intruder.communicate(timeout=30)
    finally:
        intruder.kill()
    assert intruder.returncode == 1
    assert "refused the cluster token" in out
    assert time.monotonic() - started < 60


def test_pp2_with_a_remote_last_stage_equals_one_rank(tiny, reference, remote):
    """Rank 1 is the last stage, which samples and sends the results back over the TCP link."""
    folder, prompts = tiny
    address, process = remote
    with LLM(folder, kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES_ONE_RANK, block_size=BLOCK,
             pipeline_parallel_size=2, virtual_engines=1, rank_placement=placement(address)) as llm:
        assert generated_tokens(llm, prompts) == reference
    assert process.wait(timeout=30) == 0  # rank 0 stopped it


def test_a_placement_is_checked_before_anything_starts():
    assert RankPlacement().spawned(4) == 4
    assert RankPlacement("10.0.0.1:29600", 2, b"k").spawned(4) == 2
    assert RankPlacement("10.0.0.1:29600").rendezvous("tcp://127.0.0.1:1") == "tcp://10.0.0.1:29601"
    assert RankPlacement().rendezvous("tcp://127.0.0.1:1") == "tcp://127.0.0.1:1"
    for bad, message in ((RankPlacement(local_ranks=2), "give --rank-address"),
                         (RankPlacement("h:1", 5, b"k"), r"must be in 1\.\.4"),
                         (RankPlacement("h:1", 2), "cluster token"),
                         (RankPlacement("no-port", 2, b"k"), "HOST:PORT")):
        with pytest.raises(ValueError, match=message):
            bad.spawned(4)


def test_worker_rank_flags_and_the_worker_s_checks(monkeypatch, tmp_path):
    from pagedserve.cli import build_parser
    from pagedserve.engine.runner_config import RunnerConfig
    from pagedserve.services.worker.config import WorkerConfig

    monkeypatch.setenv("PAGEDSERVE_CLUSTER_TOKEN", "tok-from-env-0123456789")
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices["worker-rank"]
    assert "tok-from-env" not in sub.format_help()
    args = parser.parse_args(["worker-rank", "--rank", "1", "--rank-address", "10.0.0.1:29600"])
    assert (args.rank, args.rank_address, args.cluster_token) == (1, "10.0.0.1:29600", "tok-from-env-0123456789")
    base = dict(model=tmp_path, redis_url="redis://127.0.0.1:6379/0", cluster_token="t" * 32,
                runner=RunnerConfig(tensor_parallel_size=2))
    assert WorkerConfig(**base, local_ranks=1, rank_address="0.0.0.0:29600").local_ranks == 1
    with pytest.raises(ValueError, match="give --rank-address"):
        WorkerConfig(**base, local_ranks=1)
    with pytest.raises(ValueError, match="HOST:PORT"):
        WorkerConfig(**base, local_ranks=1, rank_address="29600")


RANK_0 = """
import sys, time
from pagedserve.engine.parallel.rank_link import RankPlacement
from pagedserve.llm import LLM
placement = RankPlacement(sys.argv[2], local_ranks=1, authkey=sys.argv[3].encode(), join_timeout_s=120)
llm = LLM(sys.argv[1], kv_cache_memory="1MiB", block_size=4, tensor_parallel_size=2, rank_placement=placement)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_remote_rank_exits_when_rank_0_is_killed(tiny, remote):
    folder, _ = tiny
    address, process = remote
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    rank_0 = subprocess.Popen([sys.executable, "-c", RANK_0, str(folder), address, TOKEN], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert rank_0.stdout.readline().strip() == "ready"
        rank_0.kill()
        started = time.monotonic()
        process.wait(timeout=30)  # EOF on its connection: it exits
        assert time.monotonic() - started < 30
    finally:
        rank_0.kill()
        rank_0.wait()
