"""Structured outputs in the engine on the real model: each kind of spec gives output that matches it,
greedy constrained outputs are the same alone, in a batch with free requests and under recompute
preemption, and free rows beside constrained ones are unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.llm import LLM
from pagedserve.text.tokenizer import ChatTurn
from tests.engine.conftest import BASE_PROMPTS
from tests.engine.test_greedy_matches_hf import BLOCK_BYTES

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
REGEXES = {"date": "[0-9]{4}-[0-9]{2}-[0-9]{2}", "email": "[a-z]{1,10}@[a-z]{1,10}\\.(com|org)",
           "ipv4": f"({OCTET}\\.){{3}}{OCTET}"}
ARITHMETIC = """root ::= expr
expr ::= term (op term)?
term ::= num | "(" num op num ")"
op ::= "+" | "-" | "*"
num ::= [0-9] | [1-9] [0-9]
"""


def ask(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([ChatTurn("user", text)])


def greedy(structure: StructuredOutput | None, max_tokens: int = 60) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_output=structure)


def test_json_schema_output_validates(default_llm, tokenizer):
    spec = StructuredOutput(StructureKind.JSON, json.dumps(PERSON))
    out = default_llm.generate(ask(tokenizer, "Describe a person as JSON."), greedy(spec, 80))[0]
    assert out.finish_reason.name == "STOP", out.text
    jsonschema.validate(json.loads(out.text), PERSON)


@pytest.mark.parametrize("name", REGEXES)
def test_regex_output_matches_in_full(default_llm, tokenizer, name):
    spec = StructuredOutput(StructureKind.REGEX, REGEXES[name])
    out = default_llm.generate(ask(tokenizer, f"Write an example {name}."), greedy(spec, 30))[0]
    assert out.finish_reason.name == "STOP" and re.fullmatch(REGEXES[name], out.text), out.text


def test_choice_and_grammar_outputs(default_llm, tokenizer):
    choice = StructuredOutput(StructureKind.CHOICE, choices=("Paris", "Berlin", "Rome"))
    grammar = StructuredOutput(StructureKind.GRAMMAR, ARITHMETIC)
    capital, sum_ = default_llm.generate([ask(tokenizer, "What is the capital of France?"),
                                          ask(tokenizer, "Write a small sum.")], [greedy(choice), greedy(grammar)])
    assert capital.text in choice.choices and capital.finish_reason.name == "STOP"
    assert sum_.finish_reason.name == "STOP"
    assert re.fullmatch(r"(\d+|\(\d+[-+*]\d+\))([-+*](\d+|\(\d+[-+*]\d+\)))?", sum_.text), sum_.text
    assert isinstance(eval(sum_.text, {"__builtins__": {}}), int)  # noqa: S307 (digits and operators only)


def test_constrained_greedy_is_exact_beside_free_requests_and_under_preemption(default_model, default_llm, tokenizer):
    free_prompts = [tokenizer.encode_prompt(p) for p in BASE_PROMPTS[:4]]
    constrained = ask(tokenizer, "Describe a person as JSON.")
    spec = greedy(StructuredOutput(StructureKind.JSON, json.dumps(PERSON)), 48)
    free = greedy(None, 8)
    alone = default_llm.generate(constrained, spec)[0]
    assert alone.finish_reason.name == "STOP"
    free_alone = [r.token_ids for r in default_llm.generate(free_prompts, free)]
    # a busy batch of 64: 32 constrained copies (found in the prefix cache) between 32 free rows
    hits = default_llm.stats().prefix_cache_hits
    prompts = [p for pair in zip([constrained] * 32, free_prompts * 8) for p in pair]
    batch = default_llm.generate(prompts, [spec, free] * 32)
    assert default_llm.stats().prefix_cache_hits > hits
    assert [r.token_ids for r in batch[0::2]] == [alone.token_ids] * 32
    assert [r.token_ids for r in batch[1::2]] == free_alone * 8  # rows without a structure are unchanged
    blocks = -(-(len(constrained) + len(alone.token_ids)) // 16) + 2  # room for one sequence and a bit
    small = LLM(default_model, kv_cache_memory=blocks * BLOCK_BYTES, preemption_mode="recompute",
                enable_prefix_caching=False, admission_headroom=0.0)  # both admitted: one is preempted
    preempted = small.generate([constrained, constrained], spec)
    assert small.stats().num_preemptions > 0
    assert [r.token_ids for r in preempted] == [alone.token_ids] * 2


def test_constrained_greedy_is_exact_under_swap_preemption(default_model, default_llm, tokenizer):
    """Swapped out and back in, a sequence's matcher is rebuilt by replaying its tokens (issue #22 item 3)."""
    constrained = ask(tokenizer, "Describe a person as JSON.")
    spec = greedy(StructuredOutput(StructureKind.JSON, json.dumps(PERSON)), 48)
    alone = default_llm.generate(constrained, spec)[0]
    blocks = -(-(len(constrained) + len(alone.token_ids)) // 16) + 2
    small = LLM(default_model, kv_cache_memory=blocks * BLOCK_BYTES, swap_space=64 * BLOCK_BYTES,
                preemption_mode="swap", enable_prefix_caching=False, admission_headroom=0.0)
    swapped = small.generate([constrained, constrained, constrained], spec)
    assert small.stats().num_swap_preemptions > 0
    assert [r.token_ids for r in swapped] == [alone.token_ids] * 3


@pytest.mark.parametrize("n, best_of", [(3, None), (1, 3)], ids=["n=3", "best_of=3"])
def test_each_seeded_sample_has_its_own_matcher(default_llm, tokenizer, n, best_of):
    """n > 1 and best_of: every sample validates, the samples differ (each advanced its own matcher),
    and the seed repeats them."""
    spec = StructuredOutput(StructureKind.JSON, json.dumps(PERSON))
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=11, n=n, best_of=best_of, structured_output=spec)
    prompt = ask(tokenizer, "Describe a person as JSON.")
    result = default_llm.generate(prompt, params)[0]
    assert len(result.samples) == n
    for sample in result.samples:
        assert sample.finish_reason.name == "STOP", sample.text
        jsonschema.validate(json.loads(sample.text), PERSON)
    if n > 1:
        assert len({s.token_ids for s in result.samples}) == n
    assert [s.token_ids for s in default_llm.generate(prompt, params)[0].samples] == \
        [s.token_ids for s in result.samples]
