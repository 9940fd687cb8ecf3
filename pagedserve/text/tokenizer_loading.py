"""Loading a model folder's Hugging Face tokenizer: the transformers class that reads it (the plain
``tokenizer.json`` one, without torch, where the folder allows), and the ``PromptTokenizer`` built on
it, kept once per process for a folder whose small files are unchanged.
"""

from __future__ import annotations

import json

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from pagedserve.engine.model_info import ModelInfo, load_model_info
from pagedserve.text.request_limits import RequestLimits

T = TypeVar("T")

PLAIN_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""``tokenizer_class`` values of a folder whose tokenizer is its ``tokenizer.json`` as it stands."""


def tokenizer_loader(folder: Path) -> Any:
    """The transformers class that loads ``folder``'s tokenizer: ``TokenizersBackend`` when its
    ``tokenizer_config.json`` names a plain ``tokenizer.json`` tokenizer (what AutoTokenizer would
    pick, without importing the model configuration code and torch: about 1 s of CPU instead of
    4 s in every gateway start), else ``AutoTokenizer``."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and config.get("tokenizer_class") in PLAIN_TOKENIZER_CLASSES \
            and (folder / "tokenizer.json").is_file():
        from transformers import TokenizersBackend  # heavy imports, kept off module import

        return TokenizersBackend
    from transformers import AutoTokenizer

    return AutoTokenizer


def file_stamps(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, mtime ns, size) of the folder's files a tokenizer or model facts are read from."""
    files = sorted(p for p in folder.iterdir() if p.suffix in {".json", ".jinja", ".txt", ".model"}) \
        if folder.is_dir() else []
    return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)


@lru_cache(maxsize=8)  # a few folders a process (tests make many tiny models: the oldest are let go)
def load_prompt_tokenizer(cls: Callable[[Any, ModelInfo, RequestLimits], T], folder: Path, limits: RequestLimits,
                          stamps: tuple[tuple[str, int, int], ...]) -> T:
    """:meth:`PromptTokenizer.from_folder`'s load: ``cls`` (``PromptTokenizer``) built on the folder's
    tokenizer and model facts, memoized by class, folder, limits and file stamps (``file_stamps``; a
    failed load raises and is not kept)."""
    info = load_model_info(folder)
    tokenizer = tokenizer_loader(folder).from_pretrained(str(folder), local_files_only=True)
    return cls(tokenizer, info, limits)
