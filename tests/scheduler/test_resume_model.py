"""Scheduler.resume_request over a tiny random-weight Llama in process: a request resumed from the
first k tokens of an undisturbed run continues with exactly that run's tokens k, k+1, ... (and
their logprobs), greedy or seeded, with penalties and min_tokens, alone or in a busy batch."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.config import SchedulerConfig
from pagedserve.engine.engine import Engine, LocalExecutor
from pagedserve.engine.messages import EngineRequest, FinishReason, ResumedSample
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.runner_factory import build_model_runner
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.scheduler import Scheduler
from tests.scheduler.scripted_runner import TOKEN_COUNTS_ONLY
from tests.worker.tiny_models import save_tiny_model

BLOCK = 4
PROMPT = (17, 45, 3, 88, 61, 9, 30)  # 7 tokens: prompt + k fills whole blocks at k = 1, 5, 9, 13
GREEDY = EngineSamplingParams(max_tokens=16, temperature=0.0)
STOP = 5  # stop token of the min_tokens case: biased up, so it comes as soon as min_tokens allows


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", seed=7)
    return build_model_runner(folder, kv_cache_memory_bytes=1 << 20, block_size=BLOCK)


class Run:
    """An engine over ``runner`` (its worker state starts afresh) and the outputs per sample."""

    def __init__(self, runner, **config) -> None:
        cfg = SchedulerConfig(**{"block_size": BLOCK, "max_num_seqs": 16, "max_num_batched_tokens": 24, **TOKEN_COUNTS_ONLY,
                                  **config})
        self.scheduler = Scheduler(cfg)
        self.scheduler.add_worker("w", runner.num_blocks)
        self.engine = Engine(self.scheduler, LocalExecutor({"w": runner}))
        self.outputs: dict[tuple[str, int], list[RequestOutput]] = {}

    def until_done(self) -> Run:
        for _ in range(1000):
            if not self.engine.has_unfinished_requests():
                return self
            for out in self.engine.step():
                self.outputs.setdefault((out.request_id, out.sample_index), []).append(out)
        raise AssertionError("the engine did not finish")

    def tokens(self, rid: str, sample: int = 0) -> list[int]:
        return [t for out in self.outputs.get((rid, sample), ()) for t in out.new_token_ids]


def request(rid: str, sampling: EngineSamplingParams, prompt: tuple[int, ...] = PROMPT) -> EngineRequest:
    return EngineRequest(rid, prompt, sampling, 0.0)


def undisturbed(runner, sampling: EngineSamplingParams) -> Run:
    run = Run(runner)
    run.engine.add_request(request("u", sampling))
    return run.until_done()


def resumed(runner, sampling: EngineSamplingParams, samples: list[ResumedSample], **config) -> Run:
    run = Run(runner, **config)
    run.scheduler.resume_request(request("m", sampling), samples)
    return run.until_done()


def assert_continues(run: Run, reference: Run, sample: int, k: int) -> None:
    """Sample ``sample`` of ``m`` in ``run`` is sample ``sample`` of ``u`` in ``reference`` from token k on."""
    outputs, expected = run.outputs[("m", sample)], reference.outputs[("u", sample)]
    assert outputs[0].first_output_index == k
    assert run.tokens("m", sample) == reference.tokens("u", sample)[k:]
    assert outputs[-1].finish_reason is expected[-1].finish_reason
    assert outputs[-1].stop_token_id == expected[-1].stop_token_id


@pytest.mark.parametrize("k", [0, 1, 3, 5, 9, 15])
def test_greedy_continues_with_the_undisturbed_tokens(runner, k):
    reference = undisturbed(runner, GREEDY)
    tokens = reference.tokens("u")
    assert len(tokens) == 16 and len(set(tokens)) > 1
    assert_continues(resumed(runner, GREEDY, [ResumedSample(0, tuple(tokens[:k]), False)]), reference, 0, k)


def test_greedy_resumed_in_the_same_engine_takes_the_prompt_from_the_prefix_cache(runner):
    run = Run(runner)
    run.engine.add_request(request("u", GREEDY))
    tokens = run.until_done().tokens("u")
    hits = run.scheduler.stats().prefix_cache_hits
    run.scheduler.resume_request(request("m", GREEDY), [ResumedSample(0, tuple(tokens[:6]), False)])
    assert run.until_done().tokens("m") == tokens[6:]
    assert run.scheduler.stats().prefix_cache_hits - hits == 3 * BLOCK  # 13 tokens: 3 full blocks cached


SEEDED = EngineSamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1234, n=3)


@pytest.mark.parametrize("ks, finished", [((4, 12, 0), (False, True, False)),
                                          ((0, 7, 3), (False, False, True)),
                                          ((9, 1, 5), (True, False, False))])
def test_seeded_samples_continue_each_with_its_own_tokens(runner, ks, finished):
    reference = undisturbed(runner, SEEDED)
    streams = [reference.tokens("u", i) for i in range(3)]
    assert len({tuple(s) for s in streams}) == 3  # each sample draws its own tokens
    samples = [ResumedSample(i, tuple(streams[i][:k]), done) for i, (k, done) in enumerate(zip(ks, finished))]
    run = resumed(runner, SEEDED, samples)
    for i in range(3):
        if finished[i]:
            assert ("m", i) not in run.outputs
        else:
            assert_continues(run, reference, i, ks[i])


PENALTIES = dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.8, presence_penalty=0.5)


@pytest.mark.parametrize("sampling, ks", [
    (EngineSamplingParams(max_tokens=16, **PENALTIES), (0, 3, 8, 13)),
    (EngineSamplingParams(max_tokens=16, min_tokens=6, stop_token_ids=(STOP,), logit_bias=((STOP, 50.0),),
                          **PENALTIES), (0, 2, 5, 6)),
])
def test_penalties_and_min_tokens_count_the_delivered_tokens_as_output(runner, sampling, ks):
    reference = undisturbed(runner, sampling)
    tokens = reference.tokens("u")
    if sampling.min_tokens:  # the stop token comes as soon as min_tokens allows it
        assert tokens == tokens[:6] + [STOP] and reference.outputs[("u", 0)][-1].finish_reason is FinishReason.STOP
    else:  # the penalties change the output
        assert tokens != undisturbed(runner, EngineSamplingParams(max_tokens=16, temperature=0.0)).tokens("u")
    for k in ks:
        assert_continues(resumed(runner, sampling, [ResumedSample(0, tuple(tokens[:k]), False)]), reference, 0, k)


def assert_same_logprobs(got: RequestOutput, expected: RequestOutput) -> None:
    for a, b in zip(got.logprobs, expected.logprobs, strict=True):
        assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-5)


LOGPROBS = EngineSamplingParams(max_tokens=10, temperature=0.7, seed=99, n=2, logprobs=3, prompt_logprobs=2,
                                repetition_penalty=1.2)


@pytest.mark.parametrize("ks", [(3, 0), (0, 4), (9, 1)])
def test_logprobs_of_continued_tokens_equal_the_undisturbed_run(runner, ks):
    reference = undisturbed(runner, LOGPROBS)
    streams = [reference.tokens("u", i) for i in range(2)]
    run = resumed(runner, LOGPROBS, [ResumedSample(i, tuple(streams[i][:k]), False) for i, k in enumerate(ks)])
    for i, k in enumerate(ks):
        assert_continues(run, reference, i, k)
        for got, expected in zip(run.outputs[("m", i)], reference.outputs[("u", i)][k:], strict=True):
            assert_same_logprobs(got, expected)
    first, expected = run.outputs[("m", 0)][0], reference.outputs[("u", 0)][0]
    if ks[0] > 0:  # the client got the prompt logprobs with its first token
        assert first.prompt_logprobs is None
    else:
        assert len(first.prompt_logprobs) == len(PROMPT) - 1
        for a, b in zip(first.prompt_logprobs, expected.prompt_logprobs, strict=True):
            assert (a.token_id, a.rank, a.top_token_ids) == (b.token_id, b.rank, b.top_token_ids)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)


def test_greedy_resumed_inside_a_busy_batch(runner):
    rng = random.Random(5)
    others = [request(f"o{i}", EngineSamplingParams(max_tokens=8 + i, temperature=0.0 if i % 2 else 0.9, seed=i,
                                                    n=1 + i % 3), tuple(rng.randrange(3, 96) for _ in range(3 + 9 * i)))
              for i in range(5)]  # prompts up to 39 tokens: prefilled in chunks of the 24-token budget
    reference = undisturbed(runner, GREEDY)
    alone = Run(runner)
    for other in others:
        alone.engine.add_request(other)
    alone.until_done()
    busy = Run(runner, max_num_seqs=6)
    for other in others[:3]:
        busy.engine.add_request(other)
    busy.scheduler.resume_request(request("m", GREEDY), [ResumedSample(0, tuple(reference.tokens("u")[:7]), False)])
    for other in others[3:]:
        busy.engine.add_request(other)
    busy.until_done()
    assert_continues(busy, reference, 0, 7)
    assert {key: busy.tokens(*key) for key in alone.outputs} == {key: alone.tokens(*key) for key in alone.outputs}
