"""Structured outputs: the one spec type a request carries, its validation and its grammar.

A :class:`StructuredOutput` says what the output must match: a JSON schema, any JSON object, a
regular expression, one of a list of strings, or a context-free grammar (GBNF/EBNF as llama.cpp
writes it, or Lark). The grammar engine is llguidance (docs/architecture.md, "Structured outputs",
says why): :meth:`StructuredOutput.grammar` turns a spec into llguidance's grammar text, which the
worker's matchers (``grammar_matchers``) run token by token.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from dataclasses import dataclass

from pagedserve.engine.request_errors import LONE_SURROGATE, InvalidRequestError


class GrammarError(RuntimeError):
    """A matcher failed to build: a spec that passed the gateway's check but not llguidance's
    compiler (the request ends with INVALID_ARGUMENT), or did not build in time. (Here, not beside
    the matchers, so that the scheduler, which only sees the error, does not import torch.)"""

MAX_SPEC_BYTES = 64 * 1024
"""Largest spec accepted (UTF-8 bytes of the schema, regex or grammar text, or of the choices together)."""
MAX_CHOICES = 1024
"""Most choices of a ``CHOICE`` structure: llguidance's grammar takes at most 2,000 items in a row (one per
choice and one more), and 2,000-4,096 choices failed there with a message that did not say to send fewer."""
GRAMMAR_BUILD_TIMEOUT_S = 30.0
"""Longest a worker may take to build a request's grammar before the request fails (seconds)."""
JSON_OPTIONS = {"whitespace_flexible": False}
"""llguidance's JSON compile options: compact JSON (``,`` and ``:``, no free whitespace), so that a
small model cannot fill its output with newlines between keys."""


class StructureKind(enum.Enum):
    """What a structured output's spec is."""

    JSON = "json"                # a JSON schema (the spec is its JSON text)
    JSON_OBJECT = "json_object"  # any JSON object (no spec)
    REGEX = "regex"              # a regular expression (Rust ``regex`` syntax) the whole output matches
    CHOICE = "choice"            # exactly one of ``choices``
    GRAMMAR = "grammar"          # a GBNF/EBNF (llama.cpp) or Lark grammar


@dataclass(frozen=True)
class StructuredOutput:
    """The structure a request's output must have.

    Attributes:
        kind: what ``spec`` or ``choices`` hold.
        spec: the JSON schema text (``JSON``), the regex (``REGEX``) or the grammar (``GRAMMAR``).
        choices: the strings the output may be (``CHOICE``).
    """

    kind: StructureKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    @property
    def value(self) -> str | bool | tuple[str, ...]:
        """The kind's one value (the choices, the spec text, or ``True`` for ``JSON_OBJECT``): what a
        ``oneof`` member carries on the wire (``pagedserve/services/common/pb_fields.py``)."""
        if self.kind is StructureKind.CHOICE:
            return self.choices
        return True if self.kind is StructureKind.JSON_OBJECT else self.spec

    @classmethod
    def of(cls, kind: StructureKind, value: str | bool | tuple[str, ...]) -> StructuredOutput:
        """The inverse of :attr:`value`.

        Raises:
            InvalidRequestError: ``JSON_OBJECT`` with ``False``, which would ask for nothing (and was taken as
                ``True``: a JSON object forced on a gRPC client that set ``json_object: false``).
        """
        if kind is StructureKind.JSON_OBJECT and value is not True:
            raise InvalidRequestError(_field(kind), "must be true (false asks for no structure: leave "
                                                    "structured_output unset)")
        if kind is StructureKind.CHOICE:
            return cls(kind, choices=tuple(value))
        return cls(kind) if kind is StructureKind.JSON_OBJECT else cls(kind, spec=str(value))

    @functools.cached_property
    def cache_key(self) -> str:
        """A hash of the spec (BLAKE2b, hex): compiled grammars are cached under it."""
        text = json.dumps([self.kind.value, self.spec, list(self.choices)])
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def grammar(self) -> str:
        """llguidance's grammar text for this spec (not yet checked: see :func:`check_structured_output`).

        Raises:
            InvalidRequestError: a JSON schema that is not JSON, or a grammar that does not convert to Lark.
        """
        import llguidance

        if self.kind is StructureKind.JSON:
            return llguidance.LLMatcher.grammar_from_json_schema(_load_json(self.spec, _field(self.kind)),
                                                                 defaults=JSON_OPTIONS)
        if self.kind is StructureKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind is StructureKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind is StructureKind.CHOICE:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choices))
        try:
            return llguidance.grammar_from("grammar", self.spec)
        except ValueError as e:
            raise InvalidRequestError("structured_output.grammar", str(e)) from None


def _field(kind: StructureKind) -> str:
    return f"structured_output.{kind.value}"


