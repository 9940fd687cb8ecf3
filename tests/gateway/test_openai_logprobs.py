"""The OpenAI logprobs formats (no model, no processes): completions, chat, vLLM's prompt_logprobs."""

from __future__ import annotations

import asyncio
import math

from pagedserve.engine.messages import FinishReason, TokenLogprobs
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.output_processor import TextDelta
from pagedserve.services.gateway.generation_core import SampleDelta
from pagedserve.services.gateway.openai_logprobs import (
    MIN_LOGPROB, CompletionOffsets, TokenNames, chat_logprobs, prompt_logprobs_out,
)
from pagedserve.services.gateway.openai_samples import EchoPrompt, StreamEcho, collect_samples
from pagedserve.text.request_samples import ParsedRequest


class FakeTokenizer:
    VOCAB = {1: "a", 2: "bc", 3: "é", 4: "<s>"}

    def decode(self, ids, skip_special_tokens):
        assert not skip_special_tokens
        return "".join(self.VOCAB[i] for i in ids)

    def token_bytes(self, token_id, decoded):
        return decoded.encode()


NAMES = TokenNames(FakeTokenizer())
CHOSEN_SECOND = TokenLogprobs(token_id=2, logprob=-1.5, rank=2, top_token_ids=(1,), top_logprobs=(-0.5,))
CHOSEN_FIRST = TokenLogprobs(token_id=3, logprob=-0.1, rank=1, top_token_ids=(3, 1), top_logprobs=(-0.1, -float("inf")))


def test_completion_logprobs_layout_and_offsets_carry_over_chunks():
    offsets = CompletionOffsets(NAMES)
    first = offsets.format([4, 2], [None, CHOSEN_SECOND])
    assert first.tokens == ["<s>", "bc"] and first.token_logprobs == [None, -1.5]
    assert first.top_logprobs == [None, {"a": -0.5, "bc": -1.5}]  # top-k first, then the chosen token
    assert first.text_offset == [0, 3]
    second = offsets.format([3], [CHOSEN_FIRST])
    assert second.text_offset == [5] and second.top_logprobs == [{"é": -0.1, "a": MIN_LOGPROB}]


def test_echoed_prompt_tokens_stand_at_their_offsets_in_the_prompt_as_sent():
    # "<s>" (a BOS the tokenizer added) is not in the text "abc": it stands at 0 and takes no room
    prompt = EchoPrompt("abc", (4, 1, 2), (0, 0, 1), (None, CHOSEN_FIRST, CHOSEN_SECOND))
    offsets = CompletionOffsets(NAMES)
    first = offsets.format([3], [CHOSEN_FIRST], prompt)
    assert first.tokens == ["<s>", "a", "bc", "é"] and first.text_offset == [0, 0, 1, 3]
    assert first.token_logprobs == [None, -0.1, -1.5, -0.1]
    assert offsets.format([1], [CHOSEN_FIRST]).text_offset == [4]


def test_chat_logprobs_have_bytes_and_top_alternatives():
    out = chat_logprobs(NAMES, [CHOSEN_FIRST]).model_dump()
    entry = out["content"][0]
    assert entry["token"] == "é" and entry["bytes"] == [0xC3, 0xA9] and entry["logprob"] == -0.1
    assert [t["token"] for t in entry["top_logprobs"]] == ["é", "a"]
    assert entry["top_logprobs"][1]["logprob"] == MIN_LOGPROB and math.isfinite(entry["top_logprobs"][1]["logprob"])


def test_prompt_logprobs_are_vllm_shaped():
    out = prompt_logprobs_out(NAMES, [None, CHOSEN_SECOND])
    assert out[0] is None
    assert {k: v.model_dump() for k, v in out[1].items()} == {
        "2": {"logprob": -1.5, "rank": 2, "decoded_token": "bc"},
        "1": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}


def delta(ids, lps, finish=None, prompt=None, stop_reason=None) -> TextDelta:
    return TextDelta("".join(FakeTokenizer.VOCAB[i] for i in ids), tuple(ids), finish, False, len(ids), tuple(lps),
                     prompt, stop_reason)


def test_best_of_keeps_the_samples_of_highest_cumulative_logprob():
    params = SamplingParams(max_tokens=2, n=1, best_of=3)
    parsed = ParsedRequest((1,), params, params.to_engine(1, 10, 5, ()))
    cumulative = [-3.0, -0.5, -2.0]

    async def events():
        for i, c in enumerate(cumulative):
            lp = TokenLogprobs(token_id=1, logprob=c, rank=1)
            yield 0, SampleDelta(i, delta([1], [lp], FinishReason.LENGTH, stop_reason="x" if i == 1 else None))

    results, _ = asyncio.run(collect_samples(events(), [parsed]))
    best = results[0].best()
    assert len(best) == 1 and best[0].index == 1 and best[0].stop_reason == "x"
    assert best[0].logprobs is None  # not asked for: computed for ranking only


def test_stream_echo_holds_samples_until_the_prompt_logprobs_arrive():
    echo = StreamEcho([EchoPrompt("a", (1,), (0,))], with_logprobs=True)
    late = SampleDelta(1, delta([2], [CHOSEN_SECOND]))
    assert echo.ready(0, late) == []
    first = SampleDelta(0, delta([2], [CHOSEN_SECOND], prompt=(None,)))
    ready = echo.ready(0, first)
    assert [(s.sample_index, p.logprobs) for _, s, p in ready] == [(1, (None,)), (0, (None,))]
    again = SampleDelta(0, delta([1], [CHOSEN_FIRST]))
    assert echo.ready(0, again) == [(0, again, None)]
