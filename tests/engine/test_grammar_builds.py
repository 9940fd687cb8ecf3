"""Grammar builds on the real model: they run on the compile thread before the request is
admitted (never in a step), and a grammar that fails (at its build, or at a parser limit while
decoding) ends its request with INVALID_ARGUMENT and a message saying why, while the other
requests of the batch run as if it had not been there."""

from __future__ import annotations

import json
import threading

import pytest

from pagedserve.engine.grammar_matchers import GrammarCompiler, llguidance_tokenizer
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import GrammarError, StructuredOutput, StructureKind
from pagedserve.llm import LLM
from pagedserve.text.tokenizer import ChatTurn

pytestmark = pytest.mark.model

UNKNOWN_TOKEN = StructuredOutput(StructureKind.GRAMMAR, "start: <|no_such_token|>")
"""Passes the gateway's check (no vocabulary there), fails to build against the model's vocabulary."""
WIDE = {"type": "object", "properties": {f"key_{i}": {"type": "integer"} for i in range(600)},
        "additionalProperties": False}
"""600 optional properties: builds, then exceeds llguidance's 2,000 parser items in a row at its first key."""


def params(structure: StructuredOutput | None, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=structure is None,
                          structured_output=structure)


def run(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str | None]]:
    """Each request's token ids and error, all in one batch."""
    ids = [llm.add_request(prompt, p) for prompt, p in requests]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    errors: dict[str, str | None] = dict.fromkeys(ids)
    while llm.has_unfinished_requests():
        for delta in llm.step():
            tokens[delta.request_id] += delta.delta.token_ids
            errors[delta.request_id] = errors[delta.request_id] or delta.error
    return {i: (tokens[i], errors[i]) for i in ids}


@pytest.fixture
def build_threads(monkeypatch) -> list[str]:
    """The name of the thread each grammar build of the test ran on."""
    threads: list[str] = []
    build = GrammarCompiler._new_pristine

    def recorded(self, structure):
        threads.append(threading.current_thread().name)
        return build(self, structure)

    monkeypatch.setattr(GrammarCompiler, "_new_pristine", recorded)
    return threads


def ask(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([ChatTurn("user", text)])


def test_grammars_build_on_the_compile_thread_before_their_request_runs(default_llm, tokenizer, build_threads):
    schemas = [{"type": "object", "properties": {f"field_{i}_{k}": {"type": "string"} for k in range(5)},
                "required": [f"field_{i}_0"]} for i in range(4)]
    requests = [(ask(tokenizer, "Give me JSON."), params(StructuredOutput(StructureKind.JSON, json.dumps(s)), 20))
                for s in schemas]
    results = run(default_llm, requests + [(ask(tokenizer, "Hello"), params(None))])
    assert all(error is None for _, error in results.values())
    assert len(build_threads) == 4 and set(build_threads) == {"grammar-compile_0"}


def test_a_grammar_that_does_not_build_ends_with_an_error_and_spares_the_batch(default_llm, tokenizer):
    free = (ask(tokenizer, "Name three colors."), params(None))
    alone = list(run(default_llm, [free]).values())[0]
    results = list(run(default_llm, [free, (ask(tokenizer, "Say it."), params(UNKNOWN_TOKEN))]).values())
    assert results[0] == alone
    tokens, error = results[1]
    assert tokens == [] and "unknown special token" in error and "<|no_such_token|>" in error


def test_a_grammar_past_the_parser_limit_ends_with_an_error_not_a_silent_stop(default_llm, tokenizer):
    free = (ask(tokenizer, "Count to five."), params(None))
    alone = list(run(default_llm, [free]).values())[0]
    wide = params(StructuredOutput(StructureKind.JSON, json.dumps(WIDE)), 30)
    results = list(run(default_llm, [free, (ask(tokenizer, "Fill the form as JSON."), wide)]).values())
    assert results[0] == alone
    tokens, error = results[1]
    assert error is not None and "max is 2000" in error, (tokens, error)
    assert 0 < len(tokens) < 30


def test_the_vocabulary_is_built_once_per_process_for_a_tokenizer(default_model):
    """llguidance's read-only view of the vocabulary (~0.5 CPU-s to build) is shared by every compiler
    of the same tokenizer, vocabulary width and EOS ids in the process; other arguments get their own."""
    path = str(default_model / "tokenizer.json")
    first = GrammarCompiler(path, 49152, [2])._llg_tokenizer()
    assert GrammarCompiler(path, 49152, [2])._llg_tokenizer() is first
    assert llguidance_tokenizer(path, 49152, (2,)) is first
    assert llguidance_tokenizer(path, 49160, (2,)) is not first


def test_grammars_that_fail_at_once_never_deadlock_the_compiler(default_model):
    """A build that failed before :meth:`GrammarCompiler.prepare` let go of its lock once ran the
    build's clean-up in the preparing thread, which took the lock again and hung for ever (a fresh
    compiler's first failing grammar hung within 4 tries). 100 such prepares each end with the error."""
    path = str(default_model / "tokenizer.json")
    errors: list[str] = []

    def prepare_failing_grammars() -> None:
        for i in range(100):
            build = GrammarCompiler(path, 49152, [2]).prepare(
                StructuredOutput(StructureKind.GRAMMAR, f"start: <|no_such_token_{i}|>"))
            errors.append(str(build.exception(timeout=30)))

    thread = threading.Thread(target=prepare_failing_grammars, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"the compiler hung after {len(errors)} failing grammars"
    assert len(errors) == 100 and all("does not build" in e for e in errors), errors[:3]


def test_a_grammar_that_did_not_build_is_not_compiled_again(default_model, monkeypatch):
    """A client sending a spec that fails over and over costs one compile: the second prepare is done at once
    with the same error, and so is a matcher asked for it."""
    compiler = GrammarCompiler(str(default_model / "tokenizer.json"), 49152, [2])
    builds, build = [], compiler._new_pristine
    monkeypatch.setattr(compiler, "_new_pristine", lambda structure: builds.append(structure) or build(structure))
    first = compiler.prepare(UNKNOWN_TOKEN).exception(timeout=30)
    again = compiler.prepare(UNKNOWN_TOKEN)
    assert again.done() and isinstance(again.exception(), GrammarError) and str(again.exception()) == str(first)
    with pytest.raises(GrammarError, match="does not build"):
        compiler.matcher(UNKNOWN_TOKEN)
    assert len(builds) == 1
