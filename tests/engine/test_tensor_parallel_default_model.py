"""The default model (SmolLM2-135M: 9 query heads, 3 KV heads, 30 layers) over TP = 3 ranks, each
with 3 query heads and 1 KV head, or over PP = 2 stages: the same greedy tokens as one rank, free and
constrained by a JSON schema or a regex in the same batch (only the rank that samples holds grammar
matchers; about 15 s each on two cores)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.llm import LLM
from tests.engine.conftest import BASE_PROMPTS
from tests.engine.test_structured_outputs import PERSON, REGEXES

pytestmark = pytest.mark.model
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPTS = BASE_PROMPTS[:8]
STRUCTURES = (StructuredOutput(StructureKind.JSON, json.dumps(PERSON)),
              StructuredOutput(StructureKind.REGEX, REGEXES["date"]))
"""The last prompts are constrained: free and structured rows in one batch."""


def _params() -> list[SamplingParams]:
    structured = [SamplingParams(max_tokens=24, temperature=0.0, structured_output=s) for s in STRUCTURES]
    return [GREEDY] * (len(PROMPTS) - len(structured)) + structured


def _greedy(llm: LLM) -> list[list[int]]:
    """Greedy ids of PROMPTS; checks that the constrained rows match their specs."""
    results = llm.generate(PROMPTS, _params())
    jsonschema.validate(json.loads(results[-2].text), PERSON)
    assert re.fullmatch(REGEXES["date"], results[-1].text), results[-1].text
    return [list(r.token_ids) for r in results]


def test_tp3_greedy_equals_one_rank(default_model, default_llm):
    single = _greedy(default_llm)
    with LLM(default_model, kv_cache_memory="64MiB", tensor_parallel_size=3) as llm:
        assert _greedy(llm) == single


def test_pp2_with_two_virtual_engines_greedy_equals_one_rank(default_model, default_llm):
    """PP = 2 (15 layers per stage; the tied embedding on both ends) with two virtual engines."""
    single = _greedy(default_llm)
    with LLM(default_model, kv_cache_memory="64MiB", pipeline_parallel_size=2) as llm:
        assert [w.worker_id for w in llm.stats().workers] == ["worker-0/ve0", "worker-0/ve1"]
        assert _greedy(llm) == single
