"""Scheduler features: prefix caching, decodes before prefill chunks, chunking off, priority,
swap preemption and parallel sampling (fork + copy-on-write), checked with the scripted runner."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.messages import EngineRequest, SequenceId
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.engine import Engine, LocalExecutor
from pagedserve.engine.scheduler import Scheduler
from tests.scheduler.scripted_runner import TOKEN_COUNTS_ONLY, ScriptedRunner, reference_output


def make(workers: dict[str, int], cpu_blocks: int = 0, **config) -> tuple[Engine, dict[str, ScriptedRunner]]:
    cfg = SchedulerConfig(**{"block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64, **TOKEN_COUNTS_ONLY, **config})
    scheduler, runners = Scheduler(cfg), {}
    for wid, num_blocks in workers.items():
        scheduler.add_worker(wid, num_blocks, cpu_blocks)
        runners[wid] = ScriptedRunner(num_blocks, cfg.block_size, cpu_blocks)
    return Engine(scheduler, LocalExecutor(runners)), runners


def req(rid: str, prompt: list[int], max_tokens: int, t: float = 0.0, **sampling) -> EngineRequest:
    priority = sampling.pop("priority", 0)
    params = EngineSamplingParams(max_tokens=max_tokens, eos_token_ids=(2,), **sampling)
    return EngineRequest(rid, tuple(prompt), params, t, priority=priority)


def collect(engine: Engine, outputs: dict) -> None:
    """One step; its tokens appended to ``outputs`` by (request id, sample index)."""
    for out in engine.step():
        tokens = outputs.setdefault((out.request_id, out.sample_index), [])
        assert out.first_output_index == len(tokens)
        tokens.extend(out.new_token_ids)


def run(engine: Engine, outputs: dict | None = None) -> dict[tuple[str, int], list[int]]:
    outputs = {} if outputs is None else outputs
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return outputs
        collect(engine, outputs)
    raise AssertionError("did not finish")


def all_free(engine: Engine) -> bool:
    stats = engine.scheduler.stats()
    return stats.num_running == stats.num_swapped == 0 and all(w.num_free_blocks == w.num_blocks for w in stats.workers)


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + i % 50 for i in range(n)]


def test_a_shared_prefix_is_computed_once():
    engine, runners = make({"w": 32})
    engine.add_request(req("a", prompt(10), 3))
    run(engine)
    engine.add_request(req("b", prompt(8) + [77, 78, 79], 3))
    outputs = run(engine)
    new_b = [n for p in runners["w"].plans for n in p.new_requests if n.request_id == "b"][0]
    new_a = [n for p in runners["w"].plans for n in p.new_requests if n.request_id == "a"][0]
    assert new_b.num_computed_tokens == 8 and new_b.num_scheduled_tokens == 3
    assert new_b.block_ids[:2] == new_a.block_ids[:2]
    assert outputs[("b", 0)] == reference_output(prompt(8) + [77, 78, 79], 3)
    stats = engine.scheduler.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (21, 8)


def test_without_prefix_caching_nothing_is_shared():
    engine, runners = make({"w": 32}, enable_prefix_caching=False)
    engine.add_request(req("a", prompt(10), 3))
    run(engine)
    engine.add_request(req("b", prompt(10), 3))
    run(engine)
    assert all(n.num_computed_tokens == 0 for p in runners["w"].plans for n in p.new_requests)


def test_decodes_are_served_before_prefill_chunks():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, max_plans_in_flight=1)
    outputs: dict = {}
    engine.add_request(req("a", prompt(4, 5), 12))
    collect(engine, outputs)  # a: prefill
    engine.add_request(req("b", prompt(30, 60), 2))
    for _ in range(5):
        collect(engine, outputs)
    plans = runners["w"].plans[1:]
    assert [(n.request_id, n.num_scheduled_tokens) for n in plans[0].new_requests] == [("b", 7)]
    for plan in plans[1:]:
        assert [(c.request_id, c.num_scheduled_tokens) for c in plan.cached_requests][0] == ("a", 1)
    assert [c.num_scheduled_tokens for p in plans[1:] for c in p.cached_requests if c.request_id == "b"] == [7, 7, 7, 2]
    run(engine, outputs)
    assert outputs[("a", 0)] == reference_output(prompt(4, 5), 12)
    assert outputs[("b", 0)] == reference_output(prompt(30, 60), 2)
    assert all_free(engine)


def test_without_chunking_a_prompt_runs_whole_or_is_refused():
    engine, runners = make({"w": 64}, max_num_batched_tokens=8, enable_chunked_prefill=False)
    engine.add_request(req("too-long", prompt(9), 2))
    engine.add_request(req("fits", prompt(8), 2))
    outputs: dict = {}
    first = engine.step()
    assert first[0].request_id == "too-long" and first[0].error.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert [(n.request_id, n.num_scheduled_tokens) for n in runners["w"].plans[-1].new_requests] == [("fits", 8)]
    outputs[("fits", 0)] = [o.new_token_ids[0] for o in first if o.request_id == "fits"]
    assert run(engine, outputs)[("fits", 0)] == reference_output(prompt(8), 2)


def test_without_chunking_a_prompt_goes_to_a_worker_whose_own_budget_takes_it_whole():
    """Review 71: with workers of different budgets (a CPU's 256 beside a GPU's 2048), placement looked at KV
    capacity only: a 1,000-token prompt went to the CPU worker, which could never take it whole, and waited
    there for ever with the queue behind it; and a prompt that one worker's cache holds and only another's
    budget takes whole was not refused either."""
    config = SchedulerConfig(block_size=16, max_num_seqs=8, enable_chunked_prefill=False, **TOKEN_COUNTS_ONLY)
    scheduler = Scheduler(config)
    runners = {"cpu": ScriptedRunner(200, 16), "gpu": ScriptedRunner(100, 16)}
    scheduler.add_worker("cpu", 200, device="cpu")
    scheduler.add_worker("gpu", 100, device="cuda")
    engine = Engine(scheduler, LocalExecutor(runners))
    engine.add_request(req("long", prompt(1000), 2))
    engine.add_request(req("short", prompt(10, 30), 2))
    outputs = run(engine)
    assert outputs == {("long", 0): reference_output(prompt(1000), 2),
                       ("short", 0): reference_output(prompt(10, 30), 2)}
    assert [n.request_id for p in runners["gpu"].plans for n in p.new_requests] == ["long"]
    engine.add_request(req("nowhere", prompt(2000), 2))  # the CPU worker's cache holds it, the GPU's budget would
    refused = engine.step()
    assert refused[0].request_id == "nowhere" and refused[0].error.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "every worker whose KV cache holds it (at most 256)" in refused[0].error.message
    assert all_free(engine)


def test_priority_orders_admission_and_picks_the_lowest_priority_victim():
    engine, runners = make({"w": 6}, policy="priority", max_num_seqs=8, admission_headroom=0.0)  # all three admitted
    engine.add_request(req("low", prompt(4, 1), 12, t=0, priority=5))
    engine.add_request(req("high", prompt(4, 2), 12, t=1, priority=0))
    engine.add_request(req("mid", prompt(4, 3), 12, t=2, priority=2))
    outputs: dict = {}
    collect(engine, outputs)
    assert [n.request_id for n in runners["w"].plans[0].new_requests] == ["high", "mid", "low"]
    run(engine, outputs)
    assert engine.scheduler.stats().num_preemptions > 0
    first_victim = next(s for p in runners["w"].plans for s in p.finished_seq_ids)
    assert first_victim == SequenceId("low")
    for rid, start in (("low", 1), ("high", 2), ("mid", 3)):
        assert outputs[(rid, 0)] == reference_output(prompt(4, start), 12)


def test_swap_preemption_resumes_exactly_and_frees_cpu_blocks():
    engine, runners = make({"w": 8}, cpu_blocks=8, preemption_mode="swap")
    reqs = [req(f"r{i}", prompt(6, 10 * i), 14, t=i) for i in range(4)]
    for r in reqs:
        engine.add_request(r)
    outputs = run(engine)
    stats = engine.scheduler.stats()
    assert stats.num_swap_preemptions > 0
    plans = runners["w"].plans
    assert any(p.blocks_to_swap_out for p in plans) and any(p.blocks_to_swap_in for p in plans)
    for r in reqs:
        assert outputs[(r.request_id, 0)] == reference_output(list(r.prompt_token_ids), 14)
    assert all_free(engine) and engine.scheduler.block_manager("w").num_free_cpu_blocks == 8


def test_parallel_samples_share_the_prompt_and_copy_the_partial_block():
    engine, runners = make({"w": 32})
    engine.add_request(req("p", prompt(10), 5, n=3))
    outputs = run(engine)
    plans = runners["w"].plans
    children = [n for p in plans for n in p.new_requests if n.seq_id.sample_index > 0]
    parent = [n for p in plans for n in p.new_requests if n.seq_id == SequenceId("p", 0)][0]
    assert sorted(c.seq_id for c in children) == [SequenceId("p", 1), SequenceId("p", 2)]
    for child in children:
        assert child.block_ids[:2] == parent.block_ids[:2]  # the full prompt blocks, shared
        assert child.block_ids[2] != parent.block_ids[2] and child.num_computed_tokens == 10
    copies = [c for p in plans for c in p.blocks_to_copy]
    assert sorted(copies) == sorted((parent.block_ids[2], c.block_ids[2]) for c in children)
    for i in range(3):
        assert outputs[("p", i)] == reference_output(prompt(10), 5, sample_index=i)
    assert all_free(engine)


def test_aborting_a_parallel_request_aborts_every_sample():
    engine, _ = make({"w": 32})
    engine.add_request(req("p", prompt(6), 50, n=4))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("p") and not engine.has_unfinished_requests()
    engine.step()
    assert all_free(engine)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(1, 3), st.integers(0, 3)),
             min_size=1, max_size=10),
    st.sampled_from(["recompute", "swap"]),
    st.sampled_from(["fcfs", "priority"]),
    st.integers(4, 24),
    st.sampled_from([1, 2]),
)
def test_all_features_together_stay_exact(specs, mode, policy, budget, plans_in_flight):
    engine, _ = make({"w0": 14, "w1": 10}, cpu_blocks=6, preemption_mode=mode, policy=policy,
                     max_num_seqs=4, max_num_batched_tokens=budget, max_plans_in_flight=plans_in_flight)
    shared = prompt(8, 40)
    reqs = []
    for i, (plen, max_tokens, n, priority) in enumerate(specs):
        p = (shared + prompt(plen, 3 * i))[: 8 + plen] if i % 2 else prompt(plen, 3 * i)
        reqs.append(req(f"r{i}", p, max_tokens, t=i, n=n, priority=priority))
    outputs: dict = {}
    for i, r in enumerate(reqs):
        engine.add_request(r)
        if i % 3 == 2:
            collect(engine, outputs)
    run(engine, outputs)
    for r in reqs:
        for sample in range(r.sampling.n):
            got = outputs.get((r.request_id, sample))
            if got is None:
                assert any(k[0] == r.request_id for k in outputs)  # the whole request was refused
                continue
            assert got == reference_output(list(r.prompt_token_ids), r.sampling.max_tokens, sample)[: len(got)]
    assert all_free(engine)


def test_a_request_id_that_looks_like_a_sample_is_its_own_request():
    """Issue #9, defect 2: ids were "<id>#<i>" strings, so a request "p#1" collided with sample 1 of "p"."""
    for order in (("p", "p#1"), ("q#1", "q")):
        engine, runners = make({"w": 64})
        for rid in order:
            engine.add_request(req(rid, prompt(6), 5, n=2 if "#" not in rid else 1))
        outputs = run(engine)
        samples = {rid: 2 if "#" not in rid else 1 for rid in order}
        assert sorted(outputs) == sorted((rid, i) for rid, n in samples.items() for i in range(n))
        for (rid, i), tokens in outputs.items():
            assert tokens == reference_output(prompt(6), 5, sample_index=i)
        assert all_free(engine)


def test_workers_get_stop_token_ids_only_while_min_tokens_needs_them():
    """Issue #9, defect 4: stop ids are the scheduler's business; a worker needs them only to mask."""
    engine, runners = make({"w": 64})
    engine.add_request(req("plain", prompt(5), 3, stop_token_ids=tuple(range(3, 40))))
    engine.add_request(req("masked", prompt(5, 1), 3, stop_token_ids=(7,), min_tokens=2))
    engine.step()
    sent = {n.request_id: n.sampling for n in runners["w"].plans[0].new_requests}
    assert sent["plain"].stop_token_ids == () and sent["plain"].eos_token_ids == ()
    assert sent["masked"].stop_token_ids == (7,) and sent["masked"].eos_token_ids == (2,)
