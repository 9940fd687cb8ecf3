"""How the engine says a request cannot be served: an ``ErrorKind`` and, for bad input, the field.

The engine knows no wire: field names are bare (``top_p``, ``logit_bias[5]``), and each front end
names them as its own API spells them and maps each kind to its own status (gRPC in
``pagedserve/services/gateway/generation_core.py``, HTTP in ``pagedserve/services/gateway/openai_errors.py``).
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Why a request cannot be served."""

    INVALID_ARGUMENT = "invalid_argument"  # a field holds a value the server cannot serve
    RESOURCE_EXHAUSTED = "resource_exhausted"  # larger than any worker's KV cache holds
    UNAVAILABLE = "unavailable"  # no worker can run it now; retrying later may succeed


LONE_SURROGATE = ("holds a lone UTF-16 surrogate (U+D800-U+DFFF, e.g. the JSON escape \\ud800 unpaired), which is "
                  "not text")
"""Why a text that is not Unicode text (a prompt, a chat content, a spec or a string of its JSON) is refused."""


class InvalidRequestError(ValueError):
    """A request field holds a value the server cannot serve (kind ``INVALID_ARGUMENT``).

    ``str(error)`` starts with the field name.

    Args:
        field_name: the offending field, bare (``"top_p"``, ``"stop[1]"``); a front end prefixes
            it where its API nests the field (gRPC: ``sampling_params.top_p``).
        reason: what is wrong with its value.
    """

    kind = ErrorKind.INVALID_ARGUMENT

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"{field_name}: {reason}")
        self.field_name = field_name
        self.reason = reason

    def renamed(self, field_name: str) -> InvalidRequestError:
        """The same error naming the field ``field_name`` (as a front end's API spells it)."""
        return InvalidRequestError(field_name, self.reason)
