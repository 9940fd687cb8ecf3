"""The vLLM driver's job format (requests, passes free or constrained, the backend) through
``run_vllm``, against a stand-in ``vllm`` package that records what the driver asked of it: CI has
no vLLM. The stand-in answers each request with its prompt's first ``max_tokens`` ids."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from pagedserve.bench.peer_systems import PeerError, run_vllm
from pagedserve.bench.structured_vllm import schema_validity, validity_cell, vllm_structured_config

STAND_IN = '''
import json, os
__version__ = "0.0-stand-in"
LOG = os.environ["STAND_IN_LOG"]

def _log(entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\\n")

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos, structured_outputs=None):
        self.temperature, self.max_tokens, self.ignore_eos = temperature, max_tokens, ignore_eos
        self.structured_outputs = structured_outputs

class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]

class LLM:
    def __init__(self, **kwargs):
        self.backend = kwargs["structured_outputs_config"].get("backend", "auto")
        _log({"llm": kwargs})

    def generate(self, prompts, params, use_tqdm):
        params = params if isinstance(params, list) else [params] * len(prompts)
        for p in params:
            if p.structured_outputs is not None:
                p.structured_outputs._backend = "stand-in-" + self.backend
        _log({"generate": [{"prompt": pr["prompt_token_ids"], "temperature": p.temperature,
                            "max_tokens": p.max_tokens, "ignore_eos": p.ignore_eos,
                            "structured": p.structured_outputs and p.structured_outputs.fields}
                           for pr, p in zip(prompts, params)]})
        return [_Output(pr["prompt_token_ids"][:p.max_tokens]) for pr, p in zip(prompts, params)]
'''
SAMPLING = '''
class StructuredOutputsParams:
    def __init__(self, **fields):
        self.fields = fields
        self._backend = None
'''


@pytest.fixture
def stand_in_python(tmp_path, monkeypatch):
    """A Python that imports the stand-in ``vllm`` (run_vllm runs the driver isolated, ``-I``, so the
    package goes in through a wrapper script that puts it on ``sys.path``); returns it and its log."""
    package = tmp_path / "site" / "vllm"
    (package / "inputs").mkdir(parents=True)
    (package / "__init__.py").write_text(STAND_IN)
    (package / "sampling_params.py").write_text(SAMPLING)
    (package / "inputs" / "__init__.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                                    "    return {'prompt_token_ids': prompt_token_ids}\n")
    python = tmp_path / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        exec {sys.executable} -c 'import runpy, sys; sys.path.insert(0, "{tmp_path / "site"}"); \\
        sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name="__main__")' "$@"
        """))
    python.chmod(0o755)
    log = tmp_path / "log.jsonl"
    monkeypatch.setenv("STAND_IN_LOG", str(log))
    return str(python), log


SPEC = {"model": "/m", "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 2048,
        "kv_cache_gib": 1, "warmup_token_ids": [7, 8, 9], "warmup_tokens": 2}
PROMPTS = [[10, 11, 12, 13], [20, 21, 22]]


def test_free_and_constrained_passes_in_order(stand_in_python):
    python, log = stand_in_python
    structure = {"json": {"type": "object"}}
    config = vllm_structured_config("guidance")
    assert config == {"backend": "guidance", "disable_any_whitespace": True}  # compact JSON, as pagedserve's
    runs = run_vllm(python, SPEC | {"structured_outputs_config": config}, PROMPTS, [3, 2],
                    [("free", None), ("json", structure), ("json", structure), ("free", None)])
    assert [r.run.system for r in runs] == ["free", "json", "json", "free"]
    assert all(r.outputs == [[10, 11, 12], [20, 21]] for r in runs)
    assert all(r.run.output_tokens == 5 and r.run.prompt_tokens == 7 for r in runs)
    assert runs[0].info == {"vllm_version": "0.0-stand-in", "kv_cache_gib": 1,
                            "structured_outputs_backend": "stand-in-guidance"}
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries[0]["llm"]["structured_outputs_config"] == config
    calls = [e["generate"] for e in entries[1:]]
    # one warm-up per distinct structure (free first), then the four timed passes
    assert [[c["prompt"] for c in call] for call in calls[:2]] == [[[7, 8, 9]], [[7, 8, 9]]]
    assert [call[0]["structured"] for call in calls] == [None, structure, None, structure, structure, None]
    for call in calls[2:]:
        assert [c["max_tokens"] for c in call] == [3, 2]
        assert all(c["temperature"] == 0 and c["ignore_eos"] for c in call)


def test_one_free_pass_by_default(stand_in_python):
    python, log = stand_in_python
    [run] = run_vllm(python, SPEC, PROMPTS, [1, 1])
    assert run.run.system == "vllm" and run.outputs == [[10], [20]]
    assert run.info["structured_outputs_backend"] is None
    assert json.loads(log.read_text().splitlines()[0])["llm"]["structured_outputs_config"] == {}


def test_a_failing_driver_is_a_peer_error(stand_in_python, monkeypatch):
    python, _ = stand_in_python
    monkeypatch.delenv("STAND_IN_LOG")  # the stand-in cannot log: the driver fails
    with pytest.raises(PeerError, match="exited with status 1"):
        run_vllm(python, SPEC, PROMPTS, [1, 1])


@pytest.mark.model
def test_schema_validity_counts_documents_before_eos(default_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model)
    eos = tokenizer.eos_token_id
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    outputs = [tokenizer.encode('{"a": 1}') + [eos, 5, 6],   # valid, then tokens past the ignored EOS
               tokenizer.encode('{"a":"x"}') + [eos],        # JSON, but not of the schema
               tokenizer.encode('{"a":') + [eos],            # not JSON, but the start of a document
               tokenizer.encode('{"a":12')]                  # cut off (no EOS), the start of a document
    validity = schema_validity(tokenizer, outputs, schema, [eos])
    assert validity == {"requests": 4, "on_schema": 3, "ended": 3, "valid": 1,
                        "examples": ['{"a": 1}', '{"a":"x"}'], "invalid": ['{"a":"x"}', '{"a":']}
    assert validity_cell(validity) == "1/3 3/4"
