"""The HTTP API's forms of a structured output, and the one ``StructuredOutput`` they become.

Three forms, at most one per request: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema`` with ``name``, ``schema``, ``strict``), vLLM's ``structured_outputs`` (one of
``json``, ``regex``, ``choice``, ``grammar``, ``json_object``), and vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``. Spec errors name the field as the client
sent it (``response_format.json_schema.schema``, ``guided_regex``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr

from pagedserve.engine.request_errors import InvalidRequestError
from pagedserve.engine.structured_output import MAX_CHOICES, StructuredOutput, StructureKind
from pagedserve.text.request_limits import RequestLimits

Spec = Annotated[StrictStr, Field(max_length=RequestLimits().max_text_chars)]
"""A spec string as the body carries it (its size is checked against ``MAX_SPEC_BYTES`` later,
with a message that names the field; this bound only stops absurd bodies)."""
Choices = Annotated[list[Spec], Field(max_length=MAX_CHOICES)]


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema (``strict`` is always honoured)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[StrictStr, Field(max_length=256)]
    description: Spec | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its members."""

    model_config = ConfigDict(extra="forbid")

    json_spec: dict[str, Any] | Spec | None = Field(None, alias="json")
    regex: Spec | None = None
    choice: Choices | None = None
    grammar: Spec | None = None
    json_object: StrictBool | None = None


class StructuredFields(BaseModel):
    """The request fields that ask for a structured output (mixed into ``SamplingFields``)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | Spec | None = None
    guided_regex: Spec | None = None
    guided_choice: Choices | None = None
    guided_grammar: Spec | None = None


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def _forms(request: StructuredFields) -> list[tuple[str, StructuredOutput]]:
    """Each (client's field name, structured output) the request sets."""
    forms: list[tuple[str, StructuredOutput]] = []
    rf = request.response_format
    if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
        raise InvalidRequestError("response_format.json_schema", f"is only read with type json_schema, not {rf.type}: "
                                  "set type json_schema, or leave json_schema out")
    if rf is not None and rf.type == "json_object":
        forms.append(("response_format", StructuredOutput(StructureKind.JSON_OBJECT)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise InvalidRequestError("response_format.json_schema.schema", "is required for type json_schema")
        forms.append(("response_format.json_schema.schema",
                      StructuredOutput(StructureKind.JSON, _schema_text(rf.json_schema.json_schema))))
    so = request.structured_outputs
    if so is not None:
        members = [(name, value) for name, value in (("json", so.json_spec), ("regex", so.regex),
                   ("choice", so.choice), ("grammar", so.grammar), ("json_object", so.json_object or None))
                   if value is not None]
        if len(members) != 1:
            raise InvalidRequestError("structured_outputs", f"must set exactly one of json, regex, choice, grammar, "
                                      f"json_object; got {[name for name, _ in members] or 'none'}")
        forms.append(_member(f"structured_outputs.{members[0][0]}", members[0][0], members[0][1]))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{name}")
        if value is not None:
            forms.append(_member(f"guided_{name}", name, value))
    return forms


def _member(field: str, kind_name: str, value: Any) -> tuple[str, StructuredOutput]:
    kind = StructureKind(kind_name)
    if kind is StructureKind.JSON:
        value = _schema_text(value)
    return field, StructuredOutput.of(kind, tuple(value) if isinstance(value, list) else value)


def structured_output_of(request: StructuredFields) -> tuple[StructuredOutput | None, str]:
    """The request's structured output (``None``: free text) and the field that asked for it.

    Raises:
        InvalidRequestError: two forms in one request, or a form that is incomplete.
    """
    forms = _forms(request)
    if len(forms) > 1:
        raise InvalidRequestError(forms[1][0], f"only one structured-output form per request; {forms[0][0]} "
                                  "is set too")
    return forms[0][1] if forms else None, forms[0][0] if forms else ""


def renamed_structure_error(error: InvalidRequestError, field: str) -> InvalidRequestError:
    """A spec error of ``SamplingParams`` (``structured_output.<kind>``) named as the client's ``field``."""
    return error.renamed(field) if error.field_name.startswith("structured_output") else error
