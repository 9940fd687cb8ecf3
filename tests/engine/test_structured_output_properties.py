"""A property of structured outputs on the real model, in one busy batch: for 52 JSON schemas drawn by
hypothesis (objects of bounded integers, strings, booleans, enums, arrays and nested objects) and 12
drawn regexes, choice lists and grammars, every one of 64 rows (half greedy, half sampled at
temperature 1 with a seed) ends by itself (finish reason ``stop``, never ``length``) with text its
spec accepts; and the greedy rows are token-identical in a batch of their own (another batch
composition, other rows' masks beside them)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.engine.messages import FinishReason
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.text.tokenizer import ChatTurn
from tests.engine.test_structured_outputs import ARITHMETIC

pytestmark = pytest.mark.model

NAMES = ("id", "name", "age", "city", "tags", "ok", "color", "size")
WORDS = st.text(alphabet="abcdefghijklmnop", min_size=1, max_size=6)
LEAVES = st.one_of(
    st.builds(lambda low, span: {"type": "integer", "minimum": low, "maximum": low + span},
              st.integers(-50, 50), st.integers(0, 500)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 10)),
    st.just({"type": "boolean"}),
    st.lists(WORDS, min_size=1, max_size=4, unique=True).map(lambda words: {"enum": words}),
)


def _objects(values: st.SearchStrategy) -> st.SearchStrategy:
    def schema(properties: dict) -> dict:
        return {"type": "object", "properties": properties, "required": sorted(properties),
                "additionalProperties": False}
    return st.dictionaries(st.sampled_from(NAMES), values, min_size=1, max_size=4).map(schema)


VALUES = st.recursive(LEAVES, lambda inner: st.one_of(
    _objects(inner), st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n},
                               inner, st.integers(1, 3))), max_leaves=6)
SCHEMAS = st.lists(_objects(VALUES), min_size=52, max_size=52)
REGEXES = st.lists(st.builds(lambda a, b, sep, tail: f"[a-z]{{1,{a}}}{sep}[0-9]{{{b}}}({tail})",
                             st.integers(1, 8), st.integers(1, 4), st.sampled_from(["-", "@", "\\.", ":"]),
                             st.lists(WORDS, min_size=1, max_size=3, unique=True).map("|".join)),
                   min_size=4, max_size=4)
CHOICES = st.lists(st.lists(WORDS, min_size=2, max_size=5, unique=True), min_size=4, max_size=4)


def _rows(schemas, regexes, choices) -> list[tuple[StructuredOutput, object]]:
    """(spec, a check of the text) per row."""
    rows = [(StructuredOutput(StructureKind.JSON, json.dumps(s)),
             lambda text, s=s: jsonschema.validate(json.loads(text), s)) for s in schemas]
    rows += [(StructuredOutput(StructureKind.REGEX, r),
              lambda text, r=r: _check(re.fullmatch(r, text), text)) for r in regexes]
    rows += [(StructuredOutput(StructureKind.CHOICE, choices=tuple(c)),
              lambda text, c=c: _check(text in c, text)) for c in choices]
    rows += [(StructuredOutput(StructureKind.GRAMMAR, ARITHMETIC),
              lambda text: _check(re.fullmatch(r"[0-9+*()\-]+", text), text))] * 4
    return rows


def _check(ok, text: str) -> None:
    assert ok, text


@settings(max_examples=1, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
@given(SCHEMAS, REGEXES, CHOICES)
def test_every_row_of_a_busy_batch_ends_with_text_its_spec_accepts(default_llm, schemas, regexes, choices):
    rows = _rows(schemas, regexes, choices)
    assert len(rows) == 64
    prompt = default_llm.tokenizer.encode_chat([ChatTurn("user", "Answer in the requested format.")])
    params = [SamplingParams(max_tokens=200, temperature=1.0 if i % 2 else 0.0, seed=i if i % 2 else None,
                             structured_output=spec) for i, (spec, _) in enumerate(rows)]
    outputs = default_llm.generate([prompt] * len(rows), params)
    for i, ((spec, check), out) in enumerate(zip(rows, outputs)):
        assert out.finish_reason is FinishReason.STOP, (i, spec, out.text)
        check(out.text)
    greedy = list(range(0, len(rows), 2))
    again = default_llm.generate([prompt] * len(greedy), [params[i] for i in greedy])
    assert [o.token_ids for o in again] == [outputs[i].token_ids for i in greedy]
