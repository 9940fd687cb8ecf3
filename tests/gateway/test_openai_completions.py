"""Completions prompts with a tokenizer that adds a BOS (no model, no processes)."""

from __future__ import annotations

import pytest

from pagedserve.services.gateway.openai_completions import parse_completion
from pagedserve.services.gateway.openai_protocol import CompletionRequest


@pytest.fixture(scope="module")
def bos_tokenizer(sp_tokenizer, prompt_tokenizer):
    """The SentencePiece-style tokenizer adding ``<s>`` (id 1) before every text, as Llama's does."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from pagedserve.text.tokenizer import PromptTokenizer

    tok = Tokenizer.from_str(sp_tokenizer.backend_tokenizer.to_str())  # a copy: the fixture is shared
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    return PromptTokenizer(hf, prompt_tokenizer.info)


def test_add_special_tokens_false_leaves_out_the_bos(bos_tokenizer):
    with_bos = parse_completion(CompletionRequest(model="m", prompt="Hello world"), bos_tokenizer)[0]
    without = parse_completion(CompletionRequest(model="m", prompt="Hello world", add_special_tokens=False),
                               bos_tokenizer)[0]
    assert with_bos.prompt_token_ids[0] == 1
    assert with_bos.prompt_token_ids[1:] == without.prompt_token_ids and 1 not in without.prompt_token_ids
