"""`bench structured-outputs --vllm-python`: the same requests through vLLM CPU's offline
``LLM.generate`` (``vllm_driver.py`` under that Python), free and with the same JSON schema through
vLLM's ``StructuredOutputsParams(json=...)``, in the same order of passes as pagedserve's; and
whether each system's constrained outputs parse as the schema.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pagedserve.engine.structured_output import JSON_OPTIONS


def vllm_structure(schema: dict) -> dict:
    """vLLM's ``StructuredOutputsParams`` fields for ``schema``: compact JSON, no free whitespace,
    as pagedserve's grammar (``JSON_OPTIONS``)."""
    return {"json": schema, "disable_any_whitespace": not JSON_OPTIONS["whitespace_flexible"]}


def schema_validity(tokenizer, outputs: Sequence[Sequence[int]], schema: dict,
                    eos_token_ids: Sequence[int]) -> dict:
    """How many constrained outputs are documents of ``schema``.

    An output ends at its first EOS token (EOS is ignored, so the request goes on past it);
    one with no EOS was cut off by its output length before the document closed.

    Returns:
        ``requests``; ``ended``: outputs with an EOS; ``valid``: ended outputs whose text before the
        EOS is JSON that validates against ``schema`` (the ``jsonschema`` package); ``invalid``:
        up to 3 ended outputs that are not, as text.
    """
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    eos = set(eos_token_ids)
    ended = valid = 0
    invalid: list[str] = []
    for ids in outputs:
        end = next((i for i, t in enumerate(ids) if t in eos), None)
        if end is None:
            continue
        ended += 1
        text = tokenizer.decode(ids[:end])
        try:
            ok = validator.is_valid(json.loads(text))
        except json.JSONDecodeError:
            ok = False
        valid += ok
        if not ok and len(invalid) < 3:
            invalid.append(text)
    return {"requests": len(outputs), "ended": ended, "valid": valid, "invalid": invalid}


def validity_cell(validity: dict) -> str:
    """``valid/ended/requests``, for the table."""
    return f"{validity['valid']}/{validity['ended']}/{validity['requests']}"
