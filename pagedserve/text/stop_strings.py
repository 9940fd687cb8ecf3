"""Stop strings over streamed text: cut the output where one first appears, leak none of it.

Text arrives in deltas, and a stop string may span several of them. The matcher holds back the
longest tail of the unemitted text that is the beginning of some stop string (at most
``max(len(s)) - 1`` characters), so text is emitted only once no stop string can start in it.

Matching runs an Aho-Corasick automaton (Aho and Corasick, 1975, "Efficient string matching"):
a trie of the stop strings with failure links, built once per request in O(total stop length)
time and memory and shared by the request's samples; each character of output then costs
amortized O(1), and the automaton's state is itself the held-back tail.

Which match wins does not depend on how the text was split into deltas: it is the stop string
that is complete first, reading the text from the left (the one ending earliest), and among those
ending at the same place, the longest (the one starting earliest).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    """The result of feeding one text delta.

    Attributes:
        text: text to emit now (``""`` when everything is held back).
        stopped: a stop string matched; ``text`` ends where the output ends.
        stop: the stop string that matched; ``""`` unless ``stopped``.
    """

    text: str
    stopped: bool = False
    stop: str = ""


class StopStrings:
    """The Aho-Corasick automaton of a request's stop strings; immutable, shared by its samples.

    Memory and build time are O(total length of the stop strings).

    Args:
        stop: the stop strings, each non-empty; repeats are dropped.

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stop))
        # Node 0 is the root (the empty string). An edge is keyed node * _RADIX + code point.
        self._goto: dict[int, int] = {}
        self._depth = [0]
        self._fail = [0]
        self._out = [-1]  # index in ``stops`` of the longest stop that ends the node's string
        edges: list[tuple[int, int]] = [(0, 0)]  # (parent, code point) of each node
        for index, s in enumerate(self.stops):
            node = 0
            for ch in s:
                key = node * _RADIX + ord(ch)
                child = self._goto.get(key)
                if child is None:
                    child = len(self._depth)
                    self._goto[key] = child
                    self._depth.append(self._depth[node] + 1)
                    self._fail.append(0)
                    self._out.append(-1)
                    edges.append((node, ord(ch)))
                node = child
            self._out[node] = index
        self._link(edges)

    def _link(self, edges: list[tuple[int, int]]) -> None:
        """Sets failure links and outputs, parents before children (by depth)."""
        for node in sorted(range(1, len(self._depth)), key=self._depth.__getitem__):
            parent, code = edges[node]
            if parent:
                self._fail[node] = self._next(self._fail[parent], code)
            if self._out[node] < 0:
                self._out[node] = self._out[self._fail[node]]

    def _next(self, state: int, code: int) -> int:
        """The state after reading code point ``code`` in ``state`` (amortized O(1))."""
        goto, fail = self._goto, self._fail
        while True:
            child = goto.get(state * _RADIX + code)
            if child is not None:
                return child
            if state == 0:
                return 0
            state = fail[state]

    def scan(self, state: int, text: str) -> tuple[int, int, int]:
        """Reads ``text`` from ``state`` until a stop string ends.

        Returns:
            ``(state, end, stop_index)``: the state reached, the number of characters of ``text``
            read, and the index in ``stops`` of the longest stop string ending there, or -1 when
            none ended in ``text`` (then ``end == len(text)``).
        """
        out = self._out
        for i, ch in enumerate(text):
            state = self._next(state, ord(ch))
            if out[state] >= 0:
                return state, i + 1, out[state]
        return state, len(text), -1

    def depth(self, state: int) -> int:
        """Length of the text a state stands for: the longest tail read that begins a stop string."""
        return self._depth[state]


_RADIX = 0x110000  # one more than the largest code point


class StopStringMatcher:
    """Finds the first stop string in a stream of text deltas.

    Args:
        stop: the stop strings, each non-empty (an empty list passes all text through at once),
            or their automaton, built once and shared by the samples of a request.
        include_stop_str_in_output: keep the matched stop string at the end of the text instead
            of cutting it.

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(self, stop: Sequence[str] | StopStrings, include_stop_str_in_output: bool) -> None:
        self._automaton = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._include = include_stop_str_in_output
        self._state = 0
        self._held = ""
        self._stopped = False
        self._matched = ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched (later deltas are then ignored)."""
        return self._stopped

    def feed(self, text_delta: str) -> StopCheck:
        """Takes the next piece of text and returns what may be emitted now.

        Costs amortized O(1) per character of ``text_delta`` plus copying the held-back tail.
        After a match, every later call returns no text, with ``stopped`` and the same ``stop``.
        """
        if self._stopped:
            return StopCheck(text="", stopped=True, stop=self._matched)
        automaton = self._automaton
        if not automaton.stops:
            return StopCheck(text=text_delta)
        state, read, index = automaton.scan(self._state, text_delta)
        text = self._held + text_delta
        if index >= 0:
            stop = automaton.stops[index]
            end = len(self._held) + read
            self._stopped, self._matched, self._held = True, stop, ""
            return StopCheck(text=text[: end if self._include else end - len(stop)], stopped=True, stop=stop)
        self._state = state
        keep = automaton.depth(state)
        self._held = text[len(text) - keep :]
        return StopCheck(text=text[: len(text) - keep])

    def flush(self) -> str:
        """Returns the held-back text at the end of the stream (``""`` after a match)."""
        held, self._held = self._held, ""
        self._state = 0
        return held
