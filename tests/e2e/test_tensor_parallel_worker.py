"""`pagedserve worker --tensor-parallel-size 3` with the default model (SmolLM2-135M: 9 query heads,
3 KV heads, so one KV head a rank) in the whole stack: the same greedy tokens as the in-process
single-rank engine (free and constrained by a JSON schema and a regex in the same batch), the KV capacity of one rank's budget over one KV head, and a killed helper
rank makes the scheduler drop the worker and the worker exit non-zero (no hang). One stack
startup serves all three checks (issue #12)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.text.tokenizer import ChatTurn
from pagedserve.services.common.pb import generate_pb2 as gen
from pagedserve.services.common.pb import generate_pb2_grpc
from tests.e2e.processes import scheduler_stats, start_stack, wait_until
from tests.e2e.test_stack import QUESTIONS, assert_all_blocks_free, chat_request, stream
from tests.engine.test_structured_outputs import PERSON, REGEXES

pytestmark = [pytest.mark.e2e, pytest.mark.model]
KV_MIB = 8
MAX_CONSTRAINED = 96


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _helper_pids(worker_pid: int) -> list[int]:
    """The helper ranks: the children of the worker's multiprocessing fork server (engine/parallel/spawn.py
    forks them there; the worker's other child is multiprocessing's resource tracker)."""
    servers = [pid for pid in _children(worker_pid) if b"forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return [helper for server in servers for helper in _children(server)]


@pytest.fixture(scope="module")
def tp3_stack(tmp_path_factory, default_model):
    stack = start_stack(tmp_path_factory.mktemp("tp3"), default_model, num_workers=1,
                        kv_cache_memory=f"{KV_MIB}MiB", worker_args=("--tensor-parallel-size", "3"),
                        scheduler_args=("--step-timeout", "30"))
    yield stack
    stack.stop()


def test_tp3_capacity_is_one_ranks_budget_over_one_kv_head(tp3_stack):
    # Each rank's 8 MiB holds blocks of its 1 KV head (30 layers, K and V, head_dim 64, 16 tokens,
    # float32): 34 blocks, where one rank holding all 3 KV heads would get 8 MiB // 737280 = 11.
    assert scheduler_stats(tp3_stack.scheduler).workers[0].num_blocks == (KV_MIB << 20) // (2 * 30 * 64 * 16 * 4) == 34
    assert len(_helper_pids(tp3_stack.processes["worker-0"].popen.pid)) == 2


def _constrained(question: str, kind: StructureKind, spec: str) -> tuple[gen.GenerateRequest, SamplingParams]:
    """A greedy chat request whose output ``spec`` constrains, and the same as in-process parameters."""
    request = chat_request(question, max_tokens=MAX_CONSTRAINED)
    setattr(request.sampling_params.structured_output, kind.name.lower(), spec)
    return request, SamplingParams(max_tokens=MAX_CONSTRAINED, temperature=0.0,
                                   structured_output=StructuredOutput(kind, spec))


def test_tp3_greedy_equals_single_rank_in_process(tp3_stack, offline_outputs, default_llm):
    """Four free questions, a JSON-schema and a regex one at once: one batch over the three ranks,
    where rank 0 holds the grammar matchers (issue #22: structured outputs under tensor parallelism)."""
    questions = QUESTIONS[:4]
    constrained = [_constrained(QUESTIONS[4], StructureKind.JSON, json.dumps(PERSON)),
                   _constrained(QUESTIONS[5], StructureKind.REGEX, REGEXES["date"])]
    requests = [chat_request(q) for q in questions] + [r for r, _ in constrained]
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: stream(tp3_stack.gateway, r), requests))
    for question, responses in zip(questions, results):
        want = offline_outputs[question]
        assert [t for r in responses for t in r.token_ids] == list(want.token_ids), question
        assert "".join(r.text for r in responses) == want.text
    wanted = [default_llm.chat([[ChatTurn("user", q)]], params)[0]
              for q, (_, params) in zip(QUESTIONS[4:6], constrained)]
    for want, responses in zip(wanted, results[4:]):
        assert [t for r in responses for t in r.token_ids] == list(want.token_ids)
    assert json.loads(wanted[0].text) and re.fullmatch(REGEXES["date"], wanted[1].text), [w.text for w in wanted]
    assert_all_blocks_free(tp3_stack)


def kill_a_rank_and_expect_the_drop(stack, worker_ids: tuple[str, ...]) -> None:
    """Kills worker-0's first helper rank, sends a request, and expects the scheduler to drop every
    id of ``worker_ids`` ("a step failed") and the worker to exit non-zero, within 40 s."""
    os.kill(_helper_pids(stack.processes["worker-0"].popen.pid)[0], signal.SIGKILL)
    started = time.monotonic()
    with grpc.insecure_channel(stack.gateway) as channel, pytest.raises(grpc.RpcError):
        # Its step fails on rank 0 (a peer is gone); the client gives up after 5 s.
        request = gen.GenerateRequest(prompt="Hello", sampling_params=gen.SamplingParams(max_tokens=4))
        list(generate_pb2_grpc.GenerationStub(channel).Generate(request, timeout=5))  # a raw prompt: any tokenizer
    log = stack.processes["scheduler"]
    wait_until(lambda: all(f"worker {w} dropped: a step failed" in log.log_text() for w in worker_ids),
               f"{worker_ids} dropped", 30)
    worker = stack.processes["worker-0"].popen
    wait_until(lambda: worker.poll() is not None, "the broken worker exiting", 30)
    assert worker.returncode != 0  # so that a supervisor (`pagedserve up`) restarts it
    assert time.monotonic() - started < 40


def test_killed_helper_rank_drops_the_worker(tp3_stack):
    """Runs last in this module: it breaks the stack."""
    kill_a_rank_and_expect_the_drop(tp3_stack, ("worker-0",))
