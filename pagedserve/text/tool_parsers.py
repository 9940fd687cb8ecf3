"""Tool-call parsers: the calls a model wrote in its text, found as the text streams.

One parser reads text in pieces (:meth:`HermesToolParser.feed`, then :meth:`~HermesToolParser.finish`)
and says what the pieces are: content outside the calls, a call's start with its function name,
pieces of a call's arguments, a call's end. A whole answer is parsed by feeding it in one piece
(:func:`parse_tool_calls`), so a streamed answer and a whole one give the same calls by
construction. The idea of holding back a possible partial tag follows vLLM's Hermes parser; the
code is this project's.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from pagedserve.text.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class ToolCallParserKind(enum.Enum):
    """Which form of tool calls the gateway parses (``--tool-call-parser``).

    Members:
        HERMES: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes 2/3, Qwen2.5,
            and pagedserve's fallback tools prompt).
    """

    HERMES = "hermes"


@dataclass(frozen=True)
class ContentPiece:
    """Text outside any call."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call number ``index`` (from 0 in its answer) of function ``name`` begins."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsPiece:
    """More of call ``index``'s arguments (JSON text; the pieces of one call joined are its arguments)."""

    index: int
    text: str


@dataclass(frozen=True)
class CallEnd:
    """Call ``index`` is complete: its arguments pieces are all given (at its ``</tool_call>``)."""

    index: int


@dataclass(frozen=True)
class CallCut:
    """Call ``index`` was cut short at the answer's end (by ``max_tokens``, a stop string or an EOS) before its
    JSON was whole: it is no call. ``text``: what was written of it, from the whitespace before its
    ``<tool_call>`` on, for the answer's content; ``rest``: its arguments' text not yet given as pieces, for a
    stream that gave the call's start (``index`` below the calls started; a call cut inside its head never
    started, and its text is all there is)."""

    index: int
    text: str
    rest: str


ToolEvent = ContentPiece | CallStart | ArgumentsPiece | CallEnd | CallCut

_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
"""A call's JSON up to its arguments' value (Hermes writes ``name`` first)."""


class _State(enum.Enum):
    CONTENT = "content"      # outside calls
    CALL_HEAD = "call_head"  # inside <tool_call>, name not yet read
    ARGUMENTS = "arguments"  # inside <tool_call>, streaming the arguments


