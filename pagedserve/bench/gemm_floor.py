"""The GEMM floor of `pagedserve bench profile`: a step's matmul shapes timed alone, per GEMM backend."""

from __future__ import annotations

import time
from collections.abc import Callable


def gemm_floor_ms(config, num_tokens: int, num_logit_rows: int, dtype: str,
                  repeats: int = 5) -> dict[str, float]:
    """The step's GEMMs alone for ``num_tokens`` rows (and ``num_logit_rows`` of logits) with weights
    and inputs in ``dtype`` (a torch dtype's name), ms per step: ``torch.mm`` (what ``F.linear`` runs),
    oneDNN with prepacked weights (what ``--gemm-backend onednn`` runs) and, for float32 where it is
    built, the panel GEMM (``--gemm-backend panels``).

    Every layer gets weights of its own, as in the model, so a small batch pays for streaming all
    of them from memory (one shared matrix would stay in cache and flatter the floor).
    """
    import torch

    from pagedserve.engine.models.onednn import OneDnnLinear
    from pagedserve.engine.models.huge_pages import HugePageArena
    from pagedserve.engine.models.panel_gemm import PanelLinear, panels_available

    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = [(config.q_size + 2 * config.kv_size, hidden), (hidden, config.q_size), (2 * inter, hidden),
              (hidden, inter)] * config.num_layers + [(config.vocab_size, hidden)]  # [out, in]; lm_head last
    kind = getattr(torch, dtype)
    weights = [torch.randn(n, k, dtype=kind) for n, k in shapes]
    inputs = [torch.randn(num_logit_rows if i == len(shapes) - 1 else num_tokens, k, dtype=kind)
              for i, (_, k) in enumerate(shapes)]
    transposed = [w.t().contiguous() for w in weights]                    # [in, out] for torch.mm
    packed = [OneDnnLinear(w, None) for w in weights]
    floors = {"torch.mm": _best_ms(lambda: [torch.mm(x, w) for x, w in zip(inputs, transposed)], repeats),
              "onednn": _best_ms(lambda: [f(x) for x, f in zip(inputs, packed)], repeats)}
    del packed
    if kind == torch.float32 and panels_available():
        arena = HugePageArena()  # as pack_linear_layers packs a model's
        panels = [PanelLinear(w, None, arena) for w in weights]
        floors["panels"] = _best_ms(lambda: [f(x) for x, f in zip(inputs, panels)], repeats)
    return floors


def _best_ms(fn: Callable, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - start) * 1000)
    return best
