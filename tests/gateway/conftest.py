"""Fixtures: the default model's real tokenizer, recorded real outputs, a SentencePiece-style tokenizer,
a real redis-server per test module.

``model_outputs.json`` holds token ids the default model generated (see its ``about`` field), so the
tests use real model output without running the model.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest

import redis

from pagedserve.model_files import prepare_default_model
from pagedserve.text.tokenizer import PromptTokenizer
from tests.e2e.processes import start_redis

OUTPUTS_FILE = Path(__file__).with_name("model_outputs.json")


@pytest.fixture(scope="session")
def model_path() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def prompt_tokenizer(model_path: Path) -> PromptTokenizer:
    return PromptTokenizer.from_folder(model_path)


@pytest.fixture(scope="session")
def hf_tokenizer(prompt_tokenizer: PromptTokenizer):
    return prompt_tokenizer.hf_tokenizer


@pytest.fixture(scope="session")
def model_outputs() -> list[dict]:
    return json.loads(OUTPUTS_FILE.read_text())["requests"]


def build_sentencepiece_tokenizer():
    """A small Llama-2-style tokenizer: Unigram pieces with ``▁`` for spaces, byte fallback, and a
    decoder that strips the first space of a decoded text; built in memory, no files."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁the", "▁Hello", "▁world", "▁a", "ing", "▁is", "é"]
    chars = ["▁", *string.ascii_letters, *string.digits, *".,!?'"]
    vocab = [(p, 0.0) for p in special + byte_pieces]
    vocab += [(p, -6.0) for p in chars] + [(p, -1.0 / len(p)) for p in words]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="session")
def sp_tokenizer():
    return build_sentencepiece_tokenizer()


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory) -> str:
    """A redis-server of the test module's own, on a free loopback port."""
    process, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    process.stop()


@pytest.fixture
def client(redis_url) -> redis.Redis:
    """A client of ``redis_url``, whose database is emptied first."""
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    yield client
    client.close()
