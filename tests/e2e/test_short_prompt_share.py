"""A short request is not queued behind long prompts' prefill chunks (``--short-prompt-share``,
``RunningSchedule._prefill_share``, ``admission_order``), through the real services: one worker, a small
token budget so that a long prompt takes tens of steps. A short request sent while one long prompt is
prefilled and a second waits for it passes the second and gets its answer many steps before the first
long prompt's first token (first come, first served, it waited for both), and every answer is the
in-process engine's."""

from __future__ import annotations

import random
import threading

import pytest

from tests.e2e.processes import scheduler_stats, start_stack, wait_until
from tests.e2e.test_stack import assert_all_blocks_free, stream
from tests.e2e.timed_streams import token_request

pytestmark = [pytest.mark.e2e, pytest.mark.model]

BUDGET = 8  # tokens a step: the long prompt takes ~100 steps, a few seconds on the default model's one-thread worker
LONG_PROMPT_TOKENS = 400  # each of two
SHORT_PROMPT_TOKENS = 20


def test_a_short_request_passes_a_waiting_long_prompt_and_is_answered_during_the_first_ones_prefill(
        tmp_path, default_model, default_llm):
    from pagedserve.engine.sampling_params import SamplingParams

    rng = random.Random(23)
    prompts = {name: [rng.randrange(1000, 20000) for _ in range(n)] for name, n in
               [("long1", LONG_PROMPT_TOKENS), ("long2", LONG_PROMPT_TOKENS), ("short", SHORT_PROMPT_TOKENS)]}
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = default_llm.generate(list(prompts.values()), greedy)
    expected = {name: list(o.token_ids) for name, o in zip(prompts, outputs)}
    stack = start_stack(tmp_path, default_model, num_workers=1,
                        scheduler_args=("--max-num-batched-tokens", str(BUDGET)))
    try:
        answers: dict[str, list[int]] = {}
        steps_at_answer: dict[str, int] = {}

        def run(name: str) -> None:
            answers[name] = [t for r in stream(stack.gateway, token_request(prompts[name], 2)) for t in r.token_ids]
            steps_at_answer[name] = scheduler_stats(stack.scheduler).num_steps

        threads = [threading.Thread(target=run, args=(name,)) for name in ("long1", "long2")]
        threads[0].start()
        wait_until(lambda: scheduler_stats(stack.scheduler).num_running == 1, "the first long prompt admitted", 60)
        threads[1].start()
        wait_until(lambda: scheduler_stats(stack.scheduler).num_waiting == 1, "the second long prompt queued", 60)
        run("short")
        for thread in threads:
            thread.join(300)
        print(f"\nscheduler steps when answered: {steps_at_answer}")
        assert answers == expected
        # answered beside the first long prompt's chunks (first come, first served: after both long prompts')
        assert steps_at_answer["long1"] - steps_at_answer["short"] >= 10, steps_at_answer
        assert steps_at_answer["long1"] <= steps_at_answer["long2"]
        assert_all_blocks_free(stack)
    finally:
        stack.stop()
