"""`pagedserve bench grammar-engines`: llguidance against xgrammar on the default model's tokenizer.

For each of four JSON schemas (``grammar_schemas``): the compile time cold (first matcher from the
spec, its first mask included: llguidance builds lazily) and warm (a second matcher from the
engine's compiled artifact: xgrammar's cached ``CompiledGrammar``, llguidance's grammar string),
and the mask time per decoding step at batch 1/64/256: every row's matcher fills its row of the
bitmask (fill), then the bitmask is applied to float32 logits ``[B, V]`` (apply, the same code for
both), over ``--tokens`` tokens of a valid JSON walk after its first (each row consumes the walk's token). One process, both engines,
so the ratios hold on a shared machine; xgrammar is optional (``pip install xgrammar --no-deps``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pagedserve.bench.grammar_schemas import SCHEMAS
from pagedserve.bench.machine import machine_info, machine_line


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("grammar-engines", help="llguidance vs xgrammar: compile and mask time per token",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder whose tokenizer is used (default: the default model)")
    p.add_argument("--batches", default="1,64,256", help="batch sizes of the mask timing (default %(default)s)")
    p.add_argument("--tokens", type=int, default=8, help="decoding steps timed per batch (default %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="warm compiles timed, the median kept (default %(default)s)")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    p.set_defaults(func=run)


class _Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance

        self._ll = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)

    def compile(self, schema: dict) -> str:
        return self._ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))

    def matcher(self, compiled: str):
        return self._ll.LLMatcher(self.tokenizer, compiled)

    def clear_cache(self) -> None:
        pass  # llguidance keeps no cache of its own

    @staticmethod
    def fill(matcher, bitmask, row: int) -> None:
        view = bitmask[row]
        matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * 4)

    @staticmethod
    def consume(matcher, token_id: int) -> None:
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"llguidance refused token {token_id}: {matcher.get_error()}")


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)

    def compile(self, schema: dict):
        return self._compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)

    def matcher(self, compiled):
        return self._xgr.GrammarMatcher(compiled)

    def clear_cache(self) -> None:
        self._compiler.clear_cache()

    @staticmethod
    def fill(matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    @staticmethod
    def consume(matcher, token_id: int) -> None:
        if not matcher.accept_token(token_id):
            raise RuntimeError(f"xgrammar refused token {token_id}")


def _compile_ms(engine, schema: dict, vocab_size: int, repeats: int) -> tuple[float, float]:
    """Cold and warm (median of ``repeats``) ms to a first mask from the schema."""
    from pagedserve.engine.token_bitmask import allocate_bitmask

    bitmask = allocate_bitmask(1, vocab_size)
    engine.clear_cache()
    start = time.perf_counter()
    engine.fill(engine.matcher(engine.compile(schema)), bitmask, 0)
    cold = (time.perf_counter() - start) * 1000
    warm = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.fill(engine.matcher(engine.compile(schema)), bitmask, 0)
        warm.append((time.perf_counter() - start) * 1000)
    return cold, statistics.median(warm)


def _mask_ms(engine, compiled, walk: list[int], batch: int, vocab_size: int) -> tuple[float, float]:
    """Mean ms per decoding step to fill ``batch`` rows, and to apply them to float32 logits
    (the first step, whose lazy work the cold compile counts, is not timed)."""
    import torch

    from pagedserve.engine.token_bitmask import allocate_bitmask, apply_bitmask

    matchers = [engine.matcher(compiled) for _ in range(batch)]
    bitmask = allocate_bitmask(batch, vocab_size)
    logits = torch.randn(batch, vocab_size)
    fill = apply = 0.0
    for step, token_id in enumerate(walk):
        start = time.perf_counter()
        for row, m in enumerate(matchers):
            engine.fill(m, bitmask, row)
        filled = time.perf_counter()
        apply_bitmask(logits, bitmask)
        if step > 0:
            fill, apply = fill + filled - start, apply + time.perf_counter() - filled
        for m in matchers:
            engine.consume(m, token_id)
    steps = len(walk) - 1
    return fill / steps * 1000, apply / steps * 1000


def run(args: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    from pagedserve.model_files import prepare_default_model

    model = Path(args.model) if args.model else prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    vocab_size, eos = len(tokenizer), tokenizer.eos_token_id
    batches = [int(b) for b in args.batches.split(",")]
    engines = []
    for make in (lambda: _Llguidance(str(model / "tokenizer.json"), vocab_size, eos),
                 lambda: _Xgrammar(tokenizer, vocab_size, eos)):
        start = time.perf_counter()
        try:
            engine = make()
        except ImportError as e:
            print(f"skipped: {e}")
            continue
        engines.append((engine, (time.perf_counter() - start) * 1000))
    rows = []
    for engine, tokenizer_ms in engines:
        for name, (schema, instance) in SCHEMAS.items():
            walk = tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
            cold, warm = _compile_ms(engine, schema, vocab_size, args.repeats)
            compiled = engine.compile(schema)
            masks = {b: _mask_ms(engine, compiled, walk[:args.tokens + 1], b, vocab_size) for b in batches}
            rows.append(dict(engine=engine.name, schema=name, tokenizer_ms=tokenizer_ms, cold_ms=cold,
                             warm_ms=warm, mask_ms=masks))
    _print(rows, batches, vocab_size)
    if args.result_json:
        args.result_json.write_text(json.dumps(dict(machine=machine_line(machine_info()), vocab_size=vocab_size, rows=rows),
                                               indent=2))


def _print(rows: list[dict], batches: list[int], vocab_size: int) -> None:
    print(f"# {machine_line(machine_info())}; vocabulary {vocab_size} ids")
    print("| engine | schema | tokenizer setup ms | compile cold ms | compile warm ms | "
          + " | ".join(f"fill / apply ms per step @{b}" for b in batches) + " |")
    print("|---" * (5 + len(batches)) + "|")
    for r in rows:
        print(f"| {r['engine']} | {r['schema']} | {r['tokenizer_ms']:.0f} | {r['cold_ms']:.1f} | {r['warm_ms']:.2f} | "
              + " | ".join("{:.2f} / {:.2f}".format(*r['mask_ms'][b]) for b in batches) + " |")
