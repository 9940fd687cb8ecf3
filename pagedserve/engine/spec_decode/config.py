"""The one speculative-decoding config (vLLM's ``speculative_config``): which proposer, how many drafts."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedserve.engine.spec_decode.ngram_proposer import NgramProposer
from pagedserve.options import option


class SpeculativeMethod(enum.Enum):
    """How draft tokens are proposed (vLLM's ``method``)."""

    NONE = "none"  # plain decoding: one token per sequence per step
    NGRAM = "ngram"  # prompt lookup over the sequence's own tokens (``ngram_proposer``), on the worker
    DRAFT_MODEL = "draft_model"  # a smaller model's tokens (``draft_model``), beside the target on the worker


class SpeculativeControl(enum.Enum):
    """How many drafts a step verifies."""

    FIXED = "fixed"  # every decode that may speculate gets num_speculative_tokens slots (vLLM)
    GOODPUT = "goodput"  # each step's k, 0..num_speculative_tokens, maximizes expected tokens per second (``goodput``)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding of the engine (fields documented by their ``help``; vLLM's names).

    ``LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})`` or the flags
    ``--speculative-method ngram --num-speculative-tokens 4``;
    ``{"method": "draft_model", "model": "/path/to/small-model"}`` or ``--speculative-method draft_model
    --speculative-model /path/to/small-model``.

    Raises:
        ValueError: an unknown method, ``num_speculative_tokens`` < 1, not
            ``1 <= prompt_lookup_min <= prompt_lookup_max``, a field other than its default without a method,
            ``draft_model`` without a ``model``, or a ``model`` with another method.
    """

    method: SpeculativeMethod = option(
        "speculative decoding: none, ngram (the worker drafts the tokens that followed the latest earlier "
        "occurrence of the sequence's last n tokens, after the tokens a structured output's grammar forces next) or "
        "draft_model (the worker drafts with --speculative-model: "
        "its argmax for greedy requests, draws from its distribution for sampled ones); over pipeline stages the "
        "first stage drafts and passes the drafts on; one target step verifies the drafts; greedy outputs are the "
        "same as without, sampled ones keep their distribution", SpeculativeMethod.NONE, flag="speculative-method")
    num_speculative_tokens: int = option("most draft tokens verified per sequence and step (k)", 4)
    prompt_lookup_min: int = option("ngram: shortest suffix of the sequence that may match earlier", 1)
    prompt_lookup_max: int = option("ngram: longest suffix of the sequence tried first", 4)
    control: SpeculativeControl = option(
        "how many drafts a step verifies: fixed (every decode that may speculate, num_speculative_tokens) or goodput "
        "(each step's number, 0 up to num_speculative_tokens, maximizes the worker's expected output tokens per "
        "second from its fitted step time and the acceptance seen so far: drafts cost rows, which a big batch on a "
        "CPU pays for in full)", SpeculativeControl.GOODPUT, flag="speculative-control")
    model: str | None = option(
        "draft_model: the draft model's Hugging Face folder (on the workers), loaded with the target's dtype, device "
        "and GEMM backend, with its own KV cache of the target's blocks (--kv-cache-memory holds both); its "
        "vocabulary must be the target's (same tokenizer)", None, flag="speculative-model", metavar="FOLDER")

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", SpeculativeMethod(self.method))
        object.__setattr__(self, "control", SpeculativeControl(self.control))
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative decoding needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method is SpeculativeMethod.NONE:
            for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "control"):
                if (value := getattr(self, name)) != getattr(SpeculativeConfig, name):
                    raise ValueError(f"{name}={getattr(value, 'value', value)} has no effect without a speculative "
                                     "method: give one (ngram or draft_model), or leave it out")
        if (self.method is SpeculativeMethod.DRAFT_MODEL) != (self.model is not None):
            raise ValueError(f"speculative method {self.method.value} with model={self.model!r}: the method "
                             "draft_model needs a model (--speculative-model), and only it takes one")

    def ngram_proposer(self) -> NgramProposer | None:
        """The worker's n-gram proposer; ``None`` for the other methods (a draft model's proposer needs
        the target and its cache: ``runner_factory`` builds it)."""
        if self.method is not SpeculativeMethod.NGRAM:
            return None
        return NgramProposer(self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max)

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler reserves past a decode's token for its drafts (0: no speculation)."""
        return 0 if self.method is SpeculativeMethod.NONE else self.num_speculative_tokens
