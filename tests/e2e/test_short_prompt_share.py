"""A short request is not queued behind a long prompt's prefill chunks (``--short-prompt-share``,
``RunningSchedule._prefill_share``), through the real services: one worker, a small token budget so that
a long prompt takes tens of steps; a short request sent while it is prefilled gets its answer many steps
before the long prompt's first token (first come, first served, it waited for every chunk), and both
answers are the in-process engine's."""

from __future__ import annotations

import random
import threading

import pytest

from tests.e2e.processes import scheduler_stats, start_stack, wait_until
from tests.e2e.test_stack import assert_all_blocks_free, stream
from tests.e2e.timed_streams import token_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BUDGET = 8  # tokens a step: the long prompt takes ~100 steps, a few seconds on the default model's one-thread worker
LONG_PROMPT_TOKENS = 800
SHORT_PROMPT_TOKENS = 20


def test_a_short_request_is_answered_while_a_long_prompt_is_still_prefilled(tmp_path, default_model, default_llm):
    from pagedserve.engine.sampling_params import SamplingParams

    rng = random.Random(23)
    long_prompt = [rng.randrange(1000, 20000) for _ in range(LONG_PROMPT_TOKENS)]
    short_prompt = [rng.randrange(1000, 20000) for _ in range(SHORT_PROMPT_TOKENS)]
    expected = [list(o.token_ids) for o in default_llm.generate(
        [long_prompt, short_prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))]
    stack = start_stack(tmp_path, default_model, num_workers=1,
                        scheduler_args=("--max-num-batched-tokens", str(BUDGET)))
    try:
        answers: dict[str, list[int]] = {}
        steps_at_answer: dict[str, int] = {}

        def run(name: str, prompt: list[int]) -> None:
            answers[name] = [t for r in stream(stack.gateway, token_request(prompt, 2)) for t in r.token_ids]
            steps_at_answer[name] = scheduler_stats(stack.scheduler).num_steps

        long = threading.Thread(target=run, args=("long", long_prompt))
        long.start()
        wait_until(lambda: scheduler_stats(stack.scheduler).num_running == 1, "the long prompt admitted", 60)
        run("short", short_prompt)
        long.join(300)
        print(f"\nscheduler steps when answered: {steps_at_answer}")
        assert answers == {"long": expected[0], "short": expected[1]}
        # answered beside the long prompt's chunks, not after them (first come, first served: 0-2 steps apart)
        assert steps_at_answer["long"] - steps_at_answer["short"] >= 10, steps_at_answer
        assert_all_blocks_free(stack)
    finally:
        stack.stop()
