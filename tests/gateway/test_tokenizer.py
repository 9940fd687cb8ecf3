"""PromptTokenizer: encoding with the real tokenizer, validation errors naming the client's fields."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.text.request_limits import RequestLimits
from pagedserve.text.tokenizer import (
    CHAT_FIELD,
    PROMPT_FIELD,
    TOKEN_IDS_FIELD,
    ChatTurn,
    PromptTokenizer,
    check_prompt_length,
)

SYSTEM_PROMPT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
ASSISTANT_OPENING = "<|im_start|>assistant\n"


def test_loads_model_facts(prompt_tokenizer: PromptTokenizer) -> None:
    assert prompt_tokenizer.info.vocab_size == 49152
    assert prompt_tokenizer.info.eos_token_ids == (2,)
    assert prompt_tokenizer.has_chat_template


def test_encode_prompt_matches_tokenizer(prompt_tokenizer: PromptTokenizer, hf_tokenizer) -> None:
    text = "Hello world, 世界 😀"
    ids = prompt_tokenizer.encode_prompt(text)
    assert ids == hf_tokenizer.encode(text)
    assert prompt_tokenizer.decode(ids, skip_special_tokens=True) == text


def test_empty_prompt_names_prompt(prompt_tokenizer: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequestError) as err:
        prompt_tokenizer.encode_prompt("")
    assert err.value.field_name == "prompt" == PROMPT_FIELD
    assert str(err.value).startswith("prompt: ")


def test_chat_has_default_system_prompt_and_opens_assistant_turn(
    prompt_tokenizer: PromptTokenizer, hf_tokenizer
) -> None:
    ids = prompt_tokenizer.encode_chat([ChatTurn("user", "What is 2+2?")])
    text = hf_tokenizer.decode(ids)
    assert text.startswith(SYSTEM_PROMPT)
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n" + ASSISTANT_OPENING)
    expected = hf_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=True
    )["input_ids"]
    assert ids == list(expected)
    assert ids[0] == 1 and ids.count(1) == 3  # <|im_start|> is one special token, not its characters


def test_chat_with_own_system_prompt_and_all_roles(prompt_tokenizer: PromptTokenizer, hf_tokenizer) -> None:
    turns = [
        ChatTurn("system", "Be brief."),
        ChatTurn("user", "Hi"),
        ChatTurn("assistant", "Hello!"),
        ChatTurn("tool", "{}"),
    ]
    text = hf_tokenizer.decode(prompt_tokenizer.encode_chat(turns))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "You are a helpful AI assistant" not in text
    assert text.endswith("<|im_start|>tool\n{}<|im_end|>\n" + ASSISTANT_OPENING)


def test_empty_chat_names_messages(prompt_tokenizer: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequestError) as err:
        prompt_tokenizer.encode_chat([])
    assert err.value.field_name == "chat.messages"


def test_unknown_role_names_the_message_and_lists_roles(prompt_tokenizer: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequestError) as err:
        prompt_tokenizer.encode_chat([ChatTurn("user", "a"), ChatTurn("robot", "b")])
    assert err.value.field_name == "chat.messages[1].role"
    assert "'robot'" in err.value.reason
    for role in ("system", "user", "assistant", "tool"):
        assert role in err.value.reason


def test_chat_without_template_names_chat(prompt_tokenizer: PromptTokenizer, sp_tokenizer) -> None:
    no_template = PromptTokenizer(sp_tokenizer, prompt_tokenizer.info)
    assert not no_template.has_chat_template
    with pytest.raises(InvalidRequestError) as err:
        no_template.encode_chat([ChatTurn("user", "Hi")])
    assert err.value.field_name == "chat" == CHAT_FIELD


def test_token_ids_pass_through(prompt_tokenizer: PromptTokenizer) -> None:
    assert prompt_tokenizer.check_token_ids((0, 5, 49151)) == [0, 5, 49151]


def test_empty_token_ids_names_ids(prompt_tokenizer: PromptTokenizer) -> None:
    with pytest.raises(InvalidRequestError) as err:
        prompt_tokenizer.check_token_ids([])
    assert err.value.field_name == "prompt_token_ids.ids" == TOKEN_IDS_FIELD


@pytest.mark.parametrize(("ids", "bad_index", "bad_value"), [([1, 2, 49152], 2, 49152), ([7, -1], 1, -1)])
def test_token_id_out_of_vocab_names_its_index(
    prompt_tokenizer: PromptTokenizer, ids: list[int], bad_index: int, bad_value: int
) -> None:
    with pytest.raises(InvalidRequestError) as err:
        prompt_tokenizer.check_token_ids(ids)
    assert err.value.field_name == f"prompt_token_ids.ids[{bad_index}]"
    assert str(bad_value) in err.value.reason and "49152" in err.value.reason


def test_vocab_size_comes_from_model_config(prompt_tokenizer: PromptTokenizer) -> None:
    padded = dataclasses.replace(prompt_tokenizer.info, vocab_size=49280)  # padded embedding table
    wide = PromptTokenizer(prompt_tokenizer.hf_tokenizer, padded)
    assert wide.check_token_ids([49200]) == [49200]
    with pytest.raises(InvalidRequestError):
        wide.check_token_ids([49280])


def test_prompt_length_check(prompt_tokenizer: PromptTokenizer) -> None:
    max_len = prompt_tokenizer.info.max_model_len
    check_prompt_length(max_len - 1, max_len, PROMPT_FIELD)
    with pytest.raises(InvalidRequestError) as err:
        check_prompt_length(max_len, max_len, "chat")
    assert err.value.field_name == "chat"
    assert str(max_len) in err.value.reason
    with pytest.raises(InvalidRequestError) as err:
        check_prompt_length(9000, 8192, TOKEN_IDS_FIELD)
    assert err.value.field_name == "prompt_token_ids.ids"
    assert "9000" in err.value.reason and "8192" in err.value.reason


def test_a_template_that_refuses_the_chat_names_chat_messages(model_path) -> None:
    """A template's own error (``raise_exception``, as Llama's and Mistral's templates raise on roles
    out of order) is the client's bad input on every API, not a server failure."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model_path), local_files_only=True)  # its own: from_folder's is shared
    hf.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    refusing = PromptTokenizer(hf, PromptTokenizer.from_folder(model_path).info)
    with pytest.raises(InvalidRequestError) as err:
        refusing.encode_chat([ChatTurn("user", "Hi"), ChatTurn("user", "again")])
    assert err.value.field_name == CHAT_FIELD + ".messages"
    assert "roles must alternate" in str(err.value)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=40), skip_special_tokens=st.booleans())
