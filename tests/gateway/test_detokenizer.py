"""IncrementalDetokenizer: deltas join to exactly what ``decode`` gives, never half a character."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.text.detokenizer import MAX_PENDING_TOKENS, PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

REPLACEMENT = "\ufffd"
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Text with multi-byte characters: accents, CJK, emoji (4 bytes, and sequences joined by ZWJ).
TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from("abc xyz.,\n\t"),
        st.sampled_from("éüñßø€£¥"),
        st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF),
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1F6FF),
        st.sampled_from(["\u200d", "\ufe0f", REPLACEMENT]),
        st.characters(codec="utf-8"),
    ),
    max_size=40,
)


def stream(tokenizer, prompt: list[int], output: list[int], skip: bool, chunks: list[int]) -> list[str]:
    """Feeds ``output`` in chunks of the given sizes (cycled); returns the deltas, ``finish()`` last.

    Checks on the way that text once emitted is never taken back: every running join is a prefix
    of the final decode.
    """
    detok = IncrementalDetokenizer(tokenizer, prompt, skip)
    deltas, i, k = [], 0, 0
    while i < len(output):
        size = chunks[k % len(chunks)] if chunks else 1
        deltas.append(detok.add(output[i : i + size]))
        i, k = i + size, k + 1
    deltas.append(detok.finish())
    assert detok.finish() == ""
    return deltas


def assert_joins_to_decode(tokenizer, prompt, output, skip, chunks=()) -> list[str]:
    deltas = stream(tokenizer, prompt, output, skip, list(chunks))
    expected = tokenizer.decode(output, skip_special_tokens=skip)
    assert "".join(deltas) == expected
    running = ""
    for delta in deltas:
        running += delta
        assert expected.startswith(running)
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_real_model_outputs_one_token_at_a_time(hf_tokenizer, model_outputs, skip: bool) -> None:
    for request in model_outputs:
        deltas = assert_joins_to_decode(
            hf_tokenizer, request["prompt_token_ids"], request["output_token_ids"], skip
        )
        assert not any(REPLACEMENT in d for d in deltas)


def test_real_model_outputs_in_uneven_chunks(hf_tokenizer, model_outputs) -> None:
    rng = random.Random(0)
    for request in model_outputs:
        chunks = [rng.randint(1, 7) for _ in range(20)]
        assert_joins_to_decode(hf_tokenizer, request["prompt_token_ids"], request["output_token_ids"], True, chunks)


def test_emoji_is_held_until_complete(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) == 3
    detok = IncrementalDetokenizer(hf_tokenizer, [28120], True)
    assert [detok.add([i]) for i in ids] == ["", "", "😀"]


def test_finish_emits_truly_broken_bytes_as_decode_does(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("ok 😀", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(hf_tokenizer, [28120], True)
    text = "".join(detok.add([i]) for i in ids)
    assert text == "ok"
    assert detok.num_pending_tokens >= 1
    assert text + detok.finish() == hf_tokenizer.decode(ids) == "ok " + REPLACEMENT


@FAST
@given(text=TEXT, prompt_text=TEXT, data=st.data())
def test_encoded_text_round_trips(hf_tokenizer, text: str, prompt_text: str, data) -> None:
    output = hf_tokenizer.encode(text, add_special_tokens=False)
    prompt = hf_tokenizer.encode(prompt_text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=5))
    deltas = assert_joins_to_decode(hf_tokenizer, prompt, output, True, chunks)
    if "".join(deltas) == text and REPLACEMENT not in text:  # some characters have no tokens
        assert not any(REPLACEMENT in d for d in deltas)


@pytest.fixture(scope="session")
def partial_byte_ids(hf_tokenizer) -> list[int]:
    """Ids whose own decoding ends inside a UTF-8 character."""
    return [i for i in range(len(hf_tokenizer)) if hf_tokenizer.decode([i]).endswith(REPLACEMENT)]


def adversarial_ids(partial_byte_ids: list[int], vocab_size: int) -> st.SearchStrategy[list[int]]:
    token = st.one_of(
        st.integers(0, vocab_size - 1),
        st.sampled_from(partial_byte_ids),
        st.integers(0, 16),  # special and added tokens
        st.sampled_from([10813, 242, 218, 7906, 240, 178, 239, 230, 24211, 2756]),  # pieces of 😀 世界 � é
    )
    return st.lists(token, max_size=60)


@FAST
@given(data=st.data(), skip=st.booleans())
def test_adversarial_ids(hf_tokenizer, partial_byte_ids, data, skip: bool) -> None:
    ids = adversarial_ids(partial_byte_ids, len(hf_tokenizer))
    prompt, output = data.draw(ids, label="prompt"), data.draw(ids, label="output")
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=4), label="chunks")
    assert_joins_to_decode(hf_tokenizer, prompt, output, skip, chunks)


def test_prompt_ending_inside_a_character_is_not_context(hf_tokenizer) -> None:
    ids = hf_tokenizer.encode("世", add_special_tokens=False)
    prompt, output = [28120, *ids[:1]], ids[1:] + hf_tokenizer.encode(" ok", add_special_tokens=False)
    assert_joins_to_decode(hf_tokenizer, prompt, output, True)


class CountingTokenizer:
    """Records the length of every decode call."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids, skip_special_tokens):
        self.lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("skip", [True, False])
