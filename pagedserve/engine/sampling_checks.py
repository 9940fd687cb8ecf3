"""Validation of ``SamplingParams``: every field's range, as the API's errors name them.

Kept apart from ``sampling_params.py`` so that each file reads in one sitting; the names here
(limits, ``InvalidRequestError``) are re-exported there.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.engine.sampling_params import SamplingParams

_PREFIX = "sampling_params."  # field names as the client API spells them
MAX_N = 64  # most samples per request (n and best_of)
MAX_LOGPROBS = 20  # most alternatives per position (logprobs, prompt_logprobs), as OpenAI allows
MAX_LOGIT_BIAS = 300  # most entries in logit_bias, as OpenAI allows
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_BIAS = 100.0  # logit_bias values lie in [-MAX_BIAS, MAX_BIAS]


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


INT32_MAX = (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38
MIN_REPETITION_PENALTY = 1e-3
"""Below this, dividing a logit by the penalty overflows float32 (1e-40 turned every logprob into -inf)."""
MAX_REPETITION_PENALTY = 1e3


def as_float32(value: float) -> float:
    """``value`` rounded to float32 as the services carry it (inf when it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)




def check_sampling_params(params: SamplingParams) -> None:
    """Raises ``InvalidRequestError`` naming the first field of ``params`` out of its range."""
    _check_basic(params)
    _check_logprobs_and_penalties(params)
    _check_wire_ranges(params)


def _check_wire_ranges(params: SamplingParams) -> None:
    """Values the services carry as uint64, int32 and float32 (proto/engine.proto) must survive
    that: a seed outside [0, 2^64), a top_k beyond int32, a temperature that overflows float32,
    a top_p that rounds to 0 in float32 would otherwise fail or change meaning on the way."""
    p = _PREFIX
    if params.seed is not None and not 0 <= params.seed < 1 << 64:
        raise InvalidRequestError(p + "seed", f"must be in [0, 2^64), got {params.seed}")
    if params.top_k > INT32_MAX:
        raise InvalidRequestError(p + "top_k", f"must be at most {INT32_MAX}, got {params.top_k}")
    if not math.isfinite(as_float32(params.temperature)):
        raise InvalidRequestError(p + "temperature", f"must be at most {FLOAT32_MAX:.3g}, got {params.temperature}")
    if as_float32(params.top_p) == 0.0:
        raise InvalidRequestError(p + "top_p", f"{params.top_p} rounds to 0 in float32; it must be in (0, 1]")

def _check_logprobs_and_penalties(params: SamplingParams) -> None:
    """Logprob counts, penalties, logit_bias and best_of within their bounds."""
    p = _PREFIX
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise InvalidRequestError(p + name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequestError(p + name, f"must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
    if not MIN_REPETITION_PENALTY <= params.repetition_penalty <= MAX_REPETITION_PENALTY:  # NaN fails too
        raise InvalidRequestError(p + "repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY}, "
                                  f"{MAX_REPETITION_PENALTY}] (1 is off), got {params.repetition_penalty}")
    if len(params.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(p + "logit_bias", f"holds {len(params.logit_bias)} entries; at most "
                                  f"{MAX_LOGIT_BIAS} are allowed")
    for token_id, bias in params.logit_bias.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise InvalidRequestError(p + "logit_bias", f"keys must be token ids (int), got {token_id!r}")
        if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise InvalidRequestError(p + f"logit_bias[{token_id}]", f"must be in [-{MAX_BIAS}, {MAX_BIAS}], got {bias}")
    if params.best_of is not None and not params.n <= params.best_of <= MAX_N:
        raise InvalidRequestError(p + "best_of", f"must be in [n={params.n}, {MAX_N}], got {params.best_of}")

def _check_basic(params: SamplingParams) -> None:
    """The fields every request has: lengths, temperature, the filters, stops, n."""
    p = _PREFIX
    if params.max_tokens is not None and params.max_tokens < 1:
        raise InvalidRequestError(p + "max_tokens", f"must be at least 1, got {params.max_tokens}")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidRequestError(p + "temperature", f"must be >= 0, got {params.temperature}")
    if not (0.0 < params.top_p <= 1.0):
        raise InvalidRequestError(p + "top_p", f"must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise InvalidRequestError(p + "top_k", f"must be -1 (off), 0 (off) or positive, got {params.top_k}")
    if not (0.0 <= params.min_p <= 1.0):
        raise InvalidRequestError(p + "min_p", f"must be in [0, 1], got {params.min_p}")
    if params.min_tokens < 0:
        raise InvalidRequestError(p + "min_tokens", f"must be >= 0, got {params.min_tokens}")
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise InvalidRequestError(
            p + "min_tokens", f"{params.min_tokens} is more than max_tokens {params.max_tokens}"
        )
    if any(not s for s in params.stop):
        raise InvalidRequestError(p + "stop", "stop strings must not be empty")
    if not 1 <= params.n <= MAX_N:
        raise InvalidRequestError(p + "n", f"must be in [1, {MAX_N}], got {params.n}")
