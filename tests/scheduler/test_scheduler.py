"""Scheduler: plans as deltas, chunked prefill, preemption, placement, aborts, no leaked blocks."""

import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.messages import EngineRequest, FinishReason, SequenceId
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.engine import Engine, LocalExecutor
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.spec_decode.config import SpeculativeConfig
from tests.scheduler.scripted_runner import TOKEN_COUNTS_ONLY, ScriptedRunner, reference_output


def request(rid: str, prompt_len: int, max_tokens: int, t: float = 0.0) -> EngineRequest:
    """A request whose prompt is a run of ids starting from one fixed per ``rid``: crc32, not ``hash``, which
    changes per process (two rids drew the same start, so shared prefix blocks, about once in 90 runs)."""
    prompt = tuple((zlib.crc32(rid.encode()) + i) % 90 + 5 for i in range(prompt_len))
    return EngineRequest(rid, prompt, EngineSamplingParams(max_tokens=max_tokens, eos_token_ids=(2,)), t)


def make_engine(workers: dict[str, int], speculative: SpeculativeConfig = SpeculativeConfig(),
                **config) -> tuple[Engine, dict[str, ScriptedRunner]]:
    cfg = SchedulerConfig(**{"block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 64, **TOKEN_COUNTS_ONLY, **config})
    scheduler = Scheduler(cfg, speculative)
    runners = {}
    for wid, num_blocks in workers.items():
        scheduler.add_worker(wid, num_blocks)
        runners[wid] = ScriptedRunner(num_blocks, cfg.block_size)
    return Engine(scheduler, LocalExecutor(runners)), runners


def run_to_completion(engine: Engine, outputs: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    outputs = {} if outputs is None else outputs
    max_steps = 10_000
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            tokens = outputs.setdefault(out.request_id, [])
            assert out.first_output_index == len(tokens)
            tokens.extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def assert_all_free(engine: Engine) -> None:
    for w in engine.scheduler.stats().workers:
        assert w.num_free_blocks == w.num_blocks and w.num_running == 0


def test_first_plan_sends_requests_in_full_then_deltas():
    engine, runners = make_engine({"w0": 16})
    engine.add_request(request("a", 5, 4))
    engine.add_request(request("b", 3, 4))
    plan = engine.scheduler.schedule(["w0"]).plans["w0"]
    assert [(r.seq_id.request_id, r.block_ids, r.num_computed_tokens, r.num_scheduled_tokens) for r in plan.new_requests] == [
        ("a", (0, 1), 0, 5),
        ("b", (2,), 0, 3),
    ]
    assert plan.cached_requests == () and plan.finished_seq_ids == ()
    engine.scheduler.update_from_output({"w0": runners["w0"].execute(plan)})
    plan = engine.scheduler.schedule(["w0"]).plans["w0"]
    assert plan.new_requests == ()
    # a: 6 tokens, slot 5 is in block 1; b: 4 tokens, slot 3 still in block 2
    assert [(c.seq_id.request_id, c.new_block_ids, c.num_computed_tokens, c.num_scheduled_tokens) for c in plan.cached_requests] == [
        ("a", (), 5, 1),
        ("b", (), 3, 1),
    ]
    engine.scheduler.update_from_output({"w0": runners["w0"].execute(plan)})
    plan = engine.scheduler.schedule(["w0"]).plans["w0"]
    assert [(c.seq_id.request_id, c.new_block_ids) for c in plan.cached_requests] == [("a", ()), ("b", (3,))]


def test_outputs_match_reference_and_blocks_are_freed():
    engine, _ = make_engine({"w0": 32})
    for i in range(6):
        engine.add_request(request(f"r{i}", 3 + i, 5 + i))
    outputs = run_to_completion(engine)
    for i in range(6):
        req = request(f"r{i}", 3 + i, 5 + i)
        assert outputs[f"r{i}"] == reference_output(list(req.prompt_token_ids), 5 + i)
    assert_all_free(engine)


def test_lookahead_slots_left_empty_are_given_back_on_both_sides():
    """Speculation reserves slots the scripted runner drafts into and accepts some of; the scheduler frees
    the blocks past the computed slots, and the runner drops them from its table as a worker does, so a
    block freed there and taken by another sequence is never read or written twice (12 blocks, 4 requests)."""
    engine, runners = make_engine({"w0": 12}, SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                control="fixed"))
    for rid in "abcd":
        engine.add_request(request(rid, 5, 14))
    outputs = run_to_completion(engine)
    assert outputs == {rid: reference_output(list(request(rid, 5, 14).prompt_token_ids), 14) for rid in "abcd"}
    assert sum(c.num_lookahead_tokens for p in runners["w0"].plans for c in p.cached_requests) > 0
    assert_all_free(engine)


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    engine, runners = make_engine({"w0": 32}, max_num_seqs=4, max_num_batched_tokens=8)
    engine.add_request(request("long", 20, 2))
    outputs = run_to_completion(engine)
    chunks = [(p.new_requests + p.cached_requests)[0].num_scheduled_tokens for p in runners["w0"].plans if p.new_requests or p.cached_requests]
    assert chunks == [8, 8, 4, 1]
    assert outputs["long"] == reference_output(list(request("long", 20, 2).prompt_token_ids), 2)


def test_decodes_go_first_and_budget_is_shared():
    engine, runners = make_engine({"w0": 64}, max_num_seqs=4, max_num_batched_tokens=6)
    engine.add_request(request("a", 2, 5))
    engine.step()  # a prefilled
    engine.add_request(request("b", 10, 2))
    engine.step()
    plan = runners["w0"].plans[-1]
    assert [(c.request_id, c.num_scheduled_tokens) for c in plan.cached_requests] == [("a", 1)]
    assert [(n.request_id, n.num_scheduled_tokens) for n in plan.new_requests] == [("b", 5)]


def test_preemption_recomputes_newest_and_outputs_stay_exact():
    engine, runners = make_engine({"w0": 10}, max_num_seqs=8, admission_headroom=0.0)  # admit what fits: preempt
    reqs = [request(f"r{i}", 6, 12, t=i) for i in range(5)]
    for r in reqs:
        engine.add_request(r)
    outputs = run_to_completion(engine)
    assert engine.scheduler.stats().num_preemptions > 0
    for r in reqs:
        assert outputs[r.request_id] == reference_output(list(r.prompt_token_ids), 12)
    assert_all_free(engine)
    resumed = [n for p in runners["w0"].plans for n in p.new_requests if n.num_prompt_tokens < len(n.token_ids)]
    assert resumed, "a preempted sequence was resumed with its generated tokens"
    assert all(n.seq_id in {r for p in runners["w0"].plans for r in p.finished_seq_ids} for n in resumed)


def test_newest_running_sequence_is_the_victim():
    engine, runners = make_engine({"w0": 4}, max_num_seqs=8, max_plans_in_flight=1,  # one plan per step
                                  admission_headroom=0.0)  # both admitted, so one is preempted
    engine.add_request(request("old", 4, 8, t=0))
    engine.add_request(request("new", 4, 8, t=1))
    for _ in range(5):  # prefill (blocks 0, 1), then decodes fill blocks 2, 3 up to slot 7
        engine.step()
    assert engine.scheduler.stats().num_preemptions == 0
    engine.step()  # slot 8 needs a third block for "old": the newest, "new", is preempted
    assert engine.scheduler.sequence(SequenceId("new")).num_preemptions == 1
    assert engine.scheduler.sequence(SequenceId("old")).num_preemptions == 0


def test_new_sequences_go_to_the_worker_with_most_free_blocks():
    engine, runners = make_engine({"w0": 8, "w1": 12}, placement="least-loaded")
    engine.add_request(request("a", 16, 2))  # 4 blocks -> w1 (12 free), then w1 has 8
    engine.add_request(request("b", 4, 2))  # tie 8/8: first registered wins
    engine.add_request(request("c", 4, 2))  # w0 has 7 free, w1 8 -> w1
    out = engine.scheduler.schedule(["w0", "w1"])
    assert [n.seq_id.request_id for n in out.plans["w1"].new_requests] == ["a", "c"]
    assert [n.seq_id.request_id for n in out.plans["w0"].new_requests] == ["b"]


def test_abort_frees_blocks_and_tells_the_worker():
    engine, runners = make_engine({"w0": 8})
    engine.add_request(request("a", 6, 10))
    engine.add_request(request("b", 2, 10))
    engine.step()
    assert engine.abort_request("a") and engine.abort_request("zzz") == []
    assert engine.scheduler.block_manager("w0").num_free_blocks == 7
    engine.step()
    assert runners["w0"].plans[-1].finished_seq_ids == (SequenceId("a"),)
    assert SequenceId("a") not in runners["w0"].state
    engine.abort_request("b")
    engine.add_request(request("c", 1, 1))
    run_to_completion(engine)
    assert_all_free(engine)


def test_request_larger_than_any_worker_is_rejected_with_resource_exhausted():
    engine, _ = make_engine({"w0": 4})
    engine.add_request(request("huge", 17, 10))  # a 17-token prompt, 16 slots
    engine.add_request(request("ok", 2, 1))
    outputs = engine.step()
    assert outputs[0].request_id == "huge" and outputs[0].finish_reason is FinishReason.ABORT
    assert outputs[0].error is not None and outputs[0].error.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert [o.request_id for o in outputs[1:]] == ["ok"]
    assert not engine.has_unfinished_requests()


def test_failed_worker_sequences_resume_elsewhere():
    engine, runners = make_engine({"w0": 16, "w1": 16})
    reqs = [request(f"r{i}", 5, 6) for i in range(4)]
    for r in reqs:
        engine.add_request(r)
    outputs: dict[str, list[int]] = {}
    for out in engine.step() + engine.step():
        outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.scheduler.sequences_on("w1")
    engine.scheduler.remove_worker("w1")
    del engine.executor.runners["w1"]
    run_to_completion(engine, outputs)
    for r in reqs:
        assert outputs[r.request_id] == reference_output(list(r.prompt_token_ids), 6)
    assert_all_free(engine)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(0, 3), st.booleans()), min_size=1, max_size=12),
    st.integers(6, 20),
    st.integers(4, 24),
    st.sampled_from([1, 2]),
    st.sampled_from([0, 0, 2, 4]),
)
def test_random_workloads_are_exact_and_leak_nothing(specs, num_blocks, budget, plans_in_flight, lookahead):
    """Random arrivals, aborts, preemptions over two workers, and speculation's lookahead slots when
    ``lookahead`` > 0 (the scripted runner accepts 0..lookahead of its drafts; the blocks past the
    computed slots go back after each step): outputs equal the reference, no block is held twice or lost."""
    speculative = SpeculativeConfig(method="ngram", num_speculative_tokens=lookahead, control="fixed") \
        if lookahead else SpeculativeConfig()
    engine, _ = make_engine({"w0": num_blocks, "w1": num_blocks // 2 + 2}, speculative, max_num_seqs=4,
                            max_num_batched_tokens=max(4, budget), max_plans_in_flight=plans_in_flight)
    pending = [(request(f"r{i}", p, m, t=i), delay, abort) for i, (p, m, delay, abort) in enumerate(specs)]
    outputs: dict[str, list[int]] = {}
    finished: dict[str, FinishReason] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        for item in [x for x in pending if x[1] <= step]:
            engine.add_request(item[0])
            pending.remove(item)
        for req, _, abort in specs_abort(specs, step):
            engine.abort_request(req)
        for out in engine.step():
            tokens = outputs.setdefault(out.request_id, [])
            assert out.first_output_index == len(tokens)
            tokens.extend(out.new_token_ids)
            if out.finish_reason:
                finished[out.request_id] = out.finish_reason
        sched = engine.scheduler
        for wid in sched.worker_ids:
            bm = sched.block_manager(wid)
            held = [b for rid in bm.seq_ids() for b in bm.block_table(rid)]
            assert sorted(set(held) | set(bm.free_block_ids())) == list(range(bm.num_blocks))
            assert not set(held) & set(bm.free_block_ids())
            assert all(bm.ref_count(b) == held.count(b) for b in set(held))  # shared prefix blocks
        step += 1
        assert step < 5000
    for i, (p, m, _, _) in enumerate(specs):
        rid = f"r{i}"
        if finished.get(rid) is FinishReason.LENGTH:  # max_tokens, or the worker's whole cache
            expected = reference_output(list(request(rid, p, m).prompt_token_ids), m)
            assert outputs[rid] == expected[: len(outputs[rid])]
    assert_all_free(engine)


def specs_abort(specs, step):
    """Aborts request i at step 3*i+2 when its abort flag is set."""
    return [(f"r{i}", None, True) for i, s in enumerate(specs) if s[3] and step == 3 * i + 2]


def test_a_sequence_that_fills_its_worker_alone_finishes_with_length():
    engine, _ = make_engine({"w0": 4})  # 16 slots
    engine.add_request(request("long", 4, 100))
    outputs = run_to_completion(engine)
    assert outputs["long"] == reference_output(list(request("long", 4, 100).prompt_token_ids), 13)
    assert engine.scheduler.stats().num_preemptions == 0
    assert_all_free(engine)


def test_a_prompt_cached_on_a_worker_too_small_for_it_runs_on_one_that_holds_it():
    """Found by the property test above: r2 (21 tokens: 6 blocks) is prefilled in part on w1 (5
    blocks), preempted, and its cached prefix there made prefix placement pick w1 for ever, which can
    never hold it, while w0 (6 blocks) stood free."""
    engine, _ = make_engine({"w0": 6, "w1": 5}, max_num_seqs=4, max_num_batched_tokens=9, max_plans_in_flight=1)
    reqs = [request("r0", 5, 2, t=0), request("r1", 1, 3, t=1), request("r2", 21, 1, t=2)]
    for r in reqs:
        engine.add_request(r)
    outputs: dict[str, list[int]] = {}
    run_to_completion(engine, outputs)
    for r in reqs:
        assert outputs[r.request_id] == reference_output(list(r.prompt_token_ids), r.sampling.max_tokens)
    assert_all_free(engine)
