"""Tool use in an HTTP chat history is checked as the gRPC API checks it (``ChatTurn.check_tool_use``):
a ``tool`` message must name the call it answers, only a ``tool`` message answers one, and only an
assistant message makes calls; each refusal names the message's field."""

from __future__ import annotations

import pytest

from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.text.chat_encoding import ChatPromptMode
from pagedserve.services.gateway.openai_chat import encode_messages
from pagedserve.services.gateway.openai_protocol import ChatMessage

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
QUESTION = {"role": "user", "content": "Weather in Paris?"}
ANSWERED = [QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]}]


def encode(prompt_tokenizer, messages: list[dict]) -> list[int]:
    return encode_messages(prompt_tokenizer, [ChatMessage.model_validate(m) for m in messages],
                           ChatPromptMode.OPEN_ASSISTANT_TURN)


@pytest.mark.parametrize("messages, field", [
    (ANSWERED + [{"role": "tool", "content": "sunny"}], "messages[2].tool_call_id"),
    ([{**QUESTION, "tool_call_id": "call_1"}], "messages[0].tool_call_id"),
    ([{**QUESTION, "tool_calls": [CALL]}], "messages[0].tool_calls"),
], ids=["tool-without-call-id", "call-id-on-user", "calls-on-user"])
def test_bad_tool_use_in_the_history_names_the_message_field(prompt_tokenizer, messages, field):
    with pytest.raises(InvalidRequestError) as info:
        encode(prompt_tokenizer, messages)
    assert info.value.field_name == field, info.value


def test_a_tool_result_answering_its_call_is_rendered(prompt_tokenizer):
    ids = encode(prompt_tokenizer, ANSWERED + [{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert "<tool_response>\nsunny\n</tool_response>" in prompt_tokenizer.hf_tokenizer.decode(ids)
