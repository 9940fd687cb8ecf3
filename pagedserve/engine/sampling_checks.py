"""The bounds of the client's sampling parameters, in one table, and the check that applies them.

Every numeric field's range is written once, in ``BOUNDS``; the front ends read their own limits
from here (the HTTP body's ``logit_bias`` size, the API docs). Fields the services carry as
int32, uint64 or float32 (proto/*.proto) are bounded so that they survive that: a value is
checked as given and as float32 where the wire rounds it (a top_p of 1e-50 would become 0).
Errors name the field bare (``top_p``, ``logit_bias[5]``); see ``request_errors``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.request_errors import InvalidRequestError

INT32_MAX = (1 << 31) - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_N = 64
"""Most samples per request (``n`` and ``best_of``)."""
MAX_LOGPROBS = 20
"""Most alternatives per position (``logprobs``, ``prompt_logprobs``, chat's ``top_logprobs``), as OpenAI allows."""
MAX_LOGIT_BIAS = 300
"""Most entries in ``logit_bias``, as OpenAI allows."""
MAX_ALLOWED_IDS_IN_ALL = 1 << 16
"""Most distinct ``allowed_token_ids`` times samples. Each sample carries the list in the plan that
starts it (and masks with it every step): 20 copies of the vocabulary at n = 64 made one plan too large
for gRPC's 64 MiB; at this bound, 256 new sequences in one plan carry at most about 44 MB of them."""


@dataclass(frozen=True)
class Bound:
    """An interval ``[low, high]`` (``(low, high]`` when ``low_open``) a numeric field must lie in.

    Attributes:
        float32: the services carry the field as float32: the rounded value must lie in it too.
        note: appended to the message (what a special value means).
    """

    low: float
    high: float
    low_open: bool = False
    float32: bool = False
    note: str = ""

    def holds(self, value: float) -> bool:
        """Whether ``value`` lies in the interval (NaN never does)."""
        values = (value, as_float32(value)) if self.float32 else (value,)
        return all((self.low < v if self.low_open else self.low <= v) and v <= self.high for v in values)

    def describe(self) -> str:
        """``[0, 20]``, ``(0, 1]``: the interval as the error messages write it."""
        return f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}]{self.note}"


def _number(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


BOUNDS: Mapping[str, Bound] = {
    "max_tokens": Bound(1, INT32_MAX),
    "temperature": Bound(0, FLOAT32_MAX, float32=True, note=" (0 is greedy)"),
    "top_p": Bound(0, 1, low_open=True, float32=True),
    "top_k": Bound(-1, INT32_MAX, note=" (-1 and 0 are off)"),
    "min_p": Bound(0, 1, float32=True),
    "seed": Bound(0, (1 << 64) - 1),
    "min_tokens": Bound(0, INT32_MAX),
    "n": Bound(1, MAX_N),
    "best_of": Bound(1, MAX_N),
    "logprobs": Bound(0, MAX_LOGPROBS),
    "prompt_logprobs": Bound(0, MAX_LOGPROBS),
    "presence_penalty": Bound(-2, 2, float32=True),
    "frequency_penalty": Bound(-2, 2, float32=True),
    # below 1e-3, dividing a logit by the penalty overflows float32 (1e-40 made every logprob -inf)
    "repetition_penalty": Bound(1e-3, 1e3, float32=True, note=" (1 is off)"),
}
"""Per numeric field, the range of its value (an optional field that is unset, ``None``, is not checked)."""
BIAS_BOUND = Bound(-100, 100, float32=True)
"""The range of each ``logit_bias`` value."""


def as_float32(value: float) -> float:
    """``value`` rounded to float32 as the services carry it (inf when it overflows)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def check_bound(field_name: str, value: float, bound: Bound) -> None:
    """Raises ``InvalidRequestError(field_name)`` unless ``value`` lies in ``bound``."""
    if not bound.holds(value):
        raise InvalidRequestError(field_name, f"must be in {bound.describe()}, got {value}")


def check_count(field_name: str, count: int, limit: int, what: str) -> None:
    """Raises ``InvalidRequestError(field_name, ...)`` when ``count > limit`` (``what`` names the unit)."""
    if count > limit:
        raise InvalidRequestError(field_name, f"holds {count} {what}; at most {limit} are allowed")


def check_sampling_params(params: Any) -> None:
    """Raises ``InvalidRequestError`` naming the first field of ``params`` (a ``SamplingParams``)
    out of its range: ``BOUNDS``, then the rules that relate fields or look inside lists."""
    for name, bound in BOUNDS.items():
        value = getattr(params, name)
        if value is not None:
            check_bound(name, value, bound)
    if params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise InvalidRequestError("min_tokens", f"{params.min_tokens} is more than max_tokens {params.max_tokens}")
    if params.best_of is not None and params.best_of < params.n:
        raise InvalidRequestError("best_of", f"must be in [n={params.n}, {MAX_N}], got {params.best_of}")
    if any(not s for s in params.stop):
        raise InvalidRequestError("stop", "stop strings must not be empty")
    if any(not w for w in params.bad_words):
        raise InvalidRequestError("bad_words", "bad words must not be empty")
    check_count("logit_bias", len(params.logit_bias), MAX_LOGIT_BIAS, "entries")
    for token_id, bias in params.logit_bias.items():
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise InvalidRequestError("logit_bias", f"keys must be token ids (int), got {token_id!r}")
        check_bound(f"logit_bias[{token_id}]", bias, BIAS_BOUND)


def check_an_allowed_id_stays(allowed_token_ids: tuple[int, ...] | None,
                              bad_words_token_ids: tuple[tuple[int, ...], ...], stop_ids: tuple[int, ...],
                              min_tokens: int) -> None:
    """Raises ``InvalidRequestError("allowed_token_ids", ...)`` when every allowed id may be masked at once: a
    stop id while ``min_tokens`` holds the output back, or the last token of a bad word whose other tokens are
    allowed (only those can precede it in the output). The sampler would then choose among ids of probability
    0, outside the allowed ones (attack of 2026-12-07: ``allowed_token_ids [2]`` with ``min_tokens 5`` gave
    token 0). An allowed id that is neither can always be chosen."""
    if allowed_token_ids is None:
        return
    allowed = set(allowed_token_ids)  # a bad word whose other tokens are not all allowed can never be completed
    maskable = {word[-1] for word in bad_words_token_ids if allowed.issuperset(word[:-1])}
    maskable |= set(stop_ids) if min_tokens else set()
    if maskable.issuperset(allowed_token_ids):
        raise InvalidRequestError("allowed_token_ids", "every allowed id may be masked (a stop id while min_tokens "
                                                       "holds the output back, or the last token of a bad word): "
                                                       "allow an id that is neither")
