"""Issue #23: the panel GEMM over the default model's weights with its panels on 2 MiB pages
(``models/huge_pages.py``, as ``pack_linear_layers`` packs a model) against the same panels in torch's
ordinary allocation (4 KiB pages), alternated in one process (this machine's speed drifts up to 1.5x
within minutes, so only a same-process A/B resolves a 10% change).

    python scripts/panels_huge_pages_ab.py [--rows 1,4,16] [--rounds 15] [--decode-tokens 100]

The layers are the default model's fused QKV, output, gate-up and down projections of 30 layers and its
LM head (0.54 GB of float32 panels, so each pass comes from DRAM), random weights. Printed per row count:
each side's median milliseconds per pass over every layer, its GB/s of weights, and the ratio; beside
them a streaming read (``torch.sum`` over 512 MiB) from each kind of page. With ``--decode-tokens N``,
then the offline engine on the default model at batch 1 (one 300-token prompt, N greedy tokens, EOS
ignored), its panels on 2 MiB pages as built and a copy in torch's allocation swapped in by turns:
milliseconds per token, and the same token ids from both. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from pagedserve.engine.models.huge_pages import HugePageArena
from pagedserve.bench.attention_op import STREAM_BYTES
from pagedserve.bench.gemm_rows import MODEL_GEMMS as SHAPES  # [out, in], LM head last
from pagedserve.engine.models.panel_gemm import panel_shape, panels_available

STREAM_ELEMENTS = STREAM_BYTES // 4  # float32, as the benches' streaming read


def packed(weights: list[torch.Tensor], allocate) -> list[tuple[torch.Tensor, int]]:
    """(panels, out_features) per weight, the panels allocated by ``allocate(shape)``."""
    layers = []
    for w in weights:
        panels = allocate(panel_shape(*w.shape))
        torch.ops.pagedserve_panels.pack_panels(w, panels)
        layers.append((panels, w.shape[0]))
    return layers


def pass_ms(layers: list[tuple[torch.Tensor, int]], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for panels, out_features in layers:
        torch.ops.pagedserve_panels.panel_linear(inputs[panels.shape[1]], panels, None, out_features)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16", help="comma-separated row counts (default 1,4,16)")
    parser.add_argument("--rounds", type=int, default=15, help="alternated rounds per row count (default 15)")
    parser.add_argument("--decode-tokens", type=int, default=0,
                        help="then the engine at batch 1 in --rounds alternated rounds of this many tokens "
                             "(default: not)")
    args = parser.parse_args()
    if not panels_available():
        raise SystemExit("the panel GEMM needs an x86 CPU with AVX2 and FMA and a C++ compiler")
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=g) * s[1] ** -0.5 for s in SHAPES]
    arena = HugePageArena()
    sides = {"4 KiB pages": packed(weights, lambda shape: torch.empty(shape)),
             "2 MiB pages": packed(weights, lambda shape: arena.empty(shape, torch.float32))}
    nbytes = sum(p.numel() * 4 for p, _ in sides["4 KiB pages"])
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(f"{nbytes / 1e9:.2f} GB of panels; THP: {thp.read_text().strip() if thp.exists() else 'n/a'}")
    for rows in map(int, args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=g) for k in {s[1] for s in SHAPES}}
        times = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, layers in sides.items():
                times[name].append(pass_ms(layers, inputs))
        ms = {name: statistics.median(t) for name, t in times.items()}
        print(f"rows {rows}: " + ", ".join(f"{name} {m:.2f} ms ({nbytes / m / 1e6:.1f} GB/s)" for name, m in ms.items())
              + f"; 4 KiB / 2 MiB time {ms['4 KiB pages'] / ms['2 MiB pages']:.2f}x")
    buffers = {"4 KiB pages": torch.ones(STREAM_ELEMENTS),
               "2 MiB pages": arena.empty((STREAM_ELEMENTS,), torch.float32)}
    buffers["2 MiB pages"].fill_(1.0)
    sums = {name: [] for name in buffers}
    for _ in range(args.rounds):
        for name, buffer in buffers.items():
            start = time.perf_counter()
            buffer.sum()
            sums[name].append(time.perf_counter() - start)
    print("streaming read: " + ", ".join(f"{name} {STREAM_ELEMENTS * 4 / statistics.median(t) / 1e9:.1f} GB/s"
                                         for name, t in sums.items()))
    if args.decode_tokens:
        decode_ab(args.decode_tokens, args.rounds)


def decode_ab(tokens: int, rounds: int) -> None:
    """Batch-1 decode in the offline engine: the model's panels as built (2 MiB pages) against copies in
    torch's allocation, swapped into the decode loop and the LM head by turns."""
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM
    from pagedserve.model_files import prepare_default_model

    llm = LLM(prepare_default_model(), kv_cache_memory="256MiB", max_num_seqs=1)
    model = llm.engine.executor.runners["worker-0"].model
    if model.decode_layers is None:
        raise SystemExit("the default model does not run the C++ decode loop here")
    built = (model.decode_layers, model.lm_head.panels)
    copied = (dataclasses.replace(model.decode_layers, panels=tuple(
        None if p is None else p.clone() for p in model.decode_layers.panels)), model.lm_head.panels.clone())
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    prompt = [[1, 2, 3] * 100]
    reference = llm.generate(prompt, params)[0].token_ids
    times = {"4 KiB pages": [], "2 MiB pages": []}
    for _ in range(rounds):
        for name, (loop, lm_head) in (("4 KiB pages", copied), ("2 MiB pages", built)):
            model.decode_layers, model.lm_head.panels = loop, lm_head
            start = time.perf_counter()
            assert llm.generate(prompt, params)[0].token_ids == reference
            times[name].append((time.perf_counter() - start) / tokens * 1e3)
    ms = {name: statistics.median(t) for name, t in times.items()}
    print(f"engine, batch 1, {tokens} tokens a round: " + ", ".join(f"{n} {m:.2f} ms/token" for n, m in ms.items())
          + f"; 4 KiB / 2 MiB time {ms['4 KiB pages'] / ms['2 MiB pages']:.2f}x (same token ids)")


if __name__ == "__main__":
    main()
