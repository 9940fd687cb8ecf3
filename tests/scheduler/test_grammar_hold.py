"""A request with a structured output waits out of the queue until every worker has built its
grammar (``Engine.add_request``), so no step stops to compile it; one whose grammar does not build
ends with INVALID_ARGUMENT; aborting a waiting one frees nothing it does not hold."""

from concurrent.futures import Future

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.engine import Engine, LocalExecutor
from pagedserve.engine.structured_output import GrammarError
from pagedserve.engine.messages import EngineRequest, FinishReason
from pagedserve.engine.request_errors import ErrorKind
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from tests.scheduler.scripted_runner import TOKEN_COUNTS_ONLY, ScriptedRunner, reference_output
from tests.scheduler.test_scheduler import assert_all_free, request, run_to_completion

DIGITS = StructuredOutput(StructureKind.REGEX, "[0-9]+")


class GatedRunner(ScriptedRunner):
    """A scripted runner whose grammar builds finish when the test says (``builds``, in call order)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.builds: list[tuple[StructuredOutput, Future[None]]] = []

    def prepare(self, structure: StructuredOutput) -> Future[None]:
        self.builds.append((structure, Future()))
        return self.builds[-1][1]


def make_engine(workers: int = 1) -> tuple[Engine, list[GatedRunner]]:
    config = SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, **TOKEN_COUNTS_ONLY)
    scheduler = Scheduler(config)
    runners = {f"w{i}": GatedRunner(16, 4) for i in range(workers)}
    for worker_id in runners:
        scheduler.add_worker(worker_id, 16)
    return Engine(scheduler, LocalExecutor(runners)), list(runners.values())


def structured(rid: str, prompt_len: int, max_tokens: int) -> EngineRequest:
    free = request(rid, prompt_len, max_tokens)
    params = EngineSamplingParams(max_tokens=max_tokens, eos_token_ids=(2,), structured_output=DIGITS)
    return EngineRequest(rid, free.prompt_token_ids, params, 0.0)


def scheduled_ids(runner: ScriptedRunner) -> set[str]:
    return {r.seq_id.request_id for plan in runner.plans for r in plan.new_requests}


def test_a_structured_request_runs_only_after_every_worker_built_its_grammar():
    engine, (w0, w1) = make_engine(workers=2)
    engine.add_request(structured("s", 5, 3))
    engine.add_request(request("free", 3, 3))
    assert [b[0] for b in w0.builds] == [DIGITS] and [b[0] for b in w1.builds] == [DIGITS]
    for _ in range(4):
        engine.step()
    assert "s" not in scheduled_ids(w0) | scheduled_ids(w1)
    assert "free" in scheduled_ids(w0) | scheduled_ids(w1)
    assert engine.scheduler.waiting_requests() == ["s"] and engine.scheduler.stats().num_waiting == 1
    w0.builds[0][1].set_result(None)
    engine.step()
    assert "s" not in scheduled_ids(w0) | scheduled_ids(w1)  # w1 has not built it yet
    w1.builds[0][1].set_result(None)
    outputs = run_to_completion(engine)
    assert outputs["s"] == reference_output(list(structured("s", 5, 3).prompt_token_ids), 3)
    assert_all_free(engine)


def test_a_grammar_that_does_not_build_ends_its_request_with_invalid_argument():
    engine, (w0,) = make_engine()
    engine.add_request(structured("bad", 5, 3))
    engine.add_request(request("free", 3, 3))
    w0.builds[0][1].set_exception(GrammarError("structured output does not build: unknown rule"))
    outputs = [o for _ in range(5) for o in engine.step()]
    ended = [o for o in outputs if o.request_id == "bad"]
    assert [(o.finish_reason, o.error.kind) for o in ended] == [(FinishReason.ABORT, ErrorKind.INVALID_ARGUMENT)]
    assert "unknown rule" in ended[0].error.message
    assert "bad" not in scheduled_ids(w0)
    free = [t for o in outputs if o.request_id == "free" for t in o.new_token_ids]
    assert free == reference_output(list(request("free", 3, 3).prompt_token_ids), 3)
    assert_all_free(engine)


def test_a_worker_that_cannot_answer_does_not_hold_the_request_for_ever():
    engine, (w0,) = make_engine()
    engine.add_request(structured("s", 5, 2))
    w0.builds[0][1].set_exception(ConnectionError("worker gone"))  # it builds the grammar when the plan comes
    assert run_to_completion(engine)["s"] == reference_output(list(structured("s", 5, 2).prompt_token_ids), 2)


def test_aborting_a_request_that_waits_for_its_grammar_ends_it_and_leaks_nothing():
    engine, (w0,) = make_engine()
    engine.add_request(structured("s", 5, 3))
    engine.step()
    outputs = engine.abort_request("s")
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("s", FinishReason.ABORT)]
    w0.builds[0][1].set_result(None)  # built after the abort: nothing to release
    engine.step()
    assert not engine.has_unfinished_requests() and engine.scheduler.waiting_requests() == []
    assert engine.scheduler.stats().num_waiting == 0 and "s" not in scheduled_ids(w0)
    assert_all_free(engine)
