"""Issue #23: could the target's own first layers be a cheap draft model? The teacher-forced agreement of
the default model's early exits (its first N layers, then its final norm and LM head) with its full
argmax, over 96 tokens the full model generates greedily for each of 8 ShareGPT first turns (chat
template). A measurement, not a test:

    PYTHONPATH=. python scripts/early_exit_agreement.py [DATASET_JSON]
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from pagedserve.model_files import prepare_default_model
path = prepare_default_model()
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
dataset = sys.argv[1] if len(sys.argv) > 1 else "../shared/data/sharegpt/sharegpt_v3_random1000_multiturn.json"
data = json.load(open(dataset))
prompts = []
for conv in data[:40]:
    turns = conv.get("conversations") or conv.get("conversation") or []
    if turns:
        text = turns[0].get("value", "")
        if 20 < len(text) < 600:
            prompts.append(text)
prompts = prompts[:8]
agree = {n: [0, 0] for n in (6, 10, 15, 20, 25)}
with torch.no_grad():
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt")
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        out = model.generate(ids, max_new_tokens=96, do_sample=False)
        hs = model(out, output_hidden_states=True).hidden_states
        start = ids.shape[1] - 1
        full = model.lm_head(model.model.norm(hs[-1]))[0, start:-1].argmax(-1)
        for n in agree:
            early = model.lm_head(model.model.norm(hs[n]))[0, start:-1].argmax(-1)
            agree[n][0] += int((early == full).sum()); agree[n][1] += len(full)
for n, (a, t) in agree.items():
    print(f"first {n:2d} of {model.config.num_hidden_layers} layers: {a}/{t} = {a / t:.1%} agree with the full argmax")
