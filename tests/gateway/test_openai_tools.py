"""The HTTP chat API's calls of an answer (services/gateway/openai_tools.py): whole and streamed, the finish
reason ``tool_calls`` only for an answer whose calls are all complete and that ended by itself."""

from __future__ import annotations

import pytest

from pagedserve.engine.messages import FinishReason
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.text.tool_use import ToolChoiceMode, ToolUse
from services.gateway.openai_tools import ToolCallStream, answer_message, finish_reason_of

HERMES = ToolCallParserKind.HERMES
CALL = '<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>'
CUT = 'Sure.\n<tool_call>\n{"name": "w", "arguments": {"city": "Pa'


def tool_use() -> ToolUse:
    return ToolUse(mode=ToolChoiceMode.AUTO)


def streamed(text: str) -> tuple[str, dict[int, str], ToolCallStream]:
    """(content, arguments by call index, the stream) of ``text`` fed a character at a time."""
    stream, content, arguments = ToolCallStream(HERMES), "", {}
    for i, piece in enumerate(text):
        got, calls = stream.pieces(piece, i == len(text) - 1)
        content += got
        for call in calls:
            arguments[call.index] = arguments.get(call.index, "") + (call.function.arguments or "")
    return content, arguments, stream


@pytest.mark.parametrize("reason,text,want", [
    (FinishReason.STOP, CALL, "tool_calls"),
    (FinishReason.STOP, CALL + "\n" + CUT, "stop"),       # the second call cut by a stop string or an EOS
    (FinishReason.LENGTH, CALL + "\n" + CUT, "length"),
    (FinishReason.STOP, CALL + '\n<tool_call>\n{"na', "stop"),  # cut inside its head
    (FinishReason.STOP, "No call.", "stop"),
])
def test_tool_calls_is_the_finish_reason_of_complete_calls_only_whole_and_streamed(reason, text, want):
    message, called = answer_message(text, tool_use(), HERMES)
    assert finish_reason_of(reason, called) == want
    *_, stream = streamed(text)
    assert finish_reason_of(reason, stream.called) == want


def test_a_cut_call_is_content_whole_and_its_streamed_pieces_run_to_where_it_stopped():
    message, called = answer_message(CALL + "\n" + CUT, tool_use(), HERMES)
    assert [c.function.arguments for c in message.tool_calls] == ['{"city": "Paris"}'] and not called
    assert message.content == CUT
    content, arguments, stream = streamed(CALL + "\n" + CUT)
    assert content == "Sure." and arguments == {0: '{"city": "Paris"}', 1: '{"city": "Pa'} and stream.cut_short
    content, arguments, _ = streamed(CALL + '\n<tool_call>\n{"na')  # never started: its text is content
    assert content == '<tool_call>\n{"na' and list(arguments) == [0]  # the whitespace after a call is dropped
