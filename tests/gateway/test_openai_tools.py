"""The HTTP chat API's calls of an answer (pagedserve/services/gateway/openai_tools.py): whole and streamed, the finish
reason ``tool_calls`` only for an answer whose calls are all complete and that ended by itself."""

from __future__ import annotations

import pytest

from pagedserve.engine.messages import FinishReason
from pagedserve.text.tool_parsers import ToolCallParserKind
from pagedserve.text.tool_use import ToolChoiceMode, ToolUse
from pagedserve.services.gateway.openai_tools import ToolCallStream, answer_message, finish_reason_of

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


@pytest.mark.parametrize("reason,stop_reason,text,want", [
    (FinishReason.STOP, None, CALL, "tool_calls"),                # an EOS after the call
    (FinishReason.STOP, 2, CALL, "tool_calls"),                   # a stop token id
    (FinishReason.STOP, "\n<tool_call>", CALL, "stop"),           # a stop string, wherever it falls
    (FinishReason.STOP, "</tool_call>", CALL[:-len("</tool_call>")], "stop"),  # the call stands (whole JSON)
    (FinishReason.STOP, None, CALL + "\n" + CUT, "stop"),         # the second call cut by an EOS
    (FinishReason.LENGTH, None, CALL + "\n" + CUT, "length"),
    (FinishReason.STOP, None, CALL + '\n<tool_call>\n{"na', "stop"),  # cut inside its head
    (FinishReason.STOP, None, "No call.", "stop"),
])
def test_tool_calls_is_the_finish_reason_of_complete_calls_that_ended_by_themselves(reason, stop_reason, text, want):
    message, called = answer_message(text, tool_use(), HERMES)
    assert finish_reason_of(reason, stop_reason, called) == want
    assert [c.function.name for c in message.tool_calls or ()] == (["w"] if text.startswith(CALL[:20]) else [])
    *_, stream = streamed(text)
    assert finish_reason_of(reason, stop_reason, stream.called) == want


def test_a_cut_call_is_content_whole_and_its_streamed_pieces_run_to_where_it_stopped():
    message, called = answer_message(CALL + "\n" + CUT, tool_use(), HERMES)
    assert [c.function.arguments for c in message.tool_calls] == ['{"city": "Paris"}'] and not called
    assert message.content == CUT
    content, arguments, stream = streamed(CALL + "\n" + CUT)
    assert content == "Sure." and arguments == {0: '{"city": "Paris"}', 1: '{"city": "Pa'} and stream.cut_short
    _, arguments, _ = streamed('<tool_call>\n{"name":"w","arguments":{"city":"Paris","unit":"C"}')  # a stop on "}"
    assert arguments == {0: '{"city":"Paris","unit":"C"}'}  # to its last brace (attack 58: it lost it)
    content, arguments, _ = streamed(CALL + '\n<tool_call>\n{"na')  # never started: its text is content
    assert content == '<tool_call>\n{"na' and list(arguments) == [0]  # the whitespace after a call is dropped
