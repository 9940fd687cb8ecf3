"""`bench structured-outputs --vllm-python`: the same requests through vLLM CPU's offline
``LLM.generate`` (``vllm_driver.py`` under that Python), free and with the same JSON schema through
vLLM's ``StructuredOutputsParams(json=...)``, in the same order of passes as pagedserve's; and
whether each system's constrained outputs parse as the schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pagedserve.engine.structured_output import JSON_OPTIONS


VLLM_BACKENDS = ("xgrammar", "guidance")
"""vLLM's structured-output backends that take ``disable_any_whitespace`` (``xgrammar`` is the one
its ``auto`` picks for the bench's schemas; ``guidance`` is llguidance, as pagedserve's)."""


def vllm_structured_config(backend: str) -> dict:
    """vLLM's ``StructuredOutputsConfig`` fields: ``backend`` (one of ``VLLM_BACKENDS``) and JSON
    without free whitespace, ``,`` and ``:`` as separators, as pagedserve's grammar (``JSON_OPTIONS``).
    vLLM 0.32 reads ``disable_any_whitespace`` only here, for the whole engine."""
    return {"backend": backend, "disable_any_whitespace": not JSON_OPTIONS["whitespace_flexible"]}


def schema_validity(tokenizer, outputs: Sequence[Sequence[int]], schema: dict,
                    eos_token_ids: Sequence[int]) -> dict:
    """How many constrained outputs are documents of ``schema``, or the start of one.

    An output ends at its first EOS token (EOS is ignored, so the request goes on past it);
    one with no EOS was cut off by its output length, maybe before the document closed.

    Args:
        tokenizer: the model's (fast) Hugging Face tokenizer.
        outputs: generated token ids per request.

    Returns:
        ``requests``; ``on_schema``: outputs whose tokens before the EOS (all of them when cut off)
        llguidance's matcher of ``schema`` accepts, with free whitespace so that no system's
        separators count against it; ``ended``: outputs with an EOS; ``valid``: ended outputs whose
        text is JSON that validates against ``schema`` (the ``jsonschema`` package);
        ``examples``: the first 2 outputs as text; ``invalid``: up to 3 ended outputs that are not
        valid, as text.
    """
    import jsonschema
    import llguidance
    import llguidance.hf

    validator = jsonschema.Draft202012Validator(schema)
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": True})
    eos = set(eos_token_ids)
    on_schema = ended = valid = 0
    texts, invalid = [], []
    for ids in outputs:
        end = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
        on_schema += all(matcher.consume_token(t) for t in ids[:end])
        texts.append(tokenizer.decode(ids[:end]))
        if end == len(ids):
            continue
        ended += 1
        try:
            ok = validator.is_valid(json.loads(texts[-1]))
        except json.JSONDecodeError:
            ok = False
        valid += ok
        if not ok and len(invalid) < 3:
            invalid.append(texts[-1])
    return {"requests": len(outputs), "on_schema": on_schema, "ended": ended, "valid": valid,
            "examples": texts[:2], "invalid": invalid}


def validity_cell(validity: dict) -> str:
    """``valid/ended on_schema/requests``, for the table."""
    return f"{validity['valid']}/{validity['ended']} {validity['on_schema']}/{validity['requests']}"
