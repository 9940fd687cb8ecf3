"""The text state of a whole request: one ``RequestTextState`` per sample (``n`` of them)."""

from __future__ import annotations

from collections.abc import Sequence

from services.common.messages import RequestOutput
from services.common.sampling_params import SamplingParams
from services.gateway.detokenizer import TokenDecoder
from services.gateway.output_processor import RequestTextState, TextDelta


class RequestSamples:
    """Routes a request's engine outputs to the text state of their sample.

    Args:
        tokenizer, prompt_token_ids, params: as for ``RequestTextState``; ``params.n`` samples.
    """

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.samples = [RequestTextState(tokenizer, prompt_token_ids, params) for _ in range(params.n)]

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

    def process(self, output: RequestOutput) -> TextDelta:
        """The text delta of ``output``'s sample (see ``RequestTextState.process``).

        Raises:
            ValueError: a sample index outside ``[0, n)``.
        """
        if not 0 <= output.sample_index < len(self.samples):
            raise ValueError(f"sample {output.sample_index} of a request with n={len(self.samples)}")
        return self.samples[output.sample_index].process(output)
