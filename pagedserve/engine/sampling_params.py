"""Sampling parameters: the user-facing set (validated) and the token-level set the engine uses.

Field names and defaults follow vLLM's ``SamplingParams`` and the OpenAI API.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

_PREFIX = "sampling_params."  # field names as the client API spells them
MAX_N = 64  # most samples per request


class InvalidRequestError(ValueError):
    """A request field holds a value the server cannot serve.

    The gateway answers it with gRPC ``INVALID_ARGUMENT``; ``str(error)`` starts with the field name.

    Args:
        field_name: the offending field as the client named it (``"sampling_params.top_p"``).
        reason: what is wrong with its value.
    """

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field_name = field_name
        self.reason = reason


GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (as vLLM does): dividing logits by a subnormal one
overflows them to inf."""


@dataclass(frozen=True)
class EngineSamplingParams:
    """Token-level sampling parameters, as the scheduler and the worker's sampler use them.

    Stop strings stay in the gateway (they are text); everything here acts on token ids.

    Attributes:
        max_tokens: most tokens to generate, >= 1 (already resolved against the context length).
        temperature: 0 is greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; <= 0 is off.
        min_p: drop tokens below ``min_p * p_max``; 0 is off.
        seed: per-request seed; ``None`` draws from the worker's shared generator.
        min_tokens: EOS and stop token ids are masked until this many tokens exist.
        stop_token_ids: ids that finish the request (reason ``stop``) once sampled.
        ignore_eos: do not stop at ``eos_token_ids``.
        eos_token_ids: the model's EOS ids, from its generation config.
        n: samples to draw for the prompt; they share the prompt's KV blocks.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()
    n: int = 1

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_worker(self) -> EngineSamplingParams:
        """What a worker needs of these parameters: stop and EOS ids only while ``min_tokens``
        masks them (deciding that a sequence stopped is the scheduler's business)."""
        if self.min_tokens > 0 or not (self.stop_token_ids or self.eos_token_ids):
            return self
        return dataclasses.replace(self, stop_token_ids=(), eos_token_ids=())

    def stops_at(self, token_id: int, num_output_tokens: int) -> bool:
        """Whether sampling ``token_id`` as output number ``num_output_tokens`` (1-based) ends the request."""
        if num_output_tokens <= self.min_tokens:
            return False
        if token_id in self.stop_token_ids:
            return True
        return not self.ignore_eos and token_id in self.eos_token_ids


@dataclass(frozen=True)
class SamplingParams:
    """What a client may ask for, validated on construction.

    Raises:
        InvalidRequestError: a value outside its range; the message names the field.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        p = _PREFIX
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(p + "max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(p + "temperature", f"must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError(p + "top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequestError(p + "top_k", f"must be -1 (off), 0 (off) or positive, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError(p + "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise InvalidRequestError(p + "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                p + "min_tokens", f"{self.min_tokens} is more than max_tokens {self.max_tokens}"
            )
        if any(not s for s in self.stop):
            raise InvalidRequestError(p + "stop", "stop strings must not be empty")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(p + "n", f"must be in [1, {MAX_N}], got {self.n}")

    def to_engine(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
    ) -> EngineSamplingParams:
        """Resolves the parameters against a tokenized prompt and the model.

        Args:
            num_prompt_tokens: length of the prompt in tokens.
            max_model_len: the model's context length in tokens.
            vocab_size: number of token ids the model knows.
            eos_token_ids: the model's EOS ids.

        Raises:
            InvalidRequestError: ``max_tokens`` beyond the context, or a stop token id outside the vocabulary.
        """
        p = _PREFIX
        room = max_model_len - num_prompt_tokens
        max_tokens = room if self.max_tokens is None else self.max_tokens
        if max_tokens > room:
            raise InvalidRequestError(
                p + "max_tokens",
                f"{max_tokens} + {num_prompt_tokens} prompt tokens exceeds the model's context of {max_model_len}",
            )
        for i, token_id in enumerate(self.stop_token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(p + f"stop_token_ids[{i}]", f"{token_id} is not in [0, {vocab_size})")
        return EngineSamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if self.temperature < GREEDY_BELOW else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            min_tokens=min(self.min_tokens, max_tokens),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            eos_token_ids=tuple(eos_token_ids),
            n=self.n,
        )


def child_sampling(parent: EngineSamplingParams, sample_index: int) -> EngineSamplingParams:
    """Sample ``i``'s parameters: ``n = 1`` and, for a seeded request, a seed of its own.

    The worker draws sample i's first token with the same derived seed, so each sample is one
    reproducible stream whatever else runs.
    """
    seed = parent.seed if parent.seed is None else derive_seed(parent.seed, sample_index)
    return dataclasses.replace(parent, n=1, seed=seed)


def derive_seed(seed: int, sample_index: int) -> int:
    """Sample 0 keeps the request's seed; sample i > 0 gets a 63-bit hash of (seed, i)."""
    if sample_index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
