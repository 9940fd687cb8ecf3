"""The hermes tool-call parser: the same calls and content whether an answer streams token by token
(replayed through the real tokenizer and detokenizer) or comes whole, and whole calls (as gRPC sends
them) given where their text ends."""

from __future__ import annotations

import pytest

from pagedserve.text.detokenizer import IncrementalDetokenizer
from pagedserve.text.tool_parsers import (
    ArgumentsPiece, CallCut, CallStart, ContentPiece, HermesToolParser, ParsedAnswer, ToolCallParserKind,
    parse_tool_calls,
)
from pagedserve.text.tool_use import WholeCallStream

HERMES = ToolCallParserKind.HERMES
TWO_CALLS = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": {"n": 2}}}\n'
             '</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>\n')


def streamed(pieces: list[str]) -> ParsedAnswer:
    """The answer the parser gives from ``pieces`` fed one by one (the events folded as a client would)."""
    parser = HermesToolParser()
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    cut = {e.index for e in events if isinstance(e, CallCut)}
    names = {e.index: e.name for e in events if isinstance(e, CallStart) and e.index not in cut}
    arguments = ["".join(e.text for e in events if isinstance(e, ArgumentsPiece) and e.index == i) for i in names]
    content = "".join(e.text for e in events if isinstance(e, ContentPiece | CallCut)) or None
    return ParsedAnswer(content, tuple(zip(names.values(), arguments)), bool(cut))


def replayed_pieces(prompt_tokenizer, text: str) -> list[str]:
    """``text`` tokenized, then detokenized one token at a time as the gateway streams it."""
    ids = prompt_tokenizer.hf_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(prompt_tokenizer, [], skip_special_tokens=True)
    return [detok.add([token_id]) for token_id in ids] + [detok.finish()]


def test_whole_answer_splits_content_and_calls():
    answer = parse_tool_calls(TWO_CALLS, HERMES)
    assert answer.content == "Let me look."
    assert answer.calls == (("get_weather", '{"city": "Paris", "days": {"n": 2}}'), ("get_time", "{}"))


@pytest.mark.parametrize("text", [
    TWO_CALLS,
    "No tools needed: 3 < 4 and <b>bold</b>.  ",
    '<tool_call>\n{"arguments": {"x": [1, 2]}, "name": "reordered"}\n</tool_call>',
    "<tool_call>not json</tool_call> then text",
    '<tool_call>\n{"name": "cut_short", "arguments": {"q": "unfinis',
    'Text with "quotes" } and braces {\n<tool_call>{"name": "f", "arguments": {"s": "a}b </tool"}}</tool_call>',
], ids=["two-calls", "no-calls", "name-second", "not-json", "cut-short", "braces-in-strings"])
def test_replayed_token_stream_gives_the_whole_answers_calls(prompt_tokenizer, text):
    pieces = replayed_pieces(prompt_tokenizer, text)
    assert len(pieces) > 5
    assert streamed(pieces) == parse_tool_calls(text, HERMES)
    assert streamed(list(text)) == parse_tool_calls(text, HERMES)


def test_call_pieces_are_never_content():
    parser = HermesToolParser()
    events = [event for ch in TWO_CALLS for event in parser.feed(ch)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentPiece))
    assert "<" not in content and "{" not in content
    starts = [e for e in events if isinstance(e, CallStart)]
    assert starts == [CallStart(0, "get_weather"), CallStart(1, "get_time")]


def test_text_that_is_not_a_call_stays_content():
    assert parse_tool_calls("<tool_call>not json</tool_call> then", HERMES) == \
        ParsedAnswer("<tool_call>not json</tool_call> then", ())


@pytest.mark.parametrize("cut", ['{"city": "', '{"city": "Paris", "days": 3', '  {"q": 1'])
def test_a_call_cut_short_is_no_call_but_its_text(cut):
    """An answer that ends inside a call (max_tokens, a stop string, an EOS) gives the complete calls only;
    the cut one's text, as written from the whitespace before its tag on, is content."""
    text = TWO_CALLS + 'Then:\n<tool_call>\n{"name": "get_weather", "arguments": ' + cut
    answer = parse_tool_calls(text, HERMES)
    assert answer.calls == parse_tool_calls(TWO_CALLS, HERMES).calls and answer.cut_short
    assert answer.content == 'Let me look.Then:\n<tool_call>\n{"name": "get_weather", "arguments": ' + cut
    assert streamed(list(text)) == answer == whole_calls(list(text))[0]
    parser = HermesToolParser()
    events = parser.feed(text)
    assert CallStart(2, "get_weather") in events and not any(isinstance(e, CallCut) for e in events)
    (end,) = parser.finish()
    assert isinstance(end, CallCut) and end.text == '\n<tool_call>\n{"name": "get_weather", "arguments": ' + cut


def test_a_call_cut_inside_its_head_is_cut_short_too():
    text = TWO_CALLS + '<tool_call>\n{"na'
    answer = parse_tool_calls(text, HERMES)
    assert answer == ParsedAnswer('Let me look.<tool_call>\n{"na', parse_tool_calls(TWO_CALLS, HERMES).calls, True)
    assert streamed(list(text)) == answer == whole_calls(list(text))[0]


@pytest.mark.parametrize("tail", ["\n", "\n</tool_", ""])
def test_a_whole_call_whose_closing_tag_never_came_is_a_call(tail):
    """A stop string on ``</tool_call>`` (a common client setting) or an EOS after a call's whole JSON: the
    call stands, as vLLM's Hermes parser reads it."""
    for head in ('{"name": "w", "arguments": ', '{"arguments": {"c": [1, 2]}, "name": "w"'):
        text = 'Ok.\n<tool_call>\n' + head + ('{"c": [1, 2]}}' if "name\": \"w\", " in head else "}") + tail
        answer = parse_tool_calls(text, HERMES)
        assert answer.calls == (("w", '{"c": [1, 2]}'),) and not answer.cut_short and answer.content == "Ok.", text
        assert streamed(list(text)) == answer == whole_calls(list(text))[0]


def whole_calls(pieces: list[str]) -> tuple[ParsedAnswer, list[int]]:
    """The answer ``WholeCallStream`` gives from ``pieces`` (the gRPC API's form), and the index of
    the piece each call came with."""
    stream = WholeCallStream(HERMES)
    content, calls, at = "", [], []
    for i, piece in enumerate(pieces):
        text, done = stream.pieces(piece, i == len(pieces) - 1)
        content += text
        calls += done
        at += [i] * len(done)
    assert all(call.id.startswith("call_") for call in calls) and len({call.id for call in calls}) == len(calls)
    return ParsedAnswer(content or None, tuple((call.name, call.arguments) for call in calls), stream.cut_short), at


@pytest.mark.parametrize("text", [
    TWO_CALLS, "No tools needed.", '<tool_call>\n{"arguments": {}, "name": "second"}\n</tool_call>',
    '<tool_call>\n{"name": "cut_short", "arguments": {"q": "unfinis',
], ids=["two-calls", "no-calls", "name-second", "cut-short"])
def test_whole_calls_equal_the_whole_answers(prompt_tokenizer, text):
    assert whole_calls(replayed_pieces(prompt_tokenizer, text))[0] == parse_tool_calls(text, HERMES)


def test_each_whole_call_comes_where_its_text_ends():
    pieces = list(TWO_CALLS) + [""]
    _, at = whole_calls(pieces)
    first_end = TWO_CALLS.index("</tool_call>") + len("</tool_call>") - 1
    assert at == [first_end, len(TWO_CALLS) - 2]  # the last piece is the newline after the second call
