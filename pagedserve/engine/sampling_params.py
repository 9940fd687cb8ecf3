"""Sampling parameters: the client's set (validated) and the token-level sets the engine uses.

The engine's parameters are split by who uses them, as TGI splits them: ``ChoosingParams`` (how
the worker's sampler chooses the next token) and ``StoppingParams`` (when the scheduler ends a
sequence); ``EngineSamplingParams`` is both, plus the number of samples. Field names and defaults
follow vLLM's ``SamplingParams`` and the OpenAI API; the services map each dataclass to its
protobuf message by field name (``pagedserve/services/common/pb_fields.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagedserve.engine.request_errors import InvalidRequestError  # noqa: F401 (the API's name for it lives here too)
from pagedserve.engine.sampling_checks import MAX_ALLOWED_IDS_IN_ALL, check_an_allowed_id_stays, check_sampling_params
from pagedserve.engine.structured_output import StructuredOutput, check_structured_output

CONFLICTS_WITH_STRUCTURE = ("allowed_token_ids", "bad_words", "min_tokens")
"""Fields a request with a structured output must leave at their defaults: each masks tokens the
grammar may need (``min_tokens`` masks EOS where the grammar may allow nothing else)."""
GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (as vLLM does): dividing logits by a subnormal one
overflows them to inf."""


def derive_seed(seed: int, index: int) -> int:
    """The one seed derivation: a 63-bit seed from a request seed and an index (BLAKE2b of both).

    The sampler seeds output token ``i``'s draw with ``derive_seed(seed, i)``; sample ``j > 0`` of
    a request runs under the seed ``derive_seed(seed, -j)`` (negative: apart from the draws).
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class StoppingParams:
    """When a sequence ends: the scheduler's parameters (TGI's stopping criteria).

    Attributes:
        max_tokens: most tokens to generate, >= 1 (already resolved against the context length).
        min_tokens: EOS and stop token ids are masked until this many tokens exist.
        stop_token_ids: ids that finish the request (reason ``stop``) once sampled.
        ignore_eos: do not stop at ``eos_token_ids``.
        eos_token_ids: the model's EOS ids, from its generation config.
    """

    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The one stop rule: the ids that end a sequence, a stop token id or EOS unless ``ignore_eos``
        (the worker masks them while fewer than ``min_tokens`` exist)."""
        return self.stop_token_ids + (() if self.ignore_eos else self.eos_token_ids)

    def stops_at(self, token_id: int, num_output_tokens: int) -> bool:
        """Whether sampling ``token_id`` as output number ``num_output_tokens`` (1-based) ends the request."""
        return num_output_tokens > self.min_tokens and token_id in self.stop_ids

    def stop_token_id(self, token_id: int) -> int | None:
        """``token_id`` when it ends a sequence as one of ``stop_token_ids`` rather than as EOS
        (vLLM's ``stop_reason``), else ``None``."""
        is_eos = token_id in self.stop_ids[len(self.stop_token_ids):]
        return token_id if token_id in self.stop_token_ids and not is_eos else None


@dataclass(frozen=True)
class ChoosingParams:
    """How the next token is chosen: the worker sampler's parameters (TGI's next-token chooser).

    Attributes:
        temperature: 0 is greedy; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; 1 is off.
        top_k: keep the k most likely tokens; <= 0 is off.
        min_p: drop tokens below ``min_p * p_max``; 0 is off.
        seed: per-request seed; ``None`` draws from the worker's shared generator.
        logprobs: ``None``: no logprobs (greedy rows then stay argmax-only); k in [0, 20]: the
            chosen token's logprob and rank plus the k most likely alternatives, from the
            log-softmax of the processed logits (see ``pagedserve.engine.logprobs``).
        prompt_logprobs: ``None`` or k in [0, 20]: per prompt position after the first, the
            prompt token's logprob and rank and the k most likely alternatives (raw logits).
        presence_penalty: subtracted once from the logit of every token in the output, [-2, 2].
        frequency_penalty: subtracted from a token's logit per occurrence in the output, [-2, 2].
        repetition_penalty: > 0, 1 is off; divides positive (multiplies negative) logits of
            tokens in the prompt or the output (CTRL, Keskar et al., 2019, §4.1).
        logit_bias: ``(token id, bias)`` pairs added to the logits, ids sorted and distinct.
        allowed_token_ids: ``None`` (all) or the only ids that may be chosen (vLLM's).
        bad_words_token_ids: token sequences never to generate: a sequence's last token is masked
            while the output ends with its other tokens (vLLM's ``bad_words``, tokenized).
        structured_output: ``None`` or the structure the output must match: the worker masks
            every token its grammar does not allow, before anything else (``grammar_matchers``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_output: StructuredOutput | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether any of the presence, frequency or repetition penalties is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether choosing reads the row's tokens so far (prompt and output): the sampler then
        gets its ``TokenHistory``."""
        return self.has_penalties or bool(self.bad_words_token_ids)


