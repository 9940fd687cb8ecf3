"""Drafting tokens with a smaller model beside the target: the draft-model proposer (vLLM's
``draft_model`` speculative method; Leviathan et al., "Fast Inference from Transformers via
Speculative Decoding", ICML 2023; Chen et al., "Accelerating Large Language Model Decoding with
Speculative Sampling", 2023).

The draft model keeps its own paged KV cache with the target's number of blocks and block size,
indexed by the target's block ids: the scheduler's block tables and slot mappings serve both, and
no message changes. Its K/V stay in step with the target's:

- every target forward (prefill chunks, decodes, verification rows ``[t, d1..dk]``) also runs
  through the draft model with the same token ids, positions and block tables (:meth:`observe`),
  so after each step every computed or verified position has draft K/V at the target's slot, and
  the slots of rejected drafts are overwritten later exactly as the target's are;
- to propose for sequences whose last token ``t`` (at position ``p``) is in no cache yet,
  :meth:`propose` runs ``t`` at ``p`` (draft ``d1`` = its argmax), then ``d1`` at ``p + 1`` (``d2``),
  ..., one forward of ``B`` rows per draft index, batched over the step's speculating sequences
  (fewer rows once a sequence's ``limit`` is reached), writing draft K/V at ``p .. p + limit - 1``:
  inside the decode's slot and the lookahead slots the scheduler reserved.

The draft's logits get the target's processing (a structured output's mask, from a copy of the matcher
walked along the drafts; penalties, bias, allowed ids, ``min_tokens``). A
greedy request's drafts are then their argmax tokens (one-hot ``q``, as the n-gram ones); a sampled
request's are drawn from the draft's distribution ``q`` (temperature, top-k/p, min-p as well), and
``q`` goes to the rejection sampler, which accepts with ``min(1, p / q)``. The sampler is exact for
any ``q``, so greedy rows emit the target's argmax and sampled rows keep the target's distribution;
only the acceptance rate depends on the draft, and drawing from ``q`` keeps the drafts a draft close
to the target proposes (with argmax drafts a sampled row would keep only ``p(argmax)`` of them).

The draft's vocabulary must be the target's (its logits' width; :func:`load_draft_model` checks);
a draft with another tokenizer of the same size cannot be told apart and would only draft badly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from pagedserve.engine.attention import AttentionBackend
from pagedserve.engine.argmax import row_argmax
from pagedserve.engine.config import GemmBackend
from pagedserve.engine.forward_batch import ForwardBatch
from pagedserve.engine.grammar_matchers import follow, mask_grammar
from pagedserve.engine.kv_cache import KVCache, KVCacheSpec
from pagedserve.engine.messages import BatchPlan
from pagedserve.engine.sampler import Draw, Sampler, inverse_transform, sampling_probs
from pagedserve.engine.sampling_params import EngineSamplingParams
from pagedserve.engine.models.registry import load_model_config
from pagedserve.engine.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from pagedserve.engine.spec_decode.proposer import Proposal, Proposer
from pagedserve.engine.spec_decode.verifier import Drafted, process_rows
from pagedserve.engine.models.onednn import pack_linear_layers
from pagedserve.engine.weight_loader import load_model
from pagedserve.engine.worker_requests import ScheduledRequest


def load_draft_model(path: str | Path, target: nn.Module, gemm_backend: GemmBackend) -> nn.Module:
    """The draft model of the Hugging Face folder ``path``, with ``target``'s dtype and device and the
    resolved ``gemm_backend`` (``onednn`` or ``panels``: its linear layers prepacked, as the target's).

    Raises:
        ValueError: its vocabulary size differs from the target's, or its context is shorter (it runs
            over every position of the target's sequences; learned position embeddings would fail past
            theirs); the loader's errors as well.
    """
    device = next(target.parameters()).device
    draft = load_model(path, dtype=target.dtype, device=device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model {path} has a vocabulary of {draft.config.vocab_size} tokens, the target "
                         f"{target.config.vocab_size}: speculative decoding needs the target's tokenizer")
    if draft.config.max_model_len < target.config.max_model_len:
        raise ValueError(f"the draft model {path} serves contexts of up to {draft.config.max_model_len} tokens, the "
                         f"target {target.config.max_model_len}: take a draft whose context covers the target's")
    if gemm_backend is not GemmBackend.TORCH:
        pack_linear_layers(draft, gemm_backend)
    return draft


def speculative_caches(speculative: SpeculativeConfig, target_spec: KVCacheSpec) -> tuple[KVCacheSpec, ...]:
    """The caches beside the target's, indexed by its block ids: a draft model's (the layers and KV
    heads of its ``config.json``, the target's block size and cache dtype), or none.

    Raises:
        ModelConfigError: the draft's folder has no readable ``config.json``.
    """
    if speculative.method is not SpeculativeMethod.DRAFT_MODEL:
        return ()
    config = load_model_config(speculative.model)
    return (KVCacheSpec(config.num_layers, config.num_kv_heads, config.head_dim, target_spec.block_size,
                        target_spec.dtype),)


def build_proposer(speculative: SpeculativeConfig, target: nn.Module, gemm_backend: GemmBackend,
                   kv_cache: KVCache, attention_backend: AttentionBackend) -> Proposer | None:
    """The worker's proposer: the n-gram one, or the draft model loaded beside ``target`` (with the
    resolved ``gemm_backend``) and its cache of ``kv_cache``'s block counts; ``None`` without
    speculation. Raises what :func:`load_draft_model` raises."""
    return build_proposers(speculative, target, gemm_backend, [kv_cache], attention_backend)[0]


def build_proposers(speculative: SpeculativeConfig, target: nn.Module, gemm_backend: GemmBackend,
                    kv_caches: Sequence[KVCache], attention_backend: AttentionBackend) -> list[Proposer | None]:
    """One proposer per target cache (a pipeline stage's virtual engines have one each), as
    :func:`build_proposer`; a draft model is loaded once and shared, each proposer with its own cache."""
    if speculative.method is not SpeculativeMethod.DRAFT_MODEL:
        return [speculative.ngram_proposer() for _ in kv_caches]
    draft = load_draft_model(speculative.model, target, gemm_backend)
    device = next(target.parameters()).device
    (spec,) = speculative_caches(speculative, kv_caches[0].spec)  # the engines' caches share block size and dtype
    return [DraftModelProposer(draft, KVCache(spec, c.num_blocks, device=device, num_cpu_blocks=c.num_cpu_blocks),
                               attention_backend, speculative.num_speculative_tokens) for c in kv_caches]


class DraftModelProposer:
    """Proposes up to ``num_speculative_tokens`` drafts per sequence with a draft model (a
    ``proposer.Proposer``; see the module docstring for how its cache follows the target's).

    Args:
        model: the draft model (``forward(input_ids, positions, attention)``, ``compute_logits``,
            ``dtype``), loaded by :func:`load_draft_model`.
        kv_cache: its cache, with the target's ``num_blocks``, ``num_cpu_blocks`` and block size.
        attention_backend: the target's paged attention (shared: it holds no per-model state).
        num_speculative_tokens: most drafts per sequence and step (``k``), >= 1.

    Raises:
        ValueError: ``num_speculative_tokens`` < 1.
    """

    def __init__(self, model: nn.Module, kv_cache: KVCache, attention_backend: AttentionBackend,
                 num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self.model = model
        self.kv_cache = kv_cache
        self.attention_backend = attention_backend
        self.num_speculative_tokens = num_speculative_tokens
        self.device = next(model.parameters()).device

    def propose(self, requests: Sequence[ScheduledRequest], sampler: Sampler) -> list[Proposal]:
        """Per request, ``min(num_lookahead_tokens, k)`` drafts, each after its known tokens and the
        drafts before it (``max(limits)`` forwards of at most ``len(requests)`` rows), from the
        draft's logits processed as the target's row at the same output index (a structured output's
        mask after the drafts before it, then ``verifier.process_rows``: penalties, bias, allowed ids,
        ``min_tokens``): a greedy request's are their argmax; a sampled request's are drawn from ``q``
        (``sampling_probs`` of them) with ``sampler``'s ``Draw.DRAFT`` uniforms, and ``q`` comes with
        them (the acceptance is then ``min(1, p / q)``: a draft that agrees with the target keeps most
        sampled drafts). Each request schedules its last known token only (``proposer.Proposer``)."""
        limits = [min(r.num_lookahead_tokens, self.num_speculative_tokens) for r in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        paths = [r.state.matcher.deep_copy() if r.state.matcher is not None else None for r in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]  # per sampled request, (V,) per draft
        for index in range(max(limits, default=0)):
            rows = [i for i, limit in enumerate(limits) if limit > index]
            tokens = [drafts[i][-1] if index else requests[i].state.token_ids[-1] for i in rows]
            # the row's token sits at position len(token_ids) - 1 + index, after that many cached ones
            contexts = [len(requests[i].state.token_ids) - 1 + index for i in rows]
            batch = ForwardBatch.build(tokens, [1] * len(rows), contexts, [requests[i].state.block_ids for i in rows],
                                       self.kv_cache.block_size, self.model.dtype, self.device)
            hidden = batch.run(self.model, self.kv_cache, self.attention_backend)   # (B, hidden)
            logits = self.model.compute_logits(hidden)                          # (B, V) float32
            mask_grammar(logits, [paths[i] for i in rows])                      # first, as the target's rows
            params, counts = process_rows(logits, [_pending(requests[i], drafts[i]) for i in rows])
            chosen = row_argmax(logits).tolist()
            drawn = [j for j, p in enumerate(params) if not p.is_greedy]
            if drawn:
                q, ids = _draw(logits[torch.tensor(drawn, device=logits.device)], [params[j] for j in drawn],
                               [counts[j] for j in drawn], sampler)
                for j, row_q, token in zip(drawn, q, ids.tolist()):
                    chosen[j] = token
                    q_rows[rows[j]].append(row_q)
            for i, token in zip(rows, chosen):
                drafts[i].append(token)
                if paths[i] is not None:
                    follow(paths[i], token)
        return [Proposal(tuple(d), torch.stack(q) if q else None) for d, q in zip(drafts, q_rows)]

    def observe(self, batch: ForwardBatch) -> None:
        """Runs the target's batch through the draft model: its K/V at the same slots."""
        batch.run(self.model, self.kv_cache, self.attention_backend)

    def move_blocks(self, plan: BatchPlan) -> None:
        """The plan's swaps and copies on the draft's cache (the same block ids as the target's)."""
        self.kv_cache.move_blocks(plan.blocks_to_swap_out, plan.blocks_to_swap_in, plan.blocks_to_copy)


def _pending(request: ScheduledRequest, drafts: Sequence[int]) -> tuple[Drafted, int]:
    """The row drafting a request's next token, as ``verifier.process_rows`` takes it."""
    state = request.state
    return Drafted(state.seq_id, state.token_ids, state.num_prompt_tokens, state.sampling, tuple(drafts)), len(drafts)


def _draw(logits: torch.Tensor, params: Sequence[EngineSamplingParams], counts: Sequence[int],
          sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` float32 ``[R, V]`` of sampled rows (``logits`` float32 ``[R, V]``, processed) at output
    indices ``counts``, and the drafts drawn from it, int64 ``[R]``."""
    q = sampling_probs(logits, params)                                    # (R, V)
    uniforms = sampler.uniforms(params, counts, num_draws=Draw.DRAFT + 1)[:, Draw.DRAFT]  # (R,)
    return q, inverse_transform(q, uniforms)