def test_decode_equals_the_hugging_face_decode(prompt_tokenizer: PromptTokenizer, hf_tokenizer, ids: list[int],
                                               skip_special_tokens: bool) -> None:
    """The default (fast, no clean-up) tokenizer decodes in Rust directly: the same text as the
    wrapper's, special tokens (ids 0-16) and bytes that end inside a character included."""
    assert prompt_tokenizer._rust_decoder is not None
    assert (prompt_tokenizer.decode(ids, skip_special_tokens) ==
            hf_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_its_wrapper(model_path) -> None:
    """With ``clean_up_tokenization_spaces`` the wrapper may change the text: no Rust shortcut then."""
    tokenizer = PromptTokenizer.from_folder(model_path)
    hf = tokenizer.hf_tokenizer
    hf.clean_up_tokenization_spaces = True
    try:
        assert PromptTokenizer(hf, tokenizer.info)._rust_decoder is None
    finally:
        hf.clean_up_tokenization_spaces = False


def test_a_folder_is_loaded_once_until_its_files_change(model_path, tmp_path) -> None:
    """from_folder keeps one tokenizer per folder, limits and file stamps: the same object again, a new
    one for other limits or once a tokenizer file changes (a memo of read-only data, never stale)."""
    import shutil

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_path / name, folder / name)
    first = PromptTokenizer.from_folder(folder)
    assert PromptTokenizer.from_folder(folder) is first
    assert PromptTokenizer.from_folder(str(folder) + "/") is first  # the resolved path is the key
    assert PromptTokenizer.from_folder(folder, RequestLimits(max_chat_messages=3)) is not first
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text() + "\n")
    changed = PromptTokenizer.from_folder(folder)
    assert changed is not first and changed.encode_prompt("Hello") == first.encode_prompt("Hello")