@dataclass(frozen=True)
class EngineSamplingParams(ChoosingParams, StoppingParams):
    """A request's token-level parameters: its ``StoppingParams``, its ``ChoosingParams``, and ``n``.

    Stop strings stay in the gateway (they are text); everything here acts on token ids.

    Attributes:
        n: samples to draw for the prompt; they share the prompt's KV blocks (``best_of`` when
            the client asked for more samples than it gets back).
    """

    n: int = 1

    def for_worker(self) -> EngineSamplingParams:
        """What a worker needs of these parameters: stop and EOS ids only while ``min_tokens``
        masks them (deciding that a sequence stopped is the scheduler's business)."""
        if self.min_tokens > 0 or not (self.stop_token_ids or self.eos_token_ids):
            return self
        return dataclasses.replace(self, stop_token_ids=(), eos_token_ids=())


@dataclass(frozen=True)
class SamplingParams:
    """What a client may ask for, validated on construction.

    The fields beyond vLLM's basic set (semantics as vLLM's ``SamplingParams``):

    Attributes:
        logprobs: ``None`` (off) or k in [0, 20]: each output token comes with its logprob, its
            rank (1-based) and the k most likely alternatives, computed in float32 from the
            log-softmax of the logits after min_tokens masking, ``logit_bias``, the penalties
            and the temperature (none for greedy), before top-k/top-p/min-p truncation.
        prompt_logprobs: ``None`` (off) or k in [0, 20]: the same for the prompt tokens, from
            the raw logits; the first position has none. Such requests skip the prefix cache.
        presence_penalty, frequency_penalty: OpenAI's penalties over the output tokens, [-2, 2].
        repetition_penalty: CTRL's penalty (Keskar et al., 2019) over prompt and output, > 0, 1 off.
        logit_bias: token id -> bias in [-100, 100] added to its logit; at most 300 entries.
        best_of: generate this many samples (in [n, 64]) and return the ``n`` with the highest
            cumulative logprob (offline ``LLM`` only; the streaming gRPC API refuses best_of > n).
        spaces_between_special_tokens: passed to the tokenizer's decode; only slow (Python)
            Hugging Face tokenizers use it, fast ones such as the default model's ignore it.
        allowed_token_ids: ``None`` or the only token ids that may be generated (not empty).
        bad_words: words never to generate, each with and without a leading space (vLLM's).
        structured_output: ``None`` or the structure the output must match (JSON schema, any
            JSON object, regex, choice, grammar); checked on construction (``check_structured_output``).

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
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    best_of: int | None = None
    spaces_between_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    structured_output: StructuredOutput | None = None

    @property
    def num_samples(self) -> int:
        """Samples the engine generates: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    def __post_init__(self) -> None:
        check_sampling_params(self)
        if self.structured_output is not None:
            check_structured_output(self.structured_output)
            for name in CONFLICTS_WITH_STRUCTURE:
                if getattr(self, name) != getattr(SamplingParams, name):
                    raise InvalidRequestError(name, "cannot be combined with a structured output (its mask could "
                                                    "leave no token the grammar allows)")

    def to_engine(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
    ) -> EngineSamplingParams:
        """Resolves the parameters against a tokenized prompt and the model.

        Args:
            num_prompt_tokens: length of the prompt in tokens.
            max_model_len: the model's context length in tokens.
            vocab_size: number of token ids the model knows.
            eos_token_ids: the model's EOS ids.
            bad_words_token_ids: ``bad_words`` tokenized (``request_samples.bad_words_token_ids``).

        Raises:
            InvalidRequestError: ``max_tokens`` or ``min_tokens`` beyond the context, a token id outside the
                vocabulary (``stop_token_ids[i]``, ``logit_bias[id]``), or more distinct ``allowed_token_ids``
                times samples than ``MAX_ALLOWED_IDS_IN_ALL`` (the list is carried deduplicated and sorted), or
                ``allowed_token_ids`` that may all be masked (``check_an_allowed_id_stays``).
        """
        room = max_model_len - num_prompt_tokens
        max_tokens = room if self.max_tokens is None else self.max_tokens
        for name, tokens in (("max_tokens", max_tokens), ("min_tokens", self.min_tokens)):
            if tokens > room:  # min_tokens without max_tokens: it would hold EOS back to the end of the context
                raise InvalidRequestError(name, f"{tokens} + {num_prompt_tokens} prompt tokens exceeds the model's "
                                                f"context of {max_model_len}")
        _check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        _check_token_ids("logit_bias", self.logit_bias, vocab_size)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise InvalidRequestError("allowed_token_ids", "must hold at least one token id when given")
        _check_token_ids("allowed_token_ids", self.allowed_token_ids or (), vocab_size)
        allowed = None if self.allowed_token_ids is None else tuple(sorted(set(self.allowed_token_ids)))
        if allowed is not None and len(allowed) * self.num_samples > MAX_ALLOWED_IDS_IN_ALL:
            raise InvalidRequestError("allowed_token_ids", f"{len(allowed)} distinct ids x {self.num_samples} samples "
                                      f"is over {MAX_ALLOWED_IDS_IN_ALL} in all: allow fewer ids or ask for fewer samples")
        for word in bad_words_token_ids:
            _check_token_ids("bad_words", word, vocab_size)
        # best_of > n ranks samples by their cumulative logprob: the engine must compute it
        logprobs = 0 if self.logprobs is None and self.num_samples > self.n else self.logprobs
        same = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineSamplingParams) if hasattr(self, f.name)}
        engine = EngineSamplingParams(**same | dict(
            max_tokens=max_tokens,
            temperature=0.0 if self.temperature < GREEDY_BELOW else self.temperature,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            eos_token_ids=tuple(eos_token_ids),
            n=self.num_samples,
            logprobs=logprobs,
            logit_bias=tuple(sorted((int(t), float(b)) for t, b in self.logit_bias.items() if b != 0.0)),
            allowed_token_ids=allowed,
            bad_words_token_ids=bad_words_token_ids,
        ))
        check_an_allowed_id_stays(allowed, bad_words_token_ids, engine.stop_ids, engine.min_tokens)
        return engine


def _check_token_ids(field_name: str, token_ids: Iterable[int], vocab_size: int) -> None:
    """Raises ``InvalidRequestError`` naming ``field_name[i]`` (``field_name[id]`` for a mapping's
    keys) for an id outside ``[0, vocab_size)``."""
    keyed = isinstance(token_ids, Mapping)
    for i, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(f"{field_name}[{token_id if keyed else i}]", f"{token_id} is not in [0, {vocab_size})")


def child_sampling(parent: EngineSamplingParams, sample_index: int) -> EngineSamplingParams:
    """Sample ``i``'s parameters: ``n = 1`` and, for a seeded request, a seed of its own.

    Sample 0 keeps the request's seed; sample ``i > 0`` runs under ``derive_seed(seed, -i)``. The
    worker draws sample i's first token with that seed, so each sample is one reproducible stream
    whatever else runs. Only sample 0 computes ``prompt_logprobs``.
    """
    seed = parent.seed if parent.seed is None or sample_index == 0 else derive_seed(parent.seed, -sample_index)
    prompt_logprobs = parent.prompt_logprobs if sample_index == 0 else None  # sample 0 reports the prompt's
    return dataclasses.replace(parent, n=1, seed=seed, prompt_logprobs=prompt_logprobs)