def _partial_tag_length(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper beginning of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _arguments_so_far(body: str) -> str:
    """The part of a call's arguments text that is surely its own: ``body`` (the text after
    ``"arguments":``) without a possible partial ``</tool_call>``, trailing whitespace, and the last
    ``}`` with the whitespace before it (which may close the call's object)."""
    text = body[:len(body) - _partial_tag_length(body, TOOL_CALL_CLOSE)].rstrip()
    return text[:-1].rstrip() if text.endswith("}") else text


def _call_of(text: str) -> dict | None:
    """``text`` read as a call's JSON: an object with a string ``name``; None when it is not one."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    return call if isinstance(call, dict) and isinstance(call.get("name"), str) else None


class HermesToolParser:
    """Reads Hermes-form calls from text given in pieces.

    Content just before ``<tool_call>`` and just after ``</tool_call>`` loses its whitespace (the
    newlines between calls); a ``<tool_call>`` whose JSON does not begin with ``name`` and then
    ``arguments`` is read whole at its ``</tool_call>``: a JSON object with a string ``name`` is a
    call (its ``arguments`` re-serialized), anything else is content, tags included. A call cut
    short (the answer ends inside it) ends in a :class:`CallCut` carrying its text, not a :class:`CallEnd`.
    """

    def __init__(self) -> None:
        self._state = _State.CONTENT
        self._pending = ""
        self._calls = 0
        self._sent_arguments = 0
        self._after_call = False
        self._call_text = ""  # the current call's text as written, whitespace before its tag included
        self._call_json = ""  # its JSON up to the arguments' value (the head)
        self.complete_calls = 0  # CallEnd events given
        self.cut_short = False  # a CallCut given: the answer ended inside a call

    @property
    def calls_started(self) -> int:
        """Calls whose :class:`CallStart` was given (a call cut inside its head never started)."""
        return self._calls

    @property
    def called(self) -> bool:
        """Whether the answer made calls and none was cut short (``tool_use.ended_by_calls``)."""
        return self.complete_calls > 0 and not self.cut_short

    def _tally(self, events: list[ToolEvent]) -> list[ToolEvent]:
        """``events``, counted into :attr:`complete_calls` and :attr:`cut_short`."""
        self.complete_calls += sum(isinstance(event, CallEnd) for event in events)
        self.cut_short = self.cut_short or any(isinstance(event, CallCut) for event in events)
        return events

    def feed(self, text: str) -> list[ToolEvent]:
        """The events that ``text`` (the answer's next piece) completes; text that may still turn
        out to be a tag or a call's end is held until the next piece."""
        self._pending += text
        events: list[ToolEvent] = []
        while True:
            before = (self._state, len(self._pending))
            events += self._step()
            if (self._state, len(self._pending)) == before:
                return self._tally(events)

    def finish(self) -> list[ToolEvent]:
        """The events of the text still held, at the answer's end. A call whose JSON is whole though its
        ``</tool_call>`` never came (a stop string on the tag, an EOS) is a call; any other begun is cut short."""
        return self._tally(self._finish())

    def _finish(self) -> list[ToolEvent]:
        pending, self._pending = self._pending, ""
        if self._state is _State.CONTENT:
            text = pending.lstrip() if self._after_call else pending
            return [ContentPiece(text)] if text else []
        body = pending[:len(pending) - _partial_tag_length(pending, TOOL_CALL_CLOSE)]
        if self._state is _State.CALL_HEAD:
            return self._whole_call(body) or [CallCut(self._calls, self._call_text + pending, "")]
        if _call_of(self._call_json + body) is None:  # its arguments' text as written, the brace held back too
            return [CallCut(self._calls - 1, self._call_text + pending, body[self._sent_arguments:])]
        rest = _arguments_so_far(body)[self._sent_arguments:]
        return ([ArgumentsPiece(self._calls - 1, rest)] if rest else []) + [CallEnd(self._calls - 1)]

    def _whole_call(self, body: str) -> list[ToolEvent]:
        """The events of a call read whole (``body``: its JSON), or none when it is not one."""
        call = _call_of(body)
        if call is None:
            return []
        self._calls, self._after_call = self._calls + 1, True
        return [CallStart(self._calls - 1, call["name"]),
                ArgumentsPiece(self._calls - 1, json.dumps(call.get("arguments", {}), ensure_ascii=False)),
                CallEnd(self._calls - 1)]

    def _step(self) -> list[ToolEvent]:
        if self._state is _State.CONTENT:
            return self._content()
        if self._state is _State.CALL_HEAD:
            return self._call_head()
        return self._arguments()

    def _content(self) -> list[ToolEvent]:
        if self._after_call:
            self._pending = self._pending.lstrip()
            self._after_call = not self._pending
        start = self._pending.find(TOOL_CALL_OPEN)
        if start >= 0:
            text = self._pending[:start].rstrip()
            self._call_text = self._pending[len(text):start] + TOOL_CALL_OPEN
            self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
            self._state = _State.CALL_HEAD
            return [ContentPiece(text)] if text else []
        held = _partial_tag_length(self._pending, TOOL_CALL_OPEN)
        text = self._pending[:len(self._pending) - held]
        kept = text.rstrip()  # whitespace before a <tool_call> is dropped, so wait to see what follows
        self._pending = self._pending[len(kept):]
        return [ContentPiece(kept)] if kept else []

    def _call_head(self) -> list[ToolEvent]:
        head = _CALL_HEAD.match(self._pending)
        if head is not None:
            self._call_json = self._pending[:head.end()]
            self._call_text += self._call_json
            self._pending = self._pending[head.end():]
            self._state, self._sent_arguments = _State.ARGUMENTS, 0
            self._calls += 1
            return [CallStart(self._calls - 1, json.loads(head.group(1)))]
        end = self._pending.find(TOOL_CALL_CLOSE)
        if end < 0:
            return []
        body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CALL_CLOSE):]
        self._state = _State.CONTENT
        return self._whole_call(body) or [ContentPiece(TOOL_CALL_OPEN + body + TOOL_CALL_CLOSE)]

    def _arguments(self) -> list[ToolEvent]:
        if not self._sent_arguments:  # the whitespace before the value may come after the head matched
            value = self._pending.lstrip()
            self._call_text += self._pending[:len(self._pending) - len(value)]
            self._pending = value
        end = self._pending.find(TOOL_CALL_CLOSE)
        body = self._pending if end < 0 else self._pending[:end]
        sure = _arguments_so_far(body)
        rest = sure[self._sent_arguments:]
        self._sent_arguments = len(sure)
        events: list[ToolEvent] = [ArgumentsPiece(self._calls - 1, rest)] if rest else []
        if end >= 0:
            self._pending = self._pending[end + len(TOOL_CALL_CLOSE):]
            self._state, self._after_call = _State.CONTENT, True
            events.append(CallEnd(self._calls - 1))
        return events


@dataclass(frozen=True)
class ParsedAnswer:
    """A whole answer split into its content and calls.

    Attributes:
        content: the text outside the calls (``None`` when there is none), a call cut short's included.
        calls: (function name, arguments JSON text) of each complete call, in order.
        cut_short: whether the answer ended inside a call (then not among ``calls``).
    """

    content: str | None
    calls: tuple[tuple[str, str], ...]
    cut_short: bool = False


PARSERS: dict[ToolCallParserKind, type[HermesToolParser]] = {ToolCallParserKind.HERMES: HermesToolParser}
"""The parser of each kind."""


def parse_tool_calls(text: str, kind: ToolCallParserKind) -> ParsedAnswer:
    """The calls and content of a whole answer (the streaming parser fed ``text`` in one piece)."""
    parser = PARSERS[kind]()
    content: list[str] = []
    calls: dict[int, list[str]] = {}  # index -> [name, arguments]
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, ContentPiece):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls[event.index] = [event.name, ""]
        elif isinstance(event, ArgumentsPiece):
            calls[event.index][1] += event.text
        elif isinstance(event, CallCut):
            calls.pop(event.index, None)
            content.append(event.text)
    return ParsedAnswer("".join(content) or None, tuple((name, arguments) for name, arguments in calls.values()),
                        parser.cut_short)