def test_cost_per_token_is_bounded(hf_tokenizer, partial_byte_ids, skip: bool) -> None:
    text_ids = hf_tokenizer.encode("Hello 世界 😀 naïve café. " * 150, add_special_tokens=False)
    rng = random.Random(1)
    garbage = [rng.choice(partial_byte_ids) for _ in range(200)]  # bytes that never form a character
    output = text_ids[:400] + [2] * 300 + garbage + text_ids[400:]
    counting = CountingTokenizer(hf_tokenizer)
    deltas = stream(counting, list(range(20, 60)), output, skip, [1])
    assert "".join(deltas) == hf_tokenizer.decode(output, skip_special_tokens=skip)
    assert max(counting.lengths) <= PROMPT_CONTEXT_TOKENS + 2 * (MAX_PENDING_TOKENS + 1)
    assert len(counting.lengths) <= 2 * len(output) + 4


def test_sentencepiece_byte_fallback_round_trips(sp_tokenizer) -> None:
    text = "Hello wörld 😀 is the 世界 à la ñ"
    ids = sp_tokenizer.encode(text, add_special_tokens=False)
    assert any(sp_tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids)
    deltas = assert_joins_to_decode(sp_tokenizer, [], ids, True)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_sentencepiece_keeps_the_space_after_the_prompt(sp_tokenizer) -> None:
    prompt = sp_tokenizer.encode("the", add_special_tokens=False)
    output = sp_tokenizer.encode("Hello world", add_special_tokens=False)
    assert sp_tokenizer.convert_ids_to_tokens(output) == ["▁Hello", "▁world"]
    detok = IncrementalDetokenizer(sp_tokenizer, prompt, True)
    assert [detok.add([i]) for i in output] == [" Hello", " world"]
    # decode(output) alone drops the first space: the deltas continue the prompt instead.
    assert sp_tokenizer.decode(output) == "Hello world"


@FAST
@given(prompt_text=TEXT, text=TEXT)
def test_sentencepiece_text_continues_the_prompt(sp_tokenizer, prompt_text: str, text: str) -> None:
    prompt = sp_tokenizer.encode(prompt_text, add_special_tokens=False)
    output = sp_tokenizer.encode(text, add_special_tokens=False)
    joined = "".join(stream(sp_tokenizer, prompt, output, True, [1]))
    context = prompt[-PROMPT_CONTEXT_TOKENS:]
    if context and sp_tokenizer.decode(context).endswith(REPLACEMENT):
        context = []
    both = sp_tokenizer.decode(context + output)
    assert joined == both[len(sp_tokenizer.decode(context)) :]
