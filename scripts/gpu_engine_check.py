"""The engine on a GPU against transformers on the same GPU: greedy tokens, alone and in a busy batch.

No model hub is reachable from a lent GPU machine and the default model (a GGUF file) is too large to
carry, so this builds a random-weight model of a given shape (a ``config.json``) with the default
model's tokenizer. Its weights are drawn wide (embeddings N(0, 1), matrices N(0, 0.15/sqrt(width/64)),
norms 1 + N(0, 0.2)) so that greedy choices are rarely near-ties; each divergence is reported with the
reference's top-2 logit gap at that position, so a tie can be told from a bug.

Usage (on the GPU machine):
  python scripts/gpu_engine_check.py make-model --config CONFIG.json --tokenizer DIR --out DIR
  python scripts/gpu_engine_check.py greedy --model DIR [--dtype float32] [--num-prompts 24]
Exit status: 0 every sequence equal, 1 a divergence with a top-2 gap over 1e-3 (float32), 2 no CUDA.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch

# Shapes other than the config's own: overrides of its fields (the default model's vocabulary kept).
SHAPES = {
    "config": {},
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64),  # Llama-3.2-1B's
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def make_model(config_path: Path, tokenizer_dir: Path, out: Path, device: str, shape: str = "config",
               seed: int = 0) -> Path:
    """Writes a random-weight Hugging Face folder of ``config_path``'s shape (float32 safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.from_pretrained(config_path.parent if config_path.name == "config.json" else config_path,
                                        **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    scale = 0.15 / (config.hidden_size / 64) ** 0.5
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 1.0 if "embed" in name else scale)
            else:
                param.normal_(0.0, scale)
    model.generation_config.eos_token_id = None
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists() and name != "generation_config.json":
            shutil.copy(tokenizer_dir / name, out / name)
    return out


def hf_greedy(model, prompt: list[int], num_tokens: int, device: str) -> tuple[list[int], list[float]]:
    """transformers greedy ``generate`` of ``num_tokens`` tokens, alone (no padding), and at each step
    the gap between the top two logits."""
    ids = torch.tensor([prompt], device=device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                             min_new_tokens=num_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_scores=True, return_dict_in_generate=True)
    gaps = [float(s[0].float().topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


def greedy(model_dir: Path, dtype: str, num_prompts: int, num_tokens: int, seed: int, device: str) -> int:
    from transformers import AutoModelForCausalLM

    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    rng = random.Random(seed)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.choice((1, 7, 16, 33, 120, 300, 700)))]
               for _ in range(num_prompts)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    t0 = time.perf_counter()
    reference = [hf_greedy(hf, p, num_tokens, device) for p in prompts]
    print(f"transformers, {num_prompts} prompts alone: {time.perf_counter() - t0:.1f} s")
    del hf
    if device == "cuda":
        torch.cuda.empty_cache()
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    with LLM(model_dir, device=device, dtype=dtype, kv_cache_memory="4GiB", max_num_batched_tokens=512) as llm:
        t0 = time.perf_counter()
        batched = [o.token_ids for o in llm.generate(prompts, params)]
        print(f"pagedserve, {num_prompts} prompts at once (chunked prefill, 512-token budget): "
              f"{time.perf_counter() - t0:.1f} s")
        alone = [llm.generate(prompts[i], params)[0].token_ids for i in range(min(4, num_prompts))]
    return report(prompts, reference, {"batched": batched, "alone": alone}, dtype)


def report(prompts, reference, runs: dict[str, list], dtype: str) -> int:
    worst = 0
    for mode, outputs in runs.items():
        equal = 0
        for i, ours in enumerate(outputs):
            ref, gaps = reference[i]
            if list(ours) == ref:
                equal += 1
                continue
            at = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
            gap = gaps[at] if at < len(gaps) else float("nan")
            print(f"  {mode} prompt {i} ({len(prompts[i])} tokens): diverges at output {at}: ours "
                  f"{list(ours)[at:at + 3]} ref {ref[at:at + 3]}, reference top-2 gap {gap:.2e}")
            if dtype == "float32" and not gap < 1e-3:
                worst = 1
        print(f"{mode}: {equal}/{len(outputs)} sequences equal to transformers ({dtype})")
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("--config", type=Path, required=True)
    m.add_argument("--tokenizer", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--shape", default="config", choices=sorted(SHAPES), help="the config's shape, or another's")
    g = sub.add_parser("greedy")
    g.add_argument("--model", type=Path, required=True)
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--num-prompts", type=int, default=24)
    g.add_argument("--num-tokens", type=int, default=32)
    g.add_argument("--seed", type=int, default=0)
    for q in (m, g):
        q.add_argument("--device", default="cuda", help="cuda, or cpu to try the script itself")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    if args.command == "make-model":
        print(make_model(args.config, args.tokenizer, args.out, args.device, args.shape))
        return 0
    return greedy(args.model, args.dtype, args.num_prompts, args.num_tokens, args.seed, args.device)


if __name__ == "__main__":
    sys.exit(main())
