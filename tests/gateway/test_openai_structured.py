"""The HTTP API's structured-output forms and their one StructuredOutput (no model, no processes)."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.sampling_params import InvalidRequestError
from pagedserve.engine.structured_output import MAX_SPEC_BYTES, StructuredOutput, StructureKind
from pagedserve.services.gateway.openai_params import sampling_params_from_openai
from pagedserve.services.gateway.openai_protocol import ChatCompletionRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], **fields)


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     StructuredOutput(StructureKind.JSON, json.dumps(SCHEMA))),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(StructureKind.JSON_OBJECT)),
    ({"response_format": {"type": "text"}}, None),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(StructureKind.JSON, json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, StructuredOutput(StructureKind.REGEX, "[0-9]{3}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(StructureKind.CHOICE, choices=("yes", "no"))),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredOutput(StructureKind.GRAMMAR, 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(StructureKind.JSON_OBJECT)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(StructureKind.JSON, json.dumps(SCHEMA))),
    ({"guided_regex": "a+"}, StructuredOutput(StructureKind.REGEX, "a+")),
    ({"guided_choice": ["x"]}, StructuredOutput(StructureKind.CHOICE, choices=("x",))),
    ({"guided_grammar": 'start: "a"'}, StructuredOutput(StructureKind.GRAMMAR, 'start: "a"')),
], ids=lambda v: next(iter(v)) if isinstance(v, dict) else "")
def test_each_form_becomes_its_structured_output(fields, expected):
    assert sampling_params_from_openai(chat(**fields)).structured_output == expected


@pytest.mark.parametrize("fields, field_name", [
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}},
     "structured_outputs.json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "no-such"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "object", "description": "x" * (MAX_SPEC_BYTES + 1)}}, "guided_json"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": SCHEMA}}}, "response_format.json_schema"),
], ids=["two-forms", "format-and-vllm", "two-members", "no-schema", "bad-regex", "bad-grammar", "no-choice",
        "invalid-schema", "unsupported-keyword", "over-64KiB", "schema-with-json-object", "schema-with-text"])
def test_a_bad_spec_is_refused_naming_the_clients_field(fields, field_name):
    with pytest.raises(InvalidRequestError) as caught:
        sampling_params_from_openai(chat(**fields))
    assert caught.value.field_name == field_name
