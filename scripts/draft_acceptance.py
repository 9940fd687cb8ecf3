"""Issue #23: how many of a sampled request's drafts speculative decoding keeps with a draft model,
printed as accepted / drafted and the mean accepted length (vLLM's ``spec_decode`` counters).

    python scripts/draft_acceptance.py --dataset-path ShareGPT.json [--draft FOLDER] [--num-prompts 8]

Each of ``--num-prompts`` ShareGPT first turns (cut to 1,500 characters) is sampled at
``--temperature`` / ``--top-p`` with its own seed, ``--output-len`` tokens, EOS ignored: one request
at a time, then all as one batch. The default draft is the target itself, the upper bound of what a
draft can agree with (every sampled draft is kept only when the draft's ``q`` is processed exactly
as the target's ``p``). A measurement, not a test; to compare with another revision, run this file
with ``PYTHONPATH`` at that revision's checkout.
"""

from __future__ import annotations

import argparse
import json
import time

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.llm import LLM
from pagedserve.model_files import resolve_model
from pagedserve.text.tokenizer import PromptTokenizer


def first_turns(path: str, count: int) -> list[str]:
    """The first ``count`` conversations' first turns of over 40 characters, cut to 1,500."""
    texts = []
    for conversation in json.load(open(path)):
        turns = conversation.get("conversations") or []
        if turns and len(turns[0].get("value", "")) > 40:
            texts.append(turns[0]["value"][:1500])
        if len(texts) == count:
            break
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset-path", required=True, help="ShareGPT JSON (conversations of turns)")
    parser.add_argument("--draft", help="draft model folder (default: the target itself)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    args = parser.parse_args()
    model = resolve_model(None)
    tokenizer = PromptTokenizer.from_folder(model)
    prompts = [tokenizer.encode_prompt(t) for t in first_turns(args.dataset_path, args.num_prompts)]
    llm = LLM(model, kv_cache_memory="256MiB", speculative_config={
        "method": "draft_model", "model": str(args.draft or model),
        "num_speculative_tokens": args.num_speculative_tokens})
    for label, batches in (("one at a time", [[p] for p in prompts]), (f"batch of {len(prompts)}", [prompts])):
        before, start, seed = llm.stats().spec_decode, time.perf_counter(), 100
        for batch in batches:
            params = []
            for _ in batch:
                params.append(SamplingParams(max_tokens=args.output_len, temperature=args.temperature,
                                             top_p=args.top_p, seed=seed, ignore_eos=True))
                seed += 1
            llm.generate(batch, params)
        after = llm.stats().spec_decode
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        steps = after.num_drafts - before.num_drafts
        print(f"{label}: {accepted} of {drafted} drafts accepted ({accepted / max(drafted, 1):.1%}), mean "
              f"accepted length {1 + accepted / max(steps, 1):.2f}, {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
