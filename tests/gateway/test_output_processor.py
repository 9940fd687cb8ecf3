"""RequestTextState end to end on fake engine streams built from real model token ids."""

from __future__ import annotations

import pytest

from pagedserve.engine.messages import FinishReason
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.output_processor import RequestTextState, TextDelta

EOS = 2


def engine_stream(output_ids: list[int], finish: FinishReason, request_id: str = "r1") -> list[RequestOutput]:
    """One RequestOutput per token, the last one finished, as the scheduler emits them."""
    last = len(output_ids) - 1
    return [
        RequestOutput(request_id=request_id, first_output_index=i, new_token_ids=(token,),
                      finish_reason=finish if i == last else None) for i, token in enumerate(output_ids)
    ]


def run(state: RequestTextState, outputs: list[RequestOutput]) -> list[TextDelta]:
    """Processes outputs as a caller does: stops sending once the state is finished."""
    deltas = []
    for output in outputs:
        deltas.append(state.process(output))
        if state.finished:
            break
    return deltas


@pytest.fixture
def say_hi(model_outputs) -> dict:
    request = next(r for r in model_outputs if r["prompt"] == "Say hi.")
    assert request["output_token_ids"][-1] == EOS
    return request


def test_plain_stream_joins_to_decode(hf_tokenizer, model_outputs) -> None:
    for request in model_outputs:
        out = request["output_token_ids"]
        finish = FinishReason.STOP if out[-1] == EOS else FinishReason.LENGTH
        state = RequestTextState(hf_tokenizer, request["prompt_token_ids"], SamplingParams())
        deltas = run(state, engine_stream(out, finish))
        assert "".join(d.text for d in deltas) == hf_tokenizer.decode(out, skip_special_tokens=True)
        assert [t for d in deltas for t in d.token_ids] == out
        assert [d.finish_reason for d in deltas] == [None] * (len(out) - 1) + [finish]
        assert [d.num_output_tokens for d in deltas] == list(range(1, len(out) + 1))
        assert not any(d.stop_string_matched for d in deltas)
        assert state.num_output_tokens == len(out)
        assert state.num_prompt_tokens == len(request["prompt_token_ids"])
        assert state.finish_reason is finish


def test_special_tokens_kept_on_request(hf_tokenizer, say_hi) -> None:
    params = SamplingParams(skip_special_tokens=False)
    state = RequestTextState(hf_tokenizer, say_hi["prompt_token_ids"], params)
    deltas = run(state, engine_stream(say_hi["output_token_ids"], FinishReason.STOP))
    assert "".join(d.text for d in deltas).endswith("with?<|im_end|>")


@pytest.mark.parametrize(("include", "expected"), [(False, "Hello there! I'm"), (True, "Hello there! I'm here")])
def test_stop_string_ends_the_request(hf_tokenizer, say_hi, include: bool, expected: str) -> None:
    params = SamplingParams(stop=(" here",), include_stop_str_in_output=include)
    state = RequestTextState(hf_tokenizer, say_hi["prompt_token_ids"], params)
    outputs = engine_stream(say_hi["output_token_ids"], FinishReason.STOP)
    deltas = run(state, outputs)
    assert "".join(d.text for d in deltas) == expected
    last = deltas[-1]
    assert last.finish_reason is FinishReason.STOP and last.stop_string_matched
    assert not any(d.finish_reason or d.stop_string_matched for d in deltas[:-1])
    assert last.num_output_tokens == len(deltas) < len(outputs)
    assert state.num_output_tokens == len(deltas)
    # The engine may still deliver outputs before the abort lands: they are ignored.
    late = state.process(outputs[len(deltas)])
    assert late == TextDelta("", (), None, False, len(deltas))
    assert state.finish_reason is FinishReason.STOP


def test_stop_string_spanning_tokens_is_never_leaked(hf_tokenizer, say_hi) -> None:
    out = say_hi["output_token_ids"]
    text = hf_tokenizer.decode(out, skip_special_tokens=True)
    stop = "e to help wi"  # spans several tokens
    assert stop in text
    state = RequestTextState(hf_tokenizer, say_hi["prompt_token_ids"], SamplingParams(stop=(stop, "zzz")))
    emitted = ""
    for delta in run(state, engine_stream(out, FinishReason.STOP)):
        emitted += delta.text
        assert text[: text.index(stop)].startswith(emitted)
    assert emitted == text[: text.index(stop)]


