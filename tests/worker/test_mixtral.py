"""Mixtral (sparse mixture of experts) against transformers and against a dense reference.

A tiny random-weight ``MixtralForCausalLM`` (4 experts, top-2) saved by transformers'
``save_pretrained``: logits of a ragged prefill, a decode batch and a prefill over cached context;
the engine's greedy tokens vs HF ``generate``; the MoE block vs every expert on every token; each
expert sees only the tokens routed to it.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.engine.attention import TorchAttentionBackend
from pagedserve.engine.model_info import load_model_info
from pagedserve.engine.models.config import ModelConfigError
from pagedserve.engine.models.registry import parse_config
from pagedserve.engine.models.mixtral import MixtralForCausalLM, SparseMoeBlock
from pagedserve.engine.weight_loader import load_model
from tests.worker.tiny_models import (TINY, TINY_MIXTRAL, forward_step, hf_greedy, hf_logits, hf_model, make_cache,
                                      relative_errors, save_tiny_model, save_tiny_tokenizer)

TOL = 1e-4
RAW = {"architectures": ["MixtralForCausalLM"], **TINY, **TINY_MIXTRAL}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("mixtral"), "mixtral", seed=3, **TINY_MIXTRAL)
    save_tiny_tokenizer(folder)
    return folder, hf_model(folder)


def _prompts(seed: int, *lengths: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in lengths]


def _check(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    rel, rel_max = relative_errors(got, ref)
    assert rel < TOL and rel_max < TOL, (what, rel, rel_max)


def test_logits_match_transformers_ragged_prefill_decode_and_cached_context(tiny):
    folder, ref_model = tiny
    ours = load_model(folder)
    assert isinstance(ours, MixtralForCausalLM)
    seqs = _prompts(5, 30, 22, 27)
    refs = [hf_logits(ref_model, s) for s in seqs]
    cache, backend = make_cache(ours, 40, 4), TorchAttentionBackend()
    tables = [list(b) for b in torch.randperm(40, generator=torch.Generator().manual_seed(0))[:39].view(3, 13).tolist()]
    steps = [([13, 7, 20], [0, 0, 0]),          # ragged prefill, three sequences in one flat batch
             ([1, 1, 1], [13, 7, 20]),          # a decode batch
             ([9, 14, 6], [14, 8, 21])]         # a prefill over each sequence's cached context
    for step, (lens, ctx) in enumerate(steps):
        tokens = [s[c:c + n] for s, c, n in zip(seqs, ctx, lens)]
        got = forward_step(ours, cache, backend, tokens, ctx, tables)
        start = 0
        for i, (c, n) in enumerate(zip(ctx, lens)):
            _check(got[start:start + n], refs[i][c:c + n], f"step {step} sequence {i}")
            start += n


def test_engine_greedy_matches_hf_generate_for_8_prompts(tiny):
    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    folder, ref_model = tiny
    shared = _prompts(11, 9)[0]  # four prompts share a prefix of two blocks: prefix caching reuses it
    prompts = _prompts(12, 5, 17, 3, 26) + [shared + p for p in _prompts(13, 2, 6, 11, 1)]
    llm = LLM(folder, kv_cache_memory=1 << 20, block_size=4, enable_prefix_caching=True)  # HF: eos_token_id=None
    results = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        assert list(result.token_ids) == hf_greedy(ref_model, prompt, 12), f"prompt {i}"
    assert llm.stats().prefix_cache_hits > 0  # the shared prefix was reused


def _tiny_block(seed: int = 0) -> SparseMoeBlock:
    block = SparseMoeBlock(parse_config(RAW), torch.float32, "cpu")
    generator = torch.Generator().manual_seed(seed)
    for param in block.parameters():
        param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return block


def test_moe_block_equals_dense_reference():
    """Every expert on every token, weighted by the renormalised top-2 softmax weights, zero elsewhere."""
    block = _tiny_block()
    x = torch.randn(37, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))  # (T, hidden)
    with torch.inference_mode():
        probs = torch.softmax(block.gate(x), dim=-1)                        # (T, E)
        top, idx = probs.topk(2, dim=-1)                                    # (T, 2)
        dense_weights = torch.zeros_like(probs).scatter(1, idx, top / top.sum(-1, keepdim=True))  # (T, E)
        every = torch.stack([expert(x) for expert in block.experts], dim=1)  # (T, E, hidden)
        reference = (dense_weights[:, :, None] * every).sum(dim=1)           # (T, hidden)
        got = block(x)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_each_expert_sees_only_its_routed_tokens():
    block = _tiny_block(seed=2)
    x = torch.randn(50, TINY["hidden_size"], generator=torch.Generator().manual_seed(3))
    seen: dict[int, list[torch.Tensor]] = {e: [] for e in range(len(block.experts))}
    for e, expert in enumerate(block.experts):
        expert.gate_up_proj.register_forward_hook(lambda mod, args, out, e=e: seen[e].append(args[0].clone()))
    with torch.inference_mode():
        _, experts = block.route(x)                                         # (T, 2)
        block(x)
    for e in seen:
        routed = (experts == e).any(dim=-1).nonzero().flatten()             # tokens routed to e
        inputs = seen[e]
        assert len(inputs) == (1 if len(routed) else 0), f"expert {e} ran {len(inputs)} times"
        if inputs:
            assert inputs[0].shape[0] == len(routed) < x.shape[0]
            torch.testing.assert_close(inputs[0], x[routed], rtol=0, atol=0)
    assert sum(i.shape[0] for rows in seen.values() for i in rows) == 2 * x.shape[0]


def test_fused_expert_checkpoint_layout_loads_the_same(tiny):
    """transformers 5.x's in-memory layout (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj``
    [E, H, I], ``mlp.gate``) loads into the same parameters as the per-expert w1/w2/w3 files."""
    folder, ref_model = tiny
    per_expert = load_model(folder)
    fused = MixtralForCausalLM(per_expert.config)
    fused.load_checkpoint((n, t.detach().clone()) for n, t in ref_model.state_dict().items())
    ours = dict(fused.named_parameters())
    for name, param in per_expert.named_parameters():
        torch.testing.assert_close(ours[name], param, rtol=0, atol=0)


def test_onednn_packs_router_and_experts(tiny):
    from pagedserve.engine.models.onednn import pack_linear_layers

    folder, _ = tiny
    plain, packed = load_model(folder), load_model(folder)
    # per layer: qkv, o, router, 4 experts x (gate_up, down); plus the LM head
    assert pack_linear_layers(packed) == 2 * (2 + 1 + 4 * 2) + 1
    tokens = _prompts(8, 11, 6)
    cache = make_cache(plain, 16, 4)
    want = forward_step(plain, cache, TorchAttentionBackend(), tokens, [0, 0], [[0, 1, 2], [3, 4]])
    got = forward_step(packed, make_cache(plain, 16, 4), TorchAttentionBackend(), tokens, [0, 0], [[0, 1, 2], [3, 4]])
    _check(got, want, "onednn")


def test_config_parser_refuses_what_it_cannot_build(tmp_path):
    config = parse_config(RAW)
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    with pytest.raises(ModelConfigError, match="num_local_experts"):
        parse_config({k: v for k, v in RAW.items() if k != "num_local_experts"})
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        parse_config({**RAW, "num_experts_per_tok": 5})
    with pytest.raises(ModelConfigError, match="hidden_act"):
        parse_config({**RAW, "hidden_act": "gelu"})


def test_sliding_window_caps_the_context_as_for_mistral(tmp_path):
    folder = save_tiny_model(tmp_path, "mixtral", **{**TINY_MIXTRAL, "sliding_window": 64})
    info = load_model_info(folder)
    assert (info.architecture, info.max_model_len) == ("MixtralForCausalLM", 64)


def test_inductor_compiles_around_the_expert_dispatch(tiny):
    """``compile_mode="inductor"``: the routed dispatch is an opaque custom op, so the graph has no
    data-dependent shape; no graph break, no new graph after the warm-up, HF's greedy tokens."""
    from torch._dynamo.utils import counters

    from pagedserve.engine.sampling_params import SamplingParams
    from pagedserve.llm import LLM

    folder, ref_model = tiny
    counters.clear()
    llm = LLM(folder, kv_cache_memory=1 << 20, block_size=4, compile_mode="inductor")
    graphs = counters["stats"]["unique_graphs"]
    prompts = _prompts(14, 5, 17, 3, 26)
    results = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        assert list(result.token_ids) == hf_greedy(ref_model, prompt, 8), f"prompt {i}"
    assert counters["stats"]["unique_graphs"] == graphs and not counters["graph_break"]
