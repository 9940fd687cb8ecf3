"""Issue #23 / #22: n-gram speculation on structured outputs (drafts verified under the grammar's masks) against
plain decoding, one request at a time, greedy, EOS respected. One in-process engine per run (two engines in one
process slow each other); alternate the methods in separate runs (this VM's speed drifts within minutes):

    for m in none ngram none ngram; do python scripts/structured_speculation.py --method $m --ids /tmp/ids-$m.json; done

Workloads: `copy`, a JSON list of 3 people given in the prompt, to be copied under its schema (the drafts are
found in the prompt); `invent`, a person described as JSON under a schema of 4 keys, nothing to copy; `form`, a
sign-up form of 8 required keys, nothing to copy (the keys are what the grammar forces: drafted as such).
Printed: output tokens/s of each workload, tokens, drafts and accepted drafts;
``--ids`` writes the greedy ids, to compare the methods' (they must be equal). A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output import StructuredOutput, StructureKind
from pagedserve.llm import LLM
from pagedserve.model_files import resolve_model
from pagedserve.text.tokenizer import ChatTurn, PromptTokenizer

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "email"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 20}, "email": {"type": "string", "maxLength": 40}}}
PEOPLE = {"type": "object", "additionalProperties": False, "required": ["people"],
          "properties": {"people": {"type": "array", "items": PERSON, "maxItems": 4}}}
FORM = {"type": "object", "additionalProperties": False,
        "properties": {"first_name": {"type": "string", "maxLength": 16},
                       "last_name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}, "is_student": {"type": "boolean"},
                       "country": {"enum": ["UK", "US", "NL", "FR", "DE"]}, "newsletter": {"type": "boolean"},
                       "favorite_color": {"enum": ["red", "green", "blue"]}, "plan": {"enum": ["free", "pro"]}}}
FORM["required"] = list(FORM["properties"])
NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov", "Donald Knuth",
         "Frances Allen", "John McCarthy", "Radia Perlman", "Ken Thompson", "Leslie Lamport", "Shafi Goldwasser"]
CITIES = ["London", "Manchester", "Arlington", "Rotterdam", "Boston", "Stanford", "Peru", "Seattle"]


def people(rng: random.Random) -> str:
    chosen = rng.sample(NAMES, 3)
    return json.dumps({"people": [{"name": n, "age": rng.randint(20, 90), "city": rng.choice(CITIES),
                                   "email": n.split()[0].lower() + "@example.org"} for n in chosen]})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", choices=("none", "ngram"), required=True)
    p.add_argument("--control", choices=("goodput", "fixed"), default="goodput", help="(default %(default)s)")
    p.add_argument("--requests", type=int, default=4, help="requests of each workload (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=160, help="(default %(default)s)")
    p.add_argument("--ids", type=Path, help="write the greedy ids here (JSON)")
    args = p.parse_args()
    model = resolve_model(None)
    speculative = {"method": "ngram", "control": args.control, "num_speculative_tokens": 4} \
        if args.method == "ngram" else {"method": "none"}
    llm = LLM(model, speculative_config=speculative)
    tokenizer, rng = PromptTokenizer.from_folder(model), random.Random(0)
    workloads = {
        "copy": [(f"Copy this JSON exactly: {people(rng)}", PEOPLE) for _ in range(args.requests)],
        "invent": [(f"Describe {name} as JSON.", PERSON) for name in rng.sample(NAMES, args.requests)],
        "form": [(f"Fill in the sign-up form for {name} as JSON.", FORM) for name in rng.sample(NAMES, args.requests)]}
    llm.generate(tokenizer.encode_chat([ChatTurn("user", "Hello")]), SamplingParams(max_tokens=8))  # warm up
    ids = {}
    for name, requests in workloads.items():
        before, tokens, start = llm.stats().spec_decode, 0, time.perf_counter()
        for text, schema in requests:
            params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0,
                                    structured_output=StructuredOutput(StructureKind.JSON, json.dumps(schema)))
            out = llm.generate(tokenizer.encode_chat([ChatTurn("user", text)]), params)[0].samples[0]
            tokens += len(out.token_ids)
            ids.setdefault(name, []).append(list(out.token_ids))
        seconds, after = time.perf_counter() - start, llm.stats().spec_decode
        drafts = (after.num_draft_tokens - before.num_draft_tokens) if after else 0
        accepted = (after.num_accepted_tokens - before.num_accepted_tokens) if after else 0
        print(f"{args.method:5s} {name:6s} {tokens / seconds:6.1f} output tok/s ({tokens} tokens in {seconds:.2f} s), "
              f"draft tokens {drafts}, accepted {accepted}", flush=True)
    if args.ids:
        args.ids.write_text(json.dumps(ids))


if __name__ == "__main__":
    main()