def test_stop_on_the_engines_last_output_needs_no_abort(hf_tokenizer, say_hi) -> None:
    out = say_hi["output_token_ids"][:-1]  # ends with "?": the engine stops it for length there
    state = RequestTextState(hf_tokenizer, say_hi["prompt_token_ids"], SamplingParams(stop=("?",)))
    deltas = run(state, engine_stream(out, FinishReason.LENGTH))
    assert len(deltas) == len(out)
    assert deltas[-1].finish_reason is FinishReason.STOP and not deltas[-1].stop_string_matched
    assert "".join(d.text for d in deltas).endswith("What can I help you with")


def test_held_back_text_is_flushed_on_finish(hf_tokenizer, say_hi) -> None:
    params = SamplingParams(stop=("with?!",))  # "with?" is held back: it could begin the stop
    state = RequestTextState(hf_tokenizer, say_hi["prompt_token_ids"], params)
    deltas = run(state, engine_stream(say_hi["output_token_ids"], FinishReason.STOP))
    assert "".join(d.text for d in deltas[:-1]).endswith("help you ")
    assert deltas[-1].text == "with?"
    assert deltas[-1].finish_reason is FinishReason.STOP and not deltas[-1].stop_string_matched


def test_length_finish_flushes_broken_bytes(hf_tokenizer) -> None:
    out = hf_tokenizer.encode("Fine 😀", add_special_tokens=False)[:-1]  # cut inside the emoji
    state = RequestTextState(hf_tokenizer, [28120], SamplingParams())
    deltas = run(state, engine_stream(out, FinishReason.LENGTH))
    assert not any("\ufffd" in d.text for d in deltas[:-1])
    assert deltas[-1].text.endswith("\ufffd")
    assert "".join(d.text for d in deltas) == hf_tokenizer.decode(out) == "Fine \ufffd"
    assert deltas[-1].finish_reason is FinishReason.LENGTH


def test_abort_without_tokens_flushes(hf_tokenizer) -> None:
    state = RequestTextState(hf_tokenizer, [28120], SamplingParams(stop=("yes!",)))
    yes = tuple(hf_tokenizer.encode(" yes", add_special_tokens=False))
    first = state.process(RequestOutput(request_id="r", first_output_index=0, new_token_ids=yes))
    assert first.text == " "  # "yes" could begin the stop string
    last = state.process(RequestOutput.aborted("r", first_output_index=1))
    assert last == TextDelta("yes", (), FinishReason.ABORT, False, 1)


def test_repeated_output_is_skipped_and_gap_raises(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("one two three", add_special_tokens=False)
    state = RequestTextState(hf_tokenizer, [28120], SamplingParams())
    first = state.process(RequestOutput(request_id="r", first_output_index=0, new_token_ids=tuple(ids[:2])))
    assert first.text == "one two"
    again = state.process(RequestOutput(request_id="r", first_output_index=1, new_token_ids=tuple(ids[1:])))
    assert again.token_ids == tuple(ids[2:]) and again.text == " three"
    assert again.num_output_tokens == len(ids)
    with pytest.raises(ValueError, match="starts at token 5"):
        state.process(RequestOutput(request_id="r", first_output_index=5, new_token_ids=(7,)))


class _Letters:
    def decode(self, ids, skip_special_tokens):
        return "".join(chr(ord("a") + i) for i in ids)


def test_output_token_ids_are_the_received_ones_held_back_text_included() -> None:
    state = RequestTextState(_Letters(), [0], SamplingParams(stop=["cde"]))
    state.process(RequestOutput(request_id="r", first_output_index=0, new_token_ids=(0, 2)))  # "ac": "c" held back
    state.process(RequestOutput(request_id="r", first_output_index=1, new_token_ids=(2, 3)))  # token 1 again, "d"
    assert state.output_token_ids == (0, 2, 3) and not state.finished
    state.process(RequestOutput(request_id="r", first_output_index=3, new_token_ids=(4,)))  # "cde" matched
    state.process(RequestOutput(request_id="r", first_output_index=4, new_token_ids=(5,)))  # ignored: it finished
    assert state.output_token_ids == (0, 2, 3, 4) and state.finished
