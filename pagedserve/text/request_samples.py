"""A validated request (``ParsedRequest``) and its text state: one ``RequestTextState`` per sample."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.sampling_params import EngineSamplingParams, SamplingParams
from pagedserve.text.detokenizer import TokenDecoder
from pagedserve.text.output_processor import RequestTextState, TextDelta
from pagedserve.text.stop_strings import StopStrings
from pagedserve.text.tokenizer import PromptTokenizer, check_prompt_length


@dataclass(frozen=True)
class ParsedRequest:
    """A client request, validated and tokenized.

    Attributes:
        prompt_token_ids: the prompt as token ids.
        params: the client's sampling parameters (stop strings, detokenization options).
        engine_params: the token-level parameters for the engine, ``max_tokens`` resolved.
        priority, cache_salt: scheduling priority and prefix-cache salt.
    """

    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    engine_params: EngineSamplingParams
    priority: int = 0
    cache_salt: str = ""


def parse_request(tokenizer: PromptTokenizer, prompt_token_ids: Sequence[int], field_name: str,
                  params: SamplingParams, priority: int = 0, cache_salt: str = "") -> ParsedRequest:
    """The one validation of a tokenized request, for the gRPC and HTTP APIs and ``LLM`` alike:
    the prompt against the model's context, the parameters against the prompt and the model.

    Args:
        prompt_token_ids: the prompt, tokenized and checked by ``tokenizer``.
        field_name: the prompt's field, as errors name it (``prompt``, ``chat``, ``messages``).
        params: the client's parameters (validated on construction).

    Raises:
        InvalidRequestError: the prompt fills the context (``field_name``), ``max_tokens`` does
            not fit after it, or a token id outside the vocabulary; bare field names.
    """
    info = tokenizer.info
    check_prompt_length(len(prompt_token_ids), info.max_model_len, field_name)
    engine_params = params.to_engine(len(prompt_token_ids), info.max_model_len, info.vocab_size, info.eos_token_ids,
                                     bad_words_token_ids(tokenizer, params.bad_words))
    return ParsedRequest(tuple(prompt_token_ids), params, engine_params, priority, cache_salt)


def bad_words_token_ids(tokenizer: PromptTokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences of ``bad_words`` as vLLM tokenizes them: each word (leading spaces
    stripped) alone, and after a space when that gives as many tokens with another first token
    (the word inside a sentence); no special tokens."""
    encode = tokenizer.hf_tokenizer.encode
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(encode(" " + word.lstrip(), add_special_tokens=False))
        sequences += [alone] if alone else []
        if alone and spaced and len(spaced) == len(alone) and spaced[0] != alone[0]:
            sequences.append(spaced)
    return tuple(sequences)


@dataclass(frozen=True)
class ReceivedSample:
    """What the gateway received of one sample (the answer to a scheduler resuming the request).

    Attributes:
        sample_index: which of the request's samples, in ``[0, n)``.
        token_ids: its output token ids received so far, in order.
        finished: the sample ended (engine finish or stop string): it must not run again.
    """

    sample_index: int
    token_ids: tuple[int, ...]
    finished: bool


class RequestSamples:
    """Routes a request's engine outputs to the text state of their sample.

    Args:
        tokenizer, prompt_token_ids, params: as for ``RequestTextState``; ``params.num_samples``
            samples (``best_of`` when set, else ``n``).

    The stop strings' automaton is built once and shared by the samples, so memory and set-up time
    are O(total stop length), whatever ``n``.
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        stops = StopStrings(params.stop)
        self.samples = [RequestTextState(tokenizer, prompt_token_ids, params, stops) for _ in range(params.num_samples)]

    @property
    def finished(self) -> bool:
        """Every sample has finished."""
        return all(sample.finished for sample in self.samples)

    @property
    def num_prompt_tokens(self) -> int:
        return self.samples[0].num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens over all samples (the usage's completion tokens)."""
        return sum(sample.num_output_tokens for sample in self.samples)

    def received(self) -> list[ReceivedSample]:
        """Per sample that received a token or finished, in sample order: its received output ids
        and whether it finished (samples not listed have received nothing)."""
        return [ReceivedSample(index, sample.output_token_ids, sample.finished)
                for index, sample in enumerate(self.samples) if sample.num_output_tokens or sample.finished]

    def process(self, output: RequestOutput) -> TextDelta:
        """The text delta of ``output``'s sample (see ``RequestTextState.process``).

        Raises:
            ValueError: a sample index outside ``[0, n)``.
        """
        if not 0 <= output.sample_index < len(self.samples):
            raise ValueError(f"sample {output.sample_index} of a request with n={len(self.samples)}")
        return self.samples[output.sample_index].process(output)
