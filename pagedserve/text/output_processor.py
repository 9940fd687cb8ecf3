"""Per-request text state: engine token events in, client text deltas out.

``RequestTextState`` joins the incremental detokenizer and the stop-string matcher for one request.
The gRPC gateway and the in-process ``LLM.generate`` API both feed it the request's
``RequestOutput`` events in order and send (or collect) the ``TextDelta`` it returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.engine.messages import FinishReason, TokenLogprobs
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.text.detokenizer import IncrementalDetokenizer, TokenDecoder
from pagedserve.text.stop_strings import StopCheck, StopStringMatcher, StopStrings


@dataclass(frozen=True)
class TextDelta:
    """What one engine output adds to a request's response.

    Attributes:
        text: text completed since the previous delta (may be ``""`` while text is held back).
        token_ids: the output token ids this delta covers (all ids received, including the one that
            completed a stop string).
        finish_reason: set on the request's last delta only.
        stop_string_matched: a stop string ended the request while the engine is still running it:
            the caller must abort the request in the engine. False when the engine had finished
            the request itself in the same output (``finish_reason`` is then ``STOP`` all the same).
        num_output_tokens: output tokens received so far (the usage's completion tokens).
        logprobs: when the request asks for ``logprobs``: one :class:`TokenLogprobs` per
            ``token_ids`` entry, same order (token's logprob, 1-based rank, the top alternatives
            most likely first); empty otherwise. Token strings are the caller's to decode.
        prompt_logprobs: when the request asks for ``prompt_logprobs``: on sample 0's first delta,
            one entry per prompt position, the first ``None`` (vLLM's layout); ``None`` otherwise.
        stop_reason: on the last delta, vLLM's ``stop_reason``: the stop string that matched, or
            the ``stop_token_ids`` id that ended the sample; ``None`` for EOS, length or abort.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    stop_string_matched: bool
    num_output_tokens: int
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    stop_reason: str | int | None = None


class RequestTextState:
    """Text state of one request: detokenization, stop strings, usage.

    Args:
        tokenizer: decodes ids to text (a Hugging Face tokenizer or a ``PromptTokenizer``).
        prompt_token_ids: the request's prompt (context for decoding the first output tokens).
        params: the request's sampling parameters (``stop``, ``include_stop_str_in_output``,
            ``skip_special_tokens``, ``spaces_between_special_tokens`` and ``min_tokens`` are used
            here: stop strings are not looked for while fewer than ``min_tokens`` tokens exist,
            as vLLM does, so a stop string must end in text of the ``min_tokens``-th token or later).
        stops: the automaton of ``params.stop``, when already built (the samples of a request
            share one); None builds it here.
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], params: SamplingParams,
                 stops: StopStrings | None = None) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                   params.spaces_between_special_tokens)
        self._min_tokens = params.min_tokens
        self._stops = StopStringMatcher(stops if stops is not None else StopStrings(params.stop), params.include_stop_str_in_output)
        self._num_prompt_tokens = len(prompt_token_ids)
        self._output_token_ids: list[int] = []  # every output id received, in order (held-back text's too)
        self._finish_reason: FinishReason | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens (the usage's prompt tokens)."""
        return self._num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens received so far (the usage's completion tokens)."""
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        """The output token ids received so far, in order: those whose text is still held back for
        stop-string matching included, those ignored after the sample finished excluded (what a
        scheduler resuming the request must continue from)."""
        return tuple(self._output_token_ids)

    @property
    def finished(self) -> bool:
        """Whether the request has had its last delta (engine finish or stop string)."""
        return self._finish_reason is not None

    @property
    def finish_reason(self) -> FinishReason | None:
        """Why the request finished; None while it runs."""
        return self._finish_reason

    def process(self, output: RequestOutput) -> TextDelta:
        """Turns the request's next engine output into a text delta.

        When ``output`` finishes the request, all held-back text is flushed into the returned delta.
        When a stop string matches, the delta's text ends there (or after it, when it is included),
        its ``finish_reason`` is ``STOP``, and every later output is ignored: it yields an empty
        delta with no ``finish_reason`` (check ``finished`` before sending). An output with several
        tokens (speculative decoding) is read token by token, as if each had come alone: the
        delta's ids end with the token that completed the stop string.

        Raises:
            ValueError: ``output.first_output_index`` is past the tokens received so far (a gap).
                Ids the state has already received (a repeated output) are skipped.
        """
        if self.finished:
            return TextDelta("", (), None, False, self.num_output_tokens)
        already = self._num_already_received(output)
        new_ids, logprobs = tuple(output.new_token_ids[already:]), tuple(output.logprobs[already:])
        prompt = None if output.prompt_logprobs is None else (None, *output.prompt_logprobs)
        text = ""
        for i in range(max(len(new_ids), 1)):
            last = i >= len(new_ids) - 1
            self._output_token_ids.extend(new_ids[i:i + 1])
            piece = self._detokenizer.add(new_ids[i:i + 1])
            if last and output.finished:
                piece += self._detokenizer.finish()
            check = self._stops.feed(piece) if self.num_output_tokens >= self._min_tokens else StopCheck(piece)
            text += check.text
            if check.stopped:
                self._finish_reason = FinishReason.STOP
                return TextDelta(text, new_ids[:i + 1], FinishReason.STOP, not output.finished, self.num_output_tokens,
                                 logprobs[:i + 1], prompt, check.stop)
        if output.finished:
            text += self._stops.flush()
            self._finish_reason = output.finish_reason
        return TextDelta(text, new_ids, output.finish_reason, False, self.num_output_tokens, logprobs, prompt,
                         output.stop_token_id)

    def _num_already_received(self, output: RequestOutput) -> int:
        """How many leading ids of ``output`` were received before (0 for a new output)."""
        if not output.new_token_ids:
            return 0
        already = self.num_output_tokens - output.first_output_index
        if already < 0:
            raise ValueError(
                f"request {output.request_id}: output starts at token {output.first_output_index} "
                f"but only {self.num_output_tokens} tokens were received"
            )
        return already