@functools.lru_cache(maxsize=256)
def check_structured_output(structure: StructuredOutput) -> None:
    """Refuses a spec that cannot be served, before it is queued (specs that pass are remembered:
    the 256 most recent are not checked again).

    Checks, in order: the size (``MAX_SPEC_BYTES``), that choices are given and not empty, that a
    JSON schema is a valid schema (``jsonschema``'s meta-schema check), and that llguidance builds
    the grammar (catches schema keywords it does not implement, bad regexes, grammars that do not
    parse).

    Raises:
        InvalidRequestError: naming ``structured_output.<kind>`` and the reason.
    """
    name = _field(structure.kind)
    try:
        size = len(structure.spec.encode()) + sum(len(c.encode()) for c in structure.choices)
    except UnicodeEncodeError:
        raise InvalidRequestError(name, LONE_SURROGATE) from None
    if size > MAX_SPEC_BYTES:
        raise InvalidRequestError(name, f"is {size} bytes; at most {MAX_SPEC_BYTES} are allowed")
    if structure.kind is StructureKind.CHOICE and (not structure.choices or not all(structure.choices)):
        raise InvalidRequestError(name, "must hold at least one choice, none of them empty")
    if len(structure.choices) > MAX_CHOICES:
        raise InvalidRequestError(name, f"holds {len(structure.choices)} choices; at most {MAX_CHOICES} are allowed")
    if structure.kind in (StructureKind.REGEX, StructureKind.GRAMMAR, StructureKind.JSON) and not structure.spec:
        raise InvalidRequestError(name, "must not be empty")
    if structure.kind is StructureKind.JSON:
        _check_schema(structure.spec, name)
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(structure.grammar())
    if error and "recursion limit exceeded" in error:  # llguidance's JSON parser stops at 128 levels
        raise InvalidRequestError(name, f"is nested too deeply ({error.splitlines()[0][:200]})")
    if error:
        raise InvalidRequestError(name, error.splitlines()[0][:500])


def _load_json(text: str, name: str) -> object:
    """``text`` parsed as JSON.

    Raises:
        InvalidRequestError(name): not JSON, nested too deeply for the parser (a few hundred
            levels: Python's recursion limit), or holding a lone surrogate.
    """
    try:
        value = json.loads(text)
        json.dumps(value, ensure_ascii=False).encode()  # a \ud800 escape loads as a lone surrogate
    except json.JSONDecodeError as e:
        raise InvalidRequestError(name, f"is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidRequestError(name, "is nested too deeply") from None
    except UnicodeEncodeError:
        raise InvalidRequestError(name, LONE_SURROGATE) from None
    return value


KNOWN_METASCHEMAS = frozenset(f"json-schema.org/{draft}/schema" for draft in (
    "draft-04", "draft-06", "draft-07", "draft/2019-09", "draft/2020-12"))
"""The ``$schema`` drafts a schema may name (scheme and a trailing ``#`` aside); one naming another is
refused (``jsonschema_rs`` would try to download it, llguidance refuses it)."""


def _check_schema(text: str, name: str) -> None:
    """Raises ``InvalidRequestError(name)`` unless ``text`` is a JSON schema object that validates against its
    draft's meta-schema (``jsonschema_rs``: 0.3-0.6 ms for a 500-property schema where the ``jsonschema``
    package takes 100-300 ms of the gateway's CPU). The boolean schemas ``true`` and ``false`` are valid JSON
    schemas, but llguidance builds no grammar from them (a ValueError, which reached clients as UNKNOWN / 500:
    attack of 2026-12-07): refused, saying what to send instead."""
    import jsonschema_rs

    schema = _load_json(text, name)
    if isinstance(schema, bool):
        raise InvalidRequestError(name, f"the boolean schema {str(schema).lower()} is not supported: send an object "
                                        "schema (any JSON object: the json_object form)")
    if not isinstance(schema, dict):
        raise InvalidRequestError(name, f"must be a JSON object, got {type(schema).__name__}")
    if not _known_metaschema(schema.get("$schema")):
        raise InvalidRequestError(name, f"names $schema {str(schema['$schema'])[:100]!r}, which is not supported: "
                                  "omit it, or name draft-04, -06, -07, 2019-09 or 2020-12")
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as e:
        where = "/".join(str(p) for p in e.instance_path)
        raise InvalidRequestError(name, f"is not a valid JSON schema: {e.message}" + (f" (at {where})" if where else "")
                                  ) from None


def _known_metaschema(uri: object) -> bool:
    """Whether ``uri`` names one of ``KNOWN_METASCHEMAS`` (``None``: no ``$schema``, the default draft)."""
    if uri is None:
        return True
    return isinstance(uri, str) and uri.split("://", 1)[-1].rstrip("#") in KNOWN_METASCHEMAS
